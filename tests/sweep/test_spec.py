"""The sweep spec: flags and a TOML file merged, expanded into points with stable ids, counts
bounded before anything is expanded, and values read as Slurm and the job read them. (Bad
input to the command: test_bad_input.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.profile import parse_profile
from kfac_hpc.sweep.safety import slurm_time_seconds
from kfac_hpc.sweep.spec import MAX_POINTS, expand_points, load_spec, point_id
from tests.helpers.sweeps import spec


def test_point_ids_are_stable_hashes_of_the_parameters():
    a = expand_points(spec(nodes="1,2", kfac="true,false", repeats=2, grad_worker_fraction="0.5,1"))
    b = expand_points(spec(nodes="1,2", kfac="true,false", repeats=2, grad_worker_fraction="0.5,1"))
    assert [p.point_id for p in a] == [p.point_id for p in b]
    assert all(p.point_id == point_id(p.params) for p in a)
    # 2 nodes x (2 gwf with K-FAC + 1 without: gwf means nothing without K-FAC) x 2 repeats
    assert len(a) == 2 * 3 * 2
    assert len({p.point_id for p in a}) == len(a)


def test_sweep_file_and_flags_merge_with_flags_winning(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(
        'name = "f"\nnodes = [1, 2]\nrepeats = 3\n'
        '[train]\nsteps = 7\n[axes]\noptimizer = ["sgd", "adam"]\n'
    )
    s = load_spec(f, {"repeats": 1, "nodes": None})
    assert s.name == "f" and s.nodes == (1, 2) and s.repeats == 1
    assert s.train.steps == 7 and s.axes["optimizer"] == ("sgd", "adam")


def test_toml_axes_take_booleans_and_numbers(tmp_path):
    """`kfac = [true, false]` and `grad_worker_fraction = [1.0, 0.5]` in a sweep file are the
    values the command line's `--kfac true,false` gives (the file `kfac-hpc plan` writes)."""
    sweep_file = tmp_path / "axes.toml"
    sweep_file.write_text(
        "nodes = [1, 2]\n[axes]\nkfac = [true, false]\ngrad_worker_fraction = [1.0, 0.5]\n"
    )
    points = expand_points(load_spec(sweep_file, {}))
    assert {p.params["kfac"] for p in points} == {True, False}
    assert {p.params.get("grad_worker_fraction") for p in points if p.params["kfac"]} == {1.0, 0.5}


def test_a_huge_repeat_count_is_rejected_before_anything_is_expanded():
    with pytest.raises(SweepInputError, match=r"^repeats: 99999999999999999999 must be in"):
        load_spec(None, {"nodes": "1", "repeats": "99999999999999999999"})


def test_the_product_of_axes_is_bounded_before_expansion():
    seeds = ",".join(str(i) for i in range(101))
    sizes = ",".join(str(8 * i) for i in range(1, 101))
    with pytest.raises(SweepInputError, match=rf"^axes: .*10100 points, more than {MAX_POINTS}"):
        load_spec(None, {"nodes": "1", "seed": seeds, "batch_size": sizes})


def test_time_limit_true_is_not_one_second():
    with pytest.raises(SweepInputError, match=r"^time_limit: True is not a duration"):
        load_spec(None, {"nodes": "1", "time_limit": True})
    assert load_spec(None, {"nodes": "1", "time_limit": "90s"}).train.time_limit == "90s"


def test_slurm_time_forms_read_as_slurm_reads_them():
    forms = {"90": 5400, "90:30": 5430, "1:00:00": 3600, "1-2": 93600, "1-2:30": 95400}
    assert {t: slurm_time_seconds(t) for t in forms} == forms
    assert load_spec(None, {"nodes": "1", "time": "2-00:00:30"}).time == "2-00:00:30"
    with pytest.raises(SweepInputError, match=r"^profile\.time: '00:00' must be above 0"):
        parse_profile("site", {"time": "00:00"})


def test_an_axis_in_train_is_fixed_to_its_one_value_and_a_list_there_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.toml"
    path.write_text('name = "a"\nnodes = [1]\n[train]\nmodel = "mlp"\ndataset = "digits"\n')
    spec = load_spec(path, {})
    assert spec.axes["model"] == ("mlp",) and spec.axes["dataset"] == ("digits",)
    path.write_text('name = "a"\nnodes = [1]\n[train]\nmodel = ["mlp", "small_cnn"]\n')
    with pytest.raises(SweepInputError, match=r"train\.model.*\[axes\]"):
        load_spec(path, {})
