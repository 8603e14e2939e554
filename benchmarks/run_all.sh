#!/usr/bin/env bash
# `make bench`: every benchmark in this folder, one after the other (each compares its variants
# in interleaved rounds inside the script, so its ratios do not depend on machine noise between
# scripts), then one table of every target they declared (from their results JSON in
# benchmarks/results/). `make bench BENCH_ARGS=--check` also exits 1 when a target is missed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
check=()
for arg in "$@"; do
  case "$arg" in
    --check) check=(--check) ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
  esac
done
started=$(date +%s)
failed=()
for bench in benchmarks/bench_*.py; do
  echo "== $bench"
  .venv/bin/python "$bench" || {
    rc=$?
    failed+=("$(basename "$bench") (exit $rc)")
  }
done
echo "== targets of this run (docs/benchmarks.md: what each one means)"
status=0
.venv/bin/python benchmarks/harness.py table --since "$started" "${check[@]}" || status=1
if ((${#failed[@]})); then
  echo "no results from: ${failed[*]}"
  status=1
fi
exit "$status"
