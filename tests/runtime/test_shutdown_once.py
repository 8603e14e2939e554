"""A process that starts many single-rank runs (a notebook, a test session) registers the
process-group shutdown at exit once, not once per run (each costs two full collections)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.launch import clean_env

SCRIPT = """
import types
from kfac_hpc.runtime import init_distributed, process_group, shutdown
for _ in range(4):
    init_distributed(backend="gloo", timeout_s=60)
    shutdown()
process_group.gc = types.SimpleNamespace(collect=lambda: print("exit-collect", flush=True))
"""


def test_shutdown_runs_at_exit_once_after_many_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split().count("exit-collect") == 2, out.stdout  # one shutdown: 2 collects
