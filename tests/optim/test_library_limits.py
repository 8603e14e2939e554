"""Library limits versus CLI limits: the option table carries each option's mathematical
validity (``check``: what the library refuses) and its operational bound (``maximum``: what
``kfac-hpc train`` and ``sweep`` refuse besides). ``KFACPreconditioner(model, kl_clip=1e12)``
("effectively no clip") is a legitimate library call; ``kfac-hpc train --kl-clip 1e12`` is
refused with exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.cli import main
from kfac_hpc.contracts.option_values import range_problem, validity_problem
from kfac_hpc.contracts.options import OPTIONS

LARGE = [
    ("kl_clip", 1e12),
    ("damping", 1e9),
    ("lr", 1e9),
    ("factor_update_steps", 2**40),
    ("inv_update_steps", 2**40),
    ("allreduce_bucket_cap_mb", 1e9),
]


@pytest.mark.parametrize(("name", "value"), LARGE, ids=[n for n, _ in LARGE])
def test_library_accepts_large_valid_values(name, value):
    model = nn.Linear(3, 2)
    pre = KFACPreconditioner(model, **{name: value})
    model(torch.randn(4, 3)).sum().backward()
    pre.step()  # scheduled values are checked at the step too


def test_scheduled_large_value_is_accepted_at_the_step():
    model = nn.Linear(3, 2)
    pre = KFACPreconditioner(model, kl_clip=lambda step: 1e12 * (step + 1))
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        pre.step()


INVALID = [
    ("kl_clip", 0.0),
    ("kl_clip", -1.0),
    ("kl_clip", float("nan")),
    ("damping", 0.0),
    ("damping", -1e-3),
    ("damping", float("nan")),
    ("damping", float("inf")),
    ("lr", float("nan")),
    ("allreduce_bucket_cap_mb", -1.0),
    ("factor_update_steps", 0),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_library_refuses_mathematically_invalid_values(name, value):
    with pytest.raises(ValueError, match=f"{name} must be"):
        KFACPreconditioner(nn.Linear(3, 2), **{name: value})


def test_the_table_splits_validity_from_the_operational_bound():
    kl_clip = OPTIONS["kl_clip"]
    assert validity_problem(kl_clip, 1e12) is None
    assert range_problem(kl_clip, 1e12) == "at most 1000000"
    assert validity_problem(kl_clip, -1.0) == range_problem(kl_clip, -1.0) is not None
    fosi_k = OPTIONS["fosi_k"]
    assert validity_problem(fosi_k, 2**31 - 1) is None and range_problem(fosi_k, 2**31 - 1)


@pytest.mark.parametrize(("flag", "value"), [("--kl-clip", "1e12"), ("--damping", "1e9")])
def test_cli_refuses_what_the_library_accepts(tmp_path: Path, flag, value):
    run = tmp_path / "run"
    result = CliRunner().invoke(main, ["train", "--run-dir", str(run), flag, value])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"{flag}:" in lines[0] and "at most 1000000" in lines[0]
    assert "Traceback" not in result.output and not run.exists()
