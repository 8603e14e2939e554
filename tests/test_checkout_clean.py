"""The suite leaves nothing in the checkout: conftest compares `git status` before and after
the session (and fails the run on a difference); here that comparison is tested itself."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.helpers.checkout import checkout_status, left_behind


def _repo(tmp_path: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "kept.txt").write_text("tracked\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "kept.txt"], check=True)
    return tmp_path


def test_a_file_written_into_the_checkout_is_reported(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    before = checkout_status(repo)
    (repo / "runs" / "abc").mkdir(parents=True)
    (repo / "runs" / "abc" / "error").write_text("x")
    (repo / "kept.txt").write_text("changed\n")
    assert left_behind(before, checkout_status(repo)) == ["?? runs/abc/error", "AM kept.txt"]


def test_ignored_files_and_an_unchanged_checkout_are_not_reported(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / ".gitignore").write_text("*.log\n")
    before = checkout_status(repo)
    (repo / "run.log").write_text("ignored")
    assert left_behind(before, checkout_status(repo)) == []


def test_no_git_work_tree_means_no_check(tmp_path: Path) -> None:
    assert checkout_status(tmp_path) is None
    assert left_behind(None, {"?? x"}) == []
