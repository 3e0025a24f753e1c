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

NVCC ?= nvcc
CUDA_ARCHS ?= 80 90
# A GPU machine: ranks per GPU allowed by NCCL >= 2.30.3 (docs/gpu.md).
GPU_SIZES ?= 1 2 4

.PHONY: all install test test-unit test-cuda test-mpi test-gpu soak demo bench clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# CPU PyTorch first (a local wheel here), so nothing pulls a CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[mpich,test,bench,demo,jax]"
	touch $(STAMP)

install: $(STAMP)

test: test-cuda test-unit test-mpi

# tests/gpu is skipped (with the reason) where no GPU is present.
test-unit: $(STAMP)
	$(PY) -m pytest tests/unit tests/gpu -q

# Every .cu file must compile for every target with no warning, GPU or not.
test-cuda:
	@set -e; for f in cuda/*.cu; do for a in $(CUDA_ARCHS); do \
	  echo "nvcc $$f sm_$$a"; \
	  $(NVCC) -std=c++17 -arch=sm_$$a -Werror all-warnings -Xptxas -warn-spills,-warn-lmem-usage \
	    -c $$f -o /dev/null; \
	done; done

# On a GPU machine (docs/gpu.md): kernels, then collectives on GPU buffers.
test-gpu: $(STAMP)
	$(PY) -m pytest tests/gpu -q
	@set -e; for n in $(GPU_SIZES); do \
	  echo "== GPU MPI tests on $$n ranks"; \
	  NCCL_MULTI_RANK_GPU_ENABLE=1 WAGMA_TEST_DIR=tests/gpu/mpi timeout $(MPI_TEST_TIMEOUT) \
	    $(MPIEXEC) -n $$n $(PY) tests/mpi/run.py -q; \
	done

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
