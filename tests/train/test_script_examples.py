"""The scripts of examples/ as a sweep point runs them (``kfac-hpc script SCRIPT ARGS --run-dir
DIR`` under the launcher): a USR2 in the middle checkpoints every rank and exits 75, and the
next attempt ends with the parameters, bit for bit, of a run that was never interrupted (the CNN
with K-FAC on 2 ranks, the tiny GPT with K-FAC on 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kfac_hpc.checkpoint import read_checkpoint
from kfac_hpc.contracts.records import validate_run_dir
from kfac_hpc.train.faults import ENV as FAULT_ENV
from tests.helpers.launch import VENV_BIN, run_bounded, script_env
from tests.helpers.waiting import bound_s
from tests.train.conftest import explain, rank_pids

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HOLD_AT = 5  # rank 0 holds before this step until the USR2 arrives: certainly mid-run


def _command(world: int, script: str, run_dir: Path, args: list[str]) -> list[str]:
    point = [sys.executable, "-m", "kfac_hpc", "script", str(EXAMPLES / script), *args]
    point += ["--run-dir", str(run_dir)]
    return [str(VENV_BIN / "mpiexec"), "-n", str(world), *point] if world > 1 else point


def _model(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    tree = read_checkpoint(run_dir / "checkpoints" / f"ckpt-{step:08d}.h5").tree
    return {f"{m}.{k}": v for m, entries in tree["model"].items() for k, v in entries.items()}


def _preempt(world: int, script: str, run_dir: Path, args: list[str]) -> None:
    """Start the point, USR2 every rank once rank 0 holds before step HOLD_AT; exit 75."""
    hold = {FAULT_ENV: f"rank=0,step={HOLD_AT},hold=preempt,hold_s=300"}
    with subprocess.Popen(
        _command(world, script, run_dir, args),
        env=script_env(hold),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        deadline = time.monotonic() + bound_s(300)
        metrics = run_dir / "metrics.jsonl"
        # log_every=5: the window at step 5 is written just before the hold
        while not (metrics.exists() and f'"step":{HOLD_AT},' in metrics.read_text()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the point never reached the hold"
            time.sleep(0.1)
        pids = rank_pids(run_dir)
        assert len(pids) == world, pids
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        out, err = proc.communicate(timeout=bound_s(300))
    assert proc.returncode == 75, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"


@pytest.mark.parametrize(
    ("world", "script", "args"),
    [
        (2, "cnn_digits.py", ["--steps", "14", "--checkpoint-every", "10"]),
        (1, "tiny_gpt.py", ["--steps", "14", "--checkpoint-every", "10", "--eval-every", "7"]),
    ],
)
def test_usr2_exits_75_and_the_resumed_example_ends_as_the_uninterrupted_one(
    tmp_path, world, script, args
):
    straight, run = tmp_path / "straight", tmp_path / "run"
    whole = run_bounded(_command(world, script, straight, args), env=script_env(), timeout=300)
    assert whole.returncode == 0, explain(whole)

    _preempt(world, script, run, args)
    first = json.loads((run / "run.json").read_text())
    assert first["state"] == "preempted" and (run / "preempted").exists()
    assert first["world_size"] == world and HOLD_AT < first["steps"] < 14
    assert not (run / "done").exists()

    again = run_bounded(_command(world, script, run, args), env=script_env(), timeout=300)
    assert again.returncode == 0, explain(again)
    summary = json.loads((run / "run.json").read_text())
    assert summary["state"] == "done" and summary["restarts"] == 1 and summary["steps"] == 14
    assert summary["attempts"][1]["start_step"] == first["steps"]
    assert validate_run_dir(run) == []
    a, b = _model(straight, 14), _model(run, 14)
    assert a.keys() == b.keys()
    for key, tensor in a.items():
        assert torch.equal(tensor, b[key]), f"{script}: {key} differs from the uninterrupted run"
