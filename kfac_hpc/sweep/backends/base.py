"""The :class:`SweepBackend` interface: one way of running the points of a sweep.

A backend says whether its scheduler can be asked about a sweep, what it would refuse, how
points start, how their state is learned, and how they are cancelled and run again. What is
shared by every backend (the spec, its points, the rendered scripts, the manifest, the run
directories' markers) lives beside this package and knows no backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kfac_hpc.sweep.manifest import Manifest, PointRecord
    from kfac_hpc.sweep.prepare import PreparedSweep
    from kfac_hpc.sweep.profile import SiteProfile

__all__ = ["SweepBackend"]


class SweepBackend(ABC):
    """One way of running the points of a sweep."""

    name: ClassVar[str]
    # True: `kfac-hpc sweep` runs the points in this process and returns when they ended.
    runs_in_process: ClassVar[bool] = False

    def check_profile(self, profile: SiteProfile) -> None:  # noqa: B027 (optional hook)
        """InputError for a site profile this backend cannot launch with; asks no scheduler,
        so it comes before any check that does."""

    def unchecked(self, *, dry_run: bool) -> str | None:
        """Why the sweep cannot be checked against the scheduler (a dry run goes on and says
        so); None when it can, or there is no scheduler. Raises (InputError, or the
        scheduler's own error) when a real run cannot go on."""
        return None

    def preflight(self, prepared: PreparedSweep) -> None:  # noqa: B027 (optional hook)
        """Check ``prepared`` before anything is written (dry runs too): InputError for a
        sweep the backend cannot run, or its scheduler would refuse or hold forever (asked
        unless ``prepared.unchecked`` says why it cannot be)."""

    @abstractmethod
    def max_array_size(self) -> int:
        """The largest array the backend takes; InputError when it is not usable here."""

    @abstractmethod
    def submit(self, prepared: PreparedSweep) -> Manifest:
        """Start every point of a prepared sweep; the manifest on disk says what started."""

    @abstractmethod
    def refresh(self, manifest: Manifest, sweep_dir: Path) -> None:
        """Update every point's state in ``manifest`` (in memory)."""

    @abstractmethod
    def cancel(self, points: Sequence[PointRecord]) -> None:
        """Stop the jobs of ``points`` (live ones)."""

    @abstractmethod
    def resubmit(self, manifest: Manifest, sweep_dir: Path, points: Sequence[PointRecord]) -> None:
        """Run ``points`` again (already prepared for their retry); updates the manifest."""
