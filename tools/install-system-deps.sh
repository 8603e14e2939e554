#!/usr/bin/env bash
# Install the Debian packages the test suite needs, only those missing:
# slurm-wlm and munge (the local test cluster), hdf5-tools (h5ls/h5dump on checkpoints),
# chromium with a font (the report is checked in a headless browser) and openmpi-bin (Open
# MPI's mpirun.openmpi and libmpi.so.40, the second MPI the launch tests use).
set -euo pipefail
missing=()
command -v slurmctld >/dev/null || missing+=(slurm-wlm)
command -v munged >/dev/null || missing+=(munge)
command -v h5ls >/dev/null || missing+=(hdf5-tools)
command -v chromium >/dev/null || missing+=(chromium)
fc-list 2>/dev/null | grep -q . || missing+=(fonts-dejavu-core)
command -v mpirun.openmpi >/dev/null || missing+=(openmpi-bin)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "missing system packages: ${missing[*]}; install them: sudo apt-get install ${missing[*]}" >&2
  exit 2
fi
echo "installing ${missing[*]} with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
