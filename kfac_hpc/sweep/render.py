"""Render one sbatch script per Slurm array from the shipped Jinja2 template.

The template is rendered with ``StrictUndefined`` (a missing variable is an error, never an
empty string). Values that reach the script are either validated names or numbers, or pass
through the ``q`` filter (:func:`shlex.quote`); see :mod:`kfac_hpc.sweep.safety`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2

from kfac_hpc import __version__
from kfac_hpc.contracts.exit_codes import ExitCode
from kfac_hpc.contracts.rundir import Marker
from kfac_hpc.contracts.textfile import read_user_text
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.profile import SiteProfile, job_command
from kfac_hpc.sweep.safety import quote
from kfac_hpc.sweep.spec import Point, SweepSpec
from kfac_hpc.sweep.train_args import train_argv

__all__ = ["ArrayScript", "load_template", "render_array"]

# Slurm constraint expressions: features joined by & | , with [ ] ( ) * and counts.
_CONSTRAINT = re.compile(r"[A-Za-z0-9_.&|,\[\]()*:-]+")


@dataclass(frozen=True)
class ArrayScript:
    """One Slurm array: its name (``n4-0``), node count, points (index = position) and text."""

    name: str
    nodes: int
    points: tuple[Point, ...]
    text: str

    @property
    def relpath(self) -> str:
        return f"scripts/{self.name}.sbatch"


def load_template(path: Path | None = None) -> jinja2.Template:
    """The shipped template, or a user's (``--template``), with StrictUndefined."""
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = quote
    if path is None:
        source = resources.files("kfac_hpc.templates").joinpath("sbatch.sh.j2").read_text()
    else:
        source = read_user_text(path, "template", error=SweepInputError)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise SweepInputError("template", f"line {exc.lineno}: {exc.message}") from None


def render_array(
    template: jinja2.Template,
    spec: SweepSpec,
    profile: SiteProfile,
    name: str,
    points: tuple[Point, ...],
) -> ArrayScript:
    """The script of one array (all ``points`` share a node count); index i runs points[i]."""
    nodes = points[0].nodes
    constraint = profile.constraint
    if constraint is not None and not _CONSTRAINT.fullmatch(constraint):
        raise SweepInputError(
            "profile.constraint", f"{constraint!r} is not a Slurm constraint expression"
        )
    gpus = spec.gpus_per_node or (profile.gpus_per_node or 0)
    context = {
        "version": __version__,
        "sweep_name": spec.name,
        "array_name": name,
        "job_name": f"{spec.name}-{name}",
        "nodes": nodes,
        "ranks_per_node": spec.ranks_per_node,
        "cpus_per_task": spec.cpus_per_task,
        "gpus_per_node": gpus,
        "time": spec.time or profile.time,
        "partition": profile.partition,
        "account": profile.account,
        "qos": profile.qos,
        "constraint": constraint,
        "signal_seconds": spec.signal_seconds or profile.signal_seconds,
        "profile_name": profile.name,
        "setup": profile.setup,
        "env": profile.env,
        "launcher": profile.launcher,
        "srun_mpi": profile.srun_mpi,
        "train_command": job_command(profile, spec.script, spec.script_args),
        "preempted_exit_code": int(ExitCode.PREEMPTED),
        "markers": {m.name.lower(): str(m) for m in Marker},
        "cases": [
            {"index": i, "run_dir": f"runs/{p.point_id}", "argv": train_argv(p.params)}
            for i, p in enumerate(points)
        ],
    }
    try:
        text = template.render(**context)
    except jinja2.UndefinedError as exc:
        raise SweepInputError(
            "template", f"{exc.message}; variables available: {', '.join(sorted(context))}"
        ) from None
    except Exception as exc:  # a user's template expression that raises (1/0, a bad filter)
        text = " ".join(str(exc).split())[:200]
        raise SweepInputError(
            "template", f"rendering failed: {type(exc).__name__}: {text}"
        ) from None
    return ArrayScript(name=name, nodes=nodes, points=points, text=text)
