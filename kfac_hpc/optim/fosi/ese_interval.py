"""The adaptive ESE interval: how far the eigenvector subspace moved between two ESEs, and the
steps to the next ESE that follow from it.

The movement of span(V_old) to span(V_new) (orthonormal rows, coordinate-sharded) is the mean
squared sine of their principal angles: the singular values of the (K_old × K_new) matrix
M = V_old V_newᵀ are the cosines of the min(K_old, K_new) angles, so the mean of sin² is
1 − ‖M‖²_F / min(K_old, K_new): 0 for the same subspace, 1 for orthogonal ones. It needs one
allreduce of K_old · K_new numbers and no full-length vector.

The interval starts at ``ese_every``; after each ESE it doubles when the movement was at most
:data:`STABLE` and halves when it was at least :data:`MOVED`, within
[``ese_every``, :data:`LONGEST` · ``ese_every``].
"""

from __future__ import annotations

import torch

from kfac_hpc.optim.fosi.sharding import CoordinateShard

__all__ = ["LONGEST", "MOVED", "STABLE", "next_interval", "subspace_movement"]

# mean sin² of the principal angles at or below which the subspace counts as stable (an angle
# of about 18° on average), and at or above which it moved (45°)
STABLE = 0.1
MOVED = 0.5
# the longest interval, in multiples of ese_every
LONGEST = 8


def subspace_movement(shard: CoordinateShard, old: torch.Tensor, new: torch.Tensor) -> float:
    """Mean squared sine of the principal angles between the row spaces of ``old`` ``(K1, n_r)``
    and ``new`` ``(K2, n_r)`` (this rank's coordinates of orthonormal rows), in [0, 1]; the
    same on every rank."""
    k = min(old.shape[0], new.shape[0])
    if k == 0:
        return 1.0
    cross = shard.allreduce((old @ new.to(old.dtype).T).to(torch.float64))
    return min(1.0, max(0.0, 1.0 - float((cross**2).sum()) / k))


def next_interval(interval: int, movement: float, ese_every: int) -> int:
    """The steps to the next ESE after one whose subspace moved by ``movement``."""
    if movement <= STABLE:
        return min(2 * interval, LONGEST * ese_every)
    if movement >= MOVED:
        return max(interval // 2, ese_every)
    return interval
