"""Started as 2 real ranks by tests/optim/test_ddp.py: K-FAC on a DistributedDataParallel model.

Each rank trains on its half of a fixed batch of 8 for 2 steps (K-FAC every step, MEM-OPT so
that gradient broadcasts run too) and saves its gradients, world size and layer names.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.optim import KFACPreconditioner
from kfac_hpc.runtime import init_distributed, shutdown
from tests.helpers.models import small_cnn
from tests.helpers.rank_checks import main_or_leave


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    init_distributed("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = nn.parallel.DistributedDataParallel(small_cnn(torch.float64))
    pre = KFACPreconditioner(
        model, grad_worker_fraction="mem-opt", kl_clip=None, inv_dtype=torch.float64
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(3)
    x, y = torch.randn(8, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (8,))
    part = slice(rank * 8 // size, (rank + 1) * 8 // size)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[part]), y[part]).backward()
        pre.step()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    torch.save({"world_size": size, "layers": list(pre.layers), "grads": grads}, out_path % rank)
    shutdown()


if __name__ == "__main__":
    main_or_leave(lambda: main(sys.argv[1]))
