"""Started as P = 2 or 3 real ranks by tests/optim/fosi/test_pipeline_nowait.py: pipelined FOSI with
the last rank given to ESE and a staleness bound of 2, whose curvature rank is held up.

The tiny float64 MLP of fosi_sharded.py, plain SGD (lr 0.1, no momentum: its update needs no state,
so that the test can replay every step densely), ESEs requested at steps 1, 6 and 11 of 0..14.
Every ESE of the curvature rank blocks until a release file exists, which training rank 0 writes at
the start of a later step (``RELEASE_BEFORE``): ESE 6 before step 10, so the training ranks must
get through steps 6..9 without it (steps 8 and 9 past the bound); ESEs 1 and 11 before steps 2 and
12, so that no result can arrive in the step that requested it. Nothing here is timed: where the
test needs a result to have arrived (before steps 2 and 10, and 12 of the resumed run) the training
ranks wait for its receives outside ``FOSI.step``. Before step 10 training rank 0 saves the full
state (an ESE in flight) and, after the run, every rank resumes from it for steps 10..14. A last
run of steps 0..2 ends with ESE 1 still held: training rank 0 releases it only as it calls
``FOSI.close``, which must wait for its result.

Each rank writes ``OUT_DIR/rank{r}.pt``: per run, the parameters before and after every step, the
steps of every swap with the eigenpairs swapped in (V gathered whole), ``late_steps``,
``staleness`` and ``late_from`` of the saved state.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.optim.fosi import FOSI
from kfac_hpc.runtime import init_distributed, shutdown
from tests.helpers.rank_checks import main_or_leave
from tests.helpers.rank_scripts.fosi_sharded import batch, build_model, part

LR = 0.1
OPTIONS: dict[str, Any] = {"k": 2, "l": 1, "alpha": 0.05, "warmup": 1, "ese_every": 5,
                           "max_staleness": 2, "hvp": "double-backward", "residual_tol": 1.0,
                           "curvature_ranks": 1}  # fmt: skip
# the curvature rank's ESE of step e waits for a file that training rank 0 writes at the start
# of step RELEASE_BEFORE[e]; the state is saved with ESE 6 in flight, before step 10
RELEASE_BEFORE = {1: 2, 6: 10, 11: 12}
SAVE_BEFORE = 10
ESE_STEPS = {1, 6, 11}
RELEASE_TIMEOUT_S = 120.0  # a training rank that waits for the held ESE never writes it


def wait_for(path: Path) -> None:
    """Block until ``path`` exists; raise after RELEASE_TIMEOUT_S (the training ranks waited)."""
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never written: the training ranks waited for the ESE")
        time.sleep(0.01)


def wait_arrival(opt: FOSI) -> None:
    """Wait (outside FOSI.step) until the oldest ESE in flight has arrived on this rank."""
    assert opt.pipeline is not None
    opt.pipeline.pending[0].done.wait()


def train(
    opt: FOSI,
    model: nn.Module,
    steps: range,
    holds: set[int],
    out: Path,
    world: int,
    name: str,
    releases: dict[int, int] = RELEASE_BEFORE,
) -> dict[str, Any]:
    """Steps ``steps`` (waiting for an ESE's arrival before the steps in ``holds``); the
    curvature rank's ESE of step e waits for the file training rank 0 writes before step
    ``releases[e]``, or, for an ESE requested but not in ``releases``, before FOSI.close."""
    rank, trainers = dist.get_rank(), world - 1
    record: dict[str, Any] = {"before": [], "after": [], "installs": {}, "late_from": None}
    vectors = opt.vectors
    for step in steps:
        if not opt.is_curvature_rank:
            if step == SAVE_BEFORE and steps.start < SAVE_BEFORE:
                if rank == 0:  # the state with the held ESE in flight, for the resumed run
                    torch.save(opt.full_state_dict(), out / "state.pt")
                    torch.save([p.detach().clone() for p in model.parameters()],
                               out / "params.pt")  # fmt: skip
                else:
                    opt.full_state_dict()  # collective over the training ranks
            released = [e for e, before in releases.items() if before == step]
            if rank == 0 and released:
                (out / f"{name}-release{released[0]}").touch()
            if step in holds:
                wait_arrival(opt)
            x, y = part(batch(step), rank, trainers)
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        cx, cy = batch(1000 + step)

        def closure(step: int = step, cx: torch.Tensor = cx, cy: torch.Tensor = cy) -> torch.Tensor:
            if step in releases:
                wait_for(out / f"{name}-release{step}")
            elif step in ESE_STEPS:
                wait_for(out / f"{name}-closing")
            return nn.functional.cross_entropy(model(cx), cy)

        record["before"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        opt.step(closure)
        record["after"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        if not opt.is_curvature_rank and opt.vectors is not vectors:
            vectors = opt.vectors
            assert vectors is not None
            whole = torch.stack([opt.shard.gather(row) for row in vectors])
            record["installs"][step] = (opt.eigenvalues.clone(), opt.top, whole)
    if rank == 0 and not opt.is_curvature_rank:
        (out / f"{name}-closing").touch()  # releases an ESE still held: FOSI.close waits for it
    record["in_flight_at_end"] = 0 if opt.pipeline is None else len(opt.pipeline.pending)
    opt.close()
    record["in_flight_after_close"] = 0 if opt.pipeline is None else len(opt.pipeline.pending)
    record["late_steps"] = list(opt.late_steps)
    record["staleness"] = list(opt.staleness)
    return record


def build(model: nn.Module) -> FOSI:
    base = torch.optim.SGD(model.parameters(), lr=LR)
    return FOSI(model.parameters(), base, model=model, **OPTIONS)


def main() -> None:
    ctx = init_distributed(backend="gloo", timeout_s=600)
    torch.set_num_threads(1)
    world, out = dist.get_world_size(), Path(sys.argv[1])
    model = build_model()
    results = {"run": train(build(model), model, range(15), {2, 10}, out, world, "run")}
    dist.barrier()  # the saved state is written
    state = torch.load(out / "state.pt")
    model = build_model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), torch.load(out / "params.pt"), strict=True):
            p.copy_(value)
    opt = build(model)
    opt.load_full_state_dict(state)
    results["resumed"] = train(opt, model, range(10, 15), {12}, out, world, "resumed")
    results["resumed"]["late_from"] = state["late_from"]
    # training ends with ESE 1 in flight, its curvature rank held until training rank 0 is in
    # FOSI.close: without the close, rank 0 would leave with the result unreceived
    model = build_model()
    results["closing"] = train(build(model), model, range(3), set(), out, world, "closing", {})
    results["curvature_rank"] = opt.is_curvature_rank
    torch.save({"world_size": world, "rank": ctx.rank, "results": results},
               out / f"rank{ctx.rank}.pt")  # fmt: skip
    shutdown()


if __name__ == "__main__":
    main_or_leave(main)
