"""The job keeps freed host memory unless told not to, and says so in run.json."""

from __future__ import annotations

import platform

import pytest

from .conftest import explain, read_json, run_plain


@pytest.mark.parametrize(
    ("args", "env", "state"),
    [
        ((), {}, "kept"),
        (("--no-keep-freed-memory",), {}, "default"),
        ((), {"MALLOC_TRIM_THRESHOLD_": "131072"}, "environment"),
    ],
    ids=["default-flag", "off", "user-malloc-env"],
)
def test_run_json_reports_the_host_memory_state(tmp_path, args, env, state):
    if state == "kept" and platform.libc_ver()[0] != "glibc":
        state = "unsupported"
    run_dir = tmp_path / "run"
    proc = run_plain(run_dir, "--steps", "3", "--no-kfac", *args, env=env)
    assert proc.returncode == 0, explain(proc)
    assert read_json(run_dir / "run.json")["host_memory"] == state
