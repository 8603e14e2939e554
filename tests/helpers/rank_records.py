"""The pytest side of multi-rank checks: what the ranks of one job reported, check by check."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Any

from tests.helpers.launch import parse_rank_records


@dataclass
class CheckReport:
    """The records of one job that ran :func:`tests.helpers.rank_checks.run_checks`."""

    world_size: int
    returncode: int
    records: list[dict[str, Any]]
    stderr: str

    @classmethod
    def from_job(cls, world_size: int, out: subprocess.CompletedProcess[str]) -> CheckReport:
        records = parse_rank_records(out.stdout)
        return cls(world_size, out.returncode, records, out.stderr)

    def assert_world(self) -> None:
        """Every record came from a job of the expected size (a stray ``mpiexec`` of another
        MPI starts singletons of size 1 that would pass)."""
        sizes = {r["world_size"] for r in self.records}
        assert sizes <= {self.world_size}, f"ranks saw world sizes {sizes}, not {self.world_size}"
        ranks = {r["rank"] for r in self.records}
        assert ranks <= set(range(self.world_size)), f"unexpected ranks {sorted(ranks)}"

    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("error")]

    def assert_passed(self, check: str) -> None:
        """``check`` passed on every rank: some rank printed it after the agreement barrier,
        which every rank reaches only by passing it; else say why not."""
        self.assert_world()
        failed = [r for r in self.failures() if r["check"] == check]
        if failed:
            raise AssertionError("\n".join(f"rank {r['rank']}: {r['error']}" for r in failed))
        if any(r.get("check") == check and r["error"] is None for r in self.records):
            return
        first = self.failures()[:1]
        why = (
            f"the job stopped at check {first[0]['check']!r}, failed on rank {first[0]['rank']}:"
            f"\n{first[0]['error']}"
            if first
            else f"the job ended with status {self.returncode}:\n{self.stderr[-4000:]}"
        )
        raise AssertionError(f"check {check!r} did not complete: {why}")

    def assert_finished(self) -> None:
        """Every rank ran every check and the job exited 0."""
        self.assert_world()
        finished = sorted(r["rank"] for r in self.records if r.get("finished"))
        assert finished == list(range(self.world_size)) and self.returncode == 0, (
            f"ranks {finished} finished, status {self.returncode}:\n{self.stderr[-4000:]}"
        )

    def checks(self) -> list[str]:
        """Names of the checks that passed everywhere, in order."""
        names = [r["check"] for r in self.records if r.get("check") and r["error"] is None]
        return list(dict.fromkeys(names))
