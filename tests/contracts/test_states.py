"""Point states: every consumer handles every state, and the one classifier decides a point's
state from its markers, its live job, the scheduler's final word and the last known state."""

from __future__ import annotations

import json

import pytest

from kfac_hpc.analysis.schema import ROW_STATE
from kfac_hpc.contracts.exit_codes import ExitCode
from kfac_hpc.contracts.rundir import Markers
from kfac_hpc.contracts.states import (
    LIVE,
    RESUMABLE,
    TERMINAL,
    PointState,
    Verdict,
    classify_point,
)
from kfac_hpc.sweep.backends import slurm as slurm_backend
from kfac_hpc.sweep.follow import RETRY
from kfac_hpc.sweep.manifest import Manifest
from kfac_hpc.workflows.local import exit_verdict

ALL = set(PointState)


def test_live_and_terminal_split_the_states():
    assert LIVE | TERMINAL == ALL and not LIVE & TERMINAL
    assert RESUMABLE <= TERMINAL and PointState.DONE not in RESUMABLE


def test_status_resume_and_the_collector_handle_every_state():
    """A state added to the enum fails here until `resume` and the collector know it (the
    workflow waits while a point is LIVE, checked above)."""
    assert set(RETRY) == ALL
    assert {s for s, retry in RETRY.items() if retry is not None} == RESUMABLE
    assert set(ROW_STATE) == ALL


def test_the_slurm_words_become_point_states():
    for state in (*slurm_backend._SLURM_LIVE.values(), *slurm_backend._SLURM_ENDED.values()):
        assert isinstance(state, PointState)
    assert set(slurm_backend._SLURM_LIVE.values()) <= LIVE
    assert set(slurm_backend._SLURM_ENDED.values()) <= TERMINAL


RUNNING = Verdict(PointState.RUNNING)
SUBMITTED = Verdict(PointState.SUBMITTED, "PENDING Resources")
CANCELLED = Verdict(PointState.CANCELLED, "kfac-hpc cancel")
NONE, DONE, ERROR, PREEMPTED = (
    Markers(),
    Markers(done=""),
    Markers(error="rank 1: boom"),
    Markers(preempted=""),
)


@pytest.mark.parametrize(
    ("markers", "known", "live", "ended", "asked", "expected"),
    [
        # the job the scheduler holds comes first (it may still be writing its marker)
        (DONE, RUNNING, RUNNING, None, True, PointState.RUNNING),
        (PREEMPTED, RUNNING, SUBMITTED, None, True, PointState.REQUEUED),
        (NONE, RUNNING, SUBMITTED, None, True, PointState.SUBMITTED),
        # then the markers
        (DONE, RUNNING, None, None, True, PointState.DONE),
        (ERROR, RUNNING, None, None, True, PointState.FAILED),
        (PREEMPTED, RUNNING, None, exit_verdict(1), False, PointState.PREEMPTED),
        # a cancel or time-out already recorded is not undone by a preempted marker
        (PREEMPTED, CANCELLED, None, None, True, PointState.CANCELLED),
        # the scheduler's or the exit code's final word
        (NONE, RUNNING, None, exit_verdict(ExitCode.PREEMPTED), False, PointState.PREEMPTED),
        (NONE, RUNNING, None, exit_verdict(0), False, PointState.FAILED),
        (NONE, RUNNING, None, Verdict(PointState.TIMEOUT), True, PointState.TIMEOUT),
        # no end marker and no live job: failed
        (NONE, RUNNING, None, None, True, PointState.FAILED),
        # nobody asked a scheduler (the collector, the local backend): the last known state
        (NONE, RUNNING, None, None, False, PointState.RUNNING),
        (NONE, Verdict(PointState.PENDING), None, None, True, PointState.FAILED),
    ],
)
def test_classify_point(markers, known, live, ended, asked, expected):
    verdict = classify_point(markers, known, live=live, ended=ended, asked=asked)
    assert verdict.state is expected


def test_the_error_message_is_the_detail():
    assert classify_point(ERROR, RUNNING).detail == "rank 1: boom"


def test_old_manifests_read_their_point_hash_as_group_hash():
    point = {"point_id": "p", "params": {}, "config_hash": "abc", "run_dir": "runs/p"}
    point |= {"array": "n1-0", "array_index": 0}
    data = {"name": "s", "backend": "local", "created": 0.0, "spec": {}, "profile": {}}
    data |= {"arrays": [], "points": [point], "schema": 1, "kind": "sweep_manifest"}
    manifest = Manifest.from_dict(json.loads(json.dumps(data)))
    assert manifest.points[0].group_hash == "abc"


def test_the_preempted_exit_code_is_the_one_the_job_and_the_script_use():
    from kfac_hpc.train.preemption import REQUEUE_EXIT_CODE
    from tests.helpers.sweeps import GOLDEN

    assert REQUEUE_EXIT_CODE == ExitCode.PREEMPTED == 75
    for script in GOLDEN.glob("*.sbatch"):
        assert f'if [ "$rc" -eq {int(ExitCode.PREEMPTED)} ]' in script.read_text()
