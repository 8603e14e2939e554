"""`kfac-hpc train --fosi` against hostile input (in process, tiny runs):

- sizes bounded by the option table and by the model's parameter count, refused before anything
  is written (exit 2, one line naming the flag);
- TOML numbers finite and within the flags' bounds;
- a run whose FOSI curvature or loss becomes non-finite ends `error` with the reason, no
  traceback;
- a FOSI checkpoint resumed with another base optimizer is refused by name; with another k or l
  its eigenpairs are re-estimated at the next step, said in the log and run.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from torch import nn

from kfac_hpc.cli import main
from kfac_hpc.contracts import validate_run_dir
from kfac_hpc.optim.fosi import NonFiniteCurvature
from kfac_hpc.train.config import ConfigError, TrainConfig, load_config
from kfac_hpc.train.job import TrainingDiverged
from kfac_hpc.train.methods import MethodSetup
from kfac_hpc.train.methods.fosi import FOSIMethod
from kfac_hpc.train.workloads import build_model

# The MLP on digits: 26,122 parameters; FOSI k = 2 with 4 Lanczos steps, the first ESE at step 1.
MLP = ["--dataset", "digits", "--model", "mlp", "--batch-size", "64", "--no-progress"]
FOSI = ["--fosi", "--fosi-k", "2", "--lanczos-iters", "4", "--fosi-warmup", "1"]
FOSI += ["--lr-schedule", "constant", "--lr", "0.05", "--log-every", "2"]
FOSI += ["--fosi-residual-tol", "1"]  # every Ritz pair kept: 4 Lanczos steps converge none
# cnn1d with one channel on a few mnist1d sequences: 74 parameters.
TINY = ["--dataset", "mnist1d", "--num-samples", "256", "--model", "cnn1d"]
TINY += ["--cnn1d-channels", "1", "--batch-size", "64", "--no-progress", "--fosi"]


def _train(run_dir: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["train", "--run-dir", str(run_dir), *args])


def _refused(result: Result, run_dir: Path, *words: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in result.output
    assert not run_dir.exists()


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# ------------------------------------------------------------------ sizes
@pytest.mark.parametrize(
    ("flag", "value", "bound"),
    [
        ("--fosi-k", "2147483647", "at most 1024"),
        ("--fosi-l", "2147483647", "at most 1024"),
        ("--lanczos-iters", "2147483647", "at most 8192"),
        ("--fosi-clip", "2147483647", "at most 1000000"),
    ],
)
def test_sizes_beyond_the_table_bounds_exit_2_naming_the_flag(tmp_path, flag, value, bound):
    run = tmp_path / "run"
    _refused(_train(run, *MLP, "--fosi", flag, value), run, f"{flag}:", bound)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--fosi-k", "74"), "--fosi-k"),
        (("--fosi-k", "1", "--fosi-l", "80"), "--fosi-l"),
        (("--fosi-k", "2", "--lanczos-iters", "74"), "--lanczos-iters"),
    ],
)
def test_sizes_at_the_parameter_count_exit_2_before_anything_is_written(tmp_path, args, flag):
    run = tmp_path / "run"
    _refused(_train(run, *TINY, *args), run, f"{flag}:", "74 parameters", "--model cnn1d")


def _mlp_setup(**values: Any) -> MethodSetup:
    config = TrainConfig(model="mlp", kfac=False, fosi=True, **values)
    return MethodSetup(config, build_model(TrainConfig(model="mlp"), (1, 8, 8), 10), 1)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"fosi_k": 26122}, "fosi_k"),
        ({"fosi_k": 20000, "fosi_l": 6122}, "fosi_k"),
        ({"fosi_k": 2, "lanczos_iters": 26122}, "lanczos_iters"),
        ({"fosi_k": 2, "lanczos_iters": 2147483647}, "lanczos_iters"),
    ],
)
def test_the_mlp_s_26122_parameters_bound_k_l_and_the_lanczos_steps(values, field):
    with pytest.raises(ConfigError, match="26122 parameters") as caught:
        FOSIMethod(_mlp_setup(**values))
    assert caught.value.field == field
    FOSIMethod(_mlp_setup(fosi_k=2, lanczos_iters=26121))  # below the count: built


# ------------------------------------------------------------------ TOML
@pytest.mark.parametrize(
    ("line", "flag"),
    [
        ("ese_every = inf", "--ese-every"),
        ("ese_every = nan", "--ese-every"),
        ("fosi_warmup = inf", "--fosi-warmup"),
        ("fosi_clip = inf", "--fosi-clip"),
        ("fosi_clip = nan", "--fosi-clip"),
        ("fosi_clip = 2147483647.0", "--fosi-clip"),
        ("fosi_alpha = inf", "--fosi-alpha"),
        ("fosi_momentum = nan", "--fosi-momentum"),
        ("fosi_k = 2147483647", "--fosi-k"),
        ("fosi_l = 1e300", "--fosi-l"),
        ("lanczos_iters = 1e20", "--lanczos-iters"),
    ],
)
def test_toml_numbers_are_finite_and_within_the_flags_bounds(tmp_path, line, flag):
    config = tmp_path / "c.toml"
    config.write_text(f"fosi = true\n{line}\n")
    run = tmp_path / "run"
    _refused(_train(run, "--config", str(config)), run, f"{flag}:")
    name = line.split(" =")[0]
    with pytest.raises(ConfigError) as caught:
        load_config(config, {})
    assert caught.value.field == name


# ------------------------------------------------------------------ divergence
def _ended_error(run: Path, result: Result, *words: str) -> dict[str, Any]:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output, result.output
    message = (run / "error").read_text()
    assert "TrainingDiverged" in message and all(w in message for w in words), message
    summary = _json(run / "run.json")
    assert summary["state"] == "error" and summary["error"] == message.strip()
    assert not (run / "done").exists() and validate_run_dir(run) == []
    return summary


UNGUARDED = ("--no-fosi-ese-check",)


@pytest.mark.parametrize(
    "args",
    [  # the alpha cases without the ESE's loss check, which would reject their subspace steps
        ("--fosi-alpha", "2147483647", "--ese-every", "2", *UNGUARDED),
        ("--fosi-alpha", "1e6", "--ese-every", "2", *UNGUARDED),
        ("--lr", "1e6", "--fosi-warmup", "3", "--log-every", "20"),
    ],
)
def test_a_diverging_fosi_run_ends_error_with_the_reason(tmp_path, args):
    run = tmp_path / "run"
    result = _train(run, *MLP, *FOSI, "--steps", "8", *args)
    _ended_error(run, result, "became non-finite at step", "--fosi-alpha")


def test_the_ese_check_rejects_a_subspace_step_that_raises_the_loss(tmp_path):
    run = tmp_path / "run"
    args = ("--steps", "8", "--fosi-alpha", "1e6", "--ese-every", "2")
    result = _train(run, *MLP, *FOSI, *args)
    assert result.exit_code == 0, result.output
    summary = _json(run / "run.json")
    assert summary["fosi_subspace_rejected_at_steps"] == [1, 3, 5, 7]  # every ESE's


def test_non_finite_curvature_of_a_finite_loss_is_named_so(monkeypatch):
    method = FOSIMethod(_mlp_setup(fosi_k=2, lanczos_iters=4))

    def overflow(*_: Any, **__: Any) -> None:
        raise NonFiniteCurvature("Lanczos step 2: not finite", step=7, diverged=False)

    monkeypatch.setattr(method.fosi, "step", overflow)

    class Timer:
        def lap(self, phase: str) -> None:
            pass

    with pytest.raises(TrainingDiverged, match="the curvature became non-finite at step 7"):
        method.step(Timer(), lambda: torch.zeros(()))  # type: ignore[arg-type]


# ------------------------------------------------------------------ resume
@pytest.fixture(scope="module")
def sgd_ckpt(tmp_path_factory) -> Path:
    """A 4-step FOSI run around SGD (k = 2, one ESE at step 1), checkpointed at step 4."""
    run = tmp_path_factory.mktemp("fosi") / "run"
    result = _train(run, *MLP, *FOSI, "--steps", "4", "--checkpoint-every", "4")
    assert result.exit_code == 0, result.output
    return run / "checkpoints" / "ckpt-00000004.h5"


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_resume_with_another_base_optimizer_is_refused_by_name(tmp_path, sgd_ckpt, optimizer):
    run = tmp_path / "run"
    result = _train(
        run, *MLP, *FOSI, "--steps", "6", "--optimizer", optimizer, "--resume-from", str(sgd_ckpt)
    )
    words = ("--optimizer:", "checkpoint was saved with --optimizer sgd; resume with the same")
    _refused(result, run, *words)


def test_resume_with_another_k_reestimates_at_the_next_step_and_says_so(tmp_path, sgd_ckpt):
    run = tmp_path / "run"
    result = _train(
        run, *MLP, *FOSI, "--fosi-k", "3", "--steps", "6", "--resume-from", str(sgd_ckpt)
    )
    assert result.exit_code == 0, result.output
    said = "saved with --fosi-k 2 --fosi-l 0, this run has --fosi-k 3 --fosi-l 0"
    assert said in result.output and "re-estimated by an ESE at step 4" in result.output
    summary = _json(run / "run.json")
    assert summary["fosi_reestimated_at_steps"] == [4] and said in summary["fosi_resume_note"]
    assert summary["ese_count"] == 2 and len(summary["ese_s"]) == 1  # the ESE at step 4
    assert len(summary["fosi_eigenvalues"]) == 3


def test_resume_with_the_same_settings_keeps_the_eigenpairs(tmp_path, sgd_ckpt):
    run = tmp_path / "run"
    result = _train(run, *MLP, *FOSI, "--steps", "6", "--resume-from", str(sgd_ckpt))
    assert result.exit_code == 0, result.output
    summary = _json(run / "run.json")
    assert summary["fosi_reestimated_at_steps"] == [] and summary["fosi_resume_note"] is None
    assert summary["ese_count"] == 1 and summary["ese_s"] == []


def test_library_state_mismatch_is_bad_input_of_resume_from(tmp_path, sgd_ckpt, monkeypatch):
    """A FOSI state that does not fit (here: the job's checks of the recorded optimizer are
    off) is refused by the FOSI state itself, still one line and exit 2."""
    import kfac_hpc.train.job as job

    monkeypatch.setattr(job, "_saved_config", lambda checkpoint: {})
    monkeypatch.setattr(job, "training_mismatch", lambda *args, **kwargs: None)
    run = tmp_path / "run"
    result = _train(
        run, *MLP, *FOSI, "--steps", "6", "--optimizer", "adam", "--resume-from", str(sgd_ckpt)
    )
    _refused(result, run, "--resume-from:", "base optimizer SGD", "Adam")


def test_the_mlp_on_digits_has_26122_parameters():
    model: nn.Module = build_model(TrainConfig(model="mlp"), (1, 8, 8), 10)
    assert sum(p.numel() for p in model.parameters()) == 26122
