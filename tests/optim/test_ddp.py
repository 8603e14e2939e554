"""K-FAC on a DistributedDataParallel model (2 real ranks, gloo) gives the gradients of one
process on the whole batch; layer names do not carry DDP's ``module.`` prefix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from tests.conftest import REPO, run_mpi
from tests.helpers.launch import RANK_SCRIPTS
from tests.helpers.models import small_cnn


@pytest.mark.mpi
def test_ddp_two_ranks_match_one_process(tmp_path: Path) -> None:
    out = str(tmp_path / "rank%d.pt")
    proc = run_mpi(
        2, [sys.executable, str(RANK_SCRIPTS / "ddp_worker.py"), out],
        env={"PYTHONPATH": str(REPO)}, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(out % r) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["layers"] == ["0", "2", "5"]

    model = small_cnn(torch.float64)
    pre = KFACPreconditioner(model, kl_clip=None, inv_dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(3)
    x, y = torch.randn(8, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (8,))
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        expected = [p.grad.clone() for p in model.parameters()]
        opt.step()
    # float64: only summation order differs, amplified by near-degenerate eigenvalues.
    for rank in ranks:
        for got, want in zip(rank["grads"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-10)
