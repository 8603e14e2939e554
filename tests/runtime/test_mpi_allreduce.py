"""Real MPI ranks (the venv's MPICH) run an all-reduce through the runtime."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import parse_rank_records, run_mpi
from tests.helpers.launch import RANK_SCRIPTS

PROBE = RANK_SCRIPTS / "allreduce_probe.py"


def parse_ranks(stdout: str) -> list[dict[str, Any]]:
    """One JSON object per rank, sorted by rank."""
    return sorted(parse_rank_records(stdout), key=lambda r: int(r["rank"]))


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [2, 4])
def test_mpiexec_allreduce(nranks: int) -> None:
    result = run_mpi(nranks, ["python", str(PROBE)], timeout=180)
    assert result.returncode == 0, result.stderr
    rows = parse_ranks(result.stdout)
    assert [r["rank"] for r in rows] == list(range(nranks))
    for row in rows:
        assert row["world_size"] == nranks and row["pg_world_size"] == nranks
        assert row["source"] == "pmi"
        assert row["rendezvous"] == "mpi-broadcast"
        assert row["backend"] == "gloo"
        assert row["sum"] == nranks * (nranks + 1) / 2
