"""SGD, Adam, SGD+K-FAC and SGD+FOSI side by side: real runs of the job (digits, a small MLP;
in-process through the CLI, the FOSI one also under `mpiexec -n 2`) collected into one table
with a `method` column, FOSI's `ese` phase, its time to target against SGD, and a summary that
names it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.output import build_tables
from kfac_hpc.analysis.summary import summary_sentences
from kfac_hpc.cli import main
from tests.train.conftest import explain, read_json, run_ranks

STEPS = "60"
TRAIN = ["--model", "mlp", "--dataset", "digits", "--batch-size", "64", "--log-every", "10"]
TRAIN += ["--steps", STEPS, "--target-accuracy", "0.5", "--no-progress", "--lr", "0.05"]
FOSI = ["--fosi", "--fosi-k", "4", "--lanczos-iters", "8", "--fosi-warmup", "5"]
FOSI += ["--ese-every", "25"]
METHODS = {
    "sgd": ["--no-kfac"],
    "adam": ["--no-kfac", "--optimizer", "adam", "--lr", "0.003"],
    "kfac": ["--kfac"],
    "fosi": FOSI,
}


@pytest.mark.mpi
def test_methods_side_by_side_in_the_collector_and_summary(tmp_path):
    runs = tmp_path / "runs"
    for name, args in METHODS.items():
        argv = ["train", "--run-dir", str(runs / name), *TRAIN, *args]
        result = CliRunner().invoke(main, argv, catch_exceptions=False)
        assert result.exit_code == 0, result.output
    proc = run_ranks(2, runs / "fosi2", "--model", "mlp", *TRAIN[4:], *FOSI)
    assert proc.returncode == 0, explain(proc)
    assert read_json(runs / "fosi2" / "run.json")["world_size"] == 2

    tables = build_tables(collect(runs))
    rows = {r["run_id"]: r for r in tables.runs}
    assert {r["state"] for r in rows.values()} == {"done"}
    assert {k: r["method"] for k, r in rows.items()} == {
        "sgd": "first_order",
        "adam": "first_order",
        "kfac": "kfac",
        "fosi": "fosi",
        "fosi2": "fosi",
    }
    assert {k: r["optimizer_label"] for k, r in rows.items()} == {
        "sgd": "sgd",
        "adam": "adam",
        "kfac": "sgd+kfac",
        "fosi": "sgd+fosi",
        "fosi2": "sgd+fosi",
    }
    assert rows["fosi"]["first_order_group"] == rows["sgd"]["group"]
    assert rows["fosi"]["phase_ese_s"] > 0 and rows["sgd"]["phase_ese_s"] in (None, 0.0)
    assert rows["fosi2"]["world_size"] == 2 and rows["fosi2"]["peak_rss_bytes"] > 0
    ese = [p for p in tables.phases if p["run_id"] == "fosi" and p["phase"] == "ese"]
    assert len(ese) == 1 and ese[0]["mean_s"] > 0

    fosi_cells = [c for c in tables.scaling if c["optimizer_label"] == "sgd+fosi"]
    one_rank = [c for c in fosi_cells if c["world_size"] == 1] or fosi_cells
    compared = [c for c in one_rank if c["time_to_target_s_median"] is not None]
    assert compared, fosi_cells  # FOSI reached 50 % within 60 steps
    for cell in compared:
        sgd = rows["sgd"]["time_to_target_s"]
        assert cell["kfac_vs_first_order_tts_ratio"] == pytest.approx(
            cell["time_to_target_s_median"] / sgd
        )
    text = " ".join(summary_sentences(tables.scaling, tables.runs))
    assert "FOSI reaches the target accuracy" in text and "K-FAC reaches" in text, text
