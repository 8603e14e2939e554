"""The library entry of ``kfac-hpc plan``: build a cost model, predict every configuration."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kfac_hpc.plan.compute_costs import MeasuredCompute, RatedCompute
from kfac_hpc.plan.errors import PlanInputError
from kfac_hpc.plan.layers import model_shape
from kfac_hpc.plan.memory import DeviceMemory, device_memory
from kfac_hpc.plan.model import ALL_METHODS, CostModel, Host, PlanConfig, Prediction
from kfac_hpc.plan.overhead import JobOverhead, measure_job_overhead
from kfac_hpc.plan.profiles import load_profile

__all__ = ["Planned", "build_cost_model", "predict_all"]


@dataclass(frozen=True)
class Planned:
    """A cost model, where its numbers come from (for the printed header) and the memory a
    point must fit in (None: this machine, no limit)."""

    model: CostModel
    source: str
    memory_limit: float | None


def build_cost_model(
    model: str,
    dataset: str,
    profile: str | None,
    calibration_ranks: Sequence[int] = (2, 4),
    overhead_batch: int = 32,
) -> Planned:
    """From a profile (shipped name or TOML path), or measured on this machine when None
    (``overhead_batch``: the batch of the run that measures the job's own overhead). A
    profile's memory is its ``[memory]`` table (context and workspaces added to every point),
    else its ``machine.memory_bytes``; this machine's: the CPU code paths, no limit."""
    shape = model_shape(model, dataset)
    if profile is not None:
        machine, network = load_profile(profile)
        device = device_memory(profile)
        if device is None and machine.memory_bytes:
            device = DeviceMemory(machine.memory_bytes)
        host = Host(
            machine.cores_per_node,
            machine.threads_per_rank,
            JobOverhead(machine.data_s_per_sample, machine.step_overhead_s),
            network.sync,
            machine.compute_cv,
            machine.slowdown_curve,
        )
        return Planned(
            CostModel(shape, RatedCompute(machine, shape), network, host, device),
            f"hardware {profile}: {machine.name}, {network.ranks_per_node} ranks/node on "
            f"{network.intra_link}, {network.nics} NIC(s)/node, {network.backend}",
            None if device is None else device.capacity_bytes,
        )
    from kfac_hpc.plan.calibrate import local_network

    cores = os.cpu_count() or 1
    network, sync, _ = local_network(calibration_ranks, cores)
    job = measure_job_overhead(dataset, overhead_batch)
    link = network.intra
    return Planned(
        CostModel(shape, MeasuredCompute(shape), network, Host(cores, 1, job, sync)),
        f"this machine ({cores} cores, 1 thread/rank, compute measured, gloo alpha "
        f"{link.alpha_s * 1e6:.0f} us, {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
        f"job {job.step_s * 1e3:.2f} ms/step outside phases)",
        None,
    )


def predict_all(
    planned: Planned,
    methods: Sequence[str],
    ranks: Sequence[int],
    batch_size: int,
    scaling: str,
    factor_update_steps: int,
    inv_update_steps: int,
    bucket_mb: float,
    **fosi: Any,
) -> list[Prediction]:
    """Every (ranks, method) pair; hybrid-opt is skipped at odd rank counts > 1 (undefined).
    ``fosi``: PlanConfig's FOSI fields by name (``fosi_k``, ``ese_every``,
    ``fosi_curvature_fraction``, ...); the job's defaults for those left out."""
    for method in methods:
        if method not in ALL_METHODS:
            raise PlanInputError("methods", f"{method!r} is not one of {', '.join(ALL_METHODS)}")
    out = []
    for p in ranks:
        if scaling == "strong" and batch_size % p:
            raise PlanInputError(
                "batch_size",
                f"{batch_size} is not divisible by {p} ranks (strong scaling splits it evenly); "
                "use a multiple of the largest rank count or --scaling weak",
            )
        for method in methods:
            if method == "kfac-hybrid-opt" and p > 1 and p % 2:
                continue
            cfg = PlanConfig(
                method,
                p,
                batch_size,
                scaling,
                factor_update_steps,
                inv_update_steps,
                bucket_mb,
                **fosi,
            )
            out.append(planned.model.predict(cfg))
    return out
