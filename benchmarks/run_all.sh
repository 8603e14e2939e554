#!/usr/bin/env bash
# `make bench`: run every benchmark in this folder, one after the other (they measure side
# by side inside each script, so the ratios they print do not depend on machine noise
# between scripts). Results also land in benchmarks/results/ as JSON.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p benchmarks/results
status=0
for bench in benchmarks/bench_*.py; do
  echo "== $bench"
  .venv/bin/python "$bench" || status=1
done
exit $status
