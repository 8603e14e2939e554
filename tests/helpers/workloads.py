"""A user's workload package, written by a test: a module on PYTHONPATH (``wlpkg``), one
installed with entry points of the group ``kfac_hpc.workloads`` (``wlplug``, a dist-info folder
beside it, as pip leaves it in site-packages), and broken factories."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import clean_env

PACKAGE = '''
import math
import os
from pathlib import Path

import torch
from torch import nn

from kfac_hpc.train.data import tensor_source


def blobs(ctx):
    """Three Gaussian blobs in ``dim`` dimensions; ``n`` training points."""
    n, dim = int(ctx.args.get("n", "256")), int(ctx.args.get("dim", "6"))
    gen = torch.Generator().manual_seed(7)
    centers = 3 * torch.randn(3, dim, generator=gen)
    y = torch.randint(0, 3, (n + 96,), generator=gen)
    x = centers[y] + torch.randn(n + 96, dim, generator=gen)
    return (x[:n], y[:n]), (x[n:], y[n:])


def blobs_by_loss(ctx):
    """The blobs, judged by the test loss (lower is better)."""
    source = tensor_source("blobs_by_loss", *blobs(ctx))
    source.metric = "loss"
    return source


def tiny_mlp(ctx):
    """One hidden layer of ``width`` units."""
    width = int(ctx.args.get("width", "16"))
    return nn.Sequential(
        nn.Linear(ctx.input_shape[0], width), nn.Tanh(), nn.Linear(width, ctx.num_classes)
    )


class Indexed(torch.utils.data.Dataset):
    """Sample i is (i, sin i, cos i, 1) of class i mod 3: its first feature names it."""

    num_classes = 3

    def __init__(self, n, offset=0):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t = float(i + self.offset)
        return torch.tensor([t, math.sin(t), math.cos(t), 1.0]), (i + self.offset) % 3


def indexed(ctx):
    """A map-style Dataset (read by worker processes when --data-workers > 0)."""
    n = int(ctx.args.get("n", "320"))
    return Indexed(n), Indexed(64, offset=n)


def recording_mlp(ctx):
    """A small MLP that appends the sample numbers of every training batch it sees to
    ``log``/rank<R>.txt, one line per forward, tagged with the process id."""
    log = Path(ctx.args["log"]) / f"rank{ctx.rank}.txt"
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, ctx.num_classes))

    def record(module, inputs):
        if module.training:
            seen = ",".join(str(int(round(v))) for v in inputs[0][:, 0].tolist())
            with open(log, "a") as fh:
                fh.write(f"{os.getpid()} {seen}\\n")

    model.register_forward_pre_hook(record)
    return model


def returns_text(ctx):
    return "not a module"


def no_parameters(ctx):
    return nn.ReLU()
'''
PLUGIN = """
from wlpkg import blobs, tiny_mlp

__all__ = ["blobs", "tiny_mlp"]
"""
ENTRY_POINTS = """[kfac_hpc.workloads]
model.plugmlp = wlplug:tiny_mlp
dataset.plugblobs = wlplug:blobs
"""


def write_workloads(root: Path) -> Path:
    """The packages under ``root`` (a folder for PYTHONPATH); returns it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "wlpkg.py").write_text(PACKAGE)
    (root / "wlplug.py").write_text(PLUGIN)
    (root / "wlbroken.py").write_text("import a_module_that_is_not_there\n")
    info = root / "wlplug-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wlplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root


def workload_env(root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """clean_env with ``root`` first on PYTHONPATH (the ranks the job starts inherit it)."""
    env = clean_env(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env
