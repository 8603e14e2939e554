"""Started as 2 real ranks by tests/optim/test_branch_graph.py: a model whose graph differs
between ranks (the branch runs on rank 1 only). Each rank saves the factors K-FAC holds after
one step and its own dense float64 factors of every layer it ran to ``OUT_DIR/rank{r}.pt``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.optim import KFACPreconditioner
from kfac_hpc.runtime import init_distributed, shutdown
from tests.helpers.models import dense_factors
from tests.helpers.rank_checks import main_or_leave


class BranchNet(nn.Module):
    """fc1 -> (branch on rank 1 only) -> fc2; registered in this order on every rank."""

    def __init__(self, take_branch: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.branch = nn.Linear(5, 5)
        self.fc2 = nn.Linear(5, 3)
        self.take_branch = take_branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.take_branch:
            h = h + torch.tanh(self.branch(h))
        return self.fc2(h)


def main(out_dir: Path) -> None:
    ctx = init_distributed("gloo")
    torch.manual_seed(0)
    model = BranchNet(take_branch=ctx.rank == 1).double()
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name: str):
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            seen[name] = [inputs[0].detach()]
            out.register_hook(lambda g: seen[name].append(g.detach()))

        return hook

    for name in ("fc1", "branch", "fc2"):
        getattr(model, name).register_forward_hook(keep(name))
    # tiny buckets: several collectives whose layout must agree between the ranks
    pre = KFACPreconditioner(
        model, kl_clip=None, inv_dtype=torch.float64, allreduce_bucket_cap_mb=0.0002
    )
    torch.manual_seed(10 + ctx.rank)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    nn.functional.cross_entropy(model(x), y).backward()
    pre.step()
    dense = {name: dense_factors(getattr(model, name), *seen[name]) for name in seen}
    state = pre.state_dict()["layers"]
    torch.save(
        {
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "kfac": {n: (s["A"], s["G"]) for n, s in state.items() if "A" in s},
            "dense": dense,
        },
        out_dir / f"rank{ctx.rank}.pt",
    )
    shutdown()


if __name__ == "__main__":
    main_or_leave(lambda: main(Path(sys.argv[1])))
