"""``kfac-hpc plan calibrate``: real ranks over gloo (4 ranks emulating 2 nodes of 2, and srun
on 2 nodes of the local Slurm cluster) write a profile that plan reads, with both links,
real-layer curves, the slowdown and waits by ranks and the job's overhead measured, and that
predicts a real run there from its own settings; the profile's text
round-trips; bad flags are one line, exit 2, nothing measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.contracts.records import phase_step_s
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.layer_rates import CONV_CHANNELS, LINEAR_WIDTHS
from kfac_hpc.plan.module_fits import MODULE_KINDS
from kfac_hpc.plan.profiles import load_profile
from kfac_hpc.plan.site import profile_text
from tests.helpers.launch import run_mpi, script_env


def test_profile_text_round_trips_through_the_loader(tmp_path: Path) -> None:
    rates = {"eigh_curve": [[64, 1e-3], [512, 4e-3]], "gemm": 2e10, "copy": 5e9}
    intra, inter = AlphaBeta(2e-5, 1 / 5e9), AlphaBeta(1e-4, 1 / 1e9)
    path = tmp_path / "site.toml"
    path.write_text(profile_text("cpu", rates, 8e9, 4, "gloo", intra, inter, 16))
    machine, net = load_profile(str(path))
    assert machine.eigh_curve == ((64, 1e-3), (512, 4e-3))
    assert machine.gemm_flops_per_s == pytest.approx(2e10, rel=1e-5)
    assert (net.ranks_per_node, net.backend, net.nics) == (4, "gloo", 4)
    assert net.intra.alpha_s == pytest.approx(2e-5, rel=1e-5)
    assert net.inter.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-5)


def test_one_node_copies_the_intra_link_and_says_so(tmp_path: Path) -> None:
    rates = {"eigh_curve": [[64, 1e-3], [512, 4e-3]], "gemm": 2e10, "copy": 5e9}
    text = profile_text("cpu", rates, 8e9, 2, "gloo", AlphaBeta(2e-5, 1e-9), None, 2)
    assert "network.inter: not measured" in text
    path = tmp_path / "one.toml"
    path.write_text(text)
    _, net = load_profile(str(path))
    assert net.inter == net.intra


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--out", "/no/such/folder/site.toml"], "--out"),
        (["--out", "x.toml", "--eigh-sizes", "64"], "--eigh-sizes"),
        (["--out", "x.toml", "--eigh-sizes", "64,big"], "--eigh-sizes"),
        (["--out", "x.toml", "--model", "nosuchmodel"], "--model"),
    ],
)
def test_bad_calibrate_flags_are_one_line(tmp_path: Path, args: list[str], flag: str) -> None:
    result = CliRunner().invoke(main, ["plan", "calibrate", *args])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0]
    assert not (tmp_path / "x.toml").exists()


def test_four_ranks_on_two_emulated_nodes_write_a_usable_profile(tmp_path: Path) -> None:
    out = tmp_path / "site.toml"
    argv = [sys.executable, "-m", "kfac_hpc", "plan", "calibrate", "--out", str(out)]
    argv += ["--backend", "gloo", "--eigh-sizes", "32,64,128"]
    result = run_mpi(4, argv, env={"KFAC_HPC_EMULATED_NODES": "2", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    text = out.read_text()
    # 2 ranks on a node and 2 nodes: both links measured
    assert "intra: not measured" not in text and "inter: not measured" not in text
    machine, net = load_profile(str(out))
    assert net.ranks_per_node == 2  # the world of 4 over 2 nodes
    assert [n for n, _ in machine.eigh_curve] == [32, 64, 128]
    assert all(t > 0 for _, t in machine.eigh_curve)
    # the job's terms: real-layer curves, the slowdown at 1, 2 (one a node) and 4 ranks at
    # once, the waits over 2 and 4 ranks, the overhead of a 1-rank run
    assert len(machine.conv_curve) == len(CONV_CHANNELS)
    assert len(machine.linear_curve) == len(LINEAR_WIDTHS)
    assert [kind for kind, _ in machine.modules] == list(MODULE_KINDS)  # every kind fitted
    assert [p for p, _ in machine.slowdown_curve] == [1, 2, 4]
    assert [fit[0] for fit in net.sync] == [2, 4]
    assert machine.step_overhead_s > 0 and machine.data_s_per_sample > 0
    for link in (net.intra, net.inter):
        assert link.alpha_s >= 0 and 0 < link.bandwidth_bytes_per_s < float("inf")
    planned = CliRunner().invoke(
        main,
        [
            "plan",
            "--hardware",
            str(out),
            "--model",
            "mlp",
            "--dataset",
            "digits",
            "--batch-size",
            "64",
            "--ranks",
            "1,2,4",
        ],
    )
    assert planned.exit_code == 0, planned.output
    assert "2 ranks/node" in planned.output


@pytest.mark.slurm
def test_srun_calibrates_a_profile_that_predicts_a_real_two_node_run(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """calibrate → profile → plan on the local cluster, end to end: a profile calibrated by
    srun on 2 nodes of 2 ranks (both links measured), then a real 2-node K-FAC run of the job
    (srun, gloo), then ``plan --explain`` of that run with the profile. Every phase that took
    a share of the run's step has a finite prediction from the run's own settings. How close
    they are is measured by benchmarks/bench_plan_site.py (no time is asserted here: the
    nodes share this machine's cores)."""
    env = script_env({"OMP_NUM_THREADS": "1"})
    srun = ["srun", "-N", "2", "--mpi=pmi2", "-t", "5"]
    site = tmp_path / "site.toml"
    calibrate = [*srun, "--ntasks-per-node", "2", sys.executable, "-m", "kfac_hpc", "plan"]
    calibrate += ["calibrate", "--out", str(site), "--backend", "gloo", "--eigh-sizes", "32,64"]
    result = subprocess.run(calibrate, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    text = site.read_text()
    assert "intra: not measured" not in text and "inter: not measured" not in text
    machine, net = load_profile(str(site))
    assert net.ranks_per_node == 2 and net.backend == "gloo"  # 4 ranks on 2 nodes
    assert [p for p, _ in machine.slowdown_curve] == [1, 2, 4]  # one a node, then all
    assert [fit[0] for fit in net.sync] == [2, 4]
    sweep = tmp_path / "sweep"
    train = [*srun, "--ntasks-per-node", "1", sys.executable, "-m", "kfac_hpc", "train"]
    train += ["--run-dir", str(sweep / "run"), "--model", "mlp", "--dataset", "digits"]
    train += ["--batch-size", "64", "--steps", "12", "--log-every", "4", "--kfac"]
    train += ["--factor-update-steps", "1", "--inv-update-steps", "4", "--no-progress"]
    result = subprocess.run(train, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    run = json.loads((sweep / "run" / "run.json").read_text())
    assert run["world_size"] == 2
    # each rank's phases lie inside its steps, so the ranks' mean step covers the mean phases
    assert len(run["rank_step_s"]) == 2
    assert phase_step_s(run) >= sum(run["phases_s"].values())
    explained = CliRunner().invoke(main, ["plan", "--explain", str(sweep), "--hardware", str(site)])
    assert explained.exit_code == 0, explained.output
    (predicted,) = json.loads((sweep / "predicted.json").read_text())["runs"].values()
    assert (predicted["method"], predicted["ranks"]) == ("kfac-comm-opt", 2)
    assert set(run["phases_s"]) <= set(predicted["phases_s"])
    # the phases that take a share of the step (COMM-OPT times an empty gradient broadcast)
    step = run["step_s"]["mean"] if isinstance(run["step_s"], dict) else run["step_s"]
    measured = {k for k, v in run["phases_s"].items() if v > 0.01 * step}
    for phase in measured:  # the data phase too: calibrate measured the job's overhead
        assert 0 < predicted["phases_s"][phase] < float("inf"), phase
    assert {"factor_compute", "factor_comm", "inverse_compute"} <= measured
