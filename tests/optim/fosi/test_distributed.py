"""DHO2: sharded FOSI equals single-process FOSI step by step; its state re-shards P -> P'.

Real processes (mpiexec, gloo) run tests/helpers/rank_scripts/fosi_sharded.py at P = 1, 2, 3,
4: a float64
MLP of 53 parameters (divisible by none of 2, 3, 4), two ESEs in six steps, SGD (momentum,
weight decay in one group) and Adam bases, and SGD with pipelined curvature ranks (staleness 0,
and a bound of 2 steps, past which the training ranks take the base update instead of waiting;
P = 2, 3, 4 give 1, 1, 2 of their ranks to ESE).

Tolerance (float64): parameters after every step agree with P = 1 to
``|Δ| <= 1e-10 · max|reference|`` (observed about 1e-15). Checkpoints: the full state written
to HDF5 reads back bit for bit; the state of P = 1 resumed at P = 2 and that of P = 2 resumed at
P = 1 continue like P = 1 resumed at P = 1, to the same tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch

from kfac_hpc.checkpoint.hdf5_tree import read_tree
from tests.conftest import run_mpi
from tests.helpers.launch import RANK_SCRIPTS
from tests.helpers.rank_scripts.fosi_sharded import STEPS

pytestmark = pytest.mark.mpi

SCRIPT = RANK_SCRIPTS / "fosi_sharded.py"
RTOL = 1e-10
_runs: dict[str, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fosi")


def run(tag: str, world_size: int, out_dir: Path, resume: str = "") -> list[dict[str, Any]]:
    """Per-rank results of one job (started once per module and tag)."""
    if tag not in _runs:
        env = {"TAG": tag, "RESUME": str(out_dir / resume) if resume else ""}
        proc = run_mpi(world_size, [sys.executable, str(SCRIPT), str(out_dir)], env=env)
        assert proc.returncode == 0, f"ranks failed:\n{proc.stdout}\n{proc.stderr[-16000:]}"
        ranks = [torch.load(out_dir / f"{tag}_rank{r}.pt") for r in range(world_size)]
        assert [r["world_size"] for r in ranks] == [world_size] * world_size
        assert [r["rank"] for r in ranks] == list(range(world_size))
        _runs[tag] = [r["results"] for r in ranks]
    return _runs[tag]


def assert_same_trajectory(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    for step, (a, b) in enumerate(zip(got["params"], want["params"], strict=True)):
        bound = RTOL * b.abs().max().item()
        err = (a - b).abs().max().item()
        assert err <= bound, f"{what} step {step}: max |Δ| {err:.3e} > {bound:.3e}"
    torch.testing.assert_close(got["eigenvalues"], want["eigenvalues"], rtol=RTOL, atol=0)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_steps_equal_single_process(world_size: int, out_dir: Path) -> None:
    reference = run("p1", 1, out_dir)[0]
    ranks = run(f"p{world_size}", world_size, out_dir)
    for config, ref in reference.items():
        assert len(ref["eigenvalues"]) == 4 and ref["staleness"] == [0, 0]
        if config == "sgd_pipelined_stale":
            continue  # swapped whenever it arrives: not step-for-step the synchronous run
        training = [r[config] for r in ranks if not r[config]["curvature_rank"]]
        expected = world_size - {"sgd_pipelined": {2: 1, 3: 1, 4: 2}}.get(config, {}).get(
            world_size, 0
        )
        assert len(training) == expected, config
        for rank, results in enumerate(training):
            assert_same_trajectory(results, ref, f"{config} P={world_size} rank {rank}")
            assert results["staleness"] == [0, 0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_pipelined_staleness_is_recorded_and_late_steps_take_the_base(
    world_size: int, out_dir: Path
) -> None:
    ranks = [r["sgd_pipelined_stale"] for r in run(f"p{world_size}", world_size, out_dir)]
    training = [r for r in ranks if not r["curvature_rank"]]
    assert len(training) == world_size // 2
    requests, bound = [1, 4], 2  # ESEs at steps 1 and 4 of 0..5; either may be in flight
    for results in training:
        staleness = results["staleness"]
        assert len(staleness) <= 2 and all(s >= 0 for s in staleness)
        swaps = [t + s for t, s in zip(requests, staleness, strict=False)]
        swaps += [STEPS] * (len(requests) - len(swaps))  # never swapped in: late to the end
        # late: the steps at which an ESE had been in flight for the bound or longer
        late = sorted({s for t, w in zip(requests, swaps, strict=True)
                       for s in range(t + bound, min(w, STEPS))})  # fmt: skip
        assert results["late_steps"] == late
        assert staleness == training[0]["staleness"]  # swapped at one step boundary
        assert results["late_steps"] == training[0]["late_steps"]
    for results in ranks:
        assert all(torch.isfinite(p).all() for p in results["params"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_state_and_basis_are_sharded(world_size: int, out_dir: Path) -> None:
    """Per-rank bytes of V, velocity, base state and Lanczos basis add up to those of P = 1."""
    one = run("p1", 1, out_dir)[0]["sgd"]["memory"]
    ranks = [r["sgd"]["memory"] for r in run(f"p{world_size}", world_size, out_dir)]
    for key in ("eigenvectors_bytes", "velocity_bytes", "base_state_bytes", "lanczos_basis_bytes"):
        assert sum(r[key] for r in ranks) == one[key], key
        # each rank holds ceil(n / P) of the n = 53 coordinates at most
        assert max(r[key] for r in ranks) == one[key] // 53 * -(-53 // world_size), key


def test_full_state_reads_back_bitwise_from_hdf5(out_dir: Path) -> None:
    for tag, world_size in (("p1", 1), ("p2", 2)):
        saved = run(tag, world_size, out_dir)[0]
        for config, results in saved.items():
            with h5py.File(out_dir / tag / f"{config}.h5", "r") as f:
                tree = read_tree(f)
            assert_equal_tree(tree["fosi"], results["full_state"], f"{tag}/{config}")


def assert_equal_tree(got: Any, want: Any, path: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, path
        assert torch.equal(got, want), path
    elif isinstance(want, dict):
        assert set(got) == set(want), path
        for key in want:
            assert_equal_tree(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_equal_tree(a, b, f"{path}/{i}")
    else:
        assert got == want and type(got) is type(want), f"{path}: {got!r} != {want!r}"


@pytest.mark.parametrize(("tag", "world_size", "saved_at"), [("r12", 2, "p1"), ("r21", 1, "p2")])
def test_state_reshards_to_another_world_size(
    tag: str, world_size: int, saved_at: str, out_dir: Path
) -> None:
    run("p1", 1, out_dir)
    run("p2", 2, out_dir)
    reference = run("r11", 1, out_dir, resume="p1")[0]
    ranks = run(tag, world_size, out_dir, resume=saved_at)
    for config, ref in reference.items():
        assert ref["staleness"] == [0, 0, 0, 0]  # two ESEs before the save, two after
        if config == "sgd_pipelined_stale":
            continue
        for rank, results in enumerate(r[config] for r in ranks):
            if not results["curvature_rank"]:
                assert_same_trajectory(results, ref, f"{config} {tag} rank {rank}")
