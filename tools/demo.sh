#!/usr/bin/env bash
# `make demo`: why kfac-hpc exists, in one command and a minute or two on a laptop-sized
# machine. A local scaling sweep with no Slurm at all (the embedded local backend: Parsl + the
# venv's MPICH): MNIST-1D (generated locally, cached), its 1-D CNN, 1 and 2 MPI ranks, SGD
# with and without K-FAC, each run stopped at the target test accuracy. K-FAC needs far fewer
# steps to the target, so it gets there sooner although each of its steps costs more. It ends
# with the report's summary, its table and the path of report.html. Expects the venv of
# `make venv`.
#
# The settings are the tuned ones of benchmarks/bench_tts_methods.py (docs/kfac.md, "Time to
# target"): batch 1024, constant lr, no weight decay, a test evaluation every 20 steps; SGD
# momentum 0.95; K-FAC with damped inverses, factors every 10 steps, inverses every 100,
# damping 0.003, KL clip 0.0005 (the clip bounds every K-FAC step, so the shared lr of 0.15
# is SGD's). The target is 90 % rather than the benchmark's 98 % so that the four runs take
# about a minute.
set -euo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$top"
venv="${VENV:-.venv}"
export PATH="$top/$venv/bin:$PATH"
export OMP_NUM_THREADS=1
sweep_dir="${KFAC_HPC_DEMO_DIR:-$top/.work/demo-sweep}"
data_dir="${KFAC_HPC_DEMO_DATA:-$top/.work/mnist1d}"
target="${KFAC_HPC_DEMO_TARGET:-0.9}"
rm -rf "$sweep_dir"
mkdir -p "$data_dir"
report="$(mktemp)"
trap 'rm -f "$report"' EXIT
echo "== kfac-hpc sweep --backend local: MNIST-1D 1-D CNN; 1 and 2 nodes (one MPI rank each, on"
echo "   this machine) x SGD, SGD+K-FAC; one run at a time, each until $target test accuracy"
echo "   (the first demo also generates MNIST-1D into $data_dir); the sweep in $sweep_dir"
start=$(date +%s)
# The sweep prints its progress on stderr and, at its end, the report's summary and table.
kfac-hpc sweep --backend local --name demo --sweep-dir "$sweep_dir" --serial \
  --nodes 1,2 --ranks-per-node 1 \
  --model cnn1d --dataset mnist1d --num-samples 32000 --cnn1d-channels 160 \
  --data-path "$data_dir" --batch-size 1024 --epochs 20 --time-limit 150s \
  --lr 0.15 --momentum 0.95 --weight-decay 0 --lr-schedule constant \
  --eval-every-steps 20 --target-accuracy "$target" --stop-at-target true \
  --optimizer sgd --kfac false,true --compute-method inverse \
  --factor-update-steps 10 --inv-update-steps 100 --damping 0.003 --kl-clip 0.0005 \
  --train-arg=--no-progress >"$report"
echo "== demo finished in $(($(date +%s) - start)) s"
echo
cat "$report"
