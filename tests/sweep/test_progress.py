"""The progress line of `sweep --wait` and `sweep status --watch` (issues 14, 15): in place on
a terminal, one line per change elsewhere; and a workflow step's failure reaches the user as
one line with the documented exit code, never as Parsl's DependencyError."""

from __future__ import annotations

import io
import shutil

import pytest
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.sweep.backends import backend_for
from kfac_hpc.sweep.prepare import new_manifest, prepare_sweep
from kfac_hpc.sweep.progress_line import ProgressLine, count_states, progress_text
from kfac_hpc.sweep.spec import load_spec
from tests.helpers.sweeps import cli


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_counts_group_every_state():
    states = ["done", "running", "pending", "submitted", "requeued", "failed", "timeout"]
    states += ["cancelled", "preempted", "done"]
    assert count_states(states) == (2, 1, 3, 4)
    assert progress_text((2, 1, 3, 4), 3725.9) == (
        "sweep: 2/10 done, 1 running, 3 pending, 4 failed, 1:02:05 elapsed"
    )


def test_not_a_terminal_one_line_per_change():
    stream, clock = io.StringIO(), Clock()
    line = ProgressLine(stream, tty=False, clock=clock)
    for counts, now in [((0, 0, 2, 0), 101), ((0, 0, 2, 0), 102), ((0, 1, 1, 0), 105)]:
        clock.now = now
        line.update(counts)
    clock.now = 170
    line.update((1, 0, 0, 1))
    line.close()
    assert stream.getvalue().splitlines() == [
        "sweep: 0/2 done, 0 running, 2 pending, 0 failed, 0:00:01 elapsed",
        "sweep: 0/2 done, 1 running, 1 pending, 0 failed, 0:00:05 elapsed",
        "sweep: 1/2 done, 0 running, 0 pending, 1 failed, 0:01:10 elapsed",
    ]


def test_terminal_rewrites_the_line_in_place():
    stream, clock = io.StringIO(), Clock()
    line = ProgressLine(stream, tty=True, clock=clock)
    clock.now = 101
    line.update((0, 1, 1, 0))
    clock.now = 102
    line.update((0, 1, 1, 0))  # same counts: the elapsed time still moves
    clock.now = 103
    line.update((2, 0, 0, 0))
    line.close()
    text = stream.getvalue()
    assert "\n" not in text[:-1] and text.endswith("\n")
    frames = text[:-1].split("\r")[1:]
    assert [f.rstrip() for f in frames] == [
        "sweep: 0/2 done, 1 running, 1 pending, 0 failed, 0:00:01 elapsed",
        "sweep: 0/2 done, 1 running, 1 pending, 0 failed, 0:00:02 elapsed",
        "sweep: 2/2 done, 0 running, 0 pending, 0 failed, 0:00:03 elapsed",
    ]
    assert len({len(f) for f in frames}) == 1  # a shorter line blanks the longer one's tail


def test_status_watch_prints_the_line_then_the_table(tmp_path):
    spec = load_spec(None, {"nodes": "1", "seed": "1,2,3,4", "model": "mlp"})
    prepared = prepare_sweep(spec, tmp_path / "sw", backend_for("local"), load=False)
    manifest = new_manifest(prepared)
    manifest.write(prepared.sweep_dir)
    for i, point in enumerate(manifest.points):
        run_dir = prepared.sweep_dir / point.run_dir
        run_dir.mkdir(parents=True)
        (run_dir / ("error" if i == 3 else "done")).write_text("")
    argv = ["status", str(prepared.sweep_dir), "--watch", "--interval", "0.1"]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stderr.splitlines() == [
        "sweep: 3/4 done, 0 running, 0 pending, 1 failed, 0:00:00 elapsed"
    ]
    assert result.stdout.splitlines()[-1] == "3 done, 1 failed"


@pytest.mark.slurm
def test_wait_with_slurm_unusable_is_one_line_exit_2(tmp_path):
    assert shutil.which("sbatch"), "Slurm's commands are installed by make sysdeps"
    conf = tmp_path / "slurm.conf"
    conf.write_text("this is not a slurm.conf\n")
    args = ["sweep", "--nodes", "1", "--steps", "5", "--model", "mlp"]
    out = cli(*args, "--sweep-dir", str(tmp_path / "sw"), "--wait", env={"SLURM_CONF": str(conf)})
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("kfac-hpc")]
    assert len(errors) == 1 and errors[0].startswith("kfac-hpc sweep: error: sbatch: "), out.stderr
    assert "Traceback" not in out.stderr and "DependencyError" not in out.stderr
