"""Which partition a sweep's sbatch options ask for (the size check reads its limits)."""

from __future__ import annotations

from kfac_hpc.sweep.submit import _requested_partition


def test_partition_argument_forms_are_recognised() -> None:
    assert _requested_partition(["--exclusive", "-p", "gpu"]) == "gpu"
    assert _requested_partition(["-pgpu"]) == "gpu"
    assert _requested_partition(["--partition=big"]) == "big"
    assert _requested_partition(["--partition", "big"]) == "big"
    assert _requested_partition(["--exclusive"]) is None
