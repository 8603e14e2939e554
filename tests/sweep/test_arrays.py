"""Arrays from points: one per node count, split past MaxArraySize, %K throttling, serial
chaining; the dry run prints exactly the sbatch commands and submits nothing."""

from __future__ import annotations

import pytest

from kfac_hpc.sweep.backends.slurm import array_spec
from kfac_hpc.sweep.prepare import plan_arrays
from kfac_hpc.sweep.spec import expand_points
from tests.helpers.sweeps import cli, spec


def test_one_array_per_node_count_indexed_over_axes_and_repeats():
    s = spec(nodes="1,2,4", optimizer="sgd,adam", repeats=3)
    plan = plan_arrays(expand_points(s), s.nodes, 1000)
    assert [name for name, _ in plan] == ["n1-0", "n2-0", "n4-0"]
    for (_, points), nodes in zip(plan, (1, 2, 4), strict=True):
        assert len(points) == 2 * 3 and {p.nodes for p in points} == {nodes}


def test_arrays_larger_than_max_array_size_are_split():
    s = spec(
        nodes="1,2", seed=",".join(str(i) for i in range(5)), repeats=2
    )  # 10 points per node count
    plan = plan_arrays(expand_points(s), s.nodes, 4)
    assert [(name, len(points)) for name, points in plan] == [
        ("n1-0", 4),
        ("n1-1", 4),
        ("n1-2", 2),
        ("n2-0", 4),
        ("n2-1", 4),
        ("n2-2", 2),
    ]


@pytest.mark.parametrize(
    ("indices", "k", "expected"),
    [
        ([0, 1, 2, 3], None, "0-3"),
        ([0, 1, 2, 3], 2, "0-3%2"),
        ([1, 4, 5, 6, 9], None, "1,4-6,9"),
        ([3], 1, "3%1"),
    ],
)
def test_array_spec(indices, k, expected):
    assert array_spec(indices, k) == expected


def test_dry_run_prints_the_exact_sbatch_commands_and_submits_nothing(tmp_path):
    out = cli(
        "sweep",
        "--nodes",
        "1,2",
        "--repeats",
        "2",
        "--max-concurrent",
        "1",
        "--sbatch-arg=--exclusive",
        "--sweep-dir",
        str(tmp_path / "sw"),
        "--dry-run",
        "--backend",
        "local",
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[2:] == [
        "n1_0=$(sbatch --parsable --array=0-1%1 --exclusive scripts/n1-0.sbatch)",
        "n2_0=$(sbatch --parsable --array=0-1%1 --exclusive scripts/n2-0.sbatch)",
    ]
    assert sorted(p.name for p in (tmp_path / "sw" / "scripts").iterdir()) == [
        "n1-0.sbatch",
        "n2-0.sbatch",
    ]
    assert not (tmp_path / "sw" / "manifest.json").exists()


def test_serial_chains_the_arrays_one_task_at_a_time(tmp_path):
    out = cli(
        "sweep",
        "--nodes",
        "1,2,4",
        "--serial",
        "--sweep-dir",
        str(tmp_path / "sw"),
        "--dry-run",
        "--backend",
        "local",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[2:] == [
        "n1_0=$(sbatch --parsable --array=0%1 scripts/n1-0.sbatch)",
        "n2_0=$(sbatch --parsable --array=0%1 --dependency=afterany:$n1_0 scripts/n2-0.sbatch)",
        "n4_0=$(sbatch --parsable --array=0%1 --dependency=afterany:$n2_0 scripts/n4-0.sbatch)",
    ]
