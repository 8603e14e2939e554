"""Re-sharding: a checkpoint saved at world size P / strategy S resumes at P' / S'.

The runs use float64, no dropout and no input noise, so the next step is the same computation
at any world size up to the order of floating-point reductions: compared with rtol 1e-9. The
factors read back from the file are compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kfac_hpc.checkpoint import (
    CheckpointMismatchError,
    init_factors_from,
    load_checkpoint,
    restore_training_state,
)
from kfac_hpc.checkpoint.training_state import saved_method_state
from kfac_hpc.optim.kfac_state import merged_state
from tests.helpers.tiny_jobs import final_state, run_tiny

SAVE, TOTAL = 5, 6
COMMON = ["--steps", str(TOTAL), "--kfac", "--inv-every", "3", "--deterministic-data", "--float64"]
RTOL = 1e-9


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=RTOL, atol=1e-12, msg=key)


def _factors(state: dict) -> dict[str, torch.Tensor]:
    return {f"{n}.{f}": e[f] for n, e in state["kfac"]["layers"].items() for f in ("A", "G")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, Path]:
    """Uninterrupted COMM-OPT runs at world sizes 1 and 2, each checkpointed after step SAVE."""
    runs = {}
    for world in (1, 2):
        run = tmp_path_factory.mktemp(f"ref{world}")
        run_tiny(world, run, *COMMON, "--save-every", str(SAVE))
        runs[world] = run
    return runs


def _ckpt(run: Path) -> Path:
    return run / "checkpoints" / f"ckpt-{SAVE:08d}.h5"


def _resume_and_compare(tmp_path: Path, saved: Path, world: int, expected: Path, *extra: str):
    resumed = tmp_path / "resumed"
    lines = run_tiny(world, resumed, *COMMON, *extra, "--resume-from", str(_ckpt(saved)))
    assert {x["resumed_from"] for x in lines} == {SAVE}
    got, want = final_state(resumed), final_state(expected)
    _close(got["params"], want["params"])
    _close(_factors(got), _factors(want))


@pytest.mark.mpi
def test_two_ranks_to_one(tmp_path, reference):
    _resume_and_compare(tmp_path, reference[2], 1, reference[1])


@pytest.mark.mpi
def test_one_rank_to_two(tmp_path, reference):
    _resume_and_compare(tmp_path, reference[1], 2, reference[2])


@pytest.mark.mpi
def test_comm_opt_to_mem_opt(tmp_path, reference):
    ckpt = load_checkpoint(_ckpt(reference[2]))
    assert ckpt.tree["strategy"] == "comm-opt" and ckpt.world_size == 2
    _resume_and_compare(tmp_path, reference[2], 2, reference[2], "--fraction", "mem-opt")


@pytest.mark.mpi
def test_loaded_factors_equal_the_saved_ones_bit_for_bit(reference):
    from kfac_hpc.optim import KFACPreconditioner

    ckpt = load_checkpoint(_ckpt(reference[2]))
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Dropout(0.0), torch.nn.Linear(32, 10)
    ).double()
    kfac = KFACPreconditioner(model, inv_dtype=torch.float64)
    restore_training_state(ckpt, model=model, preconditioner=kfac, restore_rng=False)
    saved = merged_state(saved_method_state(ckpt.tree, kfac))["layers"]
    loaded = kfac.state_dict(include_second_order=True)["layers"]
    assert saved.keys() == loaded.keys() == {"0", "3"}
    for name in saved:
        for key in ("A", "G", "QA", "dA", "QG", "dG"):
            assert torch.equal(saved[name][key], loaded[name][key]), (name, key)


@pytest.mark.mpi
def test_a_different_model_fails_naming_the_first_mismatched_layer(reference):
    ckpt = load_checkpoint(_ckpt(reference[1]))
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Dropout(0.0), torch.nn.Linear(16, 10)
    ).double()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(CheckpointMismatchError, match=r"'0\.weight'.*\(32, 64\).*\(16, 64\)"):
        restore_training_state(ckpt, model=model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.mpi
def test_init_factors_from_a_two_rank_checkpoint_at_one_rank(reference):
    from kfac_hpc.optim import KFACPreconditioner

    model = torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Dropout(0.0), torch.nn.Linear(32, 10)
    ).double()
    kfac = KFACPreconditioner(model, inv_dtype=torch.float64)
    assert init_factors_from(reference[2], kfac) == 2
    saved = load_checkpoint(_ckpt(reference[2])).tree["kfac_state"]["layers"]
    for name, entry in kfac.state_dict()["layers"].items():
        assert torch.equal(entry["A"], saved[name]["A"]) and torch.equal(
            entry["G"], saved[name]["G"]
        )
