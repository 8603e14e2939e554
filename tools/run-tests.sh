#!/usr/bin/env bash
# Run the whole test suite against a freshly started local Slurm cluster, and stop the
# cluster afterwards whatever happens. Extra arguments go to pytest.
set -euo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$top"
# One cluster for the whole suite: 16 nodes so that `sweep --nodes 1,2,4,16` runs (idle slurmd
# cost nothing; a restart mid-suite would cost more), and a small MaxArraySize so that splitting a
# sweep into several arrays needs only a few held tasks.
bash slurm/cluster.sh start --nodes 16 --max-array-size 9
trap 'bash slurm/cluster.sh stop' EXIT
export SLURM_CONF="$top/.work/slurm/etc/slurm.conf"
export PATH="$top/.venv/bin:$PATH"
# The Slurm tests must run here: a missing cluster is an error, not a skip.
export KFAC_HPC_REQUIRE_SLURM=1
# Two workers (pytest-xdist; KFAC_HPC_TEST_WORKERS=N for another count): most tests wait on a
# single process and leave a core idle. Each worker takes whole work units (tests/conftest.py:
# every Slurm test in one unit, run one after another; every other file in its own).
.venv/bin/pytest -n "${KFAC_HPC_TEST_WORKERS:-2}" "$@"
