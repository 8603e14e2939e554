"""What a node does to its ranks, in the cost model: ranks that need more cores than the node
has slow their compute by the ratio (cores per node, threads per rank); the job's per-step
overhead is predicted outside every phase, and no collective of its own (its preemption flag
rides in the gradient allreduce); a collective after
compute waits what the sync fit says; measured per-collective fits replace the step counts;
the profile keys parse. Each checked against the arithmetic written out here."""

from __future__ import annotations

from pathlib import Path

import pytest

from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.calibrate import SYNC_BYTES, fit_sync
from kfac_hpc.plan.compute_costs import RatedCompute
from kfac_hpc.plan.errors import PlanInputError
from kfac_hpc.plan.layers import model_shape
from kfac_hpc.plan.model import CostModel, Host, PlanConfig, collective_s
from kfac_hpc.plan.overhead import JobOverhead
from kfac_hpc.plan.profiles import MachineProfile, NetworkProfile, load_profile

MACHINE = MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10)
LINK = AlphaBeta(1e-4, 1e-9)
NET = NetworkProfile("one node", 64, LINK, LINK)
COMPUTE_PHASES = ("forward", "backward", "precondition", "optimizer")


def _model(host: Host, net: NetworkProfile = NET) -> CostModel:
    shape = model_shape("small_cnn", "digits")
    return CostModel(shape, RatedCompute(MACHINE, shape), net, host)


def _cfg(method: str, ranks: int) -> PlanConfig:
    return PlanConfig(method, ranks, 64, "weak", 1, 10)


@pytest.mark.parametrize(
    ("cores", "threads", "ranks", "slow"), [(2, 1, 4, 2.0), (8, 2, 8, 2.0), (8, 1, 4, 1.0)]
)
def test_compute_slows_by_threads_over_cores(cores, threads, ranks, slow) -> None:
    free = _model(Host()).predict(_cfg("kfac-comm-opt", ranks))
    shared = _model(Host(cores, threads)).predict(_cfg("kfac-comm-opt", ranks))
    for phase in COMPUTE_PHASES:
        assert shared.phases_s[phase] == pytest.approx(slow * free.phases_s[phase])
    assert shared.phases_s["grad_allreduce"] == pytest.approx(free.phases_s["grad_allreduce"])
    # factor_compute also holds the factors' finiteness agreement (a collective: not slowed)
    agreement = collective_s(NET, "allreduce", 4, ranks)
    factors = free.phases_s["factor_compute"] - agreement
    assert shared.phases_s["factor_compute"] == pytest.approx(slow * factors + agreement)


def test_job_overhead_is_outside_the_phases_with_no_collective_of_its_own() -> None:
    job = JobOverhead(data_s_per_sample=1e-6, step_s=2e-3)
    base = _model(Host(sync=((2, 1e-3, 0.5),))).predict(_cfg("sgd", 4))
    pred = _model(Host(job=job, sync=((2, 1e-3, 0.5),))).predict(_cfg("sgd", 4))
    assert pred.phases_s["data"] == pytest.approx(64 * 1e-6)
    # the preemption flag rides in the gradient allreduce: no agreement, no wait outside
    assert base.other_s == 0.0
    assert pred.other_s == pytest.approx(2e-3)
    assert pred.step_s == pytest.approx(sum(pred.phases_s.values()) + pred.other_s)


def test_collectives_after_compute_wait_what_the_sync_fit_says() -> None:
    a, b = 1e-3, 0.5
    plain = _model(Host()).predict(_cfg("sgd", 4))
    synced = _model(Host(sync=((2, a, b),))).predict(_cfg("sgd", 4))  # fit at 2 used at 4
    compute = plain.phases_s["forward"] + plain.phases_s["backward"]
    expected = plain.phases_s["grad_allreduce"] + a + b * compute
    assert synced.phases_s["grad_allreduce"] == pytest.approx(expected)
    assert synced.other_s == plain.other_s  # no collective outside the phases
    one = _model(Host(sync=((2, a, b),))).predict(_cfg("sgd", 1))
    assert one.step_s == pytest.approx(_model(Host()).predict(_cfg("sgd", 1)).step_s)


def test_fit_sync_subtracts_contended_compute_and_the_lockstep_collective() -> None:
    # allreduce rows that an α-β fits exactly: the lockstep cost is that fit at SYNC_BYTES
    link = AlphaBeta(5e-5, 2e-9)
    sizes = (64.0, 4096.0, float(SYNC_BYTES), 2.0**20)
    rows = [("allreduce", 4, n, link.time_s("allreduce", n, 4)) for n in sizes]
    lockstep = 6 * 5e-5 + 1.5 * SYNC_BYTES * 2e-9  # ring at 4 ranks: 2(P-1), 2(P-1)/P
    rows += [("sync", 4, t, 2 * t + lockstep + 1e-3 + 0.25 * t) for t in (1e-3, 4e-3, 16e-3)]
    a, b = fit_sync(rows, slowdown=2.0)
    assert a == pytest.approx(1e-3) and b == pytest.approx(0.25)


def test_a_measured_collective_fit_replaces_the_step_counts() -> None:
    measured = AlphaBeta(5e-4, 2e-9)
    net = NetworkProfile("here", 64, LINK, LINK, ((4, "broadcast", measured),))
    # broadcast at 4 ranks: the measured fit, with the tree's step counts (2, 2)
    assert collective_s(net, "broadcast", 1e6, 4) == pytest.approx(2 * 5e-4 + 2 * 1e6 * 2e-9)
    assert collective_s(net, "broadcast", 1e6, 2) == pytest.approx(1e-4 + 1e6 * 1e-9)


def _profile(tmp_path: Path, extra: str) -> str:
    path = tmp_path / "p.toml"
    path.write_text(
        "[machine]\ngemm_flops_per_s = 1e12\neigh_flops_per_s = 1e11\nmemory_bytes_per_s = 1e12\n"
        f"memory_bytes = 1e10\n{extra}\n[network]\nranks_per_node = 4\n"
        "[network.intra]\nlatency_s = 1e-6\nbandwidth_bytes_per_s = 1e11\n"
        "[network.inter]\nlatency_s = 1e-5\nbandwidth_bytes_per_s = 1e10\n"
    )
    return str(path)


def test_profile_host_keys(tmp_path: Path) -> None:
    extra = "cores_per_node = 16\nthreads_per_rank = 4\nstep_overhead_s = 0.002"
    machine, _ = load_profile(_profile(tmp_path, extra))
    assert (machine.cores_per_node, machine.threads_per_rank) == (16, 4)
    assert machine.step_overhead_s == pytest.approx(0.002)
    with pytest.raises(PlanInputError, match=r"machine\.threads_per_rank"):
        load_profile(_profile(tmp_path, "threads_per_rank = 0"))
    with pytest.raises(PlanInputError, match=r"machine\.cores_per_node"):
        load_profile(_profile(tmp_path, "cores_per_node = 2.5"))
