"""``kfac-hpc sweep --script``: the user's own script is checked before anything is written
(one line naming --script, exit 2), and the two scripts of examples/ run through the local
backend at 1 and 2 ranks to a report whose every point carries the labels the script gave."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.contracts.records import validate_run_dir
from kfac_hpc.sweep.manifest import read_manifest
from tests.helpers.sweeps import assert_scaling_report, cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _sweep(tmp_path: Path, *args: str) -> tuple[int, str]:
    argv = ["sweep", "--backend", "local", "--nodes", "1", "--sweep-dir", str(tmp_path / "s")]
    result = CliRunner().invoke(main, [*argv, *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("make", "args", "says"),
    [
        (None, ["--script", "missing.py"], "--script: cannot read missing.py"),
        ("notes.txt", [], "--script: {path} is not a Python file"),
        ("broken.py", [], "--script: {path} line 1: "),
        ("folder.py/", [], "--script: {path} is a directory"),
        ("ok.py", ["--lr", "0.1"], "--lr: a kfac-hpc train setting, but --script runs your own"),
        ("ok.py", ["--kfac", "true,false"], "--kfac: a kfac-hpc train setting"),
        ("ok.py", ["--train-arg=--seed=1"], "--train-arg: a kfac-hpc train setting"),
        (None, ["--", "--epochs", "2"], "--script: missing: the arguments after -- go to"),
    ],
)
def test_a_bad_script_is_one_line_naming_the_flag_and_nothing_is_written(
    tmp_path, make, args, says
):
    path = tmp_path / (make or "none").rstrip("/")
    if make is not None and make.endswith("/"):
        path.mkdir()
    elif make is not None:
        path.write_text("x = (\n" if make == "broken.py" else "print('hi')\n")
    script = ["--script", str(path)] if make is not None else []
    code, output = _sweep(tmp_path, *script, *args)
    assert code == 2, output
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kfac-hpc sweep: error: "), output
    assert says.format(path=path) in lines[0], lines[0]
    assert not (tmp_path / "s").exists()


def test_the_script_and_its_arguments_are_each_points_command(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    code, output = _sweep(
        tmp_path, "--nodes", "1,2", "--script", str(script), "--dry-run", "--", "--lr", "0.1"
    )
    assert code == 0, output
    text = (tmp_path / "s" / "scripts" / "n2-0.sbatch").read_text()
    assert f"-m kfac_hpc script {script} --lr 0.1 --run-dir " in text, text


def test_kfac_hpc_script_runs_the_script_as_main_with_its_arguments_and_run_dir(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, sys\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps([sys.argv[1:], os.environ['KFAC_HPC_RUN_DIR']]))\n"
    )
    out = cli(
        "script", str(script), "--lr", "0.1", "--run-dir", "--run-dir", "runs/p", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [["--lr", "0.1", "--run-dir"], str(tmp_path / "runs" / "p")]
    bad = CliRunner().invoke(main, ["script", str(tmp_path / "nope.txt")])
    assert bad.exit_code == 2
    nope = tmp_path / "nope.txt"
    assert bad.output.strip() == (
        f"kfac-hpc script: error: SCRIPT: {nope} is not a Python file; give a script named *.py"
    )


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize(
    ("example", "script_args", "labels", "scaling"),
    [
        (
            "cnn_digits.py",
            ["--steps", "10"],
            ("digits_cnn", "digits", "sgd", "kfac"),
            "strong bs=64",
        ),
        (
            "tiny_gpt.py",
            ["--steps", "10", "--eval-every", "5", "--optimizer", "adam"],
            ("tiny_gpt_2x32", "generated_bytes", "adam", "kfac"),
            "weak bs=16",
        ),
    ],
)
def test_an_example_sweeps_on_the_local_backend_to_a_report_with_its_labels(
    tmp_path, example, script_args, labels, scaling
):
    sweep_dir = tmp_path / "sweep"
    out = cli(
        *("sweep", "--backend", "local", "--nodes", "1,2", "--name", "ex"),
        *("--script", str(EXAMPLES / example), "--sweep-dir", str(sweep_dir)),
        *("--", *script_args),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert_scaling_report(out, sweep_dir, {1, 2}, points=2)
    manifest = read_manifest(sweep_dir)
    assert {p.state for p in manifest.points} == {"done"} and len(manifest.points) == 2
    for point in manifest.points:
        run_dir = sweep_dir / point.run_dir
        assert validate_run_dir(run_dir) == []
        summary = json.loads((run_dir / "run.json").read_text())
        assert summary["world_size"] == point.params["nodes"]
        assert (summary["model"], summary["dataset"], summary["optimizer"], summary["method"]) == (
            labels
        )
        assert summary["steps"] == 10 and summary["final_accuracy"] is not None
    with open(sweep_dir / "report" / "tables" / "scaling.csv", newline="") as fh:
        groups = {row["group"] for row in csv.DictReader(fh)}
    model, dataset, optimizer, method = labels
    assert len(groups) == 1
    assert groups.pop().startswith(f"{model} {dataset} {optimizer}+{method} {scaling}")


@pytest.mark.slurm
@pytest.mark.slow
def test_the_cnn_example_sweeps_on_the_slurm_cluster_to_a_labelled_report(slurm_cluster, tmp_path):
    sweep_dir = tmp_path / "sweep"
    out = cli(
        *("sweep", "--nodes", "1,2", "--name", "t-script", "--time", "00:05:00", "--wait"),
        *("--script", str(EXAMPLES / "cnn_digits.py"), "--sweep-dir", str(sweep_dir)),
        *("--", "--steps", "10", "--checkpoint-every", "5"),
        env=slurm_cluster,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert_scaling_report(out, sweep_dir, {1, 2}, points=2)
    manifest = read_manifest(sweep_dir)
    assert manifest.backend == "slurm" and {p.state for p in manifest.points} == {"done"}
    for point in manifest.points:
        run_dir = sweep_dir / point.run_dir
        assert validate_run_dir(run_dir) == []
        summary = json.loads((run_dir / "run.json").read_text())
        assert summary["launcher"] == "slurm" and summary["nodes"] == point.params["nodes"]
        assert (summary["model"], summary["dataset"], summary["method"]) == (
            "digits_cnn",
            "digits",
            "kfac",
        )
