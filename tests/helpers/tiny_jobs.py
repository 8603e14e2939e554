"""Start tiny_train.py at a given world size and read what it left behind."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kfac_hpc.checkpoint.files import open_h5
from kfac_hpc.checkpoint.hdf5_tree import read_tree
from tests.helpers.launch import RANK_SCRIPTS, parse_rank_records, run_bounded, run_mpi, script_env

SCRIPT = RANK_SCRIPTS / "tiny_train.py"


def run_tiny(world: int, run: Path, *args: str, expect_rc: int = 0) -> list[dict]:
    """Run tiny_train.py on ``world`` real processes; returns each rank's JSON summary."""
    run.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(SCRIPT), "--run", str(run), *args]
    if world == 1:
        out = run_bounded(argv, env=script_env(), timeout=180)
    else:
        out = run_mpi(world, argv, timeout=240)
    assert out.returncode == expect_rc, f"rc {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    lines = parse_rank_records(out.stdout)
    assert sorted(x["rank"] for x in lines) == list(range(world)), out.stdout
    assert all(x["world"] == world for x in lines), "launcher did not start the expected ranks"
    return lines


def final_state(run: Path, attempt: int | None = None) -> dict:
    """The parameters (and K-FAC state) rank 0 wrote at the end of an attempt (default: last)."""
    files = sorted(run.glob("final-*.h5"))
    path = files[-1] if attempt is None else run / f"final-{attempt}.h5"
    with open_h5(path, "r") as h5:
        return read_tree(h5)


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype
        assert torch.equal(a[key], b[key]), f"{key} differs: max {(a[key] - b[key]).abs().max()}"


def factors(state: dict) -> dict[str, torch.Tensor]:
    return {
        f"{layer}.{f}": entry[f]
        for layer, entry in state["kfac"]["layers"].items()
        for f in ("A", "G")
    }
