"""Checks a sweep passes before anything is submitted: the partition asked for (its node
limit is read from the cluster, see test_sixteen_nodes.py) and one rank per GPU."""

from __future__ import annotations

from pathlib import Path

from kfac_hpc.sweep.slurm_commands import requested_partition
from tests.helpers.sweeps import cli


def test_partition_argument_forms_are_recognised() -> None:
    assert requested_partition(["--exclusive", "-p", "gpu"]) == "gpu"
    assert requested_partition(["-pgpu"]) == "gpu"
    assert requested_partition(["--partition=big"]) == "big"
    assert requested_partition(["--partition", "big"]) == "big"
    assert requested_partition(["--exclusive"]) is None


def test_ranks_per_node_must_match_gpus_per_node_unless_asked(tmp_path: Path) -> None:
    args = ["sweep", "--backend", "local", "--dry-run", "--nodes", "1,2", "--gpus-per-node", "4"]
    refused = cli(*args, "--ranks-per-node", "2", "--sweep-dir", str(tmp_path / "a"))
    assert refused.returncode == 2
    [line] = refused.stderr.strip().splitlines()
    assert "ranks_per_node: 2 rank(s) per node on nodes with 4 GPU(s)" in line
    assert "--allow-gpu-rank-mismatch" in line
    assert not (tmp_path / "a").exists()
    matched = cli(*args, "--ranks-per-node", "4", "--sweep-dir", str(tmp_path / "b"))
    assert matched.returncode == 0, matched.stderr
    asked = cli(
        *args,
        "--ranks-per-node",
        "2",
        "--allow-gpu-rank-mismatch",
        "--sweep-dir",
        str(tmp_path / "c"),
    )
    assert asked.returncode == 0, asked.stderr
