"""The plan next to a finished run: a real `kfac-hpc train` run directory's configuration
maps to the plan's configuration, and every phase gets a prediction beside its measurement."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.contracts import PHASES
from kfac_hpc.contracts.records import phase_step_s
from kfac_hpc.contracts.rundir import PREDICTED
from kfac_hpc.plan.explain import config_of_run, predicted_vs_measured
from kfac_hpc.plan.planner import build_cost_model
from tests.train.conftest import run_plain


@pytest.mark.parametrize(
    ("fraction", "ranks", "method"),
    [("comm-opt", 4, "kfac-comm-opt"), (0.5, 4, "kfac-hybrid-opt"), (0.25, 4, "kfac-mem-opt")],
)
def test_strategy_of_a_run_config(fraction, ranks, method) -> None:
    config = {"world_size": ranks, "kfac": True, "grad_worker_fraction": fraction, "batch_size": 64}
    assert config_of_run(config).method == method
    assert config_of_run({**config, "kfac": False}).method == "sgd"


def test_a_real_run_gets_predictions_beside_its_measurements(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = run_plain(run_dir, "--steps", "12", "--inv-update-steps", "4", "--no-progress")
    assert out.returncode == 0, out.stderr[-2000:]
    planned = build_cost_model("small_cnn", "digits", "a100-hdr200")
    rows = predicted_vs_measured(planned, run_dir)
    assert set(rows) == {*PHASES, "other", "step"}
    run = json.loads((run_dir / "run.json").read_text())
    assert rows["forward"]["measured_s"] == pytest.approx(run["phases_s"]["forward"])
    assert rows["step"]["predicted_s"] == pytest.approx(
        sum(r["predicted_s"] for k, r in rows.items() if k != "step")
    )
    assert rows["inverse_compute"]["predicted_s"] > 0  # K-FAC is on in the quick run
    # "other": the run's step time outside every phase, measured and predicted: the ranks'
    # mean step (the step the phase means split) minus the phases
    measured_phases = sum(run["phases_s"].get(p, 0.0) for p in PHASES)
    rank_step = sum(run["rank_step_s"]) / len(run["rank_step_s"])
    assert rows["other"]["measured_s"] == pytest.approx(rank_step - measured_phases)
    assert rows["other"]["measured_s"] >= 0


def test_the_step_the_phases_split_is_the_ranks_mean() -> None:
    # rank 0 left its record-writing first: the other rank waited for it inside its step
    run = {"step_s": {"mean": 0.010}, "rank_step_s": [0.010, 0.012]}
    assert phase_step_s(run) == pytest.approx(0.011)
    assert phase_step_s({"step_s": {"mean": 0.010}}) == 0.010  # written before rank_step_s
    assert phase_step_s({}) is None


def test_plan_explain_writes_what_the_report_reads(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run_dir = sweep / "runs" / "one"
    out = run_plain(run_dir, "--steps", "12", "--inv-update-steps", "4", "--no-progress")
    assert out.returncode == 0, out.stderr[-2000:]
    result = CliRunner().invoke(
        main, ["plan", "--explain", str(sweep), "--hardware", "a100-hdr200"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads((sweep / PREDICTED).read_text())
    assert "a100-hdr200" in data["source"]
    (entry,) = data["runs"].values()
    assert list(data["runs"]) == ["runs/one"]
    expected = predicted_vs_measured(
        build_cost_model("small_cnn", "digits", "a100-hdr200"), run_dir
    )
    for phase in PHASES:
        assert entry["phases_s"][phase] == pytest.approx(expected[phase]["predicted_s"])
    assert entry["other_s"] == pytest.approx(expected["other"]["predicted_s"])
    assert entry["step_s"] == pytest.approx(expected["step"]["predicted_s"])


def test_plan_explain_of_a_folder_without_runs_is_bad_input(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["plan", "--explain", str(tmp_path), "--hardware", "a100-hdr200"]
    )
    assert result.exit_code == 2
    assert result.stderr.startswith("kfac-hpc plan: error: --explain:")
    assert not (tmp_path / PREDICTED).exists()


def test_plan_explain_prices_a_fosi_runs_ese_options(tmp_path: Path) -> None:
    """--explain prices a FOSI run's ESE with the options its config.json records (curvature
    fraction, basis dtype, reorthogonalization, kept basis), not the job's defaults."""
    ese = {
        "fosi_curvature_fraction": 0.25,
        "fosi_lanczos_dtype": "training",
        "fosi_reorthogonalize": "partial",
        "fosi_keep_basis": True,
    }
    config = {"world_size": 2, "fosi": True, "kfac": False, "batch_size": 32, "scaling": "weak"}
    config |= {"model": "small_cnn", "dataset": "digits", "fosi_k": 3}
    for name, options in (("cheap", ese), ("default", {})):
        run_dir = tmp_path / "sweep" / name
        run_dir.mkdir(parents=True)
        (run_dir / "config.json").write_text(json.dumps(config | options))
        (run_dir / "run.json").write_text(json.dumps({"phases_s": {}}))
    result = CliRunner().invoke(
        main, ["plan", "--explain", str(tmp_path / "sweep"), "--hardware", "a100-hdr200"]
    )
    assert result.exit_code == 0, result.output
    runs = json.loads((tmp_path / "sweep" / PREDICTED).read_text())["runs"]
    model = build_cost_model("small_cnn", "digits", "a100-hdr200").model
    for name, options in (("cheap", ese), ("default", {})):
        expected = model.predict(config_of_run(config | options)).phases_s["ese"]
        assert runs[name]["phases_s"]["ese"] == pytest.approx(expected)
    cheap = config_of_run(config | ese)
    assert (cheap.fosi_curvature_fraction, cheap.fosi_reorthogonalize) == (0.25, "partial")
    assert runs["cheap"]["phases_s"]["ese"] < runs["default"]["phases_s"]["ese"]


def test_a_real_fosi_run_gets_its_phases_and_its_ese_count(tmp_path: Path) -> None:
    """A real FOSI run (one rank): every phase it times (the ESE and the parameters' all-gather
    among them) gets a prediction beside its measurement, so "other" is what lies outside all
    of them; and the plan's ESEs a step are the ESEs the run counted over its steps (warm-up 3,
    every 4, 14 steps: at 3, 7 and 11), so its ``ese`` is the same per-step mean as run.json's."""
    run_dir = tmp_path / "run"
    args = ["--fosi", "--fosi-k", "2", "--lanczos-iters", "4", "--fosi-warmup", "3"]
    args += ["--ese-every", "4", "--steps", "14", "--no-progress"]
    out = run_plain(run_dir, *args)
    assert out.returncode == 0, out.stderr[-2000:]
    run = json.loads((run_dir / "run.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    assert run["world_size"] == 1 and run["ese_count"] == 3
    cfg = config_of_run(config)
    assert (cfg.method, cfg.steps, cfg.fosi_warmup, cfg.ese_every) == ("fosi", 14, 3, 4)
    assert cfg.ese_per_step == pytest.approx(run["ese_count"] / 14)
    planned = build_cost_model("small_cnn", "digits", "a100-hdr200")
    rows = predicted_vs_measured(planned, run_dir)
    timed = {p for p, s in run["phases_s"].items() if s > 0}
    assert {"ese", "grad_allreduce", "optimizer"} <= timed <= set(rows)
    assert {"ese", "param_allgather", "grad_allreduce", "optimizer"} <= set(rows)
    for phase, seconds in run["phases_s"].items():
        assert rows[phase]["measured_s"] == pytest.approx(seconds), phase
    rank_step = sum(run["rank_step_s"]) / len(run["rank_step_s"])
    assert rows["other"]["measured_s"] == pytest.approx(rank_step - sum(run["phases_s"].values()))
    one_ese = planned.model.predict(dataclasses.replace(cfg, steps=None)).phases_s["ese"] * 4
    assert rows["ese"]["predicted_s"] == pytest.approx(one_ese * 3 / 14)
