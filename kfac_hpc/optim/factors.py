"""The Kronecker factors of one layer: per-step batch statistics and their running averages.

Within a factor-update step, every micro-batch (``accumulation_steps`` of them) adds its A and
G to a pending sum; ``step()`` averages the sum, and — only if the step is finite — folds it into
the running average ``F ← α F + (1 − α) F_batch`` (α = factor_decay).

First-update rule: the first accepted update *starts from the batch statistics*
(``F = F_batch``), not from the identity, so the damping means the same from step 0 on.

Owner-only factors (MEM-OPT, HYBRID-OPT): a rank keeps the running average of only the factors
it decomposes; ``present`` says the running averages exist (on their owners) and is the same on
every rank, so all ranks take the same collective decisions.

Running factors are never modified in place (each update makes new tensors), so the state the
preconditioner hands to a checkpoint may reference them.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["LayerFactors"]


class LayerFactors:
    """Running A and G of one layer plus the sums pending for the current step."""

    def __init__(self) -> None:
        self.A: Tensor | None = None
        self.G: Tensor | None = None
        self.pending_a: Tensor | None = None
        self.pending_g: Tensor | None = None
        self.count_a = 0
        self.count_g = 0
        self.updated = False  # committed or loaded (on every rank, kept or not)

    @property
    def present(self) -> bool:
        """Whether the running averages exist (on the ranks that keep them)."""
        return self.updated or self.A is not None or self.G is not None

    def add_a(self, a: Tensor) -> None:
        self.pending_a = a if self.pending_a is None else self.pending_a.add_(a)
        self.count_a += 1

    def add_g(self, g: Tensor) -> None:
        self.pending_g = g if self.pending_g is None else self.pending_g.add_(g)
        self.count_g += 1

    def pending(self, key: str) -> Tensor | None:
        """The pending sum of factor ``key`` ("A" or "G"), None where there is none."""
        return self.pending_a if key == "A" else self.pending_g

    def set_pending(self, key: str, value: Tensor, count: int) -> None:
        if key == "A":
            self.pending_a, self.count_a = value, count
        else:
            self.pending_g, self.count_g = value, count

    def swap_pending(self, key: str, value: Tensor | None) -> None:
        """Replace the pending sum of ``key``, keeping its count: None when it was sent to the
        rank that keeps the factor, the reduced sum when that arrived back."""
        if key == "A":
            self.pending_a = value
        else:
            self.pending_g = value

    def clear_pending(self) -> None:
        self.pending_a = self.pending_g = None
        self.count_a = self.count_g = 0

    def commit(self, decay: float, keep_a: bool = True, keep_g: bool = True) -> None:
        """Fold the pending statistics, averaged over the micro-batches, into the running
        averages this rank keeps (``keep_a``/``keep_g``, which need their pending sum); the
        others are not held here (None)."""
        # lerp: α F + (1 − α) F_batch in one pass, into a new tensor: a running factor is
        # never modified in place, so a checkpoint written in the background may hold it.
        if keep_a:
            self.A = _folded(self.A, self.pending_a, self.count_a, decay)
        if keep_g:
            self.G = _folded(self.G, self.pending_g, self.count_g, decay)
        self.updated = True
        self.clear_pending()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.A, self.G) if t is not None)


def _folded(running: Tensor | None, pending: Tensor | None, count: int, decay: float) -> Tensor:
    """The new running average from the pending sum of ``count`` micro-batches."""
    assert pending is not None, "a kept factor has its pending statistics"
    if count > 1:
        pending.div_(count)
    return pending if running is None else running.lerp(pending, 1 - decay)
