"""Facts shared by every layer, defined once: the run directory's layout and records, point
states, exit codes, the job's options and the timing phases (docs/contracts.md).

Torch-free and at the bottom of the stack: it imports nothing of the package, and every layer
that reads or writes a run imports it instead of re-declaring what it holds.
"""

from __future__ import annotations

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.exit_codes import ExitCode
from kfac_hpc.contracts.grad_workers import GRAD_WORKER_NAMES, parse_grad_worker_fraction
from kfac_hpc.contracts.options import OPTIONS, Option
from kfac_hpc.contracts.phases import COMM_PHASES, KFAC_PHASES, PHASES
from kfac_hpc.contracts.records import HostMemory, validate_run_dir
from kfac_hpc.contracts.rundir import SCHEMA_VERSION, Marker, Markers, RunDir, write_json_atomic
from kfac_hpc.contracts.states import LIVE, RESUMABLE, TERMINAL, PointState, Verdict
from kfac_hpc.contracts.textfile import read_user_text

__all__ = [
    "COMM_PHASES",
    "GRAD_WORKER_NAMES",
    "KFAC_PHASES",
    "LIVE",
    "OPTIONS",
    "PHASES",
    "RESUMABLE",
    "SCHEMA_VERSION",
    "TERMINAL",
    "ExitCode",
    "HostMemory",
    "InputError",
    "Marker",
    "Markers",
    "Option",
    "PointState",
    "RunDir",
    "Verdict",
    "parse_grad_worker_fraction",
    "read_user_text",
    "validate_run_dir",
    "write_json_atomic",
]
