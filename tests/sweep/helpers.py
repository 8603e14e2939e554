"""Shared helpers of the sweep tests: build specs and run the CLI as a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from kfac_hpc.sweep.spec import SweepSpec, load_spec
from tests.conftest import clean_env

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"


def spec(**fields: Any) -> SweepSpec:
    fields.setdefault("nodes", "1,2")
    return load_spec(None, fields)


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: Path | None = None
):
    """``kfac-hpc ARGS`` in a fresh process (the installed entry point's module)."""
    return subprocess.run(
        [sys.executable, "-m", "kfac_hpc", *args],
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
