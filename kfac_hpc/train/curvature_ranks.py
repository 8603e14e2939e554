"""Orders from training rank 0 to a method's curvature ranks (FOSI's ``curvature_ranks``).

Curvature ranks take no training step and are in none of the step's collectives, so a
curvature rank busy with a seconds-long ESE holds no training rank. They wait for orders
instead: an ``ESE`` order before the step that requests one (its parameter snapshot and result
travel as the method's pipeline sends them), and an order before every meeting of the whole
world — a checkpoint, the attempt's end (``FINISH``, saying how it ended: done, time limit,
target, preemption) — so that the curvature ranks join its collectives (an evaluation is the
training ranks' alone). Every decision the training ranks agree on at a step (the clock's
checkpoint, the time limit, a preemption signal, divergence) reaches the curvature ranks as such
an order; the training ranks wait for them only at the meetings.

An order is three int64 numbers ``[kind, step, value]`` sent point to point on :data:`TAG`;
the pipeline's snapshots and results use the default tag, and a curvature rank posts the
snapshot's receive only once it has the ``ESE`` order, so the two streams need no relative
order. A curvature rank waits for an order with the process group's timeout: training rank 0
sends ``ALIVE`` when no order went out for half of it. A training rank that fails makes
training rank 0 fail in its next collective; training rank 0 then sends ``ABORT`` and the
curvature ranks exit without a message of their own (the training rank's is the run's error).
A preemption signal that reaches only a curvature rank is not acted on: Slurm signals every
task of the step, and the training ranks decide.
"""

from __future__ import annotations

import datetime
import time
from enum import IntEnum

import torch
import torch.distributed as dist

__all__ = ["ENDS", "TAG", "Order", "OrderSender", "PeerAborted", "receive_order"]

TAG = 71  # orders; the pipeline's messages use tag 0
ENDS = ("done", "time_limit", "target", "preempted")  # FINISH's value indexes this


class Order(IntEnum):
    """What training rank 0 asks of the curvature ranks."""

    ESE = 1  # serve request ``value`` made at ``step`` (its snapshot follows)
    SAVE = 2  # join the checkpoint of ``step``
    FINISH = 3  # the loop ended at ``step`` (how: ENDS[value]); join the attempt's end
    ABORT = 4  # a training rank failed: exit failed
    ALIVE = 5  # nothing to do (the receive's timeout starts again)


class PeerAborted(RuntimeError):
    """A curvature rank told to abort: the training ranks' failure is the run's error."""


class OrderSender:
    """Training rank 0's side: orders to the ranks ``first .. first + count - 1``."""

    def __init__(self, first: int, count: int, timeout_s: float) -> None:
        self.ranks = range(first, first + count)
        self.alive_every_s = timeout_s / 2
        self.last = time.monotonic()
        self.works: list[tuple[dist.Work, torch.Tensor]] = []  # sends and their buffers

    def send(self, order: Order, step: int, value: int = 0) -> None:
        """Send ``order`` to every curvature rank (returns at once)."""
        message = torch.tensor([int(order), step, value], dtype=torch.int64)
        self.works = [(work, sent) for work, sent in self.works if not work.is_completed()]
        for rank in self.ranks:
            work = dist.isend(message, rank, tag=TAG)
            assert work is not None
            self.works.append((work, message))
        self.last = time.monotonic()

    def tick(self, step: int) -> None:
        """At every step: ``ALIVE`` when no order went out for half the timeout."""
        if time.monotonic() - self.last >= self.alive_every_s:
            self.send(Order.ALIVE, step)

    def abort(self, step: int) -> None:
        """Best effort, on the way out of a failure: tell the curvature ranks to fail."""
        try:
            self.send(Order.ABORT, step)
            for work, _ in self.works[-len(self.ranks) :]:
                work.wait(datetime.timedelta(seconds=10))
        except Exception:  # a dead peer fails on its own; this rank is failing anyway
            pass


def receive_order() -> tuple[Order, int, int]:
    """A curvature rank: the next order from training rank 0 (blocks)."""
    message = torch.zeros(3, dtype=torch.int64)
    dist.recv(message, 0, tag=TAG)
    kind, step, value = (int(v) for v in message.tolist())
    return Order(kind), step, value
