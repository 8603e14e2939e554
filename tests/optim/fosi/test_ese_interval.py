"""The adaptive ESE interval (``adaptive_ese``): the subspace movement against scipy's principal
angles, the interval rule, and FOSI's schedule on a Hessian that stays put and then moves; a run
interrupted after an ESE the check rejected resumes (state_dict, and full_state_dict through
HDF5) with the schedule, the movements and the parameters of the uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn

from kfac_hpc.checkpoint.hdf5_tree import read_tree, write_tree
from kfac_hpc.optim.fosi import FOSI
from kfac_hpc.optim.fosi.ese_interval import LONGEST, next_interval, subspace_movement
from kfac_hpc.optim.fosi.options import FOSIOptions
from kfac_hpc.optim.fosi.sharding import CoordinateShard


@pytest.mark.parametrize(("k1", "k2", "overlap"), [(3, 3, 0), (3, 5, 2), (4, 2, 1), (5, 5, 5)])
def test_the_movement_is_the_mean_squared_sine_of_the_principal_angles(k1, k2, overlap) -> None:
    """Oracle: scipy.linalg.subspace_angles (float64, dense) of two random subspaces of R^40
    sharing ``overlap`` directions; ours from the (K1 x K2) cross products, 1e-12."""
    gen = np.random.default_rng(k1 * 10 + k2 + overlap)
    shared = gen.standard_normal((40, overlap))
    a = np.linalg.qr(np.hstack([shared, gen.standard_normal((40, k1 - overlap))]))[0]
    b = np.linalg.qr(np.hstack([shared, gen.standard_normal((40, k2 - overlap))]))[0]
    angles = scipy.linalg.subspace_angles(a, b)  # min(k1, k2) angles
    want = float(np.mean(np.sin(angles) ** 2))
    shard = CoordinateShard(40, 1, 0)
    got = subspace_movement(shard, torch.from_numpy(a.T.copy()), torch.from_numpy(b.T.copy()))
    assert abs(got - want) < 1e-12
    if overlap == min(k1, k2):
        assert got < 1e-12


def test_the_interval_doubles_when_stable_halves_when_moved_within_its_bounds() -> None:
    assert next_interval(10, 0.05, 10) == 20
    assert next_interval(10 * LONGEST, 0.0, 10) == 10 * LONGEST  # the longest
    assert next_interval(40, 0.3, 10) == 40  # between the thresholds: kept
    assert next_interval(40, 0.7, 10) == 20
    assert next_interval(10, 1.0, 10) == 10  # never below ese_every


def _fosi(adaptive: bool) -> tuple[FOSI, nn.Linear]:
    torch.manual_seed(0)
    model = nn.Linear(8, 1, bias=False)
    base = torch.optim.SGD(model.parameters(), lr=0.0)  # the parameters stay: only the schedule
    opt = FOSI(model.parameters(), base, k=2, ese_every=5, warmup=2, lanczos_iters=8, model=model,
               hvp="double-backward", ese_check=False, adaptive_ese=adaptive)  # fmt: skip
    return opt, model


def _run(opt: FOSI, model: nn.Linear, steps: int, moving_from: int) -> list[int]:
    """``steps`` steps on the quadratic ½ wᵀ A w: A fixed (top eigenvectors e1, e2) before step
    ``moving_from``, then a new random orthogonal basis at every ESE. The steps of the ESEs."""
    gen = torch.Generator().manual_seed(3)
    spectrum = torch.tensor([9.0, 8.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    fixed = torch.diag(spectrum)
    at = []
    for step in range(steps):
        if step >= moving_from:
            q, _ = torch.linalg.qr(torch.randn(8, 8, generator=gen))
            a = q @ torch.diag(spectrum) @ q.T
        else:
            a = fixed
        model.weight.grad = torch.zeros_like(model.weight)
        count = opt.ese_count
        w = model.weight
        opt.step(lambda a=a, w=w: 0.5 * (w @ a @ w.T).sum())
        if opt.ese_count > count:
            at.append(step)
    return at


def test_a_still_subspace_lengthens_the_interval_and_a_moving_one_shortens_it() -> None:
    opt, model = _fosi(adaptive=True)
    at = _run(opt, model, 110, moving_from=70)
    # still: 5, 10, 20, 40 steps apart (the longest: 8 x 5); then a new random basis at every
    # ESE (two random 2-planes of R^8: mean sin² about 0.75): halved at each ESE, back to 5
    assert at == [2, 7, 17, 37, 77, 97, 107]
    assert opt.intervals == [5, 10, 20, 40, 20, 10, 5]
    assert max(opt.movements[:3]) < 1e-6 and min(opt.movements[3:]) >= 0.5


def test_without_the_option_the_schedule_is_fixed_and_the_movement_still_recorded() -> None:
    opt, model = _fosi(adaptive=False)
    at = _run(opt, model, 40, moving_from=20)
    assert at == [2, 7, 12, 17, 22, 27, 32, 37] and set(opt.intervals) == {5}
    assert len(opt.movements) == 7 and opt.movements[0] < 1e-6 and opt.movements[-1] > 0.1


def test_the_schedule_is_part_of_the_state() -> None:
    opt, model = _fosi(adaptive=True)
    _run(opt, model, 30, moving_from=1000)
    state = opt.state_dict()
    again, _ = _fosi(adaptive=True)
    again.load_state_dict(state)
    assert (again.next_ese, again.interval) == (opt.next_ese, opt.interval) == (37, 20)
    assert again.intervals == opt.intervals and again.movements == opt.movements


def _rejecting() -> tuple[FOSI, nn.Linear]:
    """FOSI whose every subspace step overshoots (α = 3 with no velocity averaging: thrice the
    Newton step) so that the ESE check rejects every ESE; SGD moves the parameters."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1, bias=False).double()
    base = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = FOSI(model.parameters(), base, k=2, alpha=3.0, momentum=0.0, ese_every=5, warmup=2,
               lanczos_iters=8, model=model, hvp="double-backward", adaptive_ese=True)  # fmt: skip
    return opt, model


def _quadratic(opt: FOSI, model: nn.Linear, steps: range) -> list[int]:
    """``steps`` on ½ wᵀAw, A = diag(9, 8, 1, ...): the steps of the ESEs."""
    a = torch.diag(torch.tensor([9.0, 8.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5], dtype=torch.float64))
    w, at = model.weight, []
    for step in steps:
        w.grad = (w @ a).detach()
        count = opt.ese_count
        opt.step(lambda: 0.5 * (w @ a @ w.T).sum())
        if opt.ese_count > count:
            at.append(step)
    return at


@pytest.mark.parametrize("how", ["state_dict", "full_state_dict"])
def test_a_resume_after_a_rejected_ese_keeps_the_movement_basis(how: str, tmp_path: Path) -> None:
    straight, model = _rejecting()
    at = _quadratic(straight, model, range(80))
    assert at == [2, 7, 17, 37, 77] and straight.rejected_at == at  # every ESE rejected
    assert straight.intervals == [5, 10, 20, 40, 40] and len(straight.movements) == 4

    first, model_a = _rejecting()
    at_a = _quadratic(first, model_a, range(25))  # stopped after the rejected ESE of step 17
    assert first.vectors is None
    state: dict[str, Any]
    if how == "state_dict":
        state = first.state_dict()
    else:
        with h5py.File(tmp_path / "fosi.h5", "w") as f:
            write_tree(f, {"fosi": first.full_state_dict()})
        with h5py.File(tmp_path / "fosi.h5", "r") as f:
            state = read_tree(f)["fosi"]
    resumed, model_b = _rejecting()
    with torch.no_grad():
        model_b.weight.copy_(model_a.weight)
    getattr(resumed, "load_" + how)(state)
    at_b = _quadratic(resumed, model_b, range(25, 80))
    assert at_a + at_b == at
    assert resumed.intervals == straight.intervals and resumed.movements == straight.movements
    assert torch.equal(model_b.weight, model.weight)


def test_adaptive_ese_with_curvature_ranks_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="adaptive_ese=True"):
        FOSIOptions(adaptive_ese=True, curvature_ranks=1)
