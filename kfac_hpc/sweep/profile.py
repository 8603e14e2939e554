"""Site profiles: what differs between clusters (partition, account, launcher, setup, env).

A profile is a TOML file. ``--profile NAME`` loads a profile shipped with the package
(``slurm/site_profiles/NAME.toml``, installed as ``kfac_hpc.site_profiles``;
``slurm/profiles/`` holds example site profiles to copy); ``--profile PATH.toml``
loads a user's file. Unknown keys are errors, so a typo never silently drops a setting.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kfac_hpc.contracts.textfile import read_user_text
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.safety import check_identifier, check_line, check_slurm_time

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "LAUNCHERS",
    "SiteProfile",
    "builtin_profiles",
    "job_command",
    "load_profile",
    "train_command",
]

LAUNCHERS = ("srun", "mpiexec", "mpirun")
_SHIPPED = "kfac_hpc.site_profiles"


@dataclass(frozen=True)
class SiteProfile:
    """How jobs start on one cluster.

    ``setup`` lines run verbatim before the launch (``module load ...``): they are shell by
    design, like a ``.bashrc``, and must each be one line. ``env`` values are quoted.
    ``train_command`` is the job's argv prefix (e.g. ``["kfac-hpc", "train"]`` or a container
    wrapper); empty means the Python that runs ``kfac-hpc sweep`` (``python -u -m kfac_hpc
    train``), i.e. the same installation on a shared file system. ``signal_seconds``: how long
    before the time limit Slurm sends USR2.
    """

    name: str
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time: str = "00:30:00"
    gpus_per_node: int | None = None
    launcher: str = "srun"
    srun_mpi: str = "pmi2"
    setup: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    train_command: tuple[str, ...] = ()
    signal_seconds: int = 120
    sbatch_args: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELDS = set(SiteProfile.__dataclass_fields__) - {"name"}


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    root = resources.files(_SHIPPED)
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str) -> SiteProfile:
    """A shipped profile by name, or a TOML file by path (anything ending in ``.toml``)."""
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        path = Path(name_or_path)
        text = read_user_text(path, "profile", error=SweepInputError)
        name = path.stem
    else:
        if name_or_path not in builtin_profiles():
            raise SweepInputError(
                "profile",
                f"unknown profile {name_or_path!r}; shipped: {', '.join(builtin_profiles())}"
                " (or give a .toml path)",
            )
        text = resources.files(_SHIPPED).joinpath(f"{name_or_path}.toml").read_text()
        name = name_or_path
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SweepInputError("profile", f"{name_or_path} is not valid TOML: {exc}") from None
    return parse_profile(check_identifier("profile", name), data)


def parse_profile(name: str, data: dict[str, Any]) -> SiteProfile:
    """Validate a profile's table; every string is checked (names strictly, values single-line)."""
    unknown = set(data) - _FIELDS
    if unknown:
        raise SweepInputError(
            f"profile.{sorted(unknown)[0]}",
            f"unknown profile key; valid: {', '.join(sorted(_FIELDS))}",
        )
    out: dict[str, Any] = {"name": name}
    for key in ("partition", "account", "qos"):
        if data.get(key):
            out[key] = check_identifier(f"profile.{key}", data[key])
    if data.get("constraint"):
        # Slurm constraint expressions use & | [ ] * ( ): quoted when rendered, so only one line.
        out["constraint"] = check_line("profile.constraint", data["constraint"])
    if "time" in data:
        out["time"] = check_slurm_time("profile.time", data["time"])
    if "gpus_per_node" in data:
        out["gpus_per_node"] = _int("profile.gpus_per_node", data["gpus_per_node"], 0)
    if "launcher" in data:
        if data["launcher"] not in LAUNCHERS:
            raise SweepInputError(
                "profile.launcher", f"{data['launcher']!r} is not one of {', '.join(LAUNCHERS)}"
            )
        out["launcher"] = data["launcher"]
    if "srun_mpi" in data:
        out["srun_mpi"] = check_identifier("profile.srun_mpi", data["srun_mpi"])
    for key in ("setup", "train_command", "sbatch_args"):
        if key in data:
            out[key] = _lines(f"profile.{key}", data[key])
    if "env" in data:
        if not isinstance(data["env"], dict):
            raise SweepInputError("profile.env", 'must be a table of NAME = "value"')
        out["env"] = {
            check_identifier("profile.env", k, env_name=True): check_line(
                f"profile.env.{k}", str(v)
            )
            for k, v in data["env"].items()
        }
    if "signal_seconds" in data:
        out["signal_seconds"] = _int("profile.signal_seconds", data["signal_seconds"], 1)
    return SiteProfile(**out)


def train_command(profile: SiteProfile) -> tuple[str, ...]:
    """The job's argv prefix: the profile's, or this Python's ``-m kfac_hpc train``."""
    return profile.train_command or (sys.executable, "-u", "-m", "kfac_hpc", "train")


def job_command(
    profile: SiteProfile, script: str | None, script_args: Sequence[str]
) -> tuple[str, ...]:
    """The argv prefix of every point (``--run-dir DIR`` and its flags follow): the train
    command, or with a ``script`` this Python's ``-m kfac_hpc script SCRIPT ARGS...``.
    SweepInputError when the profile's own ``train_command`` would be bypassed."""
    if script is None:
        return train_command(profile)
    if profile.train_command:
        raise SweepInputError(
            "--script",
            f"profile {profile.name} sets train_command, which --script would bypass; use a "
            "profile without it (the script runs under the Python of kfac-hpc sweep)",
        )
    return (sys.executable, "-u", "-m", "kfac_hpc", "script", script, *script_args)


def _int(fld: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SweepInputError(fld, f"{value!r} must be an integer >= {minimum}")
    return value


def _lines(fld: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list):
        raise SweepInputError(fld, "must be a list of strings")
    return tuple(check_line(fld, str(v)) for v in value)
