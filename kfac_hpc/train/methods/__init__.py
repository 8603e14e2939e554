"""Training methods of the job: the interface, the registry and the built-in methods."""

from kfac_hpc.train.methods import first_order, fosi, kfac
from kfac_hpc.train.methods.base import CurvatureLoss, Method, MethodSetup
from kfac_hpc.train.methods.registry import (
    MethodFactory,
    build_method,
    method_name,
    register,
    registered,
)

__all__ = [
    "CurvatureLoss",
    "Method",
    "MethodFactory",
    "MethodSetup",
    "build_method",
    "first_order",
    "fosi",
    "kfac",
    "method_name",
    "register",
    "registered",
]
