"""DHO2 per-rank memory and ESE cost at P = 1, 2, 4 ranks (gloo, CPU).

One command: ``.venv/bin/python benchmarks/bench_fosi.py`` starts itself as 1, 2 and 4 real
ranks (``mpiexec``), one job after the other, each running the same workload:

* a float32 MLP 1024-1024-1024-10 (2.1 M parameters), SGD with momentum 0.9 as the base, FOSI
  with k = 10, l = 0 (m = 40 Lanczos steps, double-backward HVPs: ``hvp="auto"``), training
  micro-batches
  of 32 and curvature micro-batches of 64 per rank;
* memory, ``--rounds`` times (3): with the model and its gradients already allocated, the kernel's
  resident-set high-water mark of this process is reset (``/proc/self/clear_refs``, 5) and its
  resident set read (``VmRSS``); FOSI is built and runs two plain steps and one step with an
  ESE; the new high-water mark (``VmHWM``) minus that baseline is FOSI's peak: ESE (Lanczos
  basis, HVP and all-gather temporaries), V, velocity and the ZeRO-1 base state, measured from
  what the process really touched (the CPU allocator of torch keeps no statistics);
* time: per round, the ESE seconds (``last_ese_s``, slowest rank) and the median of five steps
  without ESE, and so the ESE's share of step time at ``ese_every = 100``; and the seconds of
  one HVP by each autodiff route (median of ``--rounds`` products).

* in-job communication, at P = 2 and 4: per step, the job's gradient sync (its own
  ``GradientAllreduce``) and FOSI's step with V installed (k = 10, no ESE), both ways the
  gradients can reach FOSI: the job allreduces them and FOSI takes its slice (what the job did
  before), or the job sums only its flags and FOSI reduce-scatters (what it does now); both end
  with FOSI's all-gather of the parameters. Every ``all_reduce``, ``reduce_scatter_single``,
  ``all_to_all_single`` (FOSI's reduce-scatter on gloo) and ``all_gather`` call is wrapped:
  the bytes of the tensors handed to it, and its wall seconds.
  The ranks meet at a barrier (not recorded) before each step's collectives, so that their
  seconds are communication, not one rank waiting for another's backward pass.
  Allreduces under 4 KiB (the job's flags, FOSI's k + l coefficients) are listed apart
  (``small_all_reduce``): their seconds are latency and waiting for the slowest rank; "without
  small" is the seconds of the gradient and parameter collectives alone.
  Bytes each rank sends follow the ring algorithms (allreduce 2(P - 1)/P of its buffer,
  reduce-scatter and all-gather (P - 1)/P of the full vector).

``--ese-variants`` measures instead, side by side in one run (interleaved rounds), the ESE's
share of the step time at ``ese_every = 100`` with full reorthogonalization (``full``: the
defaults) and with the cheaper ESE (``CHEAP``: HVPs on the leading quarter of
the curvature batch, Lanczos warm-started from the previous V and stopped once the pairs
converged, ``lanczos_tol`` = ``residual_tol``), with the Lanczos basis in float32 (``f32``:
``lanczos_dtype="training"``), with both, and each of these with partial reorthogonalization
(``partial``: ``reorthogonalize="partial"``), and two of them with the Hessian-vector products
by forward-over-reverse (``/fwd``: ``hvp="forward-over-reverse"``, what ``auto`` chose before
2026-12-03), so that the route's effect is measured in the same run, and the cheapest with the
Lanczos basis kept between ESEs (``+keep``: ``keep_basis=True``; the timed second ESE reuses
the first one's basis); ``--variants`` runs a
subset (comma-separated names); the share is
also given at 800 steps, the adaptive schedule's longest interval (8 x 100): per round
and variant a FOSI runs an ESE, two plain steps and a second ESE (the one timed: the warm start
has a previous V), then five timed plain steps; at P = 1, 2 and 4 (``--world-sizes``). Target:
ESE share <= 15 % (``SHARE_TARGET``).

Prints median (min, max) over the rounds, max over ranks, the ratios against P = 1, and writes
benchmarks/results/bench_fosi.json, with the load average before and after. Target: peak memory
at P = 4 <= 0.3x that of P = 1 (``--check``: exit 1 when missed).
Note: this machine may have fewer cores than 4 ranks; times at P = 4 then share cores.
"""

from __future__ import annotations

import functools
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py, beside this script
from memprobe import reset_peak as _reset_peak  # benchmarks/memprobe.py, beside this script
from memprobe import status_kib as _status_kib

WORLD_SIZES = (1, 2, 4)
ROUNDS = 3
TARGET = 0.3  # peak memory at P = 4 over P = 1
ESE_EVERY = 100
MIB = 1024 * 1024
MB = 1e6
COMM_STEPS = 6  # timed steps per path and round
# How the gradients reach FOSI: (the job allreduces them, FOSI averages them itself). Before,
# the job allreduced and FOSI took its slice; now FOSI reduce-scatters (the job sums flags only).
COMM_PATHS = {"allreduce": (True, False), "reduce_scatter": (False, True)}
COMM_LABELS = {"allreduce": "job allreduce + FOSI all-gather", "reduce_scatter":
               "FOSI reduce-scatter + all-gather"}  # fmt: skip
# (kind, torch.distributed function, index of the argument whose tensors are the payload)
# (FOSI's reduce-scatter is an all-to-all of the pieces on gloo, reduce_scatter_single on NCCL.)
COLLECTIVES = (("all_reduce", "all_reduce", 0), ("reduce_scatter", "reduce_scatter_single", 1),
               ("reduce_scatter", "all_to_all_single", 1),
               ("all_gather", "all_gather", 0))  # fmt: skip
# Allreduces under this many bytes (the job's flags, FOSI's k + l coefficients) are counted
# apart as "small": their seconds are mostly latency and waiting for the slowest rank.
SMALL_BYTES = 4096
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "small_all_reduce")
# --ese-variants: FOSI's options per variant, and the target on the ESE's share of step time
CHEAP: dict[str, Any] = {"curvature_fraction": 0.25, "warm_start": True, "lanczos_tol": 0.01}
FULL: dict[str, Any] = {"reorthogonalize": "full"}  # the default
PARTIAL: dict[str, Any] = {"reorthogonalize": "partial"}
ESE_VARIANTS: dict[str, dict[str, Any]] = {
    "full": FULL,
    "cheap": {**CHEAP, **FULL},
    "f32": {"lanczos_dtype": "training", **FULL},
    "f32+cheap": {**CHEAP, "lanczos_dtype": "training", **FULL},
    "partial": PARTIAL,
    "f32+partial": {"lanczos_dtype": "training", **PARTIAL},
    "f32+cheap+partial": {**CHEAP, "lanczos_dtype": "training", **PARTIAL},
    "f32+cheap+partial+keep": {
        **CHEAP,
        "lanczos_dtype": "training",
        **PARTIAL,
        "keep_basis": True,
    },
    "full/fwd": {**FULL, "hvp": "forward-over-reverse"},
    "f32+cheap+partial/fwd": {
        **CHEAP,
        "lanczos_dtype": "training",
        **PARTIAL,
        "hvp": "forward-over-reverse",
    },
}
# the adaptive schedule's longest interval (kfac_hpc.optim.fosi.ese_interval.LONGEST x 100):
# the share there is the least the adaptive schedule can reach on a still subspace
ESE_EVERY_LONGEST = 800
SHARE_TARGET = 0.15


def ring_bytes(kind: str, payload: int, world: int) -> float:
    """Bytes one rank sends for a collective of ``payload`` bytes (the allreduce's buffer, the
    reduce-scatter's input, the all-gather's output) by ring algorithms over ``world`` ranks."""
    return payload * (world - 1) / world * (2 if kind == "all_reduce" else 1)


def workload(rank: int) -> tuple[Any, Any, Any]:
    """(the MLP, ``data(size)`` of this rank, ``backward()`` of a training micro-batch)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 10)
    )
    gen = torch.Generator().manual_seed(rank)

    def data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(size, 1024, generator=gen), torch.randint(0, 10, (size,), generator=gen)

    def backward() -> None:
        x, y = data(32)
        model.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()

    return model, data, backward


def measure(rank: int, rounds_count: int) -> dict[str, Any]:
    """``rounds_count`` rounds of FOSI's peak memory (bytes), ESE seconds and step seconds."""
    import torch
    from torch import nn

    from kfac_hpc.optim.fosi import FOSI
    from kfac_hpc.optim.fosi.hvp import HessianVectorProduct

    model, data, backward = workload(rank)
    gen = torch.Generator().manual_seed(rank)
    backward()  # gradients exist before the baseline
    rounds: list[dict[str, Any]] = []
    for _ in range(rounds_count):
        gc.collect()
        _reset_peak()
        baseline = _status_kib("VmRSS")
        base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        opt = FOSI(model.parameters(), base, k=10, l=0, alpha=0.01, ese_every=ESE_EVERY,
                   warmup=2, model=model)  # fmt: skip
        cx, cy = data(64)

        def closure(cx: torch.Tensor = cx, cy: torch.Tensor = cy) -> torch.Tensor:
            return nn.functional.cross_entropy(model(cx), cy)

        step_s = []
        for step in range(8):
            backward()
            started = time.perf_counter()
            opt.step(closure)
            if step != 2:
                step_s.append(time.perf_counter() - started)
            if step == 2:
                peak = _status_kib("VmHWM")
                usage = opt.memory_usage()
        rounds.append({
            "peak_bytes": (peak - baseline) * 1024,
            "ese_s": opt.last_ese_s,
            "step_s": statistics.median(step_s),
            "memory_usage": usage,
        })  # fmt: skip
        del opt, base
    hvp_s = {}
    for mode in ("forward-over-reverse", "double-backward"):  # per product, this rank alone
        hvp = HessianVectorProduct(list(model.parameters()), lambda: nn.functional.cross_entropy(
            model(cx), cy), model, mode)  # fmt: skip
        v = torch.randn(sum(p.numel() for p in model.parameters()), generator=gen)
        hvp(v)
        samples = []
        for _ in range(rounds_count):
            started = time.perf_counter()
            hvp(v)
            samples.append(time.perf_counter() - started)
        hvp_s[mode] = statistics.median(samples)
    return {"rank": rank, "parameters": sum(p.numel() for p in model.parameters()),
            "rounds": rounds, "hvp_s": hvp_s}  # fmt: skip


def measure_ese_variants(
    rank: int, rounds_count: int, names: list[str]
) -> dict[str, list[dict[str, float]]]:
    """Per ESE_VARIANTS entry of ``names`` and round (interleaved): the second ESE's seconds
    and Lanczos steps, and the median seconds of five plain steps."""
    import torch
    from torch import nn

    from kfac_hpc.optim.fosi import FOSI

    model, data, backward = workload(rank)
    cx, cy = data(64)

    def closure(fraction: float = 1.0) -> torch.Tensor:
        from kfac_hpc.optim.fosi.curvature_batch import leading_rows

        x, y = leading_rows(fraction, cx, cy)
        return nn.functional.cross_entropy(model(x), y)

    def one(name: str, _round: int) -> dict[str, float]:
        base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        opt = FOSI(model.parameters(), base, k=10, l=0, alpha=0.01, ese_every=3, warmup=0,
                   model=model, **ESE_VARIANTS[name])  # fmt: skip
        for _ in range(3):  # the first ESE and two plain steps
            backward()
            opt.step(closure)
        backward()
        opt.step(closure)  # the second ESE, timed by FOSI itself (last_ese_s)
        ese_s, steps = opt.last_ese_s, opt.last_lanczos_steps
        step_s = []
        for _ in range(5):
            backward()
            started = time.perf_counter()
            opt.step(closure)
            step_s.append(time.perf_counter() - started)
        return {"ese_s": ese_s, "lanczos_steps": steps, "step_s": statistics.median(step_s),
                "first_rejected": float(bool(opt.rejected_at)),
                "reorthogonalized": opt.last_reorthogonalized}  # fmt: skip

    return harness.interleave({name: functools.partial(one, name) for name in names}, rounds_count)


def summarise_variants(job: dict[str, Any]) -> dict[str, Any]:
    """Per variant: per round the slowest rank's ESE and step seconds, the ESE share at
    ESE_EVERY, over rounds."""
    ranks = [r["ese_variants"] for r in job["ranks"]]
    out: dict[str, Any] = {"world_size": job["world_size"]}
    for name in ranks[0]:
        per_round = list(zip(*(r[name] for r in ranks), strict=True))
        ese = [max(r["ese_s"] for r in rnd) for rnd in per_round]
        step = [max(r["step_s"] for r in rnd) for rnd in per_round]
        share = [e / (e + ESE_EVERY * s) for e, s in zip(ese, step, strict=True)]
        longest = [e / (e + ESE_EVERY_LONGEST * s) for e, s in zip(ese, step, strict=True)]
        out[name] = {
            "ese_s": harness.stats(ese),
            "step_s": harness.stats(step),
            "ese_share_at_interval": harness.stats(share),
            "ese_share_at_longest": harness.stats(longest),
            "ese_s_per_round": ese,  # the rounds' order: the variants' ratios round by round
            "ese_share_per_round": share,
            "lanczos_steps": [int(rnd[0]["lanczos_steps"]) for rnd in per_round],
            "reorthogonalized": [int(rnd[0]["reorthogonalized"]) for rnd in per_round],
            # whether the ESE check dropped the first subspace (the second ESE then started cold)
            "first_rejected": [bool(rnd[0].get("first_rejected")) for rnd in per_round],
            "rounds": len(per_round),
        }
    return out


def report_variants(jobs: list[dict[str, Any]]) -> None:
    print(f"ESE share of step time at ese_every = {ESE_EVERY}, full vs cheap "
          f"({ESE_VARIANTS['cheap']}); MLP 2.1 M parameters, k = 10, curvature batch 64 per "
          "rank, gloo on CPU; median (min..max) over rounds, slowest rank")  # fmt: skip
    print(f"{'P':>2} {'variant':<21} {'ESE s':>22} {'step s':>24} {'ESE share':>22} "
          f"Lanczos steps (passes)  ESE vs full  share at {ESE_EVERY_LONGEST}")  # fmt: skip
    for job in jobs:
        names = [name for name in ESE_VARIANTS if name in job]
        base = job[names[0]]["ese_s"]["median"]
        for name in names:
            v = job[name]
            e, s, sh = v["ese_s"], v["step_s"], v["ese_share_at_interval"]
            print(f"{job['world_size']:>2} {name:<21} {e['median']:>7.3f} ({e['min']:.3f}.."
                  f"{e['max']:.3f}) {s['median']:>8.4f} ({s['min']:.4f}..{s['max']:.4f})"
                  f" {sh['median'] * 100:>6.1f} % ({sh['min'] * 100:.1f}..{sh['max'] * 100:.1f})"
                  f" {v['lanczos_steps']} ({v['reorthogonalized']})  {e['median'] / base:.2f}x"
                  f"  {v['ese_share_at_longest']['median'] * 100:.1f} %")  # fmt: skip
    print("(ESE vs the first variant listed)")


def _record_collectives(log: list[tuple[str, int, float]]) -> Any:
    """Wrap the COLLECTIVES of torch.distributed: each call appends (kind, payload bytes of
    the tensors handed to it, wall seconds) to ``log``. Returns the function that unwraps
    them."""
    import torch.distributed as dist

    originals = {}
    for kind, attr, arg in COLLECTIVES:
        fn = originals[attr] = getattr(dist, attr)

        def call(*args: Any, _fn: Any = fn, _kind: str = kind, _arg: int = arg, **kw: Any) -> Any:
            tensors = args[_arg] if isinstance(args[_arg], list) else [args[_arg]]
            payload = sum(t.numel() * t.element_size() for t in tensors)
            started = time.perf_counter()
            result = _fn(*args, **kw)
            seconds = time.perf_counter() - started
            small = _kind == "all_reduce" and payload < SMALL_BYTES
            log.append(("small_" + _kind if small else _kind, payload, seconds))
            return result

        setattr(dist, attr, call)
    return lambda: [setattr(dist, attr, fn) for attr, fn in originals.items()]


def measure_comm(rank: int, world: int, rounds_count: int) -> list[dict[str, Any]]:
    """Per round and path (COMM_PATHS, interleaved: the order alternates from round to round),
    the collectives of COMM_STEPS steps of the job's gradient sync (its own
    ``GradientAllreduce``) and FOSI's step, with V installed (k = 10): payload bytes per kind
    and step, and the median over steps of their seconds."""
    import torch
    import torch.distributed as dist

    from kfac_hpc.optim.fosi import FOSI
    from kfac_hpc.train.grad_sync import GradientAllreduce

    model, _, backward = workload(rank)
    n = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(7)
    vectors = torch.linalg.qr(torch.randn(n, 10, generator=gen)).Q.T.contiguous()
    values = torch.linspace(10.0, 1.0, 10, dtype=torch.float64)
    sync = GradientAllreduce(model, world)
    log: list[tuple[str, int, float]] = []
    unwrap = _record_collectives(log)

    def one_path(path: str, _round: int) -> dict[str, Any]:
        job_allreduces, fosi_reduces = COMM_PATHS[path]
        base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        opt = FOSI(model.parameters(), base, k=10, warmup=10**6, model=model,
                   average_gradients=fosi_reduces)  # fmt: skip
        opt.set_spectrum(values, vectors)
        steps = []
        for step in range(COMM_STEPS + 1):  # the first is not timed
            backward()
            dist.barrier()  # not recorded: the ranks' skew is not communication
            log.clear()
            sync([0.0, 0.0], gradients=job_allreduces)
            opt.step()
            if step:
                steps.append(list(log))
        kinds = KINDS
        return {
            "bytes": {k: sum(b for c, b, _ in steps[0] if c == k) for k in kinds},
            "calls": {k: sum(1 for c, _, _ in steps[0] if c == k) for k in kinds},
            "seconds": statistics.median(sum(t for _, _, t in st) for st in steps),
            "seconds_vectors": statistics.median(
                sum(t for c, _, t in st if not c.startswith("small")) for st in steps
            ),
            "seconds_by_kind": {
                k: statistics.median(sum(t for c, _, t in st if c == k) for st in steps)
                for k in kinds
            },
        }

    measured = harness.interleave(
        {path: functools.partial(one_path, path) for path in COMM_PATHS}, rounds_count
    )
    unwrap()
    return [{path: measured[path][i] for path in COMM_PATHS} for i in range(rounds_count)]


def worker(out: Path, rounds_count: int, variants: list[str] | None) -> None:
    import torch
    import torch.distributed as dist

    from kfac_hpc.runtime import init_distributed, shutdown

    ctx = init_distributed(backend="gloo", timeout_s=600)
    torch.set_num_threads(1)
    if variants:
        mine: dict[str, Any] = {
            "ese_variants": measure_ese_variants(ctx.rank, rounds_count, variants)
        }
    else:
        mine = measure(ctx.rank, rounds_count)
    if ctx.world_size > 1 and variants is None:
        mine["comm"] = measure_comm(ctx.rank, ctx.world_size, rounds_count)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if ctx.rank == 0:
        harness.write_worker_result(out, {"world_size": dist.get_world_size(), "ranks": gathered})
    shutdown()


def summarise(job: dict[str, Any]) -> dict[str, Any]:
    """Per round the max over ranks, then median/min/max over rounds."""
    ranks = job["ranks"]
    per_round = list(zip(*(r["rounds"] for r in ranks), strict=True))
    peak = [max(r["peak_bytes"] for r in rnd) for rnd in per_round]
    ese = [max(r["ese_s"] for r in rnd) for rnd in per_round]
    step = [max(r["step_s"] for r in rnd) for rnd in per_round]
    share = [e / (e + ESE_EVERY * s) for e, s in zip(ese, step, strict=True)]
    usage = {key: max(r["rounds"][-1]["memory_usage"][key] for r in ranks)
             for key in ranks[0]["rounds"][-1]["memory_usage"]}  # fmt: skip
    summary = {
        "world_size": job["world_size"],
        "rounds": len(per_round),
        "parameters": ranks[0]["parameters"],
        "peak_bytes_max_rank": harness.stats(peak),
        "ese_s": harness.stats(ese),
        "step_s": harness.stats(step),
        "ese_share_at_interval": harness.stats(share),
        "memory_usage_max_rank": usage,
        "hvp_s_max_rank": {
            mode: max(r["hvp_s"][mode] for r in ranks) for mode in ranks[0]["hvp_s"]
        },
    }
    if "comm" in ranks[0]:
        summary["comm"] = {path: summarise_comm(ranks, path, job["world_size"])
                           for path in COMM_PATHS}  # fmt: skip
    return summary


def summarise_comm(ranks: list[dict[str, Any]], path: str, world: int) -> dict[str, Any]:
    """One path's bytes per step (rank 0's; every rank hands the same sizes), the bytes each
    rank sends by the ring model, and its seconds: per round the slowest rank, over rounds."""
    first = ranks[0]["comm"][0][path]
    rounds = range(len(ranks[0]["comm"]))

    def seconds(kind: str | None) -> dict[str, float]:
        def of(r: dict[str, Any], i: int) -> float:
            entry = r["comm"][i][path]
            if kind in (None, "vectors"):
                return float(entry["seconds" if kind is None else "seconds_vectors"])
            return float(entry["seconds_by_kind"][kind])

        return harness.stats([max(of(r, i) for r in ranks) for i in rounds])

    return {
        "payload_bytes": first["bytes"],
        "calls": first["calls"],
        "sent_bytes_per_rank": {k: ring_bytes(k, b, world) for k, b in first["bytes"].items()},
        "seconds": seconds(None),
        "seconds_vectors": seconds("vectors"),
        "seconds_by_kind": {kind: seconds(kind) for kind in first["bytes"]},
    }


def report(jobs: list[dict[str, Any]]) -> None:
    one = jobs[0]
    print(f"FOSI/DHO2, MLP of {one['parameters'] / 1e6:.2f} M parameters, k = 10, m = 40, "
          "SGD momentum base, gloo on CPU; median (min..max) of "
          f"{one['rounds']} rounds, max over ranks")  # fmt: skip
    print(f"{'P':>2} {'peak MiB':>22} {'vs P=1':>7} {'ESE s':>20} {'step s':>20} "
          f"{'ESE share @' + str(ESE_EVERY):>16}  tally MiB (V, basis, base)")  # fmt: skip
    for job in jobs:
        p, e, s = job["peak_bytes_max_rank"], job["ese_s"], job["step_s"]
        share, use = job["ese_share_at_interval"], job["memory_usage_max_rank"]
        ratio = p["median"] / one["peak_bytes_max_rank"]["median"]
        print(
            f"{job['world_size']:>2} {p['median'] / MIB:>8.1f} "
            f"({p['min'] / MIB:.1f}..{p['max'] / MIB:.1f})"
            f" {ratio:>6.2f}x {e['median']:>7.3f} ({e['min']:.3f}..{e['max']:.3f})"
            f" {s['median']:>7.4f} ({s['min']:.4f}..{s['max']:.4f})"
            f" {share['median'] * 100:>14.1f} %"
            f"  {use['eigenvectors_bytes'] / MIB:.1f}, {use['lanczos_basis_bytes'] / MIB:.1f}, "
            f"{use['base_state_bytes'] / MIB:.1f}"
        )
    for job in jobs:
        hvp = job["hvp_s_max_rank"]
        print(f"P = {job['world_size']}: one HVP (curvature micro-batch 64, slowest rank): "
              + ", ".join(f"{mode} {sec * 1e3:.0f} ms" for mode, sec in hvp.items()))  # fmt: skip
    report_comm([job for job in jobs if "comm" in job])


def report_comm(jobs: list[dict[str, Any]]) -> None:
    if not jobs:
        return
    rounds = jobs[0]["rounds"]
    print(f"in-job communication per step (k = 10, no ESE; {COMM_STEPS} steps x {rounds} "
          "rounds): MB each rank sends (ring model, from the tensors handed to each "
          "collective; payload MB in brackets), seconds in the collectives, slowest rank, "
          "median (min..max), vs the allreduce path")  # fmt: skip
    kinds = KINDS
    print(f"{'P':>2} {'path':<34}" + "".join(f"{k:>24}" for k in kinds) + f"{'total MB':>10}"
          f"{'comm s':>28}")  # fmt: skip
    for job in jobs:
        base = job["comm"]["allreduce"]["seconds"]["median"]
        for path, label in COMM_LABELS.items():
            c = job["comm"][path]
            sent, payload, sec = c["sent_bytes_per_rank"], c["payload_bytes"], c["seconds"]
            cells = "".join(f"{sent[k] / MB:>11.3f} ({payload[k] / MB:>7.3f})" for k in kinds)
            print(f"{job['world_size']:>2} {label:<34}{cells}{sum(sent.values()) / MB:>10.2f}"
                  f"  {sec['median']:.4f} ({sec['min']:.4f}..{sec['max']:.4f})"
                  f" {sec['median'] / base:.2f}x; without small"
                  f" {c['seconds_vectors']['median']:.4f} ("
                  + ", ".join(f"{k} {c['seconds_by_kind'][k]['median']:.4f}" for k in kinds)
                  + ")")  # fmt: skip


def main() -> int:
    parser = harness.parser(__doc__, rounds=ROUNDS)
    parser.add_argument(
        "--ese-variants",
        action="store_true",
        help="ESE share: full reorthogonalization vs cheaper ESEs",
    )
    parser.add_argument("--world-sizes", help="comma-separated rank counts (default 1,2,4)")
    parser.add_argument(
        "--variants", help="with --ese-variants: comma-separated names (default: all)"
    )
    args = parser.parse_args()
    names = args.variants.split(",") if args.variants else list(ESE_VARIANTS)
    unknown = [name for name in names if name not in ESE_VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; use of {', '.join(ESE_VARIANTS)}")
    if args.worker is not None:
        worker(args.worker, args.rounds, names if args.ese_variants else None)
        return 0
    bench = harness.Benchmark("bench_fosi_ese" if args.ese_variants else "bench_fosi")
    default_sizes = ",".join(map(str, WORLD_SIZES))
    sizes = [int(w) for w in (args.world_sizes or default_sizes).split(",")]
    jobs = []
    for world in sizes:
        extra = ["--ese-variants", "--variants", ",".join(names)] if args.ese_variants else []
        job = harness.launch(
            __file__,
            "--rounds",
            str(args.rounds),
            *extra,
            ranks=world,
            env={"OMP_NUM_THREADS": "1"},
            # a variant's round is two ESEs and eight steps: about a minute on a busy machine
            timeout=max(900, 120 * len(names) * args.rounds) if args.ese_variants else 900,
        )
        jobs.append(summarise_variants(job) if args.ese_variants else summarise(job))
    if args.ese_variants:
        report_variants(jobs)
        for job in jobs:
            for name in names:
                bench.target(
                    f"FOSI ESE share at ese_every {ESE_EVERY}, P = {job['world_size']}, {name}",
                    job[name]["ese_share_at_interval"]["median"],
                    SHARE_TARGET,
                    "<=",
                    "",
                    f"slowest rank, median of {args.rounds} rounds",
                )
        return bench.finish({"jobs": jobs}, check=args.check)
    report(jobs)
    one, last = jobs[0], jobs[-1]
    ratio = last["peak_bytes_max_rank"]["median"] / one["peak_bytes_max_rank"]["median"]
    bench.target(
        f"DHO2 peak memory, P = {last['world_size']} / P = 1",
        ratio,
        TARGET,
        "<=",
        "×",
        f"max over ranks, median of {args.rounds} rounds",
    )
    return bench.finish({"jobs": jobs}, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
