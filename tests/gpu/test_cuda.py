"""The CUDA/NCCL path, run where a GPU is at hand (skipped with the reason elsewhere):
K-FAC on CUDA against CPU float64 on the same batch, a 1-rank NCCL training run with a
checkpoint and a resume, CUDA-event phase timings, AMP (GradScaler, bfloat16), pinned input
batches, and doctor's NCCL allreduce."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kfac_hpc import KFACPreconditioner
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.timing import CudaEventTimer, PhaseTimer, phase_timer
from kfac_hpc.train.workloads import build_model
from tests.conftest import VENV_BIN, clean_env

pytestmark = pytest.mark.gpu

KFAC_HPC = str(VENV_BIN / "kfac-hpc")


def _batch(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _preconditioned(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, kl_clip=None)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    grads = [p.grad.detach().cpu().double() for p in model.parameters() if p.grad is not None]
    pre.remove_hooks()
    return grads


def test_kfac_on_cuda_matches_cpu_float64(cuda: torch.device) -> None:
    torch.manual_seed(0)
    model = build_model(TrainConfig(model="small_cnn"), (1, 8, 8), 10)
    reference = copy.deepcopy(model).double()
    x, y = _batch()
    on_gpu = _preconditioned(model.to(cuda), x.to(cuda), y.to(cuda))
    on_cpu = _preconditioned(reference, x.double(), y)
    for got, want in zip(on_gpu, on_cpu, strict=True):
        # float32 factors and eigendecompositions against float64: relative to the norm
        assert (got - want).norm() <= 2e-3 * want.norm() + 1e-7


def test_timer_on_a_gpu_is_the_event_timer(cuda: torch.device) -> None:
    assert isinstance(phase_timer(False, cuda), CudaEventTimer)
    assert type(phase_timer(True, cuda)) is PhaseTimer
    assert type(phase_timer(False, torch.device("cpu"))) is PhaseTimer


def test_cuda_event_phases_add_up_to_the_step(cuda: torch.device) -> None:
    timer = phase_timer(False, cuda)
    a = torch.randn(2048, 2048, device=cuda)
    for _ in range(3):
        timer.begin_step()
        timer.lap("data")  # nothing queued: near zero
        for _ in range(10):
            a = (a @ a).tanh_()
        timer.lap("forward")
        timer.skip()
        timer.end_step()
    phases, steps = timer.drain()
    assert len(steps) == 3
    forward, data = phases[1], phases[0]
    assert forward > 10 * data and forward > 0
    # skip() leaves a gap of no work: the phases cover the steps up to it
    assert sum(phases) == pytest.approx(sum(steps), rel=0.05)


def test_amp_with_grad_scaler_and_bfloat16(cuda: torch.device) -> None:
    x, y = (t.to(cuda) for t in _batch(128))
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        model = build_model(TrainConfig(model="small_cnn"), (1, 8, 8), 10).to(cuda)
        scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        pre = KFACPreconditioner(model, grad_scaler=scaler if scaler.is_enabled() else None)
        losses = []
        for _ in range(20):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=dtype):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            pre.step()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss))
        for factors in pre.factors.values():
            assert factors.A is not None and torch.isfinite(factors.A).all()
            assert factors.A.dtype == torch.float32
        assert losses[-1] < losses[0], (dtype, losses)
        pre.remove_hooks()


def test_pinned_input_batches(cuda: torch.device) -> None:
    from kfac_hpc.train.data import ShardedBatches
    from kfac_hpc.train.workloads import load_data

    source = load_data(TrainConfig())
    x, y = ShardedBatches(source, 64, 0, 1, 0, False, pin_memory=True).batch(0, 0)
    assert x.is_pinned() and y.is_pinned()


def _train(run_dir: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [KFAC_HPC, "train", "--run-dir", str(run_dir), "--backend", "nccl", "--steps", "30"]
    argv += ["--checkpoint-every", "10", "--log-every", "5", "--no-progress"]
    return subprocess.run(argv, env=clean_env(env), capture_output=True, text=True, timeout=240)


def test_nccl_one_rank_training_checkpoints_and_resumes(cuda: torch.device, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    failed = _train(run_dir, {"KFAC_HPC_FAULT_INJECT": "rank=0,step=15"})
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert (run_dir / "checkpoints" / "latest").exists()
    resumed = _train(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["state"] == "done" and run["steps"] == 30 and run["restarts"] == 1
    assert run["attempts"][1]["start_step"] == 10
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    # CUDA-event phase times: positive forward and backward in every window
    assert all(r["phases_s"]["forward"] > 0 and r["phases_s"]["backward"] > 0 for r in train)
    config = json.loads((run_dir / "config.json").read_text())
    assert config.get("backend") == "nccl"


def test_doctor_runs_a_nccl_allreduce(cuda: torch.device) -> None:
    out = subprocess.run(
        [KFAC_HPC, "doctor"], env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert "[ok  ] nccl-allreduce" in out.stdout, out.stdout + out.stderr
