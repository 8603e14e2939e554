"""The one reader of a user's text file (``read_user_text``) and the commands that use it:
a file that is not UTF-8, too large (``/dev/zero``), a folder or absent is one line naming the
option and the file, exit 2, no traceback, nothing written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kfac_hpc.contracts import InputError, read_user_text
from kfac_hpc.sweep.errors import SweepInputError
from tests.conftest import VENV_BIN, clean_env

KFAC_HPC = str(VENV_BIN / "kfac-hpc")


def _files(tmp_path: Path) -> dict[str, Path]:
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("partition = 'caf\xe9'\n".encode("latin-1"))
    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(256)))
    utf16 = tmp_path / "utf16.toml"
    utf16.write_bytes("lr = 0.1\n".encode("utf-16"))
    big = tmp_path / "big.toml"
    big.write_bytes(b"# " + b"x" * (1 << 20) + b"\n")
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    return {
        "latin1": latin1,
        "binary": binary,
        "utf16": utf16,
        "big": big,
        "dev_zero": Path("/dev/zero"),
        "folder": folder,
        "missing": tmp_path / "missing.toml",
    }


KINDS = ["latin1", "binary", "utf16", "big", "dev_zero", "folder", "missing"]
REASON = {
    "latin1": "is not UTF-8 text",
    "binary": "is not UTF-8 text",
    "utf16": "is not UTF-8 text",
    "big": "is larger than 1 MiB",
    "dev_zero": "is larger than 1 MiB",
    "folder": "is a directory",
    "missing": "cannot read",
}


@pytest.mark.parametrize("kind", KINDS)
def test_read_user_text_refuses_with_the_option_and_the_file(tmp_path, kind):
    path = _files(tmp_path)[kind]
    with pytest.raises(SweepInputError) as caught:
        read_user_text(path, "profile", error=SweepInputError)
    assert caught.value.field == "profile"
    assert str(path) in caught.value.reason and REASON[kind] in caught.value.reason


def test_read_user_text_reads_utf8_and_drops_a_byte_order_mark(tmp_path):
    path = tmp_path / "a.toml"
    path.write_bytes("\ufeffname = 'café'\n".encode())
    assert read_user_text(path, "config") == "name = 'café'\n"
    with pytest.raises(InputError, match="larger than 4 bytes"):
        read_user_text(path, "config", max_bytes=4)


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KFAC_HPC, *args], env=clean_env(), cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _one_line_exit_2(proc: subprocess.CompletedProcess[str], option: str, path: Path) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert option in lines[0] and str(path) in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


COMMANDS = {
    "train --config": lambda run, path: ["train", "--run-dir", str(run), "--config", str(path)],
    "sweep --profile": lambda run, path: _sweep(run, "--profile", path),
    "sweep --template": lambda run, path: _sweep(run, "--template", path),
}


def _sweep(sweep_dir: Path, option: str, path: Path) -> list[str]:
    return [
        "sweep",
        "--backend",
        "local",
        "--dry-run",
        "--nodes",
        "1",
        "--sweep-dir",
        str(sweep_dir),
        option,
        str(path),
    ]


@pytest.mark.parametrize("kind", ["latin1", "binary", "dev_zero"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_commands_refuse_a_file_that_is_no_text_in_one_line(tmp_path, command, kind):
    path = _files(tmp_path)[kind]
    out = tmp_path / "out"
    work = tmp_path / "work"
    work.mkdir()
    proc = _run(*COMMANDS[command](out, path), cwd=work)
    option = command.split()[1].removeprefix("--")
    _one_line_exit_2(proc, option, path)
    assert REASON[kind] in proc.stderr
    assert not out.exists() and os.listdir(work) == []  # nothing written
