"""K-FAC step time against its floor, from real consecutive steps, in short invocations.

    .venv/bin/python benchmarks/bench_kfac_floor.py --fresh --parts   # start; floor parts
    .venv/bin/python benchmarks/bench_kfac_floor.py --round           # run 3 times (or more)
    .venv/bin/python benchmarks/bench_kfac_floor.py --report          # medians of the rounds

Each invocation takes a few minutes on the 2-core host (one round, or the floor parts), so a
benchmark holding the machine's quiet lock never holds it long; the invocations accumulate in
benchmarks/results/bench_kfac_floor.rounds.json and ``--report`` summarises them. With no
mode flag the script records the floor parts if none are recorded, runs one round and reports.

CIFAR ResNet-32 shapes, batch 64, 2 threads, CPU, SGD with momentum, eigen method. A round
runs, one after the other in one process, ``--steps`` consecutive steps of plain SGD, of
SGD+K-FAC with factors every 10 steps and eigendecompositions every 100 (expand and reduce),
and ``--every-steps`` consecutive steps with both every step (expand and reduce). Step 0 of
every trainer is the warm-up; with 110 steps each 10/100 run holds 11 factor steps and exactly
one eigendecomposition step. A ratio is the mean step of a configuration over the mean SGD step
of the same round; the report prints the median of the rounds' ratios with their min and max
(rounds are interleaved: each holds every configuration, the order rotating from round to
round) and each round's load average.

The floor of expand K-FAC is SGD's step plus ``torch.matmul`` run on the shapes of the GEMMs
that the factor computation executes (recorded by the profiler, so the count follows whatever
the code runs: row-shifted products for stride-1 convolutions, upper block triangles
elsewhere), plus the eigendecompositions of every factor (measured here both one after the
other on all threads and side by side with one thread each, as the preconditioner runs them;
the floor takes the faster), amortised over the mix: 1/10 of the products and 1/100 of the
decompositions per step at 10/100, all of them at 1/1 (the medians of the recorded
``--parts``).

Factor rate: executed GFLOP/s (FLOPs actually run) next to ``torch.matmul`` of the same
shapes, and effective GFLOP/s (2·M·n² per factor) next to ``torch.matmul`` of the full im2col
products (n × M)·(M × n) that the textbook computation runs.

kfac_pytorch side by side: the first round tries ``pip install --no-deps kfac-pytorch`` into a
throwaway directory (never a project dependency) and runs it with the same options; where the
package index cannot provide it, the round records why and that row is skipped.

``--report`` prints the table of targets (expand ≤ 1.10× its floor at both mixes, K-FAC-reduce
≤ 1.10× and ≤ 3.0× SGD, executed factor rate ≥ 90 % of ``torch.matmul``, ≤ 0.5× kfac_pytorch's
step at 1/1) and writes benchmarks/results/bench_kfac_floor.json; with ``--check`` it exits 1
when a target is missed.
"""

from __future__ import annotations

import collections
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # benchmarks/harness.py, beside this script
from bench_kfac import BATCH, THREADS, Trainer, _capture, _model

from kfac_hpc.optim import KFACPreconditioner
from kfac_hpc.optim.decompose_and_broadcast import SIDE_BY_SIDE_MAX_N
from kfac_hpc.optim.host_threads import map_side_by_side

RECORD = harness.RESULTS_DIR / "bench_kfac_floor.rounds.json"
# 3: the parts time the decompositions both one after the other and side by side; 4: the
# configurations of a round rotate their order (harness.rotation), the load is the 1-minute one
SCHEMA = 4
SPARSE = {"factor_update_steps": 10, "inv_update_steps": 100}
EVERY = {"factor_update_steps": 1, "inv_update_steps": 1}
TARGETS = {
    "expand_10_100_vs_floor": 1.10,
    "expand_1_1_vs_floor": 1.10,
    "reduce_10_100_vs_sgd": 1.10,
    "reduce_1_1_vs_sgd": 3.0,
    "executed_vs_matmul": 0.90,
    "vs_kfac_pytorch_1_1": 0.5,
}


class ForeignTrainer(Trainer):
    """The same step with kfac_pytorch's preconditioner (identical options)."""

    def __init__(self, module: Any, **options: Any) -> None:
        super().__init__()
        self.pre = module.KFACPreconditioner(self.model, lr=0.01, **options)


def _consecutive(trainer: Trainer, steps: int) -> float:
    """Mean seconds per step of ``steps`` consecutive steps."""
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    return (time.perf_counter() - start) / steps


def bench_round(index: int, steps: int, every_steps: int, foreign: Any) -> dict[str, float]:
    """Mean seconds per step of every configuration, run one after the other; round ``index``
    starts at configuration ``index`` mod their number (the harness's rotation), so that no
    configuration always runs first."""
    trainers: dict[str, Callable[[], Trainer]] = {
        "sgd": Trainer,
        "expand_10_100": lambda: Trainer(**SPARSE),
        "reduce_10_100": lambda: Trainer(**SPARSE, kfac_approx="reduce"),
        "expand_1_1": lambda: Trainer(**EVERY),
        "reduce_1_1": lambda: Trainer(**EVERY, kfac_approx="reduce"),
    }
    if foreign is not None:
        trainers["kfac_pytorch_10_100"] = lambda: ForeignTrainer(foreign, **SPARSE)
        trainers["kfac_pytorch_1_1"] = lambda: ForeignTrainer(foreign, **EVERY)
    step_s: dict[str, float] = {}
    for name in harness.rotation(list(trainers), index):
        trainer = trainers[name]()
        trainer.step()  # warm-up: allocator, the first factors and decompositions
        step_s[name] = _consecutive(trainer, every_steps if name.endswith("1_1") else steps)
        print(f"  {name:<20} {step_s[name] * 1e3:8.1f} ms/step", flush=True)
    return step_s


def _factor_shapes(pre: KFACPreconditioner, captured: dict[str, Any]) -> list[tuple[int, int, int]]:
    """(groups, M, n) of every factor: M rows of n-wide im2col patches or output gradients."""
    shapes = []
    for name, layer in pre.layers.items():
        g = captured[name][1]
        rows = g.numel() // (layer.groups * layer.n_g)
        shapes += [(layer.groups, rows, layer.n_a), (layer.groups, rows, layer.n_g)]
    return shapes


GEMM_OPS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm_"}


def _executed_gemms(fn: Callable[[], object]) -> collections.Counter[tuple[int, int, int, int]]:
    """(batch, m, k, n) of every GEMM that ``fn`` runs, with its count, from the shapes the
    profiler records: what is counted is what ran, whatever the factor code's strategy. A GEMM
    recorded inside another (a baddbmm_ of batch 1 runs as an addmm_) is counted once."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    ) as prof:
        fn()
    gemms: collections.Counter[tuple[int, int, int, int]] = collections.Counter()
    for event in prof.events():
        nested = event.cpu_parent is not None and event.cpu_parent.name in GEMM_OPS
        if event.name in GEMM_OPS and not nested:
            shapes = event.input_shapes[1:3] if "addmm" in event.name else event.input_shapes[:2]
            a, b = shapes
            gemms[(a[0] if len(a) == 3 else 1, a[-2], a[-1], b[-1])] += 1
    return gemms


def _medians(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each function over ``rounds`` interleaved rounds."""

    def timed(fn: Callable[[], object]) -> Callable[[int], float]:
        def call(_round: int) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        return call

    runs = harness.interleave({name: timed(fn) for name, fn in fns.items()}, rounds)
    return {name: statistics.median(values) for name, values in runs.items()}


def bench_floor_parts(repeats: int) -> dict[str, float]:
    """Factor computation, matmul of its executed GEMM shapes and of the full im2col products,
    and every eigendecomposition."""
    model = _model()
    pre = KFACPreconditioner(model)
    pre.remove_hooks()
    captured = _capture(model, pre.layers)
    shapes = _factor_shapes(pre, captured)
    effective = sum(2 * g * m * n * n for g, m, n in shapes)
    full_operands = [torch.randn(g, m, n) for g, m, n in shapes]
    factors: list[torch.Tensor] = []

    def ours() -> None:
        factors.clear()
        with torch.no_grad():
            for name, layer in pre.layers.items():
                x, g = captured[name]
                factors.append(layer.a_factor(x, torch.float32))
                factors.append(layer.g_factor(g, 1.0, torch.float32))

    gemms = _executed_gemms(ours)
    executed = sum(2 * b * m * k * n * count for (b, m, k, n), count in gemms.items())
    # (k × m)ᵀ·(k × n): the layout torch.matmul multiplies fastest here, as in matmul_full
    operands = {(b, m, k, n): (torch.randn(b, k, m), torch.randn(b, k, n)) for b, m, k, n in gemms}

    def matmul_executed() -> None:
        for shape, count in gemms.items():
            left, right = operands[shape]
            for _ in range(count):
                torch.matmul(left.mT, right)

    def matmul_full() -> None:
        for rows in full_operands:
            torch.matmul(rows.mT, rows)

    gemm_s = _medians(
        {"ours": ours, "matmul_executed": matmul_executed, "matmul_full": matmul_full}, repeats
    )
    t_ours, t_executed, t_full = gemm_s["ours"], gemm_s["matmul_executed"], gemm_s["matmul_full"]
    damped = sorted(
        (f + 1e-3 * torch.eye(f.shape[-1]) for f in factors), key=lambda f: -f.shape[-1]
    )

    def eigen_one_after_the_other() -> None:
        for f in damped:
            torch.linalg.eigh(f)

    narrow = [f for f in damped if f.shape[-1] <= SIDE_BY_SIDE_MAX_N]
    wide = [f for f in damped if f.shape[-1] > SIDE_BY_SIDE_MAX_N]

    def eigen_side_by_side() -> None:  # as the preconditioner runs them on CPUs
        for f in wide:
            torch.linalg.eigh(f)
        map_side_by_side(torch.linalg.eigh, narrow, torch.device("cpu"))

    eigh_s = _medians(
        {"sequential": eigen_one_after_the_other, "side_by_side": eigen_side_by_side},
        max(1, repeats // 2),
    )
    t_sequential, t_side = eigh_s["sequential"], eigh_s["side_by_side"]
    return {
        "factor_gflop_effective": effective / 1e9,
        "factor_gflop_executed": executed / 1e9,
        "factor_gemm_calls": sum(gemms.values()),
        "factor_s": t_ours,
        "matmul_executed_s": t_executed,
        "matmul_full_s": t_full,
        "factor_executed_gflops": executed / t_ours / 1e9,
        "factor_effective_gflops": effective / t_ours / 1e9,
        "matmul_executed_gflops": executed / t_executed / 1e9,
        "matmul_full_gflops": effective / t_full / 1e9,
        "executed_vs_matmul": t_executed / t_ours,
        "floor_factor_s": t_executed,
        "eigh_sequential_s": t_sequential,
        "eigh_side_by_side_s": t_side,
        "eigh_all_s": min(t_sequential, t_side),  # the floor takes the faster way
    }


def _foreign_module(skip: bool) -> tuple[Any, str]:
    """kfac_pytorch's preconditioner module from a throwaway install, or (None, why not)."""
    if skip:
        return None, "skipped (--no-kfac-pytorch)"
    target = tempfile.mkdtemp(prefix="kfac-pytorch-")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            target,
            "kfac-pytorch",
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        return None, f"not installable here: {reason}"
    sys.path.insert(0, target)
    return importlib.import_module("kfac.preconditioner"), "installed"


def _fail(message: str) -> NoReturn:
    print(f"bench_kfac_floor: {message}", file=sys.stderr)
    raise SystemExit(2)


def _recorded(settings: dict[str, int], fresh: bool) -> dict[str, Any]:
    """The accumulated invocations (a new record with ``fresh`` or when there is none)."""
    if fresh or not RECORD.exists():
        return {"schema": SCHEMA, "settings": settings, "rounds": [], "parts": []}
    record: dict[str, Any] = json.loads(RECORD.read_text())
    if record.get("schema") != SCHEMA:
        _fail(
            f"{RECORD.name} was recorded by an older version of this benchmark (schema "
            f"{record.get('schema')}, not {SCHEMA}); pass --fresh to start a new record"
        )
    for key, value in settings.items():
        if record["settings"].get(key) != value:
            _fail(
                f"--{key.replace('_', '-')}={value} differs from the {record['settings'].get(key)} "
                f"of the recorded rounds in {RECORD.name}; pass --fresh to start a new record"
            )
    return record


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--round", action="store_true", help="run one round of every config")
    parser.add_argument("--parts", action="store_true", help="measure the floor's parts")
    parser.add_argument("--report", action="store_true", help="summarise the recorded rounds")
    parser.add_argument("--fresh", action="store_true", help="start a new record")
    parser.add_argument("--steps", type=int, default=110, help="steps per 10/100 run")
    parser.add_argument("--every-steps", type=int, default=20, help="steps per 1/1 run")
    parser.add_argument("--no-kfac-pytorch", action="store_true", help="skip kfac_pytorch")
    args = parser.parse_args()
    if args.steps < 1 or args.every_steps < 1:
        _fail("--steps and --every-steps must be >= 1")
    bench = harness.Benchmark("bench_kfac_floor")
    torch.set_num_threads(THREADS)
    settings = {"steps": args.steps, "every_steps": args.every_steps}
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    record = _recorded(settings, args.fresh)
    default = not (args.round or args.parts or args.report)
    if args.parts or (default and not record["parts"]):
        load = harness.load_average()
        record["parts"].append({"load_avg": load, **bench_floor_parts(repeats=5)})
        RECORD.write_text(json.dumps(record, indent=2) + "\n")
        print(f"floor parts recorded ({len(record['parts'])} in all)")
    if args.round or default:
        foreign, record["kfac_pytorch"] = _foreign_module(args.no_kfac_pytorch)
        load = harness.load_average()
        index = len(record["rounds"])
        print(f"round {index + 1} (load average {load:.2f}):", flush=True)
        step_s = bench_round(index, args.steps, args.every_steps, foreign)
        record["rounds"].append({"load_avg": load, "step_s": step_s})
        RECORD.write_text(json.dumps(record, indent=2) + "\n")
    if args.report or default:
        if not record["rounds"] or not record["parts"]:
            _fail("nothing to report: record the floor parts (--parts) and rounds (--round)")
        result = summarise(record)
        _print(result)
        declare_targets(bench, result)
        return bench.finish(result, check=args.check)
    return 0


def declare_targets(bench: harness.Benchmark, r: dict[str, Any]) -> None:
    """The targets: medians of the per-round ratios; the factor rate from the parts."""
    note = f"median of {r['rounds']} rounds"
    for mix, label in (("10_100", "10/100"), ("1_1", "1/1")):
        bench.target(
            f"expand K-FAC {label} / its floor",
            r["ratio_vs_floor"][f"expand_{mix}"]["median"],
            TARGETS[f"expand_{mix}_vs_floor"],
            "<=",
            "×",
            note,
        )
        bench.target(
            f"K-FAC-reduce {label} / SGD",
            r["ratio_vs_sgd"][f"reduce_{mix}"]["median"],
            TARGETS[f"reduce_{mix}_vs_sgd"],
            "<=",
            "×",
            note,
        )
    bench.target(
        "factor GEMMs / torch.matmul rate",
        r["executed_vs_matmul"],
        TARGETS["executed_vs_matmul"],
        ">=",
        "%",
        "executed FLOPs, same shapes",
    )
    ours, theirs = r["step_s"].get("expand_1_1"), r["step_s"].get("kfac_pytorch_1_1")
    bench.target(
        "K-FAC 1/1 step / kfac_pytorch's",
        statistics.median(harness.ratios(ours, theirs)) if ours and theirs else None,
        TARGETS["vs_kfac_pytorch_1_1"],
        "<=",
        "×",
        r["kfac_pytorch"],
    )


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    """Per-round ratios (median, min, max over rounds) and the floor of each round."""
    rounds = record["rounds"]
    names = [n for n in rounds[0]["step_s"] if all(n in r["step_s"] for r in rounds)]
    steps = {name: [r["step_s"][name] for r in rounds] for name in names}
    sgd = steps["sgd"]
    parts_keys = [k for k in record["parts"][0] if k != "load_avg"]
    parts = {k: statistics.median(p[k] for p in record["parts"]) for k in parts_keys}
    ratios = {
        name: harness.stats(harness.ratios(times, sgd))
        for name, times in steps.items()
        if name != "sgd"
    }
    floors = _floors(sgd, parts["floor_factor_s"], parts["eigh_all_s"])
    # the floor as defined before decompositions ran side by side, for comparison
    sequential = _floors(sgd, parts["floor_factor_s"], parts["eigh_sequential_s"])
    vs_floor, vs_sequential_floor = (
        {name: harness.stats(harness.ratios(steps[name], fl)) for name, fl in fls.items()}
        for fls in (floors, sequential)
    )
    return {
        "schema": SCHEMA,
        "benchmark": "kfac_floor",
        "model": "resnet32",
        "batch": BATCH,
        "threads": THREADS,
        "rounds": len(rounds),
        "steps_10_100": record["settings"]["steps"],
        "steps_1_1": record["settings"]["every_steps"],
        "torch": torch.__version__,
        "load_avg_per_round": [r["load_avg"] for r in rounds],
        "load_avg_per_parts": [p["load_avg"] for p in record["parts"]],
        "step_s": steps,
        "floor_s": floors,
        "ratio_vs_sgd": ratios,
        "ratio_vs_floor": vs_floor,
        "ratio_vs_floor_sequential_eigh": vs_sequential_floor,
        "kfac_pytorch": record.get("kfac_pytorch", "not tried"),
        **parts,
        "targets": TARGETS,
    }


def _floors(sgd: list[float], factor_s: float, eigh_s: float) -> dict[str, list[float]]:
    """The floor of each expand mix in each round: its SGD step plus the factor products and
    decompositions that the mix amortises per step."""
    return {
        "expand_10_100": [s + factor_s / 10 + eigh_s / 100 for s in sgd],
        "expand_1_1": [s + factor_s + eigh_s for s in sgd],
    }


def _fmt(s: dict[str, float]) -> str:
    return f"{s['median']:.2f}x (min {s['min']:.2f}, max {s['max']:.2f})"


def _print(r: dict[str, Any]) -> None:
    med = {k: statistics.median(v) * 1e3 for k, v in r["step_s"].items()}
    print(
        f"ResNet-32, batch {r['batch']}, {r['threads']} threads, {r['rounds']} rounds of "
        f"{r['steps_10_100']} (10/100) and {r['steps_1_1']} (1/1) consecutive steps"
    )
    print(f"  SGD step                        {med['sgd']:8.1f} ms")
    for mix in ("10_100", "1_1"):
        label = "factors/10 eigen/100" if mix == "10_100" else "factors+eigen every step"
        floor_ms = statistics.median(r["floor_s"][f"expand_{mix}"]) * 1e3
        print(f"  {label}:")
        expand = _fmt(r["ratio_vs_sgd"][f"expand_{mix}"])
        print(f"    expand  {med[f'expand_{mix}']:8.1f} ms  vs SGD {expand}")
        print(
            f"            floor {floor_ms:8.1f} ms  measured/floor "
            f"{_fmt(r['ratio_vs_floor'][f'expand_{mix}'])}  (target <= 1.10x)"
        )
        print(
            "            (floor with the eigendecompositions one after the other: "
            f"{_fmt(r['ratio_vs_floor_sequential_eigh'][f'expand_{mix}'])})"
        )
        target = r["targets"][f"reduce_{mix}_vs_sgd"]
        print(
            f"    reduce  {med[f'reduce_{mix}']:8.1f} ms  vs SGD "
            f"{_fmt(r['ratio_vs_sgd'][f'reduce_{mix}'])}  (target <= {target:.2f}x)"
        )
        if f"kfac_pytorch_{mix}" in med:
            print(
                f"    kfac_pytorch {med[f'kfac_pytorch_{mix}']:8.1f} ms  vs SGD "
                f"{_fmt(r['ratio_vs_sgd'][f'kfac_pytorch_{mix}'])}"
            )
    print(f"  kfac_pytorch: {r['kfac_pytorch']}")
    print(
        f"  factors: {r['factor_gflop_executed']:.1f} GFLOP executed in "
        f"{r['factor_gemm_calls']:.0f} GEMMs ({r['factor_gflop_effective']:.1f} effective: "
        f"2·M·n² per factor) in {r['factor_s'] * 1e3:.0f} ms: "
        f"{r['factor_executed_gflops']:.1f} GFLOP/s executed, "
        f"{r['factor_effective_gflops']:.1f} effective"
    )
    print(
        f"    torch.matmul of the executed shapes {r['matmul_executed_gflops']:.1f} GFLOP/s "
        f"({r['matmul_executed_s'] * 1e3:.0f} ms): executed/matmul "
        f"{r['executed_vs_matmul']:.0%} (target >= 90%)"
    )
    print(
        f"    torch.matmul of the full im2col products {r['matmul_full_gflops']:.1f} GFLOP/s "
        f"({r['matmul_full_s'] * 1e3:.0f} ms): effective/matmul "
        f"{r['factor_effective_gflops'] / r['matmul_full_gflops']:.0%}"
    )
    print(
        f"  eigendecompositions of every factor: {r['eigh_all_s'] * 1e3:.0f} ms in the floor "
        f"(one after the other on {r['threads']} threads "
        f"{r['eigh_sequential_s'] * 1e3:.0f} ms, side by side with one thread each "
        f"{r['eigh_side_by_side_s'] * 1e3:.0f} ms)"
    )
    loads = ", ".join(f"{v:.2f}" for v in r["load_avg_per_round"])
    print(f"  load average (1 min) at the start of each round: {loads}")
    if r["rounds"] < 3:
        print(f"  only {r['rounds']} round(s) recorded: run --round until there are >= 3")


if __name__ == "__main__":
    sys.exit(main())
