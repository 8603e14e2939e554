#!/usr/bin/env bash
# `make demo`: a small local scaling sweep with no Slurm at all (the embedded local backend:
# Parsl + the venv's MPICH): digits, 1 and 2 MPI ranks, SGD with and without K-FAC, ending
# with the collector's report. Expects the venv of `make venv`.
set -euo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$top"
venv="${VENV:-.venv}"
export PATH="$top/$venv/bin:$PATH"
export OMP_NUM_THREADS=1
sweep_dir="${KFAC_HPC_DEMO_DIR:-$top/.work/demo-sweep}"
rm -rf "$sweep_dir"
echo "== kfac-hpc sweep --backend local (4 points: 1 and 2 ranks x SGD, SGD+K-FAC) into $sweep_dir"
start=$(date +%s)
kfac-hpc sweep --backend local --name demo --sweep-dir "$sweep_dir" \
  --nodes 1,2 --ranks-per-node 1 --model mlp --dataset digits --steps 60 --batch-size 128 \
  --optimizer sgd --kfac false,true --target-accuracy 0.8 --train-arg=--no-progress
echo "== kfac-hpc status $sweep_dir"
kfac-hpc status "$sweep_dir"
echo "== demo finished in $(( $(date +%s) - start )) s; report files in $sweep_dir/report"
