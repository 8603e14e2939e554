# kfac-hpc: the two commands a user needs are `make demo` and `make test`; both set up
# everything they use (the venv, and for tests the system packages and the local Slurm cluster).
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
# Test-only oracles that declare torchvision (which would pull a CUDA torch): installed without deps.
ORACLES := curvlinops-for-pytorch backpack-for-pytorch einconv einops unfoldNd linear_operator scipy tqdm opt_einsum packaging
PYTEST_ARGS ?=

.PHONY: venv sysdeps cluster-start cluster-stop test test-fast lint bench demo clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[mpich,test,dev,report,data,mnist1d]'
	$(PIP) install -q -c constraints.txt --no-deps $(ORACLES)
	@touch $(STAMP)

# System packages the tests use: Slurm and munge (the local cluster), hdf5-tools (h5ls/h5dump),
# Open MPI (the mpirun launcher tests) and Chromium (the report is checked in a real browser).
sysdeps:
	@bash tools/install-system-deps.sh

cluster-start: sysdeps
	@bash slurm/cluster.sh start

cluster-stop:
	@bash slurm/cluster.sh stop

# The whole suite, real Slurm included; the cluster is stopped even when tests fail.
test: venv sysdeps
	@bash tools/run-tests.sh $(PYTEST_ARGS)

# Everything that needs no Slurm cluster (quick local iteration).
test-fast: venv
	$(VENV)/bin/pytest -m "not slurm" $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check kfac_hpc workflows tests benchmarks
	$(VENV)/bin/ruff format --check kfac_hpc workflows tests benchmarks
	$(VENV)/bin/mypy kfac_hpc  # workflows/ is checked as kfac_hpc.workflows (the kfac_hpc/workflows link)

# Every benchmark, ending with the table of targets; BENCH_ARGS=--check: exit 1 on a missed one.
BENCH_ARGS ?=
bench: venv
	@bash benchmarks/run_all.sh $(BENCH_ARGS)

# A small local sweep (MNIST-1D 1-D CNN, 1 and 2 ranks, SGD vs SGD+K-FAC to 90 % test accuracy;
# no Slurm) ending in its report: K-FAC gets there sooner.
demo: venv
	@bash tools/demo.sh

clean:
	-bash slurm/cluster.sh stop
	rm -rf $(VENV) .work build *.egg-info
