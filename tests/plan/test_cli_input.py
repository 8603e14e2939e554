"""Hostile input to ``kfac-hpc plan``, in process: every bad flag, profile and output path is
one line on stderr naming the flag, exit code 2, nothing written; the package's own models and
datasets plan; the measured plan needs no data files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kfac_hpc.cli import main
from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.options import DATASETS, MODELS, TEXT_DATASETS, TEXT_MODELS
from kfac_hpc.plan import files as plan_files
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.errors import PlanInputError
from kfac_hpc.plan.layers import INPUTS, check_fit, model_shape
from kfac_hpc.plan.overhead import overhead_dataset
from kfac_hpc.plan.profiles import PROFILE_FIELDS, NetworkProfile, load_profile
from kfac_hpc.train.config import TrainConfig

CHEAP = ["--hardware", "a100-hdr200", "--model", "mlp", "--dataset", "digits", "--ranks", "1,2"]
GOOD_PROFILE = {
    "machine": {
        "gemm_flops_per_s": "1e12",
        "eigh_flops_per_s": "1e11",
        "memory_bytes_per_s": "1e12",
        "memory_bytes": "1e10",
    },
    "network": {"ranks_per_node": "4"},
    "network.intra": {"latency_s": "1e-6", "bandwidth_bytes_per_s": "1e11"},
    "network.inter": {"latency_s": "1e-5", "bandwidth_bytes_per_s": "1e10"},
}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def plan(*args: str) -> Result:
    return CliRunner().invoke(main, ["plan", *args])


def assert_bad(result: Result, flag: str, *words: str) -> str:
    """Exit 2, nothing on stdout, one line on stderr naming ``flag`` (and ``words``)."""
    assert result.exit_code == 2, (result.output, result.stderr)
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"kfac-hpc plan: error: {flag}"), line
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in line, line
    return line


def write_profile(path: Path, overrides: dict[str, dict[str, str | None]] | None = None) -> Path:
    """A valid profile with ``overrides`` (``{section: {key: TOML value or None to drop}}``)."""
    tables = {section: dict(values) for section, values in GOOD_PROFILE.items()}
    for section, values in (overrides or {}).items():
        for key, value in values.items():
            if value is None:
                tables.setdefault(section, {}).pop(key, None)
            else:
                tables.setdefault(section, {})[key] = value
    text = "".join(
        f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in values.items())
        for section, values in tables.items()
    )
    path.write_text(text)
    return path


# --- 1. the measured plan needs the input's shape, not the data --------------------------


@pytest.mark.parametrize("dataset", [d for d in DATASETS if d not in TEXT_DATASETS])
def test_overhead_is_measured_without_data_files(dataset: str) -> None:
    measured = overhead_dataset(dataset)
    assert INPUTS[measured] == INPUTS[dataset]  # the same input shape and classes
    TrainConfig(model="mlp", dataset=measured).validate()  # no --data-path needed


def _fake_network(*args: object, **kwargs: object) -> tuple[NetworkProfile, tuple, list]:
    link = AlphaBeta(2e-5, 1e-9)
    return NetworkProfile("fake-gloo", 1 << 20, link, link), (), []


@pytest.mark.slow
@pytest.mark.parametrize(("model", "dataset"), [("small_cnn", "cifar10"), ("cnn1d", "mnist1d")])
def test_measured_plan_needs_no_data(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: str, dataset: str
) -> None:
    """The defaults' dataset (cifar10) and the package's own (mnist1d) plan on this machine
    with no data files (the collectives' calibration is faked: it is tested elsewhere)."""
    import kfac_hpc.plan.calibrate as calibrate

    monkeypatch.setattr(calibrate, "local_network", _fake_network)
    monkeypatch.chdir(tmp_path)
    result = plan("--model", model, "--dataset", dataset, "--batch-size", "16", "--ranks", "1,2")
    assert result.exit_code == 0, result.stderr
    assert "this machine" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 * 4 and all(float(r[2]) > 0 for r in rows)
    assert list(tmp_path.iterdir()) == []


# --- 2. the package's own model and dataset ----------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dataset", DATASETS)
def test_every_model_and_dataset_plans_or_is_refused_in_one_line(model: str, dataset: str) -> None:
    """The job's rule (TrainConfig.validate) decides which pairs fit; the plan agrees, and
    refuses the transformer workload (not modelled yet) by name."""
    if model in TEXT_MODELS or dataset in TEXT_DATASETS:
        with pytest.raises(PlanInputError, match=r"^(model|dataset): .*transformer workload"):
            model_shape(model, dataset)
        return
    try:
        TrainConfig(model=model, dataset=dataset).validate()
        fits = True
    except InputError as exc:
        fits = exc.field != "model"  # not "needs --data-path": the plan needs no data
    if not fits:
        with pytest.raises(PlanInputError, match=r"^model: .*give --"):
            check_fit(model, dataset)
        return
    if INPUTS[dataset][0][-1] > 32 and model not in ("mlp", "resnet50"):
        return  # a CIFAR network on 224x224: fine, but slow to probe
    assert model_shape(model, dataset).layers


@pytest.mark.parametrize(
    ("args", "ok"),
    [
        (["--model", "cnn1d", "--dataset", "mnist1d"], True),
        (["--model", "mlp", "--dataset", "mnist1d"], True),
        (["--model", "cnn1d"], False),
        (["--dataset", "mnist1d"], False),
    ],
)
def test_cnn1d_and_mnist1d(args: list[str], ok: bool) -> None:
    result = plan("--hardware", "a100-hdr200", "--ranks", "1,2,4", *args)
    if ok:
        assert result.exit_code == 0, result.stderr
        rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
        assert len(rows) == 3 * 4
    else:
        assert_bad(result, "--model", "mnist1d")


# --- 3. and 4. profiles -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"garbage [[[ = =", ("not valid TOML",)),
        (b"\xff\xfe[machine]\n", ("not UTF-8",)),
        (b"x = " + b"[" * 5000 + b"]" * 5000, ("not valid TOML",)),
        (b"[machine]\n" + b"# pad\n" * 200_000, ("larger than",)),
        (b"machine = 3\n", ("machine",)),
        (b"[machine]\n[network]\n", ("machine.gemm_flops_per_s", "missing")),
    ],
)
def test_unreadable_profile_is_one_line(tmp_path: Path, content: bytes, words: tuple) -> None:
    path = tmp_path / "p.toml"
    path.write_bytes(content)
    assert_bad(plan("--hardware", str(path)), "--hardware", str(path), *words)


@pytest.mark.parametrize(
    "path", ["/dev/zero", "/dev/zero/x.toml", "/nonexistent/p.toml", "DIR", "p\nq.toml"]
)
def test_profile_path_that_is_not_a_file(tmp_path: Path, path: str) -> None:
    path = str(tmp_path) if path == "DIR" else path
    assert_bad(plan("--hardware", path), "--hardware")


def _bad_values(field) -> list[str]:
    """TOML values out of ``field``'s kind or range."""
    bad = ["inf", "nan", "-1", '"fast"', "true", "[1]", f"{field.high * 10:.6g}"]
    if field.low > 0:
        bad += ["0", f"{field.low / 10:.6g}", "1e-300"]
    if field.kind == "int":
        bad += ["2.5", f"{field.high + 1}.0"]
    return bad


@pytest.mark.parametrize(
    ("field", "value"),
    [(f, v) for f in PROFILE_FIELDS for v in _bad_values(f)],
    ids=lambda x: getattr(x, "name", x),
)
def test_every_profile_field_is_checked(tmp_path: Path, field, value: str) -> None:
    path = write_profile(tmp_path / "p.toml", {field.section: {field.key: value}})
    with pytest.raises(PlanInputError) as info:
        load_profile(str(path))
    assert info.value.field == "hardware"
    message = str(info.value)
    assert str(path) in message and field.name in message and "\n" not in message


@pytest.mark.parametrize("field", PROFILE_FIELDS, ids=lambda f: f.name)
def test_profile_field_bounds_are_accepted(tmp_path: Path, field) -> None:
    for value in (field.low, field.high):
        text = str(int(value)) if field.kind == "int" else f"{value!r}"
        path = write_profile(tmp_path / "p.toml", {field.section: {field.key: text}})
        machine, network = load_profile(str(path))
        got = {**vars(machine), "ranks_per_node": network.ranks_per_node}
        if field.key in got and field.section in ("machine", "network"):
            assert got[field.key] == value


@pytest.mark.parametrize(
    "overrides",
    [
        {"machine": {"gemm_flops_per_s": None}},
        {"machine": {"cores_per_node": "4", "threads_per_rank": "8"}},
        {"machine": {"device": '"a\\nb"'}},
        {"network": {"ranks_per_node": "100000"}},
        {"network.intra": {"latency_s": None}},
        {"machine": {"gemm_tflops": "3"}},
    ],
)
def test_nonsense_profile_is_refused_by_the_cli(tmp_path: Path, overrides) -> None:
    path = write_profile(tmp_path / "p.toml", overrides)
    sweep = tmp_path / "plan.toml"
    result = plan("--hardware", str(path), "--write-sweep", str(sweep))
    assert_bad(result, "--hardware", str(path))
    assert not sweep.exists()


def test_a_good_profile_prints_finite_times(tmp_path: Path) -> None:
    path = write_profile(tmp_path / "p.toml")
    result = plan("--hardware", str(path), "--ranks", "1,4,64")
    assert result.exit_code == 0, result.stderr
    assert "inf" not in result.stdout and "nan" not in result.stdout


# --- 6. and the rest of the flags --------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--fosi-k", "99999999999999999999"], "--fosi-k"),
        (["--fosi-k", "0"], "--fosi-k"),
        (["--fosi-l", "-1"], "--fosi-l"),
        (["--lanczos-iters", "0"], "--lanczos-iters"),
        (["--fosi-k", "4", "--fosi-l", "2", "--lanczos-iters", "5"], "--lanczos-iters"),
        (["--ese-every", "2147483648"], "--ese-every"),
        (["--ese-every", "0"], "--ese-every"),
        (["--fosi-curvature-fraction", "0"], "--fosi-curvature-fraction"),
        (["--fosi-curvature-fraction", "1.5"], "--fosi-curvature-fraction"),
        (["--fosi-curvature-fraction", "nan"], "--fosi-curvature-fraction"),
        (["--fosi-lanczos-dtype", "float16"], "--fosi-lanczos-dtype"),
        (["--fosi-reorthogonalize", "sometimes"], "--fosi-reorthogonalize"),
        (["--bucket-mb", "inf"], "--bucket-mb"),
        (["--bucket-mb", "nan"], "--bucket-mb"),
        (["--bucket-mb", "0"], "--bucket-mb"),
        (["--bucket-mb", "1e-300"], "--bucket-mb"),
        (["--bucket-mb", "1e300"], "--bucket-mb"),
        (["--batch-size", "0"], "--batch-size"),
        (["--batch-size", "4294967296"], "--batch-size"),
        (["--factor-update-steps", "0"], "--factor-update-steps"),
        (["--inv-update-steps", "-1"], "--inv-update-steps"),
        (["--steps", "0"], "--steps"),
        (["--ranks-per-node", "0"], "--ranks-per-node"),
        (["--ranks-per-node", "1000000"], "--ranks-per-node"),
        (["--ranks", "0,2"], "--ranks"),
        (["--ranks", "two"], "--ranks"),
        (["--ranks", ""], "--ranks"),
        (["--ranks", ","], "--ranks"),
        (["--ranks", "4294967296"], "--ranks"),
        (["--ranks", ",".join(str(i) for i in range(1, 200))], "--ranks"),
        (["--calibration-ranks", "1"], "--calibration-ranks"),
        (["--calibration-ranks", "100000"], "--calibration-ranks"),
        (["--methods", ""], "--methods"),
        (["--methods", ","], "--methods"),
        (["--methods", " , ,"], "--methods"),
        (["--methods", "sgd,kfac-fast"], "--methods"),
        (["--model", "vgg"], "--model"),
        (["--dataset", "mnist"], "--dataset"),
        (["--batch-size", "100", "--ranks", "1,8"], "--batch-size"),
        (["--hardware", "h100-nowhere"], "--hardware"),
        (["--hardware", ""], "--hardware"),
        (["--write-sweep", ""], "--write-sweep"),
        (["--write-sweep", "  "], "--write-sweep"),
        (["--plot", ""], "--plot"),
        (["--ranks-per-node", "3", "--write-sweep", "OUT/plan.toml"], "--ranks-per-node"),
    ],
)
def test_bad_flag_is_one_line_naming_it(tmp_path: Path, args: list[str], flag: str) -> None:
    args = [a.replace("OUT", str(tmp_path)) for a in args]
    assert_bad(plan(*CHEAP, *args), flag)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--batch-size", "abc"], "--batch-size: 'abc' is not a valid integer"),
        (["--bogus"], "--bogus: no such option"),
        (["--scaling"], "--scaling: "),
    ],
)
def test_click_errors_are_one_line(args: list[str], flag: str) -> None:
    result = plan(*CHEAP, *args)
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("kfac-hpc plan: error: ") and flag in line, line


# --- 5. output files ---------------------------------------------------------------------


def _targets(tmp_path: Path) -> dict[str, str]:
    afile = tmp_path / "a-file"
    afile.write_text("x")
    return {
        "missing parent": str(tmp_path / "missing" / "out.png"),
        "under a file": str(afile / "out.png"),
        "a folder": str(tmp_path),
        "/dev/full": "/dev/full",
        "/dev/null": "/dev/null",
        "/proc/version": "/proc/version",
        "new in /proc": "/proc/kfac-hpc-plan-test.png",
        "too long a name": str(tmp_path / ("x" * 300 + ".png")),
        "a NUL byte": str(tmp_path / "a\0b.png"),
    }


@pytest.mark.parametrize("flag", ["--plot", "--write-sweep"])
@pytest.mark.parametrize(
    "target",
    [
        "missing parent",
        "under a file",
        "a folder",
        "/dev/full",
        "/dev/null",
        "/proc/version",
        "new in /proc",
        "too long a name",
        "a NUL byte",
    ],
)
def test_unwritable_output_is_one_line_nothing_written(
    tmp_path: Path, flag: str, target: str
) -> None:
    path = _targets(tmp_path)[target]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_bad(plan(*CHEAP, flag, path), flag)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no folder, no temp file
    assert not (tmp_path / "missing").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_read_only_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    assert_bad(plan(*CHEAP, "--write-sweep", str(folder / "plan.toml")), "--write-sweep")
    assert list(folder.iterdir()) == []


def test_plot_suffix_and_same_file(tmp_path: Path) -> None:
    assert_bad(plan(*CHEAP, "--plot", str(tmp_path / "curves.jpg")), "--plot", ".png")
    assert_bad(plan(*CHEAP, "--plot", str(tmp_path / "curves")), "--plot")
    same = str(tmp_path / "x.png")
    assert_bad(plan(*CHEAP, "--plot", same, "--write-sweep", same), "--write-sweep")
    assert list(tmp_path.iterdir()) == []


def test_outputs_written_atomically(tmp_path: Path) -> None:
    sweep, plot = tmp_path / "plan.toml", tmp_path / "curves.svg"
    sweep.write_text("old")
    result = plan(*CHEAP, "--write-sweep", str(sweep), "--plot", str(plot))
    assert result.exit_code == 0, result.stderr
    assert sweep.read_text().startswith("# Written by `kfac-hpc plan`")
    assert plot.read_text().lstrip().startswith("<?xml")
    assert f"plot: {plot}" in result.stdout and f"sweep file: {sweep}" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.svg", "plan.toml"]


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk filling up while the outputs are written: one line, exit 2, no success printed,
    no temp file, the old file intact and the other output not written either."""
    sweep, plot = tmp_path / "plan.toml", tmp_path / "curves.png"
    sweep.write_text("old")
    real, calls = os.fsync, []

    def failing(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the second file (the plot)
            raise OSError(28, "No space left on device")
        real(fd)

    monkeypatch.setattr(plan_files.os, "fsync", failing)
    result = plan(*CHEAP, "--plot", str(plot), "--write-sweep", str(sweep))
    assert_bad(result, "--plot", "No space left")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.toml"]
    assert sweep.read_text() == "old"


@pytest.mark.parametrize("content", ["garbage", "[1, 2]", '{"world_size": "x"}', "\udcff"])
def test_explain_a_bad_run_config_is_one_line(tmp_path: Path, content: str) -> None:
    run = tmp_path / "sweep" / "run"
    run.mkdir(parents=True)
    (run / "config.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    (run / "run.json").write_text("{}")
    assert_bad(plan("--hardware", "a100-hdr200", "--explain", str(tmp_path / "sweep")), "--explain")
    assert not (tmp_path / "sweep" / "predicted.json").exists()
    out = plan("--explain", str(tmp_path / "sweep"), "--plot", str(tmp_path / "x.png"))
    assert_bad(out, "--plot", "--explain")


def test_the_transformer_workload_is_refused_in_one_line_before_any_work(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    result = plan("--model", "gpt", "--dataset", "generated_text")
    assert_bad(result, "--model", "transformer workload")
    assert list(tmp_path.iterdir()) == []


# --- 7. FOSI's ESE options, as the job spells them ------------------------------------------

_ESE_FLAGS = (
    "--fosi-curvature-fraction",
    "--fosi-lanczos-dtype",
    "--fosi-reorthogonalize",
    "--fosi-keep-basis",
)


def test_the_ese_flags_are_the_jobs() -> None:
    """plan's ESE flags are kfac-hpc train's, each with its negation where the job has one."""
    from kfac_hpc.plan.cli import plan as plan_command
    from kfac_hpc.train.cli import train

    def spelled(command: object) -> set[str]:
        params = command.params  # type: ignore[attr-defined]
        return {o for p in params for o in (*p.opts, *p.secondary_opts)}

    job, ours = spelled(train), spelled(plan_command)
    for flag in (*_ESE_FLAGS, "--no-fosi-keep-basis", "--fosi-k", "--ese-every", "--fosi-l",
                 "--lanczos-iters"):  # fmt: skip
        assert flag in ours and flag in job, flag


def _fosi_configs(monkeypatch: pytest.MonkeyPatch, *extras: list[str]) -> list:
    """The configuration ``plan`` predicts for FOSI at 2 ranks with each of ``extras``'
    flags added, one ``plan`` run each (which must succeed)."""
    from kfac_hpc.plan import planner

    seen = []
    original = planner.predict_all

    def recording(*args: object, **kwargs: object) -> list:
        out = original(*args, **kwargs)  # type: ignore[arg-type]
        seen.extend(p.config for p in out)
        return out

    monkeypatch.setattr(planner, "predict_all", recording)
    for extra in extras:
        result = plan(*CHEAP[:6], "--methods", "fosi", "--ranks", "2", *extra)
        assert result.exit_code == 0, result.stderr
    return seen


def test_the_ese_flags_reach_the_cost_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given, the ESE's options are the predicted configurations'; left out, the job's
    defaults."""
    chosen = ["--fosi-curvature-fraction", "0.25", "--fosi-lanczos-dtype", "training"]
    chosen += ["--fosi-reorthogonalize", "partial", "--fosi-keep-basis"]
    given, default = _fosi_configs(monkeypatch, chosen, [])
    assert (given.fosi_curvature_fraction, given.fosi_lanczos_dtype) == (0.25, "training")
    assert (given.fosi_reorthogonalize, given.fosi_keep_basis) == ("partial", True)
    assert (default.fosi_curvature_fraction, default.fosi_lanczos_dtype) == (1.0, "float64")
    assert (default.fosi_reorthogonalize, default.fosi_keep_basis) == ("full", False)


@pytest.mark.parametrize(
    ("args", "field", "given", "default"),
    [
        (["--fosi-l", "3"], "fosi_l", 3, 0),
        (["--lanczos-iters", "24"], "lanczos_iters", 24, None),
    ],
)
def test_the_pair_flags_reach_the_cost_model(
    monkeypatch: pytest.MonkeyPatch, args: list[str], field: str, given: int, default: object
) -> None:
    """--fosi-l and --lanczos-iters set the predicted configurations' fields of those names;
    left out, the job's defaults (l = 0, lanczos_iters unset: 4(k + l))."""
    with_flag, without = _fosi_configs(monkeypatch, args, [])
    assert (getattr(with_flag, field), getattr(without, field)) == (given, default)
