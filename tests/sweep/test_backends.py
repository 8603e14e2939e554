"""The backend interface: a third backend is one class in the registry, and `status`,
`cancel` and `resume` reach it without knowing its name; the command group and its aliases."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from kfac_hpc.contracts.states import PointState
from kfac_hpc.sweep import backends
from kfac_hpc.sweep.backends import SweepBackend, backend_for
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.follow import cancel_sweep, resume_sweep, status
from kfac_hpc.sweep.manifest import Manifest, PointRecord, read_manifest
from kfac_hpc.sweep.prepare import PreparedSweep, new_manifest, prepare_sweep
from tests.helpers.sweeps import cli, spec

CALLS: list[tuple[str, list[str]]] = []


class RecordingBackend(SweepBackend):
    """Holds every point as running until cancelled; records what it was asked."""

    name = "recording"

    def max_array_size(self) -> int:
        return 3  # arrays of at most 2 tasks

    def submit(self, prepared: PreparedSweep) -> Manifest:
        manifest = new_manifest(prepared)
        for point in manifest.points:
            point.state = PointState.RUNNING.value
        manifest.write(prepared.sweep_dir)
        CALLS.append(("submit", [p.point_id for p in manifest.points]))
        return manifest

    def refresh(self, manifest: Manifest, sweep_dir: Path) -> None:
        CALLS.append(("refresh", [p.point_id for p in manifest.points]))

    def cancel(self, points: Sequence[PointRecord]) -> None:
        CALLS.append(("cancel", [p.point_id for p in points]))

    def resubmit(self, manifest: Manifest, sweep_dir: Path, points: Sequence[PointRecord]) -> None:
        CALLS.append(("resubmit", [p.point_id for p in points]))
        for point in points:
            point.state = PointState.RUNNING.value


@pytest.fixture
def recording(monkeypatch):
    CALLS.clear()
    registry = {**backends._REGISTRY, "recording": f"{__name__}:RecordingBackend"}
    monkeypatch.setattr(backends, "_REGISTRY", registry)
    return CALLS


def test_a_registered_backend_runs_status_cancel_and_resume(recording, tmp_path):
    backend = backend_for("recording")
    prepared = prepare_sweep(spec(nodes="1,2", repeats=3), tmp_path / "sw", backend)
    assert [s.name for s in prepared.scripts] == ["n1-0", "n1-1", "n2-0", "n2-1"]
    backend.submit(prepared)
    ids = [p.point_id for p in read_manifest(prepared.sweep_dir).points]
    _, rows = status(prepared.sweep_dir)
    assert {r.state for r in rows} == {"running"}
    assert cancel_sweep(prepared.sweep_dir) == ids
    assert resume_sweep(prepared.sweep_dir) == ids
    expected = ["submit", "refresh", "refresh", "cancel", "refresh", "resubmit"]
    assert [c[0] for c in recording] == expected
    assert all(c[1] == ids for c in recording)


def test_an_unknown_backend_names_the_registered_ones():
    with pytest.raises(SweepInputError, match="backend: 'pbs' is not one of slurm, local"):
        backend_for("pbs")


def test_sweep_run_and_the_top_level_commands_are_the_group_s(tmp_path):
    args = ["--nodes", "1,2", "--backend", "local", "--dry-run"]
    plain = cli("sweep", *args, "--sweep-dir", str(tmp_path / "a"))
    run = cli("sweep", "run", *args, "--sweep-dir", str(tmp_path / "b"))
    assert plain.returncode == run.returncode == 0, plain.stderr + run.stderr
    assert plain.stdout.splitlines()[2:] == run.stdout.splitlines()[2:]
    for command in (["status"], ["sweep", "status"]):
        out = cli(*command, str(tmp_path / "nothing"))
        assert out.returncode == 2 and "error: SWEEP_DIR" in out.stderr
    listed = cli("sweep", "--help").stdout
    for sub in ("run", "status", "resume", "cancel"):
        assert f"  {sub} " in listed
