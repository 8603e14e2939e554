"""How a layer's second-order data is computed and applied: one strategy object per
:class:`~kfac_hpc.optim.options.ComputeMethod`, chosen once when the preconditioner is built.

Both strategies hold one typed record per factor (:class:`EigenFactor` or
:class:`InverseFactor`); the preconditioner never looks inside one except through this
interface. The math is in :mod:`kfac_hpc.optim.decompositions`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor

from kfac_hpc.optim.decompositions import (
    EigenFactor,
    InverseFactor,
    decompose,
    eigen_outer,
    invert,
    pi_split,
    precondition_eigen,
    precondition_inverse,
)
from kfac_hpc.optim.options import ComputeMethod, DampingMode

__all__ = ["EigenMethod", "InverseMethod", "SecondOrder", "SecondOrderMethod", "make_method"]

SecondOrder = EigenFactor | InverseFactor


class SecondOrderMethod(ABC):
    """Decompose factors, precondition a gradient with the result, and name its tensors."""

    kind: ComputeMethod
    failing_op: str  # what failed, in the warning when every decomposition attempt fails

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # of the second-order data (inv_dtype)

    @abstractmethod
    def state_keys(self, factor: str) -> tuple[str, ...]:
        """The state-dict keys of factor ``factor``'s ("A" or "G") tensors, in state order."""

    @abstractmethod
    def compute(
        self, a: Tensor | None, g: Tensor | None, damping: float, which: Sequence[str]
    ) -> dict[str, SecondOrder | None]:
        """Second-order data of the factors named in ``which`` (None where every attempt
        failed), from the running factors ``a`` and ``g`` (None where this rank keeps none:
        the eigen method needs only the factors in ``which``, the inverse method both)."""

    @abstractmethod
    def identity(self, shape: tuple[int, ...], device: torch.device) -> SecondOrder:
        """Data that leaves a gradient (nearly) as it is: used when the very first
        decomposition of a factor fails."""

    @abstractmethod
    def empty(self, shape: tuple[int, ...], device: torch.device) -> SecondOrder:
        """Uninitialised data of a factor of ``shape``, to receive a broadcast into."""

    @abstractmethod
    def from_tensors(self, tensors: Sequence[Tensor]) -> SecondOrder:
        """The inverse of ``data.tensors()``."""

    @abstractmethod
    def outer(self, a: SecondOrder, g: SecondOrder, damping: float) -> Tensor | None:
        """A per-layer tensor precomputed once per second-order update (or None)."""

    @abstractmethod
    def precondition(
        self, grad: Tensor, a: SecondOrder, g: SecondOrder, damping: float, outer: Tensor | None
    ) -> Tensor:
        """The preconditioned gradient matrix, shaped like ``grad``."""


class EigenMethod(SecondOrderMethod):
    """Eigendecompositions A = Q_A diag(d_A) Q_Aᵀ; exact (G ⊗ A + λI)⁻¹."""

    kind = ComputeMethod.EIGEN
    failing_op = "eigh"

    def __init__(self, dtype: torch.dtype, precompute_outer: bool) -> None:
        super().__init__(dtype)
        self.precompute_outer = precompute_outer

    def state_keys(self, factor: str) -> tuple[str, ...]:
        return (f"Q{factor}", f"d{factor}")

    def compute(
        self, a: Tensor | None, g: Tensor | None, damping: float, which: Sequence[str]
    ) -> dict[str, SecondOrder | None]:
        matrices = {"A": a, "G": g}
        computed: dict[str, SecondOrder | None] = {}
        for key in which:
            matrix = matrices[key]
            assert matrix is not None, f"factor {key} is not kept on this rank"
            data = decompose(matrix, self.dtype)
            computed[key] = None if data is None else EigenFactor(_column_major(data.Q), data.d)
        return computed

    def identity(self, shape: tuple[int, ...], device: torch.device) -> SecondOrder:
        eye = torch.eye(shape[-1], dtype=self.dtype, device=device).expand(shape)
        return EigenFactor(
            _column_major(eye), torch.ones(shape[:-1], dtype=self.dtype, device=device)
        )

    def empty(self, shape: tuple[int, ...], device: torch.device) -> SecondOrder:
        return EigenFactor(
            _empty_column_major(shape, self.dtype, device),
            torch.empty(shape[:-1], dtype=self.dtype, device=device),
        )

    def from_tensors(self, tensors: Sequence[Tensor]) -> SecondOrder:
        q, d = tensors
        return EigenFactor(_column_major(q), d)

    def outer(self, a: SecondOrder, g: SecondOrder, damping: float) -> Tensor | None:
        assert isinstance(a, EigenFactor) and isinstance(g, EigenFactor)
        return eigen_outer(a.d, g.d, damping) if self.precompute_outer else None

    def precondition(
        self, grad: Tensor, a: SecondOrder, g: SecondOrder, damping: float, outer: Tensor | None
    ) -> Tensor:
        assert isinstance(a, EigenFactor) and isinstance(g, EigenFactor)
        return precondition_eigen(grad, a, g, damping, outer)


class InverseMethod(SecondOrderMethod):
    """Damped inverses (A + λ_A I)⁻¹, (G + λ_G I)⁻¹: λ split by π between A and G
    (``pi_split``) or λ on each (``per_factor``)."""

    kind = ComputeMethod.INVERSE
    failing_op = "inv"

    def __init__(self, dtype: torch.dtype, mode: DampingMode = DampingMode.PI_SPLIT) -> None:
        super().__init__(dtype)
        self.mode = mode

    def state_keys(self, factor: str) -> tuple[str, ...]:
        return (f"{factor}_inv",)

    def compute(
        self, a: Tensor | None, g: Tensor | None, damping: float, which: Sequence[str]
    ) -> dict[str, SecondOrder | None]:
        assert a is not None and g is not None, "the inverse method needs both factors"
        if self.mode is DampingMode.PI_SPLIT:
            damping_a, damping_g = pi_split(a, g, damping)
        else:
            damping_a = torch.full(a.shape[:-2], damping, dtype=torch.float64, device=a.device)
            damping_g = torch.full(g.shape[:-2], damping, dtype=torch.float64, device=g.device)
        pairs = {"A": (a, damping_a), "G": (g, damping_g)}
        computed: dict[str, SecondOrder | None] = {}
        for key in which:
            data = invert(*pairs[key], self.dtype)
            computed[key] = None if data is None else InverseFactor(_column_major(data.inv))
        return computed

    def identity(self, shape: tuple[int, ...], device: torch.device) -> SecondOrder:
        eye = torch.eye(shape[-1], dtype=self.dtype, device=device).expand(shape)
        return InverseFactor(_column_major(eye))

    def empty(self, shape: tuple[int, ...], device: torch.device) -> SecondOrder:
        return InverseFactor(_empty_column_major(shape, self.dtype, device))

    def from_tensors(self, tensors: Sequence[Tensor]) -> SecondOrder:
        (inv,) = tensors
        return InverseFactor(_column_major(inv))

    def outer(self, a: SecondOrder, g: SecondOrder, damping: float) -> Tensor | None:
        return None

    def precondition(
        self, grad: Tensor, a: SecondOrder, g: SecondOrder, damping: float, outer: Tensor | None
    ) -> Tensor:
        assert isinstance(a, InverseFactor) and isinstance(g, InverseFactor)
        return precondition_inverse(grad, a, g)


def _column_major(matrix: Tensor) -> Tensor:
    """``matrix`` with its last two dimensions column-major, the layout in which LAPACK and
    cuSOLVER return eigenvectors and inverses: a fresh result is kept as it is (no copy), and
    every rank (computing, receiving or loading it) holds the same layout, so that their
    preconditioning GEMMs round alike and the ranks' gradients stay bit-identical."""
    return matrix if matrix.mT.is_contiguous() else matrix.mT.contiguous().mT


def _empty_column_major(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised column-major tensor of ``shape`` (a broadcast's receiver)."""
    return torch.empty((*shape[:-2], shape[-1], shape[-2]), dtype=dtype, device=device).mT


def make_method(
    kind: ComputeMethod,
    dtype: torch.dtype,
    precompute_outer: bool,
    damping_mode: DampingMode = DampingMode.PI_SPLIT,
) -> SecondOrderMethod:
    """The strategy of ``kind``; ``precompute_outer`` applies to the eigen method only,
    ``damping_mode`` to the inverse method only."""
    if kind is ComputeMethod.EIGEN:
        return EigenMethod(dtype, precompute_outer)
    return InverseMethod(dtype, damping_mode)
