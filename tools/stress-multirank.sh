#!/usr/bin/env bash
# Run every multi-rank test (real ranks under mpiexec) ROUNDS times in a row while
# tools/cpu-load.py keeps every core busy: no hang, no failure, on a loaded machine.
#
#   bash tools/stress-multirank.sh                 # 20 rounds of every multi-rank test file
#   bash tools/stress-multirank.sh 5               # 5 rounds
#   bash tools/stress-multirank.sh 20 tests/comm   # 20 rounds of the comm checks only
#
# One round of every file takes about 3-4 minutes on a loaded 2-core machine; CI runs 20 rounds
# of the comm checks and 2 of everything (.ci/run).
# Stops at the first failing round and prints its output; exit status 0 only if every round
# passed. Each test keeps its own time bound (pytest-timeout, run_mpi's bound), so a hang is a
# failure here too, never a stuck CI run.
set -euo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$top"
rounds="${1:-20}"
shift || true
if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then
  echo "stress-multirank: ROUNDS must be a positive integer, got '$rounds'" >&2
  exit 2
fi
# Every test file whose ranks run through tests/helpers/rank_checks.py (the rank scripts).
every="tests/comm/test_collectives_mpi.py tests/runtime/test_mpi_allreduce.py tests/optim/test_ddp.py
  tests/optim/test_branch_graph.py tests/optim/test_distributed_equivalence.py
  tests/optim/fosi/test_distributed.py tests/optim/fosi/test_pipeline_nowait.py
  tests/optim/fosi/test_lanczos_partial.py tests/train/test_fosi_sharded_job.py
  tests/train/test_fosi_nowait_job.py tests/train/test_curvature_orders.py
  tests/checkpoint/test_reshard.py"
tests="${*:-$every}"
python=".venv/bin/python"
[ -x "$python" ] || { echo "stress-multirank: $python missing: run make venv" >&2; exit 2; }
log="$(mktemp -d)"
trap 'rm -rf "$log"' EXIT
export KFAC_HPC_CHECKOUT_CHECK=0  # the whole suite checks the checkout; this runs a part of it
start=$(date +%s)
for ((round = 1; round <= rounds; round++)); do
  t0=$(date +%s)
  # shellcheck disable=SC2086 # $tests is a list of paths
  if ! "$python" tools/cpu-load.py -- "$python" -m pytest -q -p no:cacheprovider \
      -o addopts="--strict-markers" $tests >"$log/round" 2>&1; then
    tail -n 80 "$log/round"
    echo "stress-multirank: round $round of $rounds FAILED after $(( $(date +%s) - start )) s" >&2
    exit 1
  fi
  echo "stress-multirank: round $round/$rounds passed in $(( $(date +%s) - t0 )) s ($(tail -n 1 "$log/round"))"
done
echo "stress-multirank: $rounds rounds passed under load in $(( $(date +%s) - start )) s"
