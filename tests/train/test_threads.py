"""The intra-op threads of a rank: the user's count wins (--threads, then OMP_NUM_THREADS),
else the cores the rank was given (Slurm's CPUs per task, the launcher's binding, or the
node's cores shared by its ranks); the job sets it and run.json says so."""

from __future__ import annotations

import pytest
import torch

from kfac_hpc.train.threads import rank_threads, set_rank_threads


@pytest.mark.parametrize(
    ("option", "env", "usable", "expected"),
    [
        (3, {"OMP_NUM_THREADS": "5", "SLURM_CPUS_PER_TASK": "7"}, 16, (3, "--threads")),
        (None, {"OMP_NUM_THREADS": "5", "SLURM_CPUS_PER_TASK": "7"}, 16, (5, "OMP_NUM_THREADS")),
        (None, {"SLURM_CPUS_PER_TASK": "7"}, 16, (7, "SLURM_CPUS_PER_TASK")),
        (None, {"OMP_NUM_THREADS": "", "SLURM_CPUS_PER_TASK": "0"}, 16, (4, "16 cores / 4 ranks")),
        (None, {}, 2, (2, "the cores the launcher bound the rank to")),
    ],
)
def test_the_count_and_where_it_came_from(option, env, usable, expected):
    threads, source = rank_threads(option, 4, env, usable=usable, machine=16)
    assert threads == expected[0]
    assert source.startswith(expected[1])


def test_more_ranks_than_cores_still_get_one_thread_each():
    assert rank_threads(None, 8, {}, usable=4, machine=4) == (1, "4 cores / 8 ranks on the node")


def test_the_job_sets_torchs_count(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        record = set_rank_threads(1, 1)
        assert record == {"threads": 1, "threads_from": "--threads"}
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
