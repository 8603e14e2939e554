"""A layer whose hook fires on some ranks only (a data-dependent graph): the factor buckets
have the same layout on every rank (registration order, not hook order), and such a layer is
averaged over the ranks that ran it (docs/kfac.md). Two real ranks (mpiexec, gloo); factors
compared with dense float64 per-rank factors to 1e-12."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_mpi
from tests.helpers.launch import RANK_SCRIPTS

pytestmark = pytest.mark.mpi

SCRIPT = RANK_SCRIPTS / "branch_graph.py"


def test_branch_on_one_rank_keeps_buckets_aligned(tmp_path: Path) -> None:
    proc = run_mpi(
        2, [sys.executable, str(SCRIPT), str(tmp_path)], env={"PYTHONPATH": str(REPO)}, timeout=180
    )
    assert proc.returncode == 0, f"ranks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert set(ranks[0]["dense"]) == {"fc1", "fc2"}  # the branch ran on rank 1 only
    assert set(ranks[1]["dense"]) == {"fc1", "branch", "fc2"}
    for name in ("fc1", "branch", "fc2"):
        runs = [r["dense"][name] for r in ranks if name in r["dense"]]
        expected = [sum(f[i] for f in runs) / len(runs) for i in (0, 1)]  # mean over runners
        for r in ranks:
            got = r["kfac"][name]
            for i, which in enumerate("AG"):
                torch.testing.assert_close(
                    got[i], expected[i], rtol=1e-12, atol=1e-12, msg=f"{name} {which}"
                )
        torch.testing.assert_close(ranks[0]["kfac"][name], ranks[1]["kfac"][name], rtol=0, atol=0)
