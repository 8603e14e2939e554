"""Started by tests/plan/test_memory_runs.py: the job's own steps of one method, every tensor
allocation recorded, to compare with ``kfac_hpc.plan.memory``.

Under ``mpiexec -n P`` (gloo, one thread): builds the model, the method (``build_method``, as
the job does) and the job's :class:`~kfac_hpc.train.step.TrainStep` on synthetic samples of
the dataset's shape, and runs ``STEPS`` steps per method, everything from the model's creation
on inside ``torch.profiler`` with ``profile_memory``. The peak is the CPU allocator's own count
of allocated bytes (``total_allocated`` of each recorded allocation or free) at its highest,
less its value when the profile began: what ``torch.cuda.max_memory_allocated`` is on a GPU.
That count is kept for every thread once c10's ``caffe2_report_cpu_memory_usage`` flag is set
(first thing in ``main``): gloo frees some collectives' buffers on its own threads,
where the profiler records no event, so a running sum of the recorded events alone keeps
those buffers forever (it read FOSI at 2 ranks 1.24x too high, growing with the collectives).
Prints one JSON record per rank.

Settings (environment): MODEL, DATASET, BATCH (global), STEPS and CONFIGS (a JSON list of
job options, one method each, measured one after the other).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from kfac_hpc.contracts import PHASES
from kfac_hpc.plan.layers import INPUTS
from kfac_hpc.runtime import init_distributed, shutdown
from kfac_hpc.train.config import TrainConfig, load_config
from kfac_hpc.train.data import DataSource, ShardedBatches
from kfac_hpc.train.methods import MethodSetup, build_method
from kfac_hpc.train.methods.registry import method_name
from kfac_hpc.train.step import TrainStep
from kfac_hpc.train.timing import PhaseTimer
from kfac_hpc.train.workloads import build_model
from tests.helpers.rank_checks import main_or_leave

SAMPLES = 256


def count_every_thread() -> None:
    """Set c10's ``caffe2_report_cpu_memory_usage``: the CPU allocator then keeps its count of
    allocated bytes for every thread's allocations and frees, not only the profiled one's."""
    c10 = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    ctypes.c_bool.in_dll(c10, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def source(shape: tuple[int, ...], classes: int) -> DataSource:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(SAMPLES, *shape, generator=gen)
    y = torch.randint(0, classes, (SAMPLES,), generator=gen)
    return DataSource("synthetic", shape, classes, SAMPLES, 0, lambda i: (x[i], y[i]), None)  # type: ignore[arg-type]


def peak_bytes(prof: profile) -> int:
    """The allocator's count of allocated bytes at its highest during the profile, less its
    count when the profile began (each recorded event carries the count after it)."""
    counts: list[tuple[int, int, int]] = []

    def walk(nodes: list[Any]) -> None:
        for node in nodes:
            if node.tag == _EventType.Allocation:
                fields = node.extra_fields
                counts.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    if not counts:
        return 0
    counts.sort()
    _, first_size, first_total = counts[0]
    return max(total for _, _, total in counts) - (first_total - first_size)


def measure(
    model_name: str, dataset: str, batch: int, options: dict[str, Any], steps: int
) -> dict[str, Any]:
    """One method's peak on this rank (and the K-FAC data its preconditioner holds)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shape, classes = INPUTS[dataset]
    config = load_config(None, {"batch_size": batch, "seed": 1, **options})
    data = ShardedBatches(source(shape, classes), config.batch_size, rank, world, 1, False)
    gc.collect()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        net = build_model(TrainConfig(model=model_name), shape, classes)
        name = method_name(config)
        method = build_method(name, MethodSetup(config, net, world))
        step = TrainStep(net, data, torch.device("cpu"), method, world)
        timer = PhaseTimer(phases=PHASES + tuple(p for p in method.phases if p not in PHASES))
        for s in range(steps):
            timer.begin_step()
            step(s, config.lr, [0.0], timer)
            timer.end_step()
    held = getattr(method, "preconditioner", None)
    return {
        "options": options,
        "peak_bytes": peak_bytes(prof),
        "kfac": None if held is None else held.memory_usage(),
    }


def main() -> None:
    count_every_thread()
    torch.set_num_threads(1)
    ctx = init_distributed(backend="gloo", timeout_s=300)
    model_name, dataset = os.environ["MODEL"], os.environ["DATASET"]
    batch, steps = int(os.environ["BATCH"]), int(os.environ["STEPS"])
    configs = json.loads(os.environ["CONFIGS"])
    results = [measure(model_name, dataset, batch, o, steps) for o in configs]
    record = {"rank": ctx.rank, "world_size": dist.get_world_size(), "results": results}
    os.write(1, (json.dumps(record) + "\n").encode())
    shutdown()


if __name__ == "__main__":
    main_or_leave(main)
