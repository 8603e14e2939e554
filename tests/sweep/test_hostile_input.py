"""Hostile input to `kfac-hpc sweep` (issue 14): every count bounded before anything is
expanded, every train value checked as `kfac-hpc train` checks it, TOML values of the wrong
type, files where the sweep's folders go and templates that raise: one line naming the field,
exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.spec import MAX_POINTS, load_spec


def sweep(tmp_path: Path, *args: str, dry_run: bool = True):
    """`kfac-hpc sweep ARGS` in this process, into ``tmp_path/sw`` (local backend)."""
    extra = ["--dry-run"] if dry_run else []
    argv = ["sweep", *args, "--sweep-dir", str(tmp_path / "sw"), "--backend", "local", *extra]
    return CliRunner().invoke(main, argv)


def assert_bad_input(result, field: str, sweep_dir: Path) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"error: {field}" in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert not sweep_dir.exists() or not any(sweep_dir.rglob("*.sbatch"))


def test_a_huge_repeat_count_is_rejected_before_anything_is_expanded():
    with pytest.raises(SweepInputError, match=r"^repeats: 99999999999999999999 must be in"):
        load_spec(None, {"nodes": "1", "repeats": "99999999999999999999"})


def test_the_product_of_axes_is_bounded_before_expansion():
    seeds = ",".join(str(i) for i in range(101))
    sizes = ",".join(str(8 * i) for i in range(1, 101))
    with pytest.raises(SweepInputError, match=rf"^axes: .*10100 points, more than {MAX_POINTS}"):
        load_spec(None, {"nodes": "1", "seed": seeds, "batch_size": sizes})


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--nodes", "1", "--repeats", "99999999999999999999"], "repeats"),
        (["--nodes", "99999999999999999999"], "nodes"),
        (["--nodes", "1", "--ranks-per-node", "99999999999999999999"], "ranks_per_node"),
        (["--nodes", "1", "--lr", "-1"], "lr"),
        (["--nodes", "1", "--lr", "0"], "lr"),
        (["--nodes", "1", "--lr", "nan"], "lr"),
        (["--nodes", "1", "--target-accuracy", "5"], "target_accuracy"),
        # checked by the job only at its world size: 128 does not split over 3 ranks
        (["--nodes", "3", "--batch-size", "128"], "batch_size"),
        (["--nodes", "1", "--stop-at-target", "true"], "stop_at_target"),
        (["--nodes", "1", "--grad-worker-fraction", "0.3", "--ranks-per-node", "2"], "grad_"),
        (["--nodes", "1", "--dataset", "cifar10"], "data_path"),
        (["--nodes", "1", "--init-factors", ""], "init_factors"),
    ],
)
def test_train_values_are_checked_as_the_job_checks_them(tmp_path, args, field):
    assert_bad_input(sweep(tmp_path, *args), field, tmp_path / "sw")
    assert not (tmp_path / "sw").exists()


TOML_CASES = [
    ("nodes = [1]\n[train]\ntime_limit = [1]\n", "time_limit"),
    ("nodes = [1]\n[train]\ntime_limit = {a = 1}\n", "time_limit"),
    ("nodes = [1]\n[train]\ntime_limit = 2024-01-01\n", "time_limit"),
    ("nodes = [1]\n[train]\ntime_limit = true\n", "time_limit"),
    ("nodes = [1]\n[train]\ncheckpoint_every = nan\n", "checkpoint_every"),
    ("nodes = [1]\nrepeats = inf\n", "repeats"),
    ("nodes = [1]\nranks_per_node = -inf\n", "ranks_per_node"),
    ("nodes = [inf]\n", "nodes"),
    ("nodes = [1]\nmax_concurrent = 1979-05-27T07:32:00Z\n", "max_concurrent"),
    ("nodes = [1]\nname = [1]\n", "name"),
    ("nodes = [1]\ntime = {a = 1}\n", "time"),
    ("nodes = [1]\ntrain = 5\n", "train"),
    ("nodes = [1]\n[train]\nlr_decay_epochs = [1.5]\n", "lr_decay_epochs"),
    ("nodes = [1]\n[train]\nsteps = inf\n", "steps"),
    ('nodes = [1]\n[train]\nresume_from = ""\n', "train.resume_from"),
    ('nodes = [1]\n[train]\ninit_factors = ""\n', "init_factors"),
    ("nodes = [1]\n[axes]\nseed = [1e400]\n", "seed"),
    ("nodes = [1]\n[axes]\nbatch_size = [{a = 1}]\n", "batch_size"),
]


@pytest.mark.parametrize(("text", "field"), TOML_CASES)
def test_toml_values_of_the_wrong_type_are_bad_input(tmp_path, text, field):
    f = tmp_path / "s.toml"
    f.write_text(text)
    assert_bad_input(sweep(tmp_path, "-f", str(f)), field, tmp_path / "sw")
    assert not (tmp_path / "sw").exists()


def test_a_sweep_file_that_is_not_utf8_is_bad_input(tmp_path):
    f = tmp_path / "s.toml"
    f.write_bytes(b'name = "caf\xe9"\nnodes = [1]\n')
    result = sweep(tmp_path, "-f", str(f))
    assert_bad_input(result, "sweep_file", tmp_path / "sw")
    assert "not UTF-8" in result.stderr


@pytest.mark.parametrize("sub", ["scripts", "logs", "runs"])
def test_a_file_where_a_sweep_folder_goes_is_bad_input_before_any_write(tmp_path, sub):
    sweep_dir = tmp_path / "sw"
    sweep_dir.mkdir()
    (sweep_dir / sub).write_text("not a folder")
    result = sweep(tmp_path, "--nodes", "1")
    assert_bad_input(result, "sweep_dir", sweep_dir)
    assert sorted(p.name for p in sweep_dir.iterdir()) == [sub]


@pytest.mark.parametrize(
    "expression", ["{{ 1 // 0 }}", "{{ nodes + 'x' }}", "{{ cases[99] }}", "{{ '%d' % 'x' }}"]
)
def test_a_template_expression_that_raises_is_bad_input(tmp_path, expression):
    t = tmp_path / "t.j2"
    t.write_text(f"#!/bin/bash\n#SBATCH --nodes={{{{ nodes }}}}\n{expression}\n")
    result = sweep(tmp_path, "--nodes", "1", "--template", str(t))
    assert_bad_input(result, "template", tmp_path / "sw")
    assert not (tmp_path / "sw").exists()


def test_time_limit_true_is_not_one_second():
    with pytest.raises(SweepInputError, match=r"^time_limit: True is not a duration"):
        load_spec(None, {"nodes": "1", "time_limit": True})
    spec = load_spec(None, {"nodes": "1", "time_limit": "90s"})
    assert spec.train.time_limit == "90s"


@pytest.mark.parametrize("dataset", ["cifar10", "imagefolder"])
def test_a_dataset_that_cannot_load_stops_the_sweep_before_anything_starts(tmp_path, dataset):
    data = tmp_path / "data"
    data.mkdir()  # a folder, so the job's validation passes; but no data in it
    args = ["--nodes", "1", "--model", "mlp", "--dataset", dataset, "--data-path", str(data)]
    result = sweep(tmp_path, *args, dry_run=False)
    assert_bad_input(result, "data_path", tmp_path / "sw")
    assert f"--dataset {dataset} cannot be loaded here" in result.stderr
    assert not (tmp_path / "sw").exists()
