"""Started as N real ranks by the tests: all-reduce through the runtime, print one JSON line."""

import json
import os

import torch
import torch.distributed as dist

from kfac_hpc.runtime import init_distributed, shutdown
from tests.helpers.rank_checks import main_or_leave


def main() -> None:
    ctx = init_distributed(timeout_s=300)
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    line = (
        json.dumps(
            {
                "rank": ctx.rank,
                "world_size": ctx.world_size,
                "pg_world_size": dist.get_world_size(),
                "local_rank": ctx.launch.local_rank,
                "source": ctx.launch.source,
                "rendezvous": ctx.rendezvous.source,
                "backend": ctx.backend,
                "sum": value.item(),
            }
        )
        + "\n"
    )
    os.write(1, line.encode())  # one write per rank: launchers merge the ranks' output streams
    shutdown()


if __name__ == "__main__":
    main_or_leave(main)
