"""On sklearn's digits, FOSI reaches the target test accuracy in fewer steps than its base.

A 64-32-10 tanh MLP, mini-batches of 64 from 1400 training images, test accuracy on the other
397 checked every 5 steps, target 93 %. FOSI: k = 10, α = 0.01, ESE every 20 steps after 10,
on curvature batches of 256. Measured here: heavy ball lr 0.03 reaches it in 125 steps, FOSI
around it in 60; plain SGD lr 0.1 in 225, FOSI in 95 (over the grid lr ∈ {0.01, 0.03, 0.1} ×
momentum ∈ {0, 0.9} FOSI never needed more steps; the best-tuned base, lr 0.1 with momentum,
took 50 and FOSI 40).
"""

from __future__ import annotations

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from kfac_hpc.optim.fosi import FOSI

TARGET = 0.93
MAX_STEPS = 400


def steps_to_target(fosi: bool, lr: float, momentum: float) -> int:
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = perm[:1400], perm[1400:]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    if fosi:
        opt = FOSI(model.parameters(), opt, k=10, alpha=0.01, ese_every=20, warmup=10,
                   model=model)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for step in range(MAX_STEPS):
        batch = train[torch.randint(0, len(train), (64,), generator=gen)]
        curvature = train[torch.randint(0, len(train), (256,), generator=gen)]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        opt.step(lambda c=curvature: nn.functional.cross_entropy(model(x[c]), y[c]))
        if step % 5 == 4:
            with torch.no_grad():
                accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
            if accuracy >= TARGET:
                return step + 1
    return MAX_STEPS + 1


@pytest.mark.slow
@pytest.mark.parametrize(("lr", "momentum"), [(0.03, 0.9), (0.1, 0.0)])
def test_fosi_reaches_the_target_in_fewer_steps_than_its_base(lr: float, momentum: float) -> None:
    base = steps_to_target(False, lr, momentum)
    fosi = steps_to_target(True, lr, momentum)
    assert base <= MAX_STEPS, "the base must reach the target for the comparison to mean much"
    assert fosi < base, f"FOSI took {fosi} steps, its base {base}"
