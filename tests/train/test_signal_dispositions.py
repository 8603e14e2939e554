"""A run started from Python leaves the process's preemption-signal handling as it found it;
only the train command, whose process exits next, ignores late signals."""

from __future__ import annotations

import signal
from pathlib import Path

import torch

from kfac_hpc.train.config import load_config
from kfac_hpc.train.run import run_training


def test_a_run_from_python_puts_the_signal_handlers_back(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = load_config(None, {"model": "mlp", "steps": 2, "progress": False})
        before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM)}
        assert run_training(config, tmp_path / "run") == 0
        assert (tmp_path / "run" / "done").exists()
        assert {sig: signal.getsignal(sig) for sig in before} == before
        assert run_training(config, tmp_path / "run") == 0  # already done: returns at once
        assert {sig: signal.getsignal(sig) for sig in before} == before
    finally:
        torch.set_num_threads(threads)
