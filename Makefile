# wagma_comm: `make demo` runs the main job, `make test` runs every test.
# Both create .venv and install what they need (the PyPI mpich wheel included).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP  := $(VENV)/.installed-stamp
# Ranks the MPI test files run at (the same files pass at every size).
MPI_SIZES ?= 1 2 3 4 8
# Oversubscription is fine: these tests check correctness, not speed.
MPI_TEST_TIMEOUT ?= 600
DEMO_RANKS ?= 8

.PHONY: all install test test-unit test-mpi soak demo bench clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# CPU PyTorch first (a local wheel here), so nothing pulls a CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[mpich,test,bench,demo,jax]"
	touch $(STAMP)

install: $(STAMP)

test: test-unit test-mpi

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

test-mpi: $(STAMP)
	@set -e; for n in $(MPI_SIZES); do \
	  echo "== MPI tests on $$n ranks"; \
	  timeout $(MPI_TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PY) tests/mpi/run.py -q; \
	done

# Load/stress soak (issue #7): >= 10,000 random non-blocking collectives on
# $(SOAK_RANKS) ranks, every result checked bitwise, RSS flat (tests/soak; not
# part of `make test`, whose reduced version is tests/mpi/test_stress.py).
# WAGMA_SOAK_OPS=N overrides the operation count.
SOAK_RANKS ?= 8
SOAK_TIMEOUT ?= 1800
soak: $(STAMP)
	WAGMA_TEST_DIR=tests/soak timeout $(SOAK_TIMEOUT) $(MPIEXEC) -n $(SOAK_RANKS) $(PY) tests/mpi/run.py -q

# The training demo: WAGMA-SGD and the baselines on a digits classifier under
# load imbalance (docs/training.md). Options: make demo DEMO_ARGS="--seeds 1".
demo: $(STAMP)
	$(MPIEXEC) -n $(DEMO_RANKS) $(VENV)/bin/wagma demo $(DEMO_ARGS)

bench: $(STAMP)
	$(MPIEXEC) -n 8 $(VENV)/bin/wagma bench all -b 16 -e 64M -f 4 --vs mpi,gloo \
	  --json bench/results/host-8.json --csv bench/results/host-8.csv --plot docs/img/bench-host-8.png

clean:
	rm -rf $(VENV) build *.egg-info
