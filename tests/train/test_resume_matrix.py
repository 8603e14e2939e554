"""Resuming a checkpoint with another training method or base optimizer (generated matrix).

Nine tiny source runs — every (method, --optimizer) of first order, K-FAC, FOSI × sgd, adam,
adamw — each checkpoint at step 2 (shared by a module-scoped fixture); every checkpoint is then
resumed (`--resume-from`, in process) with every (method, optimizer) pair into a fresh run dir.
No change of method or base optimizer is legitimate (docs/train.md, "Resume"): each is refused,
exit 2, with one stderr line naming the differing flag, and no run dir; the same pair resumes
and finishes with the checkpoint's step as its start. The run dir's own resume under another
setting is refused by its config hash. Older checkpoints, without the names, are judged by what
they hold.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from kfac_hpc.checkpoint import load_checkpoint
from kfac_hpc.cli import main
from kfac_hpc.train import job
from kfac_hpc.train.methods.resume import saved_method, saved_optimizers, training_mismatch

# The MLP on digits; K-FAC with its defaults; FOSI k = 1 with 2 Lanczos steps, an ESE at step 1.
TINY = ["--dataset", "digits", "--model", "mlp", "--batch-size", "32", "--no-progress"]
TINY += ["--lr", "0.01", "--lr-schedule", "constant", "--log-every", "2"]
METHODS: dict[str, list[str]] = {
    "first_order": ["--no-kfac"],
    "kfac": ["--kfac"],
    "fosi": ["--fosi", "--fosi-k", "1", "--lanczos-iters", "2", "--fosi-warmup", "1"],
}
OPTIMIZERS = ("sgd", "adam", "adamw")
PAIRS = [(m, o) for m in METHODS for o in OPTIMIZERS]
SWITCH = {"kfac": "--kfac", "fosi": "--fosi"}  # the flag a refused method change names
LEGITIMATE: dict[tuple[tuple[str, str], tuple[str, str]], str] = {}  # (from, to) -> run.json key
SAVED_AT, STEPS = 2, 4


def _args(method: str, optimizer: str) -> list[str]:
    return [*TINY, *METHODS[method], "--optimizer", optimizer]


def _train(run_dir: Path, *args: str) -> Result:
    return CliRunner().invoke(main, ["train", "--run-dir", str(run_dir), *args])


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _pair_id(pair: tuple[str, str]) -> str:
    return "-".join(pair)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Torch on one thread; the objects alive so far frozen out of the garbage collector, whose
    two full collections per run (``shutdown()``) would otherwise scan the whole test session."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.freeze()
    yield
    gc.unfreeze()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Each (method, optimizer)'s run dir, checkpointed at step 2 (its only checkpoint)."""
    root = tmp_path_factory.mktemp("sources")
    runs = {}
    for method, optimizer in PAIRS:
        run = root / f"{method}-{optimizer}"
        steps = ["--steps", str(SAVED_AT), "--checkpoint-every", str(SAVED_AT)]
        result = _train(run, *_args(method, optimizer), *steps)
        assert result.exit_code == 0, result.output
        runs[method, optimizer] = run
    return runs


def _checkpoint(run: Path) -> Path:
    return run / "checkpoints" / f"ckpt-{SAVED_AT:08d}.h5"


def _refused(result: Result, run: Path, flag: str, *words: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"kfac-hpc train: error: {flag}: "), lines[0]
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in result.output
    assert not run.exists()


def _expected_flag(saved: tuple[str, str], resumed: tuple[str, str]) -> str:
    """The flag a refusal names: the method's switch when the method differs (the resumed
    run's, else the checkpoint's), else --optimizer."""
    if saved[0] != resumed[0]:
        return SWITCH.get(resumed[0]) or SWITCH[saved[0]]
    return "--optimizer"


@pytest.mark.parametrize("saved", PAIRS, ids=_pair_id)
def test_checkpoints_record_their_method_and_base_optimizer(sources, saved) -> None:
    extra = load_checkpoint(_checkpoint(sources[saved])).tree["extra"]
    assert (extra["method"], extra["optimizer"]) == saved


@pytest.mark.parametrize("resumed", PAIRS, ids=_pair_id)
@pytest.mark.parametrize("saved", PAIRS, ids=_pair_id)
def test_resume_from_with_every_method_and_optimizer(tmp_path, sources, saved, resumed) -> None:
    """--resume-from names the source's run dir: the refusal names the file it took."""
    run = tmp_path / "run"
    resume = ["--steps", str(STEPS), "--resume-from", str(sources[saved])]
    result = _train(run, *_args(*resumed), *resume)
    if saved == resumed or (saved, resumed) in LEGITIMATE:
        assert result.exit_code == 0, result.output
        assert "Traceback" not in result.output
        summary = _json(run / "run.json")
        assert summary["state"] == "done" and summary["steps"] == STEPS
        assert (summary["method"], summary["optimizer"]) == resumed
        assert summary["attempts"][0]["start_step"] == SAVED_AT
        if (saved, resumed) in LEGITIMATE:
            assert summary[LEGITIMATE[saved, resumed]], summary
        if resumed[0] == "fosi":  # the same k and l: the eigenpairs are kept
            assert summary["fosi_resume_note"] is None
        return
    ckpt = _checkpoint(sources[saved])
    words = ["checkpoint was saved with", "resume with the same or start a new run"]
    words.append(f"; --resume-from {ckpt})")
    if saved[0] == resumed[0]:
        words.append(f"--optimizer {saved[1]};")
    _refused(result, run, _expected_flag(saved, resumed), *words)


@pytest.mark.parametrize("saved", PAIRS, ids=_pair_id)
def test_the_run_dirs_own_resume_under_another_setting_is_refused(sources, saved) -> None:
    run = sources[saved]
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*"))
    for resumed in PAIRS:
        if resumed == saved:
            continue
        result = _train(run, *_args(*resumed), "--steps", str(STEPS))
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kfac-hpc train: error: --run-dir: "), lines
        assert "holds another experiment" in lines[0] and "use a new --run-dir" in lines[0]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*")) == before


# ------------------------------------------------------------------ older checkpoints
OLD = [("first_order", "adamw"), ("kfac", "sgd"), ("fosi", "adam")]


@pytest.fixture(scope="module")
def old_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Checkpoints as older versions wrote them: no method or optimizer name in ``extra``, and
    a config without --optimizer and the method switches."""
    capture = job.capture_training_state

    def without_names(**kwargs: Any) -> Any:
        kwargs["extra"] = {k: v for k, v in kwargs["extra"].items() if k in ("attempt", "wall_s")}
        drop = ("optimizer", "kfac", "fosi")
        kwargs["config"] = {k: v for k, v in kwargs["config"].items() if k not in drop}
        return capture(**kwargs)

    root, runs = tmp_path_factory.mktemp("old"), {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(job, "capture_training_state", without_names)
        for method, optimizer in OLD:
            run = root / f"{method}-{optimizer}"
            steps = ["--steps", str(SAVED_AT), "--checkpoint-every", str(SAVED_AT)]
            result = _train(run, *_args(method, optimizer), *steps)
            assert result.exit_code == 0, result.output
            tree = load_checkpoint(_checkpoint(run)).tree
            assert "method" not in tree["extra"]
            assert "optimizer" not in json.loads(tree["config_json"])
            runs[method, optimizer] = _checkpoint(run)
    return runs


@pytest.mark.parametrize(
    ("saved", "resumed", "flag", "said"),
    [
        # Adam and AdamW told apart by torch's decoupled_weight_decay
        (OLD[0], ("first_order", "adam"), "--optimizer", "--optimizer adamw;"),
        (OLD[0], ("first_order", "sgd"), "--optimizer", "--optimizer adamw;"),
        (OLD[1], ("kfac", "adamw"), "--optimizer", "--optimizer sgd;"),
        # FOSI's state names its base's class
        (OLD[2], ("fosi", "adamw"), "--optimizer", "--optimizer adam;"),
        # the method by its state group
        (OLD[1], ("first_order", "sgd"), "--kfac", "saved with --kfac;"),
        (OLD[2], ("kfac", "adam"), "--kfac", "saved with --fosi;"),
        # no method state: not judged here; the K-FAC state check refuses it
        (OLD[0], ("kfac", "adamw"), "--resume-from", "no K-FAC state"),
    ],
)
def test_older_checkpoints_are_judged_by_what_they_hold(
    tmp_path, old_sources, saved, resumed, flag, said
) -> None:
    run = tmp_path / "run"
    resume = ["--steps", str(STEPS), "--resume-from", str(old_sources[saved])]
    _refused(_train(run, *_args(*resumed), *resume), run, flag, said)


def test_an_older_checkpoint_resumes_with_its_own_settings(tmp_path, old_sources) -> None:
    run = tmp_path / "run"
    resume = ["--steps", str(STEPS), "--resume-from", str(old_sources[OLD[0]])]
    result = _train(run, *_args(*OLD[0]), *resume)
    assert result.exit_code == 0, result.output
    assert _json(run / "run.json")["attempts"][0]["start_step"] == SAVED_AT


def test_what_cannot_be_told_is_not_judged() -> None:
    adam_family = {"param_groups": [{"betas": (0.9, 0.999), "lr": 0.1}], "state": {}}
    assert saved_optimizers({"optimizer": adam_family}, {}) == {"adam", "adamw"}
    for tree in ({}, {"optimizer": {}}, {"optimizer": {"param_groups": "x"}}, {"extra": 3}):
        assert saved_optimizers(tree, {}) == frozenset()
        assert saved_method(tree, {}) == (None, False)
        workload = {"model": "mlp", "model_args": {}, "dataset": "digits", "dataset_args": {}}
        mine = {
            "method": "kfac",
            "config_method": "kfac",
            "optimizer": "adam",
            "workload": workload,
        }
        assert training_mismatch(tree, {}, **mine) is None
    # Adam or AdamW (torch before decoupled_weight_decay) against SGD: refused
    mismatch = training_mismatch(
        {"optimizer": adam_family},
        {},
        method="kfac",
        config_method="kfac",
        optimizer="sgd",
        workload=workload,
    )
    assert mismatch is not None and mismatch.field == "optimizer"
    assert "--optimizer adam or adamw;" in mismatch.reason()
    # two switches on (not a config the job wrote): judged by the state group instead
    assert saved_method({"kfac_state": {}}, {"kfac": True, "fosi": True}) == ("kfac", False)
