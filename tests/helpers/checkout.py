"""What a test run left in the checkout: entries of ``git status`` that were not there before."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def checkout_status(repo: Path) -> set[str] | None:
    """``git status --porcelain`` lines (untracked files one by one, ignored files left out),
    or None where ``repo`` is no git work tree or git is missing."""
    if shutil.which("git") is None or not (repo / ".git").exists():
        return None
    out = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=all"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


def left_behind(before: set[str] | None, after: set[str] | None) -> list[str]:
    """Entries that a run added to the checkout's status, sorted."""
    if before is None or after is None:
        return []
    return sorted(after - before)
