"""The `--fosi` axis comes from the option table: a dry run of `kfac-hpc sweep` with K-FAC and
FOSI on and off has one point per method (never both on), and FOSI's own axes vary FOSI points
only."""

from __future__ import annotations

import re

from tests.helpers.sweeps import cli


def test_fosi_axis_gives_one_point_per_method_in_a_dry_run(tmp_path):
    sweep_dir = tmp_path / "sw"
    out = cli(
        "sweep",
        "--nodes",
        "1,2",
        "--kfac",
        "true,false",
        "--fosi",
        "true,false",
        "--ese-every",
        "50,100",
        "--steps",
        "10",
        "--sweep-dir",
        str(sweep_dir),
        "--backend",
        "local",
        "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# dry run: 8 point(s)"), out.stdout
    points = []
    for script in sorted((sweep_dir / "scripts").glob("*.sbatch")):
        points += re.findall(r"point_args=\((.*)\) ;;", script.read_text())
    assert len(points) == 8
    assert points[:4] == points[4:]  # the same points at each node count
    assert sorted(points[:4]) == sorted(
        [
            "--no-fosi --kfac --steps 10",
            "--ese-every 50 --fosi --no-kfac --steps 10",
            "--ese-every 100 --fosi --no-kfac --steps 10",
            "--no-fosi --no-kfac --steps 10",
        ]
    )
    assert not (sweep_dir / "runs").exists() or not any((sweep_dir / "runs").iterdir())


def test_fosi_option_ranges_are_checked_by_the_sweep(tmp_path):
    out = cli("sweep", "--nodes", "1", "--fosi", "true", "--ese-every", "0",
              "--sweep-dir", str(tmp_path / "sw"), "--backend", "local", "--dry-run")  # fmt: skip
    assert out.returncode == 2 and "error: ese_every" in out.stderr, out.stderr
