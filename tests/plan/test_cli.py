"""``kfac-hpc plan`` as a user runs it: the shipped profile's table, plot and sweep file; a
run measured on this machine; bad input is one line, exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from kfac_hpc.sweep.spec import expand_points, load_spec
from tests.helpers.sweeps import cli

PROFILE = ["--hardware", "a100-hdr200", "--model", "resnet20", "--dataset", "cifar10"]


def test_profile_table_plot_and_sweep_file(tmp_path: Path) -> None:
    plot, sweep = tmp_path / "curves.png", tmp_path / "plan.toml"
    out = cli(
        "plan",
        *PROFILE,
        "--batch-size",
        "128",
        "--scaling",
        "weak",
        "--ranks",
        "1,2,16,1024",
        "--plot",
        str(plot),
        "--write-sweep",
        str(sweep),
        "--ranks-per-node",
        "1",
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4 * 4  # 4 rank counts × (sgd + three strategies)
    best = [r for r in rows if r[0].endswith("*")]
    assert [r[0] for r in best] == ["1*", "2*", "16*", "1024*"]
    assert all(r[1].startswith("kfac-") for r in best)
    assert plot.stat().st_size > 10_000
    spec = load_spec(sweep, {})
    assert spec.nodes == (1, 2, 16, 1024) and spec.axes["model"] == ("resnet20",)
    assert {p.params["kfac"] for p in expand_points(spec)} == {True, False}


def test_measured_on_this_machine(tmp_path: Path) -> None:
    out = cli(
        "plan",
        "--model",
        "small_cnn",
        "--dataset",
        "digits",
        "--batch-size",
        "64",
        "--ranks",
        "1,2",
        "--calibration-ranks",
        "2",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "this machine" in out.stdout and "gloo alpha" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 * 4
    assert all(float(r[2]) > 0 for r in rows)  # predicted step ms


def _bad_profile(tmp_path: Path) -> str:
    path = tmp_path / "bad.toml"
    path.write_text(
        "[machine]\ngemm_flops_per_s = 1e12\neigh_flops_per_s = 1e11\nmemory_bytes_per_s = 1e12\n"
        "memory_bytes = 1e10\ngemm_tflops = 3\n[network]\nranks_per_node = 4\n"
        "[network.intra]\nlatency_s = 1e-6\nbandwidth_bytes_per_s = 1e11\n"
        "[network.inter]\nlatency_s = 1e-5\nbandwidth_bytes_per_s = 1e10\n"
    )
    return str(path)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--ranks", "0,2"], "--ranks:"),
        (["--ranks", "two"], "--ranks:"),
        (["--methods", "sgd,kfac-fast"], "--methods:"),
        (["--model", "vgg"], "--model:"),
        (["--batch-size", "100", "--ranks", "1,8"], "--batch-size:"),
        (["--bucket-mb", "0"], "--bucket-mb:"),
        (["--hardware", "h100-nowhere"], "--hardware:"),
        (["--hardware", "BAD"], "--hardware:"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path: Path, args, field) -> None:
    args = [_bad_profile(tmp_path) if a == "BAD" else a for a in args]
    if "--hardware" not in args:
        args = ["--hardware", "a100-hdr200", *args]
    sweep = tmp_path / "never.toml"
    out = cli("plan", *args, "--write-sweep", str(sweep))
    assert out.returncode == 2, out.stdout + out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"kfac-hpc plan: error: {field}"), line
    assert not sweep.exists()
