"""Partial reorthogonalization (``reorthogonalize="partial"``) keeps the Lanczos basis
semi-orthogonal with far fewer passes over it, and finds the same extreme eigenpairs as full
reorthogonalization.

Oracles: the known spectrum of test_lanczos_early_stop (extremes 50, 40, 30, 25, 20 and -5, -6
around a bulk in [0, 10), 200 coordinates) and dense float64 ``eigvalsh``; the Lanczos basis is
read back from the vectors the operator is applied to, and its inner products computed densely.
A plain Lanczos without any reorthogonalization, written here, shows that the basis does lose
orthogonality on this problem (so the passes partial makes are needed, not decoration).

Tolerances: semi-orthogonality is the method's invariant, every off-diagonal |q_i · q_j| ≤ √ε
(ε the unit roundoff of the basis' dtype; a pass restores ε-level); we allow 4 √ε for the
estimate's slack. Eigenvalues: float64 5e-9 absolute (1e-10 of |H| = 50; measured 4e-14, the same
as full), float32 5e-5 (the float32 test's bound); the Ritz vectors are orthonormal to √ε
(measured 2.7e-5 in float32 against its √ε of 3.5e-4), their residuals as full's. Distributed:
P = 2, 3, 4 equal P = 1 to 1e-10 (eigenvalues relative, Ritz vectors up to sign absolute), as
the other sharded checks.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import Tensor, nn

from kfac_hpc.optim.fosi import FOSI
from kfac_hpc.optim.fosi.lanczos import lanczos_extremes
from kfac_hpc.optim.fosi.sharding import CoordinateShard
from tests.conftest import run_mpi
from tests.helpers.launch import RANK_SCRIPTS
from tests.optim.fosi.test_lanczos_early_stop import N, matrix_and_spectrum

K, L, STEPS = 5, 2, 60
EIGENVALUE_TOL = {torch.float64: 5e-9, torch.float32: 5e-5}


def _index(k: int, l: int) -> Tensor:  # noqa: E741
    return torch.cat([torch.arange(N - 1, N - 1 - k, -1), torch.arange(l - 1, -1, -1)])


def _run(matrix: Tensor, mode: str, dtype: torch.dtype, steps: int = STEPS) -> tuple:
    """The spectrum and the basis (the vectors the operator was applied to, as rows)."""
    applied: list[Tensor] = []
    op = matrix.to(dtype)

    def hvp(q: Tensor) -> Tensor:
        applied.append(q.clone())
        return op @ q

    spectrum = lanczos_extremes(
        hvp, CoordinateShard(N, 1, 0), K, L, steps, 0, dtype=dtype, reorthogonalize=mode
    )
    return spectrum, torch.stack(applied).double()


def _off_diagonal(basis: Tensor) -> float:
    gram = basis @ basis.T
    return float((gram - torch.eye(len(basis), dtype=gram.dtype)).abs().max())


def _plain_lanczos_basis(matrix: Tensor, steps: int) -> Tensor:
    """Lanczos with the three-term recurrence only (no reorthogonalization), same start."""
    start = torch.randn(N, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q, previous, beta = start / start.norm(), torch.zeros(N, dtype=torch.float64), 0.0
    basis = []
    for _ in range(steps):
        basis.append(q)
        w = matrix @ q
        w = w - (w @ q) * q - beta * previous
        beta = float(w.norm())
        previous, q = q, w / beta
    return torch.stack(basis)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_partial_keeps_the_basis_semi_orthogonal_with_fewer_passes(dtype: torch.dtype) -> None:
    matrix, _ = matrix_and_spectrum()
    full, _ = _run(matrix, "full", dtype)
    partial, basis = _run(matrix, "partial", dtype)
    eps = torch.finfo(dtype).eps / 2
    assert full.reorthogonalized == full.iterations == STEPS
    assert 0 < partial.reorthogonalized < STEPS // 2
    assert partial.iterations == STEPS
    assert _off_diagonal(basis) <= 4 * math.sqrt(eps)
    # without any pass the basis of this run is far from orthogonal
    assert _off_diagonal(_plain_lanczos_basis(matrix, STEPS)) > 0.1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_partial_finds_the_extremes_of_full_and_of_the_dense_oracle(dtype: torch.dtype) -> None:
    matrix, mu = matrix_and_spectrum()
    full, _ = _run(matrix, "full", dtype)
    partial, _ = _run(matrix, "partial", dtype)
    tol = EIGENVALUE_TOL[dtype]
    torch.testing.assert_close(partial.eigenvalues, mu[_index(K, L)], rtol=0, atol=tol)
    torch.testing.assert_close(partial.eigenvalues, full.eigenvalues, rtol=0, atol=tol)
    # the Ritz vectors are eigenvectors, orthonormal to the basis' semi-orthogonality (√ε)
    v = partial.vectors.double()
    eye = torch.eye(K + L, dtype=torch.float64)
    semi = math.sqrt(torch.finfo(dtype).eps / 2)
    torch.testing.assert_close(v @ v.T, eye, rtol=0, atol=semi)
    residual = (matrix @ v.T - v.T * partial.eigenvalues).norm(dim=0)
    assert float(residual.max()) < (1e-3 if dtype == torch.float32 else 1e-6) * 50


def test_partial_follows_the_rounding_of_narrower_products() -> None:
    """Products in float32 on a float64 basis (FOSI's float32 model with the default basis):
    the basis loses orthogonality at float32's rounding, so the estimates must follow that
    (``product_dtype``); the Ritz values then equal full's to the float32 bound."""
    matrix, mu = matrix_and_spectrum()
    single = matrix.float()

    def hvp(v: Tensor) -> Tensor:
        return (single @ v.float()).double()

    shard = CoordinateShard(N, 1, 0)
    full = lanczos_extremes(hvp, shard, K, L, STEPS, 0)
    partial = lanczos_extremes(hvp, shard, K, L, STEPS, 0, reorthogonalize="partial",
                               product_dtype=torch.float32)  # fmt: skip
    assert 0 < partial.reorthogonalized < STEPS
    tol = EIGENVALUE_TOL[torch.float32]
    torch.testing.assert_close(partial.eigenvalues, full.eigenvalues, rtol=0, atol=tol)
    torch.testing.assert_close(partial.eigenvalues, mu[_index(K, L)], rtol=0, atol=tol)


def test_no_pass_while_no_pair_has_converged() -> None:
    """A few steps into a bulk-only spectrum nothing converges, the basis stays orthogonal by
    itself, and partial makes no pass at all (full makes one per step)."""
    gen = torch.Generator().manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(N, N, generator=gen, dtype=torch.float64))
    matrix = q @ torch.diag(torch.rand(N, generator=gen, dtype=torch.float64)) @ q.T
    partial, basis = _run(matrix, "partial", torch.float64, steps=12)
    assert partial.iterations == 12 and partial.reorthogonalized == 0
    assert _off_diagonal(basis) <= math.sqrt(torch.finfo(torch.float64).eps / 2)


def test_fosi_with_partial_reorthogonalization_estimates_the_same_spectrum() -> None:
    """A float64 MLP: the ESE's eigenvalues with partial equal those with full to 1e-9 of the
    largest."""
    found = {}
    for mode in ("full", "partial"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()
        x, y = torch.randn(64, 6, dtype=torch.float64), torch.randint(0, 3, (64,))

        def loss(model: nn.Module = model, x: Tensor = x, y: Tensor = y) -> Tensor:
            return nn.functional.cross_entropy(model(x), y)

        base = torch.optim.SGD(model.parameters(), lr=0.0)
        opt = FOSI(model.parameters(), base, k=4, warmup=0, lanczos_iters=60, model=model,
                   hvp="double-backward", residual_tol=1.0, ese_check=False,
                   reorthogonalize=mode)  # fmt: skip
        loss().backward()
        opt.step(loss)
        found[mode] = (opt.eigenvalues.clone(), opt.last_reorthogonalized)
    (wide, full_passes), (narrow, partial_passes) = found["full"], found["partial"]
    assert full_passes == 60 and partial_passes < 60
    assert narrow.numel() == wide.numel() == 4
    torch.testing.assert_close(narrow, wide, rtol=0, atol=1e-9 * float(wide[0]))


def test_an_unknown_reorthogonalization_is_refused_by_name() -> None:
    model = nn.Linear(2, 1)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"reorthogonalize='some'.*full, partial"):
        FOSI(model.parameters(), base, k=1, reorthogonalize="some")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Rank 0's results of the sharded Lanczos at P = 1 .. 4 (real ranks, gloo)."""
    out = tmp_path_factory.mktemp("lanczos")
    results = {}
    for world in (1, 2, 3, 4):
        script = [sys.executable, str(RANK_SCRIPTS / "lanczos_sharded.py"), str(out)]
        proc = run_mpi(world, script)
        assert proc.returncode == 0, f"ranks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        saved = torch.load(out / f"p{world}.pt")
        assert saved["world_size"] == world
        results[world] = saved["found"]
    return results


@pytest.mark.mpi
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_partial_equals_the_single_process_run(sharded: dict, world_size: int) -> None:
    for mode in ("full", "partial"):
        got, want = sharded[world_size][mode], sharded[1][mode]
        assert (got["iterations"], got["reorthogonalized"]) == (
            want["iterations"],
            want["reorthogonalized"],
        ), mode
        torch.testing.assert_close(got["eigenvalues"], want["eigenvalues"], rtol=1e-10, atol=0)
        signs = (got["vectors"] * want["vectors"]).sum(dim=1).sign()
        torch.testing.assert_close(got["vectors"] * signs[:, None], want["vectors"],
                                   rtol=0, atol=1e-10)  # fmt: skip
    assert sharded[world_size]["partial"]["reorthogonalized"] < STEPS // 2
