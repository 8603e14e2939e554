"""Preemption: a signal sets a flag; all ranks agree at a step boundary to checkpoint and exit.

Slurm sends ``--signal=B:USR2@<s>`` (USR1 is NCCL's) to the batch shell or ``--signal=USR2@<s>``
to the step's tasks, and SIGTERM at the time limit or on ``scancel``. A signal may reach only
some ranks, so the flag is summed over ranks before anyone acts on it: every rank sees the same
answer at the same step. The job sends :meth:`PreemptionHandler.local_flag` in the step's
gradient allreduce (no collective of its own) and reads the sum with
:meth:`~PreemptionHandler.agreed`; a loop without such an allreduce calls
:meth:`~PreemptionHandler.should_stop`, which reduces the flag by itself. The job then
checkpoints and exits with :data:`REQUEUE_EXIT_CODE`, which the sbatch templates turn into a
requeue.

Once the attempt's end is on disk (the ``done`` or ``preempted`` marker and run.json), a late
signal has nothing left to stop: :meth:`PreemptionHandler.settle` ignores the signals from then
until the process exits, so they cannot turn the exit status of a finished run into a kill.
"""

from __future__ import annotations

import signal
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from kfac_hpc.contracts import ExitCode

__all__ = [
    "DEFAULT_SIGNALS",
    "REQUEUE_EXIT_CODE",
    "PreemptionHandler",
    "ignore_signals",
    "parse_signal",
]

REQUEUE_EXIT_CODE = int(ExitCode.PREEMPTED)  # 75, EX_TEMPFAIL
DEFAULT_SIGNALS = ("USR2", "TERM")


def parse_signal(value: str | int) -> signal.Signals:
    """``"USR2"``, ``"SIGUSR2"`` or ``12`` → ``signal.SIGUSR2``; ValueError naming the value."""
    if isinstance(value, int) or value.isdigit():
        return signal.Signals(int(value))
    name = value.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"unknown signal {value!r}; use a name like USR2 or TERM") from None


def ignore_signals(signals: Sequence[str | int] = DEFAULT_SIGNALS) -> None:
    """Ignore ``signals`` from now until the process exits (main thread only): the run's end is
    on disk, so a late signal must not change the exit status."""
    for sig in signals:
        signal.signal(parse_signal(sig), signal.SIG_IGN)


class PreemptionHandler:
    """Catches preemption signals; use as a context manager around the training loop.

    ``signals`` are names or numbers (default USR2 and TERM). ``group`` is the process group
    the flag is reduced over (default: the world, when torch.distributed is initialised).
    """

    def __init__(
        self, signals: Sequence[str | int] = DEFAULT_SIGNALS, group: Any | None = None
    ) -> None:
        self.signals = tuple(parse_signal(s) for s in signals)
        self.group = group
        self.requested = False
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        # Only set a flag: the training step in flight must finish so all ranks stay in step.
        self.requested = True
        self.received = signal.Signals(signum)

    def install(self) -> PreemptionHandler:
        """Install the handlers (main thread only); the previous ones are kept for uninstall."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before :meth:`install` (none after
        :meth:`settle`: the signals stay ignored)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def settle(self) -> None:
        """The run's end is written: ignore the signals until the process exits (a late one
        changes nothing, so it must not kill the rank), and keep them ignored past
        :meth:`uninstall`."""
        ignore_signals(self.signals)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def local_flag(self) -> float:
        """1.0 when this rank got a signal, else 0.0: the term this rank adds to the sum."""
        return 1.0 if self.requested else 0.0

    def agreed(self, summed: float) -> bool:
        """Whether to stop, given :meth:`local_flag` summed over all ranks (the same on every
        rank, so every rank stops at the same step)."""
        stop = summed > 0
        self.requested = self.requested or stop
        return stop

    def should_stop(self) -> bool:
        """True on every rank if any rank got a signal; collective: call on all ranks each step."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(self.group) == "nccl"
            else torch.device("cpu")
        )
        flag = torch.tensor([self.local_flag()], dtype=torch.float64, device=device)
        dist.all_reduce(flag, group=self.group)
        return self.agreed(float(flag.item()))
