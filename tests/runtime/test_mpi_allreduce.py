"""Real MPI ranks (the venv's MPICH) run an all-reduce through the runtime."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_mpi

PROBE = Path(__file__).with_name("allreduce_probe.py")


def parse_ranks(stdout: str) -> list[dict[str, object]]:
    """One JSON object per rank, found wherever the launcher put it in the merged output."""
    rows = [json.loads(match) for match in re.findall(r"\{[^{}]*\}", stdout)]
    return sorted(rows, key=lambda r: int(r["rank"]))  # type: ignore[call-overload]


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
