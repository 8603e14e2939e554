"""keep_freed_host_memory: freed blocks are reused without page faults, and a user's own
allocator settings are left alone. Each case runs in a fresh interpreter: mallopt settings are
process-wide and cannot be undone."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from typing import Any

import pytest

from kfac_hpc.runtime.host_memory import huge_pages_enabled, keep_freed_host_memory

# Tensors of 16, 15 and 14 MiB (every page written), each freed before the next: the page
# faults of each, after the state keep_freed_host_memory() reported ("default" without it).
PROBE = """
import json, resource, sys
import torch
from kfac_hpc.runtime.host_memory import huge_pages_enabled, keep_freed_host_memory
state = keep_freed_host_memory() if sys.argv[1] == "keep" else "default"
faults = []
for mib in (16, 15, 14):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(mib << 18)
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"state": state, "faults": faults}))
"""
PAGES_15_MIB = (15 << 20) // 4096


def probe(mode: str, **env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("GLIBC_TUNABLES", None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


glibc = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the setting is glibc's (Linux)"
)


@glibc
def test_freed_blocks_are_reused_without_page_faults() -> None:
    """By default glibc gives the freed 16 MiB block (its own mapping) back to the kernel, so
    the 15 MiB one is faulted in anew; kept, it is carved out of the freed block."""
    default, kept = probe("default"), probe("keep")
    assert default["state"] == "default" and kept["state"] == "kept"
    assert default["faults"][1] >= 0.9 * PAGES_15_MIB, default
    assert all(f < PAGES_15_MIB // 8 for f in kept["faults"][1:]), kept


@glibc
def test_tunables_of_other_parts_of_glibc_do_not_count_as_allocator_settings() -> None:
    assert probe("keep", GLIBC_TUNABLES="glibc.rtld.nns=4")["state"] == "kept"


@pytest.mark.parametrize(
    "env",
    [
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"GLIBC_TUNABLES": "glibc.cpu.x86_avx=1:glibc.malloc.mmap_threshold=131072"},
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
        {"LD_PRELOAD": "libtcmalloc_minimal.so.4"},
    ],
    ids=["trim-env", "mmap-env", "tunables", "jemalloc", "tcmalloc"],
)
def test_a_users_allocator_settings_are_left_alone(env: dict[str, str]) -> None:
    """Returned before any mallopt call, so this process is not changed."""
    assert keep_freed_host_memory(env) == "environment"


@pytest.mark.parametrize(
    ("env", "enabled"),
    [({}, False), ({"THP_MEM_ALLOC_ENABLE": "1"}, True), ({"THP_MEM_ALLOC_ENABLE": "0"}, False)],
)
def test_huge_pages_are_what_torchs_variable_says(env: dict[str, str], enabled: bool) -> None:
    assert huge_pages_enabled(env) is enabled
