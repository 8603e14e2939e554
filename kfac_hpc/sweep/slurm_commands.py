"""Thin wrappers around the Slurm commands; the only module that runs them.

Every call has a timeout. Query helpers return what they could learn and never raise on a
scheduler that forgot a job (``squeue`` and ``scontrol`` only know recent jobs; ``sacct`` needs
accounting storage, which many test clusters lack).
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kfac_hpc.sweep.errors import SweepInputError

__all__ = [
    "SlurmError",
    "TaskState",
    "check_accepted",
    "check_partition_fits",
    "cluster_problem",
    "job_states",
    "max_array_size",
    "partition_limits",
    "requested_partition",
    "require_sbatch",
    "sacct_states",
    "sbatch",
    "sbatch_test_only",
    "scancel",
    "scontrol_states",
    "squeue_states",
]

_TIMEOUT_S = 60
DEFAULT_MAX_ARRAY_SIZE = 1001  # Slurm's default MaxArraySize


class SlurmError(RuntimeError):
    """A Slurm command failed (not a user-input problem): the message holds its stderr."""


@dataclass(frozen=True)
class TaskState:
    """What the scheduler says about one array task. ``state`` is Slurm's word (RUNNING...)."""

    array_job_id: str
    index: int
    job_id: str
    state: str
    reason: str = ""
    restarts: int = 0
    exit_code: str = ""  # Slurm's ``status:signal`` of the batch script, e.g. ``1:0``


def require_sbatch() -> None:
    """Bad input, not a crash, when Slurm is not installed or not on PATH."""
    if shutil.which("sbatch") is None:
        raise SweepInputError(
            "backend", "sbatch is not on PATH: load Slurm, or use --backend local"
        )


def _run(
    argv: Sequence[str], cwd: Path | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_TIMEOUT_S, cwd=cwd, input=stdin
        )
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]} is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{argv[0]} did not answer within {_TIMEOUT_S} s") from None


# Slurm commands retry a configuration file they cannot read for 60 s: this line says so at once.
_NO_CONFIG = re.compile(r"cannot stat file (\S+?):? ")
_SLURM_PREFIX = re.compile(r"^\S+: (error|fatal): ")


def cluster_problem() -> str | None:
    """None when the Slurm controller answers ``scontrol ping``, else why not (one line).

    SweepInputError when Slurm has no usable configuration: the file (``SLURM_CONF``, or
    Slurm's default) does not exist (Slurm's commands would retry it for a minute each; here
    that is known at once), or Slurm cannot process it."""
    conf = os.environ.get("SLURM_CONF")
    if conf is not None and not os.path.isfile(conf):
        raise SweepInputError(
            "SLURM_CONF",
            f"{conf} is not a file; export SLURM_CONF=<path of slurm.conf> or unset it",
        )
    try:
        proc = subprocess.Popen(
            ["scontrol", "ping"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    except FileNotFoundError:
        return "scontrol is not on PATH"
    timer = threading.Timer(_TIMEOUT_S, proc.kill)  # the same bound as every other command
    timer.start()
    try:
        assert proc.stderr is not None and proc.stdout is not None
        errors: list[str] = []
        for line in proc.stderr:
            missing = _NO_CONFIG.search(line)
            if missing:
                proc.kill()
                proc.wait()
                raise SweepInputError(
                    "SLURM_CONF",
                    f"Slurm's configuration {missing.group(1)} does not exist; export "
                    "SLURM_CONF=<path of slurm.conf>",
                )
            errors.append(line.strip())
        out = proc.stdout.read()
        code = proc.wait()
    finally:
        timer.cancel()
    if code == 0 and " is UP" in out:
        return None
    fatal = [line for line in errors if "fatal:" in line and "configuration" in line]
    if fatal:
        why = [_SLURM_PREFIX.sub("", line) for line in dict.fromkeys([errors[0], fatal[0]])]
        raise SweepInputError(
            "sbatch",
            f"Slurm cannot use its configuration (SLURM_CONF={conf or 'unset'}): "
            f"{'; '.join(why)}; fix it or export SLURM_CONF=<path of slurm.conf>",
        )
    lines = [line for line in [*out.splitlines(), *reversed(errors)] if line.strip("* ")]
    said = lines[0].strip() if lines else ""
    if code < 0:
        said = f"no answer within {_TIMEOUT_S} s"
    return f"the Slurm controller does not answer (scontrol ping: {said or f'exit {code}'})"


def max_array_size() -> int:
    """The cluster's MaxArraySize (array indices must stay below it)."""
    out = _run(["scontrol", "show", "config"])
    found = re.search(r"^MaxArraySize\s*=\s*(\d+)", out.stdout, re.MULTILINE)
    return int(found.group(1)) if out.returncode == 0 and found else DEFAULT_MAX_ARRAY_SIZE


@dataclass(frozen=True)
class Partition:
    """A partition's node limits: ``total_nodes`` it has, ``max_nodes`` one job may use."""

    name: str
    total_nodes: int
    max_nodes: int | None
    default: bool

    @property
    def job_nodes(self) -> int:
        """The most nodes one job can ever get here."""
        return min(self.total_nodes, self.max_nodes or self.total_nodes)


def partition_limits() -> list[Partition]:
    """Every partition the controller knows (empty when it does not answer)."""
    out = _run(["scontrol", "-o", "show", "partition"])
    if out.returncode != 0:
        return []
    found: list[Partition] = []
    for line in out.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "PartitionName" not in fields or not fields.get("TotalNodes", "").isdigit():
            continue
        max_nodes = fields.get("MaxNodes", "")
        found.append(
            Partition(
                fields["PartitionName"],
                int(fields["TotalNodes"]),
                int(max_nodes) if max_nodes.isdigit() else None,
                fields.get("Default") == "YES",
            )
        )
    return found


def requested_partition(sbatch_args: Sequence[str]) -> str | None:
    """The partition named by ``-p X``, ``-pX``, ``--partition X`` or ``--partition=X``."""
    for i, arg in enumerate(sbatch_args):
        if arg in ("-p", "--partition") and i + 1 < len(sbatch_args):
            return sbatch_args[i + 1]
        for prefix in ("--partition=", "-p"):
            if arg.startswith(prefix) and len(arg) > len(prefix):
                return arg[len(prefix) :]
    return None


def check_partition_fits(
    nodes: int, partition: str | None, sbatch_args: Sequence[str]
) -> int | None:
    """Refuse a node count that the partition can never hold (it would pend forever).
    Returns the most nodes one job gets in the partition asked for (None: not known)."""
    partitions = partition_limits()
    wanted = requested_partition(sbatch_args) or partition
    chosen = [p for p in partitions if p.name == wanted or (wanted is None and p.default)]
    for part in chosen:
        if nodes > part.job_nodes:
            biggest = max(partitions, key=lambda p: p.job_nodes)
            raise SweepInputError(
                "nodes",
                f"{nodes} node(s) do not fit partition {part.name}, which holds at most "
                f"{part.job_nodes} node(s) per job (largest partition: {biggest.name}, "
                f"{biggest.job_nodes}); lower --nodes or choose a partition with --sbatch-arg=-p",
            )
    return chosen[0].job_nodes if chosen else None


def sbatch(argv: Sequence[str], cwd: Path) -> str:
    """Submit (``argv`` = the full ``sbatch ...`` command line) and return the job id."""
    out = _run(argv, cwd=cwd)
    if out.returncode != 0:
        raise SlurmError(f"{' '.join(argv[:1])} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def sbatch_test_only(
    argv: Sequence[str], cwd: Path | None = None, script: str | None = None
) -> str | None:
    """Ask the scheduler whether a submission would be accepted; None when yes, else why not.
    ``script``: the batch script's text, given on stdin (``argv`` then names no file), so
    nothing needs to be written to ask."""
    out = _run([argv[0], "--test-only", *argv[1:]], cwd=cwd, stdin=script)
    if out.returncode == 0:
        return None
    return (out.stderr.strip() or out.stdout.strip()).replace("\n", " ")


def check_accepted(argv: Sequence[str], script: str, what: str) -> None:
    """SweepInputError with Slurm's reason unless ``sbatch --test-only`` accepts ``script``
    (given on stdin) with ``argv`` (``sbatch OPTIONS``, no script path): an allocation Slurm
    can never grant (more ranks or CPUs than the nodes have, GPUs it lacks, a partition it
    does not know, a time limit above the partition's) is refused before anything is written."""
    problem = sbatch_test_only(argv, script=script)
    if problem is not None:
        raise SweepInputError("sbatch", f"Slurm rejects {what}: {problem}")


_SQUEUE_FMT = "%F|%K|%i|%T|%r"


def squeue_states(array_job_ids: Iterable[str]) -> dict[tuple[str, int], TaskState]:
    """Queued or running tasks of the given arrays, one entry per task (pending ranges expanded)."""
    wanted = set(array_job_ids)
    if not wanted:
        return {}
    out = _run(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", _SQUEUE_FMT])
    if out.returncode != 0:
        raise SlurmError(f"squeue failed: {out.stderr.strip()}")
    states: dict[tuple[str, int], TaskState] = {}
    for line in out.stdout.splitlines():
        parts = line.split("|")
        if len(parts) != 5 or parts[0] not in wanted or not parts[1].isdigit():
            continue
        array_id, index, job_id, state, reason = parts
        states[(array_id, int(index))] = TaskState(array_id, int(index), job_id, state, reason)
    return states


def scontrol_states(array_job_id: str) -> dict[int, TaskState]:
    """Tasks the controller still remembers (ended less than MinJobAge seconds ago included)."""
    out = _run(["scontrol", "-o", "show", "job", array_job_id])
    states: dict[int, TaskState] = {}
    if out.returncode != 0:
        return states
    for line in out.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        index = fields.get("ArrayTaskId", "")
        if fields.get("ArrayJobId") != array_job_id or not index.isdigit():
            continue
        states[int(index)] = TaskState(
            array_job_id,
            int(index),
            fields.get("JobId", ""),
            fields.get("JobState", "UNKNOWN"),
            fields.get("Reason", ""),
            int(fields.get("Restarts", "0") or 0),
            fields.get("ExitCode", ""),
        )
    return states


def sacct_states(array_job_ids: Iterable[str]) -> dict[tuple[str, int], TaskState] | None:
    """Final states from accounting, or None when accounting storage is not available."""
    ids = sorted(set(array_job_ids))
    if not ids or shutil.which("sacct") is None:
        return None
    fields = "JobID,State,JobIDRaw,ExitCode"
    out = _run(["sacct", "-n", "-P", "-X", "-j", ",".join(ids), "-o", fields])
    if out.returncode != 0:
        return None
    states: dict[tuple[str, int], TaskState] = {}
    for line in out.stdout.splitlines():
        parts = line.split("|")
        if len(parts) != 4:
            continue
        array_id, _, index = parts[0].partition("_")
        if index.isdigit():
            state = parts[1].split()[0]  # "CANCELLED by 0" -> CANCELLED
            task = TaskState(array_id, int(index), parts[2], state, exit_code=parts[3])
            states[(array_id, int(index))] = task
    return states


def scancel(job_ids: Iterable[str]) -> None:
    """Cancel jobs or whole arrays (``123``) or tasks (``123_4``)."""
    ids = sorted(set(job_ids))
    if ids:
        out = _run(["scancel", *ids])
        if out.returncode != 0:
            raise SlurmError(f"scancel failed: {out.stderr.strip()}")


def job_states(job_ids: Iterable[str]) -> dict[str, str]:
    """Slurm's word (PENDING, RUNNING, COMPLETED...) for each plain job the controller still
    holds or remembers (MinJobAge); jobs it forgot are absent."""
    states: dict[str, str] = {}
    for job_id in sorted(set(job_ids)):
        out = _run(["scontrol", "-o", "show", "job", job_id])
        found = re.search(r"\bJobState=(\S+)", out.stdout) if out.returncode == 0 else None
        if found:
            states[job_id] = found.group(1)
    return states
