"""The job's FOSI step at P = 2 and 3 real ranks equals single-process FOSI step by step, and
the job does not allreduce the gradients: FOSI reduce-scatters them and all-gathers the
parameters (ZeRO-1).

tests/helpers/rank_scripts/fosi_job_step.py runs the job's own ``TrainStep`` with the
registered ``fosi``
method (``mpiexec``, gloo) on a float64 MLP of 53 parameters (divisible by neither 2 nor 3),
seven steps with two ESEs, and, as the independent computation, ``kfac_hpc.FOSI`` in one
process on the whole global batch of every step.

Tolerance (float64): parameters after every step ``|Δ| <= 1e-10 · max|reference|``; the
ranks' gradients average to the reference's to the same bound (only the order of the sums
differs).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import RANK_SCRIPTS, run_bounded, run_mpi, script_env

pytestmark = pytest.mark.mpi

SCRIPT = RANK_SCRIPTS / "fosi_job_step.py"
N = 53  # parameters of the MLP
RTOL = 1e-10


def _load(out: Path, tag: str, world: int) -> list[dict[str, Any]]:
    ranks = [torch.load(out / f"{tag}_rank{r}.pt") for r in range(world)]
    assert [r["world_size"] for r in ranks] == [world] * world
    assert [r["rank"] for r in ranks] == list(range(world))
    return [r["results"] for r in ranks]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("reference")
    proc = run_bounded(
        [sys.executable, str(SCRIPT), str(out)], env=script_env({"MODE": "reference"}), timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _load(out, "reference", 1)[0]


@pytest.mark.parametrize("world", [2, 3])
def test_job_step_equals_single_process_fosi_without_a_gradient_allreduce(
    world: int, reference: dict[str, Any], tmp_path: Path
) -> None:
    proc = run_mpi(world, [sys.executable, str(SCRIPT), str(tmp_path)], env={"MODE": "job"})
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    ranks = _load(tmp_path, f"job{world}", world)
    assert len(reference["eigenvalues"]) == 4
    for rank, got in enumerate(ranks):
        for step, (a, b) in enumerate(zip(got["params"], reference["params"], strict=True)):
            err, bound = (a - b).abs().max().item(), RTOL * b.abs().max().item()
            assert err <= bound, f"P={world} rank {rank} step {step}: |Δ| {err:.3e} > {bound:.3e}"
        torch.testing.assert_close(got["eigenvalues"], reference["eigenvalues"], rtol=RTOL, atol=0)
        # the job's flags are still summed over ranks (time limit, checkpoint due)
        assert got["flags"] == [[float(sum(range(world))), float(world)]] * len(got["flags"])

    for step, want in enumerate(reference["grads"]):
        local = [r["grads"][step] for r in ranks]
        # every rank kept its own gradient: had the job allreduced, all would be the mean
        assert not torch.equal(local[0], local[1]), f"step {step}: gradients were averaged"
        mean = torch.stack(local).mean(0)
        assert (mean - want).abs().max().item() <= RTOL * want.abs().max().item(), step

    padded = -(-N // world) * world
    for rank, got in enumerate(ranks):
        calls: list[tuple[str, int]] = got["calls"]
        allreduced = [n for name, n in calls if name == "all_reduce"]
        assert max(allreduced) < N, f"rank {rank}: an allreduce of {max(allreduced)} numbers"
        scattered = [n for name, n in calls if name == "reduce_scatter"]
        gathered = [n for name, n in calls if name == "all_gather"]
        # one gradient reduce-scatter (on gloo an all-to-all of the n coordinates) and one
        # parameter all-gather (P padded pieces) per step, plus one of each per Lanczos step of
        # the two ESEs (12 HVPs each), and one all-gather of the trial step of each ESE's loss
        # check (--fosi-ese-check)
        assert scattered == [N] * (7 + 2 * 12), rank
        assert gathered.count(padded) == 7 + 2 * 12 + 2, rank
        phases = got["phases"]
        assert phases["grad_allreduce"] > 0 and phases["param_allgather"] > 0
        assert phases["ese"] > 0 and phases["optimizer"] > 0
