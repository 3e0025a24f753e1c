#!/bin/bash
# Everything the GPU issue asks to rerun, in one device call (docs/gpu.md):
#   bash bench/gpu/validate.sh [tests|sanitizer|death|partial|bench ...]
# Logs go to $OUT (or /tmp/gpu-out); the tail of each section is printed.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
source bench/gpu/device_setup.sh || exit 1
source bench/gpu/device_nccl.sh || exit 1
export NCCL_MULTI_RANK_GPU_ENABLE=1
MPIEXEC=$(dirname "$(command -v python3)")/mpiexec
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, cupy, mpi4py; print('torch', torch.__version__, 'cupy', cupy.__version__, 'mpi4py', mpi4py.__version__)"
section() { echo "== $1"; }
for what in "${@:-tests}"; do
  case $what in
    tests)
      section "kernel tests"
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py 2>&1 | tail -3
      for n in 1 2 4; do
        section "GPU MPI tests, $n ranks"
        extra=""; [ "$n" = 4 ] && extra="NCCL_MAX_CTAS=8"
        env $extra WAGMA_TEST_DIR=tests/gpu/mpi timeout 300 "$MPIEXEC" -n $n python3 tests/mpi/run.py -q \
          > "$OUT/gpu-mpi-$n.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/gpu-mpi-$n.log"
      done ;;
    death)
      section "rank death on the NCCL path (4 ranks)"
      timeout 400 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_rank_death_gpu.py \
        > "$OUT/gpu-death.log" 2>&1; echo "rc=$?"; grep -E "passed|failed|Error|elapsed" "$OUT/gpu-death.log" | tail -30 ;;
    sanitizer)
      section "compute-sanitizer memcheck / racecheck on the kernel tests"
      timeout 400 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -rA -p no:cacheprovider \
        tests/gpu/test_kernels.py > "$OUT/gpu-memcheck.log" 2>&1; echo "memcheck rc=$?"
      grep -E "ERROR SUMMARY|passed|failed|FAILED" "$OUT/gpu-memcheck.log" | tail -8
      timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_kernels.py -k "average or reduce" > "$OUT/gpu-racecheck.log" 2>&1; echo "racecheck rc=$?"
      grep -E "HAZARD|RACECHECK SUMMARY|passed|failed" "$OUT/gpu-racecheck.log" | tail -4 ;;
    partial)
      for n in 1 2 4; do
        section "partial collectives on GPU buffers, $n ranks"
        extra=""; [ "$n" = 4 ] && extra="NCCL_MAX_CTAS=8"
        env $extra WAGMA_TEST_DIR=tests/gpu/mpi timeout 300 "$MPIEXEC" -n $n python3 tests/mpi/run.py -q \
          -k partial > "$OUT/gpu-partial-$n.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/gpu-partial-$n.log"
      done ;;
    *) echo "unknown section $what"; exit 2 ;;
  esac
done
