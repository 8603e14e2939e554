"""``keep_basis=True``: the Lanczos basis stays allocated between ESEs and is reused, which
changes nothing FOSI computes (every basis row is written before it is read).

Oracle: the same run with ``keep_basis=False`` (bitwise equal parameters and eigenvalues); the
basis' bytes are m × n × the dtype's size, and ``memory_usage`` reports them.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from kfac_hpc.optim.fosi import FOSI
from kfac_hpc.optim.fosi.lanczos import lanczos_extremes
from kfac_hpc.optim.fosi.sharding import CoordinateShard

ITERS = 24


def _run(keep: bool, dtype: str) -> tuple[FOSI, list[Tensor], list[int]]:
    """Three ESEs (steps 0, 2, 4) of a small MLP; the parameters after the run and the basis'
    address after each ESE (0: none kept)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))

    def loss() -> Tensor:
        return nn.functional.cross_entropy(model(x), y)

    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = FOSI(model.parameters(), base, k=4, warmup=0, ese_every=2, lanczos_iters=ITERS,
               model=model, lanczos_dtype=dtype, keep_basis=keep)  # fmt: skip
    addresses = []
    for step in range(6):
        opt.zero_grad()
        loss().backward()
        opt.step(loss)
        if step % 2 == 0:
            addresses.append(0 if opt._basis is None else opt._basis.data_ptr())
    return opt, [p.detach().clone() for p in model.parameters()], addresses


@pytest.mark.parametrize(("dtype", "size"), [("float64", 8), ("training", 4)])
def test_a_kept_basis_is_reused_and_changes_nothing(dtype: str, size: int) -> None:
    fresh, fresh_params, none = _run(False, dtype)
    kept, kept_params, addresses = _run(True, dtype)
    assert none == [0, 0, 0]
    assert addresses[0] != 0 and len(set(addresses)) == 1  # one buffer, every ESE
    for a, b in zip(kept_params, fresh_params, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(kept.eigenvalues, fresh.eigenvalues) and kept.eigenvalues.numel()
    n = sum(p.numel() for p in kept_params)
    assert kept._basis is not None and kept._basis.shape == (ITERS, n)
    assert kept.memory_usage()["lanczos_basis_bytes"] == ITERS * n * size
    assert kept.memory_usage() == fresh.memory_usage()


def test_keep_basis_must_be_a_bool() -> None:
    model = nn.Linear(3, 2)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="keep_basis"):
        FOSI(model.parameters(), base, k=1, keep_basis=1)  # type: ignore[arg-type]


def test_a_basis_of_another_shape_or_dtype_is_refused() -> None:
    shard = CoordinateShard(10, 1, 0)
    for wrong in (torch.empty(5, 10), torch.empty(6, 9, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"basis of shape .* use \(6, 10\)"):
            lanczos_extremes(lambda v: v, shard, 1, 0, 6, 0, basis=wrong)
