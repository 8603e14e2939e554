"""Shared fixtures: real MPI ranks (the venv's MPICH) and the real local Slurm cluster."""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.checkout import checkout_status, left_behind
from tests.helpers.launch import (  # noqa: F401 - imported from here by many tests
    VENV_BIN,
    clean_env,
    parse_rank_records,
    run_bounded,
    run_mpi,
)

REPO = Path(__file__).resolve().parent.parent


def _must_not_skip() -> bool:
    """Under `make test` and in CI every system piece is installed: absence is a failure."""
    return os.environ.get("KFAC_HPC_REQUIRE_SLURM") == "1" or bool(os.environ.get("CI"))


def require_module(name: str) -> Any:
    """Import ``name`` (a test dependency `make venv` installs); under `make test`/CI its
    absence fails the test instead of skipping it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if _must_not_skip():
            pytest.fail(f"{name} missing: `make venv` installs it ({exc})")
        pytest.skip(f"{name} not installed")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Under `make test`/CI a skip for a module that could not be imported (a bare
    ``pytest.importorskip``) is a failure: every test dependency is installed there."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _must_not_skip() and call.excinfo is not None:
        reason = str(call.excinfo.value)
        if reason.startswith("could not import"):
            report.outcome = "failed"
            report.longrepr = f"must not skip under make test/CI: {reason}"


@pytest.fixture(scope="session")
def hdf5_tools() -> None:
    """Debian's hdf5-tools (h5ls, h5dump); a failure instead of a skip under `make test`/CI."""
    missing = [tool for tool in ("h5ls", "h5dump") if shutil.which(tool) is None]
    if missing:
        if _must_not_skip():
            pytest.fail(f"{', '.join(missing)} missing: install hdf5-tools (make sysdeps)")
        pytest.skip(f"{', '.join(missing)} not installed")


@pytest.fixture(scope="session")
def project_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout built into a wheel once (``pip wheel --no-deps --no-build-isolation``),
    for the tests of what the wheel holds and of installing it."""
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    result = subprocess.run(
        [*build, "-w", str(out), str(REPO)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = out.glob("kfac_hpc-*.whl")
    return wheel


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's headless Chromium; a failure instead of a skip under `make test`/CI."""
    path = shutil.which("chromium")
    if path is None:
        if _must_not_skip():
            pytest.fail("chromium missing: install it (make sysdeps)")
        pytest.skip("chromium not installed")
    return path


def _slurm_reachable() -> str | None:
    """None when the local cluster answers, else why not."""
    if shutil.which("sinfo") is None:
        return "sinfo not on PATH"
    if "SLURM_CONF" not in os.environ:
        return "SLURM_CONF is not set (start the cluster: bash slurm/cluster.sh start)"
    out = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, str]:
    """The running local Slurm cluster. Under `make test` (KFAC_HPC_REQUIRE_SLURM=1) or in
    CI a missing cluster fails the test instead of skipping it."""
    problem = _slurm_reachable()
    if problem is not None:
        if _must_not_skip():
            pytest.fail(f"the local Slurm cluster is required here: {problem}")
        pytest.skip(problem)
    return {"SLURM_CONF": os.environ["SLURM_CONF"]}


# Session fixtures worth building once per run rather than once per xdist worker.
_SHARED_ONCE = ("project_wheel", "mlp_checkpoints")


@functools.cache
def work_unit(path: str) -> str:
    """The pytest-xdist work unit of the test file ``path`` (tools/run-tests.sh runs the suite
    on several workers): every file on the one local Slurm cluster in one unit, whose tests run
    one after another (they compare the queue before and after their own jobs); the files of
    an expensive session fixture in one unit; any other file in a unit of its own (its module
    fixtures built once). Read from the file's text, as xdist's controller collects nothing;
    :func:`pytest_collection_modifyitems` checks it against each test's fixtures."""
    text = (REPO / path).read_text()
    if "slurm_cluster" in text or "mark.slurm" in text:
        return "slurm"
    return next((name for name in _SHARED_ONCE if name in text), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist hands out whole work units (:func:`work_unit`), in the order the workers
    collected them (:func:`pytest_collection_modifyitems`)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid.split("::")[0])

    config.option.loadscopereorder = False
    return ByWorkUnit(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: fail at once if a test's fixtures or marks put it in another work
    unit than its file's text does (a Slurm test that could run beside another); order the
    units as the workers take them: the Slurm unit (the longest) first, then those with a
    ``slow`` test, then the rest, so that no long unit is left to run alone at the end."""
    if not hasattr(config, "workerinput"):
        return
    slow = {"slurm"}
    for item in items:
        unit = work_unit(item.nodeid.split("::")[0])
        names = {*item.fixturenames, *(mark.name for mark in item.iter_markers())}
        needs = "slurm" if names & {"slurm_cluster", "slurm"} else None
        needs = needs or next((name for name in _SHARED_ONCE if name in names), None)
        if needs is not None and unit != needs:
            raise pytest.UsageError(f"{item.nodeid} needs the work unit {needs!r}, not {unit!r}")
        if "slow" in names:
            slow.add(unit)

    def order(item: pytest.Item) -> int:
        unit = work_unit(item.nodeid.split("::")[0])
        return 0 if unit == "slurm" else 1 if unit in slow else 2

    items.sort(key=order)


def pytest_collection_finish(session: pytest.Session) -> None:
    # pytest already fails on zero tests (exit 5); a suite that silently lost whole folders
    # should fail too, so a full run must collect every area.
    if session.config.getoption("-m") or session.config.args not in ([], [str(REPO / "tests")]):
        return
    if len(session.items) < 10:
        raise pytest.UsageError(f"only {len(session.items)} tests collected; the suite is broken")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every test, and every fixture it sets up, starts on one torch thread, whatever an
    earlier test left (a job run in this process takes the machine's cores when no
    OMP_NUM_THREADS says otherwise). The tests run tiny models on a shared machine, where
    torch's spinning worker threads make small ops many times slower, and a thread count
    changes the order of float reductions, so of a trajectory's losses."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


_status_before: set[str] | None = None

# How this process handles preemption signals when the session starts.
_SIGNALS_AT_START = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM)}


def _restore_signal_handlers() -> None:
    for sig, handler in _SIGNALS_AT_START.items():
        if handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _signal_handlers_as_at_start() -> Iterator[None]:
    """A `train` command run in this process (click's runner, in a test or a module fixture)
    ignores preemption signals once its run has ended, as the real process does until it
    exits; every test starts and ends with the handlers of the session's start (a child shell
    started with USR2 ignored cannot trap it)."""
    _restore_signal_handlers()
    yield
    _restore_signal_handlers()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Note the checkout's status (``KFAC_HPC_CHECKOUT_CHECK=0`` skips the check: for runs
    beside other work in the same checkout, such as tools/stress-multirank.sh)."""
    global _status_before
    if os.environ.get("KFAC_HPC_CHECKOUT_CHECK", "1") != "0":
        _status_before = checkout_status(REPO)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test that writes into the checkout fails the run (tests write under tmp_path)."""
    new = left_behind(_status_before, checkout_status(REPO))
    if new:
        listing = "\n  ".join(new)
        print(f"\nthe tests left these in the checkout (write under tmp_path):\n  {listing}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
