"""How a rank ends: bad input is one line under mpiexec (not one per rank) and exit 2 on every
rank; a signal that arrives once the run's end is on disk does not change the exit status."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from kfac_hpc.train.cli import launcher_rank
from kfac_hpc.train.config import ConfigError
from kfac_hpc.train.job import PeerInputError, agree_on_input
from kfac_hpc.train.preemption import REQUEUE_EXIT_CODE, PreemptionHandler

from .conftest import clean_env, explain, run_ranks, start_until_checkpoint, train_cmd

MLP = ["--model", "mlp", "--no-progress"]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kfac-hpc train:")]


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("case", "args", "flag"),
    [
        ("flag", ["--lr", "-1"], "--lr"),  # refused before the process group exists
        ("data", ["--batch-size", "100000"], "--batch-size"),  # refused by the launched job
        ("resume_from", ["--resume-from", "GARBAGE"], "--resume-from"),  # read by each rank
    ],
)
def test_bad_input_under_mpiexec_is_one_line_and_exit_2(tmp_path, case, args, flag):
    if case == "resume_from":
        garbage = tmp_path / "garbage.h5"
        garbage.write_bytes(bytes(range(256)) * 8)
        args = [args[0], str(garbage)]
    run = tmp_path / "run"
    proc = run_ranks(2, run, *MLP, "--steps", "2", *args)
    assert proc.returncode == 2, explain(proc)
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and flag in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run.exists()


def test_the_lowest_rank_with_bad_input_raises_its_own_error_the_others_a_quiet_one():
    cpu = torch.device("cpu")
    agree_on_input(None, 0, 1, cpu)  # nothing wrong: nothing raised
    error = ConfigError("lr", "must be > 0")
    with pytest.raises(ConfigError) as caught:
        agree_on_input(error, 0, 1, cpu)
    assert caught.value is error and caught.value.quiet is False  # type: ignore[attr-defined]
    assert PeerInputError("lr", "x").quiet is True


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, 0),
        ({"PMI_RANK": "3", "PMI_SIZE": "4"}, 3),
        ({"OMPI_COMM_WORLD_RANK": "1"}, 1),
        ({"RANK": "2", "WORLD_SIZE": "4"}, 2),
        ({"SLURM_PROCID": "5"}, 0),  # a batch script, not an srun step
        ({"SLURM_PROCID": "5", "SLURM_STEP_ID": "0"}, 5),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "PMI_RANK": "1"}, 1),  # mpiexec in srun
        ({"PMI_RANK": "x"}, 0),
    ],
)
def test_launcher_rank_from_the_environment(env, rank):
    assert launcher_rank(env) == rank


def _signal_until_exit(proc: subprocess.Popen[str], sig: signal.Signals) -> int:
    """Send ``sig`` to ``proc`` again and again until it ends; how many were sent."""
    sent = 0
    while proc.poll() is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(0.0005)
    return sent


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {path.name} within {timeout_s:g} s"
        time.sleep(0.001)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2], ids=["TERM", "USR2"])
def test_signals_after_done_leave_exit_0(tmp_path, sig):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        train_cmd(run, *MLP, "--steps", "3"),
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(run / "done", proc)
    sent = _signal_until_exit(proc, sig)
    _out, err = proc.communicate()
    assert sent > 0
    assert proc.returncode == 0, f"exit {proc.returncode} after {sent} signals\n{err[-2000:]}"


def test_signals_after_the_preempted_marker_leave_exit_75(tmp_path):
    run = tmp_path / "run"
    proc = start_until_checkpoint(run, *MLP, "--epochs", "200", "--checkpoint-every", "5")
    proc.send_signal(signal.SIGUSR2)
    _wait_for(run / "preempted", proc)
    sent = _signal_until_exit(proc, signal.SIGTERM)
    _out, err = proc.communicate()
    assert proc.returncode == REQUEUE_EXIT_CODE, f"exit {proc.returncode} after {sent}\n{err}"


def test_settle_keeps_the_signals_ignored_past_uninstall():
    previous = signal.getsignal(signal.SIGUSR2)
    handler = PreemptionHandler(signals=("USR2",))
    try:
        with handler:
            handler.settle()
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR2)  # ignored: this process lives on
        assert not handler.requested
    finally:
        signal.signal(signal.SIGUSR2, previous)
