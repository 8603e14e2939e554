"""The options of ``kfac-hpc train``: name, type, default, unit, help, range, which method
they belong to and which a sweep may vary. One table, read by the job's config
(train/config.py), the job's flags (train/cli.py), the sweep's flags and TOML tables
(sweep/spec.py, sweep/cli.py), ``kfac-hpc plan``'s flags (plan/cli.py), the library's
constructors (``KFACPreconditioner``: optim/options.py; ``FOSI``: optim/fosi/options.py: their
parameters are :data:`LIBRARY_PARAMETERS`) and the docs. Where the library's or plan's default
differs from the job's on purpose, the option says so and why (``library_default``,
``plan_default``); the allowed values of a choice are the library's enums
(contracts/choices.py). tests/contracts/test_one_home.py checks that every consumer agrees.

A method's options are one block (``KFAC_OPTIONS`` below); a new method adds its block to
``METHOD_BLOCKS`` and every consumer picks it up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kfac_hpc.contracts.choices import (
    HVP_MODES,
    LANCZOS_DTYPES,
    REORTHOGONALIZATIONS,
    AssignmentStrategy,
    ComputeMethod,
    KFACApprox,
    values,
)
from kfac_hpc.contracts.errors import InputError

__all__ = [
    "ALIASES",
    "FIRST_ORDER",
    "KINDS",
    "LIBRARY_ONLY",
    "LIBRARY_PARAMETERS",
    "METHOD_SWITCHES",
    "OPTIONS",
    "Option",
    "OtherDefault",
    "library_default",
    "method_of",
    "resolve_switches",
]

# Value kinds: scalars, or a tuple of them (given as a list, or a comma-separated string).
KINDS = ("bool", "int", "float", "str", "strs", "ints")


@dataclass(frozen=True)
class OtherDefault:
    """A default that differs on purpose from the job's (``Option.default``), and why."""

    value: Any
    why: str


@dataclass(frozen=True)
class Option:
    """One option of the job. ``method``: ``common`` or the method it configures (``kfac``);
    ``axis``: a sweep may give a list of values; ``operational``: changes how a run is
    operated, not what it computes (left out of the config hash); ``sweep``: False where the
    sweep has its own flag of that name or the value is per run.

    Two kinds of range: ``check`` is what makes a value mathematically valid (``positive``,
    ``decay``, ...), which the library (``KFACPreconditioner``) applies as well; ``maximum``
    (default: ``option_values.INT_MAX`` / ``FLOAT_MAX``) is an operational bound that only
    ``kfac-hpc train`` and ``sweep`` apply, against nonsense such as 2147483647 Lanczos steps.

    ``library_default``: the library constructor's default (:data:`LIBRARY_PARAMETERS`) where it
    differs on purpose from the job's ``default``; ``plan_default``: the same for
    ``kfac-hpc plan``'s flag of the option. Each says why; None: the job's default."""

    name: str
    kind: str
    default: Any
    help: str
    unit: str = ""
    choices: tuple[str, ...] = ()
    check: str = ""
    maximum: float | None = None
    optional: bool = False
    method: str = "common"
    axis: bool = False
    operational: bool = False
    sweep: bool = True
    library_default: OtherDefault | None = None
    plan_default: OtherDefault | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def describe(self) -> str:
        """The help text, its choices and unit included."""
        text = self.help + (f": {', '.join(self.choices)}" if self.choices else "")
        return text + (f" [{self.unit}]" if self.unit else "")


def _o(name: str, kind: str, default: Any, help: str, **meta: Any) -> Option:
    return Option(name, kind, default, help, **meta)


def _k(name: str, kind: str, default: Any, help: str, **meta: Any) -> Option:
    return Option(name, kind, default, f"K-FAC: {help}", method="kfac", **meta)


def _f(name: str, kind: str, default: Any, help: str, **meta: Any) -> Option:
    return Option(name, kind, default, f"FOSI: {help}", method="fosi", **meta)


MODELS = ("small_cnn", "mlp", "resnet20", "resnet32", "resnet56", "resnet50", "cnn1d", "gpt")
DATASETS = (
    "digits",
    "mnist1d",
    "synthetic_cifar",
    "synthetic_imagenet",
    "cifar10",
    "imagefolder",
    "text",
    "generated_text",
)
# The transformer workload: its model and the byte-level datasets only it takes.
TEXT_MODELS = ("gpt",)
TEXT_DATASETS = ("text", "generated_text")
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "step", "cosine")
SCALINGS = ("strong", "weak")
DIST_BACKENDS = ("auto", "gloo", "nccl")
# The library's choices: the values of its enums (contracts/choices.py), not copies.
COMPUTE_METHODS = values(ComputeMethod)
KFAC_APPROXES = values(KFACApprox)
ASSIGNMENT_STRATEGIES = values(AssignmentStrategy)

# Why the library's defaults differ from the job's: KFACPreconditioner keeps those of the
# reference library kfac_pytorch, so switching is a change of import (docs/kfac.md).
_KFAC_PYTORCH = (
    "KFACPreconditioner keeps the reference library kfac_pytorch's default, so that switching "
    "is a change of import (docs/kfac.md)"
)
# Why plan's defaults differ from the job's: plan predicts a study at scale, the job's
# defaults are a seconds-long run on this machine.
_PLAN_STUDY = (
    "plan predicts a study at scale (ResNet-32 on CIFAR-10, up to 1,024 ranks, as the shipped "
    "profiles); the job's default is a seconds-long run on this machine"
)

COMMON_OPTIONS: tuple[Option, ...] = (
    _o(
        "model",
        "str",
        "small_cnn",
        f"network: a registered name ({', '.join(MODELS)}, or an installed package's), "
        "module:callable or file.py:callable (docs/workloads.md)",
        axis=True,
        plan_default=OtherDefault("resnet32", _PLAN_STUDY),
    ),
    _o(
        "model_arg",
        "strs",
        (),
        "key=value given to the model's factory (repeat the flag or comma-separate)",
    ),
    _o(
        "dataset",
        "str",
        "digits",
        f"data: a registered name ({', '.join(DATASETS)}, or an installed package's), "
        "module:callable or file.py:callable (docs/workloads.md)",
        axis=True,
        plan_default=OtherDefault("cifar10", _PLAN_STUDY),
    ),
    _o(
        "dataset_arg",
        "strs",
        (),
        "key=value given to the dataset's factory (repeat the flag or comma-separate)",
    ),
    _o(
        "data_path",
        "str",
        None,
        "folder of the CIFAR-10 binary batches or the image folder; for mnist1d a cache folder "
        "of the generated sequences; for text a UTF-8 file or a folder of them",
        optional=True,
    ),
    _o(
        "num_samples",
        "int",
        4096,
        "training samples of a synthetic, the mnist1d or the generated_text dataset (windows "
        "of --context-length bytes)",
        check="positive",
    ),
    _o(
        "cnn1d_channels",
        "int",
        25,
        "channels of each cnn1d convolution (the MNIST-1D paper's 25)",
        check="positive",
        maximum=4096,
    ),
    # The transformer workload (gpt on text / generated_text: kfac_hpc/train/transformer.py).
    _o("gpt_layers", "int", 2, "decoder blocks of the gpt model", check="positive", maximum=256),
    _o(
        "gpt_d_model",
        "int",
        64,
        "width of the gpt model (a multiple of --gpt-heads)",
        check="positive",
        maximum=65536,
    ),
    _o("gpt_heads", "int", 4, "attention heads of the gpt model", check="positive", maximum=1024),
    _o(
        "context_length",
        "int",
        64,
        "bytes per sample of the text datasets (the gpt model's context)",
        unit="bytes",
        check="positive",
        maximum=65536,
    ),
    _o("gpt_tied", "bool", False, "the gpt model's output projection is its byte embedding"),
    _o(
        "precision",
        "str",
        "fp32",
        "forward/backward arithmetic: float32, bfloat16 autocast, or float16 autocast with "
        "loss scaling (parameters and K-FAC factors stay float32)",
        choices=PRECISIONS,
    ),
    _o("augment", "bool", True, "random crop + flip for 32x32 image data (cifar10)"),
    _o("optimizer", "str", "sgd", "first-order optimizer", choices=OPTIMIZERS, axis=True),
    _o("lr", "float", 0.1, "peak learning rate", check="positive", maximum=1e6),
    _o(
        "momentum",
        "float",
        0.9,
        "SGD momentum (beta1 is 0.9 for adam/adamw)",
        check="nonnegative",
        maximum=1e6,
    ),
    _o(
        "weight_decay",
        "float",
        1e-4,
        "L2 (sgd, adam) or decoupled (adamw) weight decay",
        check="nonnegative",
        maximum=1e6,
    ),
    _o("lr_schedule", "str", "cosine", "after warm-up", choices=LR_SCHEDULES),
    _o(
        "warmup_epochs",
        "float",
        0.0,
        "linear warm-up to --lr over this many epochs",
        unit="epochs",
        check="nonnegative",
        maximum=1e6,
    ),
    _o(
        "lr_decay_epochs",
        "ints",
        (),
        "epochs at which 'step' multiplies lr by the factor",
        unit="epochs",
        check="positive",
    ),
    _o(
        "lr_decay_factor",
        "float",
        0.1,
        "factor of the 'step' schedule",
        check="positive",
        maximum=1e6,
    ),
    _o("kfac", "bool", True, "precondition gradients with K-FAC", axis=True),
    _o(
        "fosi",
        "bool",
        False,
        "FOSI/DHO2 around the first-order optimizer (turns K-FAC off unless --kfac is given, "
        "which is an error)",
        axis=True,
    ),
)
KFAC_OPTIONS: tuple[Option, ...] = (
    _k(
        "factor_update_steps",
        "int",
        1,
        "steps between factor (A, G) updates",
        unit="steps",
        check="positive",
        axis=True,
    ),
    _k(
        "inv_update_steps",
        "int",
        10,
        "steps between eigen/inverse updates",
        unit="steps",
        check="positive",
        axis=True,
        library_default=OtherDefault(
            1,
            f"{_KFAC_PYTORCH}; the job recomputes them every 10 steps, a tenth of the "
            "eigendecompositions",
        ),
    ),
    _k(
        "damping",
        "float",
        0.003,
        "Tikhonov damping",
        check="positive",
        maximum=1e6,
        library_default=OtherDefault(
            0.001,
            f"{_KFAC_PYTORCH}; the job's 0.003 is the lowest damping of the benchmarks' grid "
            "(docs/kfac.md)",
        ),
    ),
    _k("factor_decay", "float", 0.95, "running-average decay of the factors", check="decay"),
    _k(
        "kl_clip",
        "float",
        0.001,
        "KL clip of the preconditioned step (0 disables)",
        check="nonnegative",
        maximum=1e6,
    ),
    _k(
        "grad_worker_fraction",
        "str",
        "comm-opt",
        "ranks that precondition each layer: comm-opt (all), mem-opt (one), hybrid-opt "
        "(half) or a fraction in (0, 1]",
        check="grad_workers",
        axis=True,
    ),
    _k("compute_method", "str", "eigen", "second-order method", choices=COMPUTE_METHODS),
    _k(
        "assignment_strategy",
        "str",
        "compute",
        "balance second-order work by compute (n^3) or memory (n^2)",
        choices=ASSIGNMENT_STRATEGIES,
    ),
    _k("colocate_factors", "bool", True, "a layer's A and G on the same rank"),
    _k("symmetry_aware", "bool", False, "communicate only the upper triangle of factors"),
    _k(
        "compute_eigenvalue_outer_product",
        "bool",
        True,
        "precompute the eigenvalue outer product (eigen method)",
    ),
    _k(
        "allreduce_bucket_cap_mb",
        "float",
        25.0,
        "factor allreduce bucket size",
        unit="MiB",
        check="positive",
        maximum=1e6,
    ),
    _k("skip_layers", "strs", (), "module or class names left unpreconditioned"),
    _k("update_factors_in_hook", "bool", True, "compute factors in the module hooks"),
    _k(
        "kfac_approx",
        "str",
        "expand",
        "weight sharing as one row per location (expand) or per sample (reduce)",
        choices=KFAC_APPROXES,
    ),
    _k(
        "factor_sample_fraction",
        "float",
        1.0,
        "factor statistics from the first ceil(f*N) samples of each batch",
        check="fraction",
    ),
)
# FOSI's operational bounds: k and l at most 1024 each, so the default 4(k + l) Lanczos steps
# stay within the bound of --lanczos-iters (a basis of at most 8192 float64 vectors); the job
# also keeps k + l and the Lanczos steps below the model's parameter count (train/methods/fosi.py).
FOSI_MAX_PAIRS = 1024
FOSI_MAX_LANCZOS = 4 * 2 * FOSI_MAX_PAIRS
FOSI_OPTIONS: tuple[Option, ...] = (
    _f(
        "fosi_k",
        "int",
        10,
        "largest Hessian eigenpairs k",
        check="nonnegative",
        maximum=FOSI_MAX_PAIRS,
        axis=True,
    ),
    _f(
        "fosi_l",
        "int",
        0,
        "smallest Hessian eigenpairs l",
        check="nonnegative",
        maximum=FOSI_MAX_PAIRS,
    ),
    _f(
        "fosi_alpha",
        "float",
        0.01,
        "Newton step size in the subspace",
        check="positive",
        axis=True,
    ),
    _f(
        "fosi_momentum",
        "float",
        0.9,
        "EMA factor of the subspace velocity",
        check="decay",
    ),
    _f(
        "ese_every",
        "int",
        100,
        "steps between extreme-spectrum estimations (ESE)",
        unit="steps",
        check="positive",
        axis=True,
    ),
    _f("fosi_warmup", "int", 20, "step of the first ESE", unit="steps", check="nonnegative"),
    _f(
        "lanczos_iters",
        "int",
        None,
        "Lanczos steps per ESE (default 4(k + l); >= k + l)",
        unit="steps",
        check="positive",
        maximum=FOSI_MAX_LANCZOS,
        optional=True,
    ),
    _f(
        "fosi_clip",
        "float",
        3.0,
        "upper bound of the base-update scale",
        check="at_least_one",
        maximum=1e6,
    ),
    _f(
        "fosi_hvp",
        "str",
        "auto",
        "Hessian-vector products by (auto: double backward, the faster route measured)",
        choices=HVP_MODES,
    ),
    _f(
        "curvature_ranks",
        "int",
        0,
        "ranks given to ESE only, pipelined with training (0: none; < world size)",
        unit="ranks",
        check="nonnegative",
        axis=True,
    ),
    _f(
        "max_staleness",
        "int",
        0,
        "steps a pipelined ESE may lag (0: training waits for it; more: the base update "
        "alone while it is later, never a wait; < --ese-every)",
        unit="steps",
        check="nonnegative",
    ),
    _f(
        "lanczos_tol",
        "float",
        None,
        "stop Lanczos early once the k + l pairs have residuals <= this x max |lambda| "
        "(default: all --lanczos-iters steps)",
        check="positive",
        optional=True,
    ),
    _f(
        "fosi_curvature_fraction",
        "float",
        1.0,
        "share of each rank's batch (its leading rows) whose loss the ESE's Hessian-vector "
        "products differentiate",
        check="fraction",
    ),
    _f(
        "fosi_warm_start",
        "bool",
        False,
        "start each ESE's Lanczos from the previous ESE's eigenvectors (their normalized sum "
        "plus a small random part) instead of a random vector",
    ),
    _f(
        "fosi_residual_tol",
        "float",
        0.01,
        "keep a Ritz pair only when its residual |Hv - lambda v| <= this x max |lambda|",
        check="positive",
    ),
    _f(
        "fosi_ese_check",
        "bool",
        True,
        "after each ESE, use the base update until the next ESE when the new subspace step "
        "raises the curvature batch's loss",
    ),
    _f(
        "fosi_adaptive_ese",
        "bool",
        False,
        "adapt the steps between ESEs to how far the eigenvector subspace moved between the "
        "last two (doubled when it hardly moved, halved when it moved much; from --ese-every "
        "to 8x it)",
    ),
    _f(
        "fosi_lanczos_dtype",
        "str",
        "float64",
        "dtype of the Lanczos basis and the eigenvectors it gives (training: the parameters' "
        "dtype; the tridiagonal eigenproblem is float64 either way)",
        choices=LANCZOS_DTYPES,
    ),
    _f(
        "fosi_reorthogonalize",
        "str",
        "full",
        "keep the Lanczos basis orthogonal at every step (full) or only where an estimate of "
        "its inner products says it drifts past sqrt(eps) (partial: the same eigenvalues, far "
        "fewer passes over the basis)",
        choices=REORTHOGONALIZATIONS,
    ),
    _f(
        "fosi_keep_basis",
        "bool",
        False,
        "keep the Lanczos basis allocated between ESEs (resident: lanczos-iters x the "
        "parameters / ranks in its dtype) so that an ESE does not page-fault a fresh one in",
    ),
    _f(
        "fosi_nonfinite_stop",
        "bool",
        True,
        "stop at the step whose gradient is non-finite (NaN or inf loss), not at the next ESE",
    ),
)
RUN_OPTIONS: tuple[Option, ...] = (
    _o(
        "epochs",
        "int",
        5,
        "passes over the training data (ignored when --steps is given)",
        unit="epochs",
        check="positive",
    ),
    _o(
        "steps",
        "int",
        None,
        "total optimizer steps (overrides --epochs)",
        unit="steps",
        check="positive",
        optional=True,
        plan_default=OtherDefault(
            100, "the sweep plan writes (--write-sweep) measures a fixed number of steps"
        ),
    ),
    _o(
        "batch_size",
        "int",
        128,
        "global batch (strong scaling) or per-rank batch (weak scaling)",
        unit="samples",
        check="positive",
        axis=True,
        plan_default=OtherDefault(
            1024,
            f"{_PLAN_STUDY}; strong scaling splits the global batch over every rank count of "
            "the default --ranks, and 1,024 is the smallest batch they all divide",
        ),
    ),
    _o(
        "scaling",
        "str",
        "strong",
        "strong: global batch fixed; weak: per-rank batch fixed",
        choices=SCALINGS,
    ),
    _o(
        "seed",
        "int",
        0,
        "seed of model init, data order and synthetic data",
        check="nonnegative",
        maximum=2**32 - 1,
        axis=True,
    ),
    _o(
        "target_accuracy",
        "float",
        None,
        "test accuracy in (0, 1] whose first time is recorded",
        check="fraction",
        optional=True,
    ),
    _o(
        "target_loss",
        "float",
        None,
        "test loss (lower is better) whose first time is recorded",
        check="positive",
        optional=True,
    ),
    _o("stop_at_target", "bool", False, "stop once --target-accuracy or --target-loss is reached"),
    _o(
        "eval_every_steps",
        "int",
        0,
        "steps between test evaluations besides the one at every epoch end (0: epoch ends only)",
        unit="steps",
        check="nonnegative",
        maximum=10**9,
    ),
    _o(
        "precise_bn_batches",
        "int",
        0,
        "before each test evaluation, recompute BatchNorm running statistics from this many "
        "training batches at the current parameters (training's own are put back after; 0: "
        "test with the running averages, which trail fast-moving parameters)",
        unit="batches",
        check="nonnegative",
        maximum=10**6,
    ),
    _o(
        "time_limit_s",
        "float",
        None,
        "stop training after this much wall time",
        unit="s",
        check="positive",
        maximum=1e9,
        optional=True,
        operational=True,
    ),
    _o(
        "checkpoint_every_steps",
        "int",
        None,
        "checkpoint every N steps",
        unit="steps",
        check="positive",
        optional=True,
        operational=True,
    ),
    _o(
        "checkpoint_every_min",
        "float",
        None,
        "checkpoint every M minutes",
        unit="min",
        check="positive",
        maximum=1e9,
        optional=True,
        operational=True,
    ),
    _o(
        "checkpoint_async",
        "bool",
        False,
        "write checkpoints in a background thread",
        operational=True,
    ),
    _o(
        "keep_checkpoints",
        "int",
        2,
        "complete checkpoints kept in RUN_DIR/checkpoints",
        check="positive",
        operational=True,
    ),
    _o(
        "log_every",
        "int",
        20,
        "steps per metrics.jsonl window",
        unit="steps",
        check="positive",
        operational=True,
    ),
    _o(
        "threads",
        "int",
        None,
        "torch intra-op threads per rank (default: OMP_NUM_THREADS if set, else the cores "
        "given to the rank: Slurm's CPUs per task, or the cores / local ranks)",
        check="positive",
        maximum=4096,
        optional=True,
        operational=True,
    ),
    _o(
        "data_workers",
        "int",
        None,
        "worker processes reading a Dataset's samples ahead of the step (default: half the "
        "rank's threads, at most 4; 0 reads them in the step; in-memory tensors never use them)",
        check="nonnegative",
        maximum=64,
        optional=True,
        operational=True,
    ),
    _o(
        "backend",
        "str",
        "auto",
        "torch.distributed backend: auto (nccl on GPU), gloo, nccl",
        choices=DIST_BACKENDS,
        sweep=False,
    ),
    _o(
        "collective_timeout_s",
        "float",
        300.0,
        "a collective waiting longer fails the run",
        unit="s",
        check="positive",
        maximum=1e6,
        operational=True,
    ),
    _o(
        "cuda_sync",
        "bool",
        False,
        "synchronize CUDA at phase boundaries (exact GPU phase times)",
        operational=True,
    ),
    _o(
        "progress",
        "bool",
        True,
        "a progress line per epoch on rank 0 (a bar on a terminal)",
        operational=True,
    ),
    _o(
        "keep_freed_memory",
        "bool",
        True,
        "keep freed host memory for reuse instead of giving it back to the OS (glibc malloc: "
        "no page faults on every large allocation; left alone under MALLOC_* or LD_PRELOAD)",
        operational=True,
    ),
    _o(
        "resume_from",
        "str",
        None,
        "start from the whole state of this checkpoint (.h5 file, run dir or checkpoints/)",
        optional=True,
        operational=True,
        sweep=False,
    ),
    _o(
        "init_factors",
        "str",
        None,
        "start from the K-FAC factors of this checkpoint file",
        optional=True,
    ),
)
# Method blocks, in the order their options are listed; a new method appends its block here.
METHOD_BLOCKS: tuple[tuple[Option, ...], ...] = (KFAC_OPTIONS, FOSI_OPTIONS)
OPTIONS: dict[str, Option] = {
    o.name: o for block in (COMMON_OPTIONS, *METHOD_BLOCKS, RUN_OPTIONS) for o in block
}
# The library constructors' parameters that are options of the job: method -> {parameter:
# option}. ``KFACPreconditioner`` takes the K-FAC block by the same names (and ``lr``, which the
# job gives it as the optimizer's current one); ``FOSI`` takes the FOSI block by the paper's
# names (and the job's ``seed``). The job passes them by these names (train/config.py).
LIBRARY_PARAMETERS: dict[str, dict[str, str]] = {
    "kfac": {**{o.name: o.name for o in KFAC_OPTIONS}, "lr": "lr"},
    "fosi": {
        "k": "fosi_k",
        "l": "fosi_l",
        "alpha": "fosi_alpha",
        "momentum": "fosi_momentum",
        "ese_every": "ese_every",
        "warmup": "fosi_warmup",
        "lanczos_iters": "lanczos_iters",
        "clip": "fosi_clip",
        "hvp": "fosi_hvp",
        "seed": "seed",
        "curvature_ranks": "curvature_ranks",
        "max_staleness": "max_staleness",
        "lanczos_tol": "lanczos_tol",
        "curvature_fraction": "fosi_curvature_fraction",
        "warm_start": "fosi_warm_start",
        "residual_tol": "fosi_residual_tol",
        "ese_check": "fosi_ese_check",
        "nonfinite_stop": "fosi_nonfinite_stop",
        "adaptive_ese": "fosi_adaptive_ese",
        "lanczos_dtype": "fosi_lanczos_dtype",
        "reorthogonalize": "fosi_reorthogonalize",
        "keep_basis": "fosi_keep_basis",
    },
}
# The library's parameters that are not options of the job, and why: method -> {parameter: why}.
LIBRARY_ONLY: dict[str, dict[str, str]] = {
    "kfac": {
        "accumulation_steps": "the job runs one backward per optimizer step",
        "damping_mode": "the job keeps the pi_split damping of the inverse method",
        "grad_scaler": "a torch.amp.GradScaler object; the job passes its own under "
        "--precision fp16",
        "factor_dtype": "a torch dtype; the job keeps the weights' dtype (float32 under every "
        "--precision)",
        "inv_dtype": "a torch dtype; the job keeps float32",
        "synchronize_timings": "the job sets it from --cuda-sync",
    },
    "fosi": {
        "average_gradients": "the job lets FOSI average the gradients itself (no DDP)",
    },
}


def library_default(name: str) -> Any:
    """The library constructor's default of option ``name``: its ``library_default`` where it
    differs on purpose from the job's, else the job's default."""
    option = OPTIONS[name]
    return option.default if option.library_default is None else option.library_default.value


# Friendlier inputs for fields: ``time_limit`` takes a duration (90s, 30m, HH:MM:SS) into
# ``time_limit_s``; ``checkpoint_every`` takes steps (an integer) or a duration (10m).
ALIASES: dict[str, tuple[tuple[str, ...], str]] = {
    "time_limit": (
        ("time_limit_s",),
        "stop training after this wall time (90s, 30m, 2h, HH:MM:SS); the run ends done, "
        "with a final evaluation",
    ),
    "checkpoint_every": (
        ("checkpoint_every_steps", "checkpoint_every_min"),
        "checkpoint every N steps (an integer) or every duration (10m, 1h)",
    ),
}

# The method a run trains with: the one switch (a bool option) that is on, else FIRST_ORDER.
FIRST_ORDER = "first_order"
METHOD_SWITCHES: dict[str, str] = {"kfac": "kfac", "fosi": "fosi"}  # switch option -> method


def resolve_switches(given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` (the options set explicitly) with every switch that was not given turned off
    when another switch was turned on: ``--fosi`` alone means K-FAC off (its default is on)."""
    on = [s for s in METHOD_SWITCHES if given.get(s) is True]
    if not on:
        return dict(given)
    return {**{s: False for s in METHOD_SWITCHES if s not in given}, **given}


def method_of(values: Mapping[str, Any]) -> str:
    """The method of a resolved set of values (defaults fill the rest); InputError naming the
    second switch when two are on."""
    on = [s for s in METHOD_SWITCHES if values.get(s, OPTIONS[s].default) is True]
    if len(on) > 1:
        flags = " and ".join(OPTIONS[s].flag for s in on)
        raise InputError(on[1], f"{flags} are different methods; choose one")
    return METHOD_SWITCHES[on[0]] if on else FIRST_ORDER
