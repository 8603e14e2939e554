"""Method name -> factory. A new method is one module that calls :func:`register`."""

from __future__ import annotations

from collections.abc import Callable

from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.methods.base import Method, MethodSetup

__all__ = ["MethodFactory", "build_method", "method_name", "register", "registered"]

MethodFactory = Callable[[MethodSetup], Method]
_FACTORIES: dict[str, MethodFactory] = {}


def register(name: str, factory: MethodFactory) -> None:
    """Make ``name`` buildable; ValueError if another factory already has the name."""
    if _FACTORIES.get(name, factory) is not factory:
        raise ValueError(f"a method named {name!r} is already registered")
    _FACTORIES[name] = factory


def registered() -> tuple[str, ...]:
    """The registered method names, in registration order."""
    return tuple(_FACTORIES)


def method_name(config: TrainConfig) -> str:
    """The method a config asks for: its switches (``--kfac``, ``--fosi``), one contract in
    :func:`kfac_hpc.contracts.options.method_of`."""
    return str(config.method)


def build_method(name: str, setup: MethodSetup) -> Method:
    """The method ``name`` for ``setup``; ValueError listing the registered names."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(_FACTORIES)}")
    return factory(setup)
