"""All options of the K-FAC preconditioner, validated once when the preconditioner is built.

The names follow the reference K-FAC library for PyTorch (kfac_pytorch) so that switching is a
change of import. Every invalid value raises ``ValueError`` naming the option and its range.
The options that ``kfac-hpc train`` has too take their defaults and valid ranges from the job's
option table (contracts/options.py: ``library_default`` where the library's default differs
on purpose) and their choices from the enums of contracts/choices.py.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kfac_hpc.contracts.choices import AssignmentStrategy, ComputeMethod, DampingMode, KFACApprox
from kfac_hpc.contracts.grad_workers import GRAD_WORKER_NAMES
from kfac_hpc.contracts.option_values import validity_problem
from kfac_hpc.contracts.options import LIBRARY_PARAMETERS, OPTIONS, library_default
from kfac_hpc.optim.schedules import Hyperparameter, ScheduledValue

__all__ = [
    "AssignmentStrategy",
    "ComputeMethod",
    "DampingMode",
    "GradScalerLike",
    "KFACApprox",
    "KFACOptions",
]


class GradScalerLike(Protocol):
    """What K-FAC needs of a ``torch.amp.GradScaler``: the current loss scale."""

    def get_scale(self) -> float: ...

    def is_enabled(self) -> bool: ...


def _table(name: str) -> Callable[[float], str | None]:
    """The validity check of job option ``name`` (contracts/options.py): the preconditioner
    refuses what is mathematically invalid (<= 0, NaN, ...), not the operational bounds that
    ``kfac-hpc train`` adds (``kl_clip=1e12`` is a way to say "effectively no clip")."""
    option = OPTIONS[name]

    def check(value: float) -> str | None:
        if option.kind == "int" and not float(value).is_integer():
            return "an integer >= 1"
        return validity_problem(option, value)

    return check


def _kl_clip(value: float) -> str | None:
    # The job gives 0 as None (no clipping); here the clip must be > 0.
    return "a finite number > 0" if value == 0 or _table("kl_clip")(value) else None


def _choice(name: str, value: Any, enum_type: type[enum.Enum]) -> Any:
    if isinstance(value, enum_type):
        return value
    valid = [m.value for m in enum_type]
    if isinstance(value, str) and value.lower() in valid:
        return enum_type(value.lower())
    raise ValueError(f"{name} must be one of {', '.join(valid)}, got {value!r}")


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


# The defaults of the options the job has too, as the library takes them (choices as enums).
_DEFAULT: dict[str, Any] = {name: library_default(name) for name in LIBRARY_PARAMETERS["kfac"]}
_DEFAULT.update(
    assignment_strategy=AssignmentStrategy(_DEFAULT["assignment_strategy"]),
    compute_method=ComputeMethod(_DEFAULT["compute_method"]),
    kfac_approx=KFACApprox(_DEFAULT["kfac_approx"]),
)


@dataclass
class KFACOptions:
    """The preconditioner's options (see docs/kfac.md for each one's meaning). The defaults of
    the job's options are the table's (``library_default``); the rest are the library's own
    (contracts/options.py ``LIBRARY_ONLY``)."""

    factor_update_steps: Hyperparameter = _DEFAULT["factor_update_steps"]
    inv_update_steps: Hyperparameter = _DEFAULT["inv_update_steps"]
    damping: Hyperparameter = _DEFAULT["damping"]
    factor_decay: Hyperparameter = _DEFAULT["factor_decay"]
    kl_clip: Hyperparameter | None = _DEFAULT["kl_clip"]
    lr: Hyperparameter = _DEFAULT["lr"]
    accumulation_steps: int = 1
    allreduce_bucket_cap_mb: float = _DEFAULT["allreduce_bucket_cap_mb"]
    assignment_strategy: AssignmentStrategy | str = _DEFAULT["assignment_strategy"]
    colocate_factors: bool = _DEFAULT["colocate_factors"]
    compute_method: ComputeMethod | str = _DEFAULT["compute_method"]
    damping_mode: DampingMode | str = DampingMode.PI_SPLIT
    compute_eigenvalue_outer_product: bool = _DEFAULT["compute_eigenvalue_outer_product"]
    grad_worker_fraction: str | float = _DEFAULT["grad_worker_fraction"]
    symmetry_aware: bool = _DEFAULT["symmetry_aware"]
    grad_scaler: GradScalerLike | None = None
    factor_dtype: torch.dtype | None = None
    inv_dtype: torch.dtype = torch.float32
    skip_layers: Sequence[str] = _DEFAULT["skip_layers"]
    update_factors_in_hook: bool = _DEFAULT["update_factors_in_hook"]
    synchronize_timings: bool = False
    kfac_approx: KFACApprox | str = _DEFAULT["kfac_approx"]
    factor_sample_fraction: float = _DEFAULT["factor_sample_fraction"]

    def __post_init__(self) -> None:
        self.schedules = self._build_schedules()
        self.assignment_strategy = _choice(
            "assignment_strategy", self.assignment_strategy, AssignmentStrategy
        )
        self.compute_method = _choice("compute_method", self.compute_method, ComputeMethod)
        self.kfac_approx = _choice("kfac_approx", self.kfac_approx, KFACApprox)
        self.damping_mode = _choice("damping_mode", self.damping_mode, DampingMode)
        for name in (
            "colocate_factors",
            "compute_eigenvalue_outer_product",
            "symmetry_aware",
            "update_factors_in_hook",
            "synchronize_timings",
        ):
            _flag(name, getattr(self, name))
        self._validate_numbers()
        self._validate_types()

    def value(self, name: str, step: int) -> float:
        """The scheduled option ``name`` at ``step``."""
        return float(self.schedules[name](step))

    def is_factor_step(self, step: int) -> bool:
        """Whether factors are captured and updated at ``step``."""
        return step % int(self.schedules["factor_update_steps"](step)) == 0

    def is_inverse_step(self, step: int) -> bool:
        """Whether second-order data is recomputed at ``step``."""
        return step % int(self.schedules["inv_update_steps"](step)) == 0

    def _build_schedules(self) -> dict[str, ScheduledValue]:
        checks = {
            "factor_update_steps": _table("factor_update_steps"),
            "inv_update_steps": _table("inv_update_steps"),
            "damping": _table("damping"),
            "factor_decay": _table("factor_decay"),
            "kl_clip": _kl_clip,
            "lr": _table("lr"),
        }
        return {
            name: ScheduledValue(name, getattr(self, name), check)
            for name, check in checks.items()
            if getattr(self, name) is not None
        }

    def _validate_numbers(self) -> None:
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"accumulation_steps must be an integer >= 1, got {steps!r}")
        cap = self.allreduce_bucket_cap_mb
        problem = (
            "a number"
            if isinstance(cap, bool) or not isinstance(cap, int | float)
            else _table("allreduce_bucket_cap_mb")(cap)
        )
        if problem is not None:
            raise ValueError(f"allreduce_bucket_cap_mb must be {problem}, got {cap!r}")
        frac = self.factor_sample_fraction
        problem = (
            "a number"
            if isinstance(frac, bool) or not isinstance(frac, int | float)
            else _table("factor_sample_fraction")(frac)
        )
        if problem is not None:
            raise ValueError(f"factor_sample_fraction must be {problem}, got {frac!r}")
        # Whether f·P divides P is checked against the world size by the assignment.
        fraction = self.grad_worker_fraction
        if isinstance(fraction, str):
            if fraction not in GRAD_WORKER_NAMES:
                raise ValueError(
                    f"grad_worker_fraction must be one of {', '.join(GRAD_WORKER_NAMES)} or a "
                    f"float in (0, 1], got {fraction!r}"
                )
        elif (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not (0 < fraction <= 1)
        ):
            raise ValueError(
                f"grad_worker_fraction must be one of {', '.join(GRAD_WORKER_NAMES)} or a float "
                f"in (0, 1], got {fraction!r}"
            )

    def _validate_types(self) -> None:
        floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        if self.factor_dtype is not None and self.factor_dtype not in floats:
            raise ValueError(
                f"factor_dtype must be None or a floating torch dtype, got {self.factor_dtype!r}"
            )
        if self.inv_dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"inv_dtype must be torch.float32 or torch.float64, got {self.inv_dtype!r}"
            )
        if isinstance(self.skip_layers, str) or not all(
            isinstance(s, str) for s in self.skip_layers
        ):
            raise ValueError(
                f"skip_layers must be a list of module names or class names, "
                f"got {self.skip_layers!r}"
            )
        scaler = self.grad_scaler
        if scaler is not None and not (hasattr(scaler, "get_scale") and hasattr(scaler, "scale")):
            raise ValueError(
                f"grad_scaler must be None or a torch.amp.GradScaler, got {type(scaler).__name__}"
            )
