"""Writers to SIGKILL, and moments to kill them at that do not depend on the machine's speed.

A writer process saves checkpoints forever. Each trial kills it at a moment chosen by events
the writer reports, not by a sleep: "mid-write" trials hold the writer inside the n-th dataset
it creates (in its first few saves; the file half-written on disk) and kill it there; "any
time" trials wait for one published checkpoint and then kill after a random delay, wherever
the writer then is. So every run has kills inside a write and a latest file to check, on an
idle or a loaded machine.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import h5py

from tests.helpers.waiting import bound_s


@dataclass(frozen=True)
class KillMoment:
    """Where a trial kills: inside the ``dataset``-th dataset the writer creates (1-based,
    counted over all its saves, which write the same tree each), or, when ``dataset`` is 0,
    ``delay_s`` after the first finished save."""

    dataset: int = 0
    delay_s: float = 0.0

    @classmethod
    def draw(cls, trial: int, rng: random.Random) -> KillMoment:
        if trial % 2:
            return cls(dataset=rng.randint(1, 40))  # a save holds more than 13 datasets
        return cls(delay_s=rng.uniform(0.0, 0.3))


@dataclass
class Progress:
    """Events the writer process sets for the test (multiprocessing objects of one context)."""

    saved: Any  # Event: a checkpoint file was published
    holding: Any  # Event: the writer is held inside the chosen dataset

    @classmethod
    def create(cls, ctx: Any) -> Progress:
        return cls(ctx.Event(), ctx.Event())


def hold_inside_a_write(moment: KillMoment, progress: Progress) -> None:
    """In the writer process: hold (until killed) inside the chosen dataset, counting the
    datasets :class:`h5py.Group` creates in any thread."""
    if moment.dataset == 0:
        return
    create = h5py.Group.create_dataset
    count = [0]

    def counting_create(group: h5py.Group, *args: Any, **kwargs: Any) -> Any:
        dataset = create(group, *args, **kwargs)
        count[0] += 1
        if count[0] == moment.dataset:
            progress.holding.set()
            time.sleep(3600)  # killed here
        return dataset

    h5py.Group.create_dataset = counting_create  # type: ignore[method-assign]


def wait_for_moment(moment: KillMoment, progress: Progress) -> None:
    """In the test: return when the writer has reached ``moment``."""
    event, what = (
        (progress.holding, "the writer's chosen dataset")
        if moment.dataset
        else (progress.saved, "the writer's first published checkpoint")
    )
    assert event.wait(timeout=bound_s(300)), f"{what} not reached within {bound_s(300):g} s"
    time.sleep(moment.delay_s)
