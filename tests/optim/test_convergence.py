"""Convergence on real data: a small CNN on scikit-learn's bundled digits (1,797 8×8 images)
reaches ≥ 97% test accuracy with SGD+K-FAC in fewer epochs than plain SGD with the same
learning-rate schedule (cosine over 10 epochs, momentum 0.9, batch 64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from tests.conftest import require_module
from tests.helpers.models import small_cnn

EPOCHS = 10
TARGET = 0.97


def _digits() -> tuple[torch.Tensor, ...]:
    datasets = require_module("sklearn.datasets")
    selection = require_module("sklearn.model_selection")
    x, y = datasets.load_digits(return_X_y=True)
    train, test = selection.train_test_split(
        range(len(y)), test_size=0.25, random_state=0, stratify=y
    )
    images = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(y)
    return images[train], labels[train], images[test], labels[test]


def _accuracy_per_epoch(use_kfac: bool) -> list[float]:
    x_train, y_train, x_test, y_test = _digits()
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps_per_epoch = -(-len(y_train) // 64)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, EPOCHS * steps_per_epoch)
    pre = None
    if use_kfac:
        pre = KFACPreconditioner(
            model, lr=lambda _: opt.param_groups[0]["lr"], damping=0.003, inv_update_steps=5
        )
    order = torch.Generator().manual_seed(0)
    accuracies = []
    for _ in range(EPOCHS):
        model.train()
        perm = torch.randperm(len(y_train), generator=order)
        for start in range(0, len(perm), 64):
            batch = perm[start : start + 64]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            if pre is not None:
                pre.step()
            opt.step()
            schedule.step()
        model.eval()
        with torch.no_grad():
            accuracies.append((model(x_test).argmax(1) == y_test).float().mean().item())
    return accuracies


def _epochs_to_target(accuracies: list[float]) -> int:
    reached = [i + 1 for i, acc in enumerate(accuracies) if acc >= TARGET]
    return reached[0] if reached else EPOCHS + 1


@pytest.mark.slow
def test_kfac_reaches_97_percent_in_fewer_epochs_than_sgd() -> None:
    kfac = _accuracy_per_epoch(use_kfac=True)
    sgd = _accuracy_per_epoch(use_kfac=False)
    print(f"test accuracy per epoch: K-FAC {kfac}, SGD {sgd}")
    assert max(kfac) >= TARGET, kfac
    assert _epochs_to_target(kfac) < _epochs_to_target(sgd), (kfac, sgd)
