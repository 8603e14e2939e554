"""Batches of a map-style Dataset read by worker processes, in the job's own order.

A ``torch.utils.data.DataLoader`` whose batch sampler yields, step after step, the sample
indices :class:`~kfac_hpc.train.data.ShardedBatches` gives this rank (its slice of the
epoch's permutation), from the step the run is at: the workers decode ahead while the step
computes, the order is the one the in-process path would read (it depends only on seed,
epoch, step and rank), and a resumed run starts the loader at the step it resumes from, not at
the epoch's start. The ``data`` phase then measures what the step waits for.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["StepLoader"]


class _StepIndices(Sampler[list[int]]):
    """This rank's indices of steps ``start``, ``start + 1``, ... of the epoch ``perm``."""

    def __init__(self, perm: torch.Tensor, start: int, steps: int, batch: int, part: slice):
        self.perm, self.start, self.steps, self.batch, self.part = perm, start, steps, batch, part

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.steps):
            chunk = self.perm[step * self.batch : (step + 1) * self.batch]
            yield chunk[self.part].tolist()

    def __len__(self) -> int:
        return self.steps - self.start


class StepLoader:
    """Worker processes that read this rank's batches of one epoch ahead of the step."""

    def __init__(self, dataset: Dataset, workers: int, pin_memory: bool) -> None:
        self.dataset, self.workers, self.pin_memory = dataset, workers, pin_memory
        self._at: tuple[int, int] | None = None  # the (epoch, step) the iterator yields next
        self._batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

    def batch(
        self,
        perm: torch.Tensor,
        epoch: int,
        step: int,
        steps: int,
        global_batch: int,
        part: slice,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch of ``step`` in ``epoch`` (``perm`` its permutation, ``steps`` its
        steps); a step other than the next one starts the loader there."""
        if self._at != (epoch, step) or self._batches is None:
            sampler = _StepIndices(perm, step, steps, global_batch, part)
            loader = DataLoader(
                self.dataset,
                batch_sampler=sampler,
                num_workers=self.workers,
                pin_memory=self.pin_memory,
            )
            self._batches = iter(loader)
        x, y = next(self._batches)
        self._at = (epoch, step + 1)
        return x, y
