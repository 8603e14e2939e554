"""A Dataset read by worker processes (--data-workers) keeps the job's order: a run killed
mid-epoch (SIGKILL) or preempted (SIGUSR2) and started again trains on the same samples, step
for step, as an uninterrupted run, at 1 and 2 ranks; and the same as the in-process reader."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.helpers.workloads import write_workloads
from tests.train import conftest as job

pytestmark = [pytest.mark.slow]

STEPS = 20  # two epochs of 10 steps (320 samples, batch 32)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_workloads(tmp_path_factory.mktemp("workloads")) / "wlpkg.py"


def _args(package: Path, log: Path, workers: int) -> tuple[str, ...]:
    log.mkdir(parents=True, exist_ok=True)
    return (
        "--model",
        f"{package}:recording_mlp",
        "--model-arg",
        f"log={log}",
        "--dataset",
        f"{package}:indexed",
        "--batch-size",
        "32",
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        "3",
        "--data-workers",
        str(workers),
        "--no-progress",
    )


def _order(log: Path, world: int) -> list[list[list[int]]]:
    """Per rank, the batches each attempt trained on (attempts in order of their lines)."""
    ranks = []
    for rank in range(world):
        attempts: dict[str, list[list[int]]] = {}
        for line in (log / f"rank{rank}.txt").read_text().splitlines():
            pid, seen = line.split()
            attempts.setdefault(pid, []).append([int(v) for v in seen.split(",")])
        ranks.append(list(attempts.values()))
    return ranks


def _run(world: int, run_dir: Path, *args: str):
    proc = job.run_plain(run_dir, *args) if world == 1 else job.run_ranks(world, run_dir, *args)
    assert proc.returncode == 0, job.explain(proc)
    return proc


def _ranks(pids: list[int]) -> list[int]:
    """The training processes among ``pids``, not their data-loading workers (children)."""

    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    return [pid for pid in pids if parent(pid) not in pids]


def _launcher(world: int, run_dir: Path) -> tuple[str, ...]:
    if world == 1:
        return ()
    return (str(Path(job.train_cmd(run_dir)[0]).parent / "mpiexec"), "-n", str(world))


@pytest.fixture(scope="module")
def uninterrupted(package: Path, tmp_path_factory: pytest.TempPathFactory):
    """Per world size, the batches of an uninterrupted run read by a worker process, checked
    against the in-process reader's (run once per world, shared by both signals)."""
    orders: dict[int, list[list[list[int]]]] = {}

    def order(world: int) -> list[list[list[int]]]:
        if world not in orders:
            root = tmp_path_factory.mktemp(f"uninterrupted-{world}")
            whole = root / "whole"
            _run(world, whole, *_args(package, root / "log-whole", 1))
            expected = _order(root / "log-whole", world)
            assert all(len(r) == 1 and len(r[0]) == STEPS for r in expected), expected
            in_process = root / "in-process"
            _run(world, in_process, *_args(package, root / "log-in-process", 0))
            assert _order(root / "log-in-process", world) == expected
            summary = job.read_json(whole / "run.json")
            assert summary["data_workers"] == 1 and summary["world_size"] == world
            orders[world] = expected
        return orders[world]

    return order


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.mpi)])
@pytest.mark.parametrize("how", ["SIGKILL", "SIGUSR2"])
def test_a_resumed_epoch_trains_on_the_samples_of_an_uninterrupted_one(
    package, uninterrupted, tmp_path, world, how
):
    expected = uninterrupted(world)
    run_dir = tmp_path / "cut"
    args = _args(package, tmp_path / "log-cut", 1)
    proc = job.start_until_checkpoint(run_dir, *args, launcher=_launcher(world, run_dir))
    pids = _ranks(job.rank_pids(run_dir))
    assert len(pids) == world, pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL if how == "SIGKILL" else signal.SIGUSR2)
    proc.communicate(timeout=120)
    if how == "SIGUSR2":
        assert proc.returncode == 75
    _run(world, run_dir, *args)
    summary = job.read_json(run_dir / "run.json")
    assert len(summary["attempts"]) == 2 and summary["steps"] == STEPS
    assert summary["world_size"] == world
    start = summary["attempts"][1]["start_step"]
    assert 0 < start < STEPS
    for rank, attempts in enumerate(_order(tmp_path / "log-cut", world)):
        assert len(attempts) == 2, attempts
        combined = attempts[0][:start] + attempts[1]
        assert combined == expected[rank][0], (rank, start)
