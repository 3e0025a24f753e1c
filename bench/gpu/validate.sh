#!/bin/bash
# Everything the GPU issue asks to rerun, in one device call (docs/gpu.md):
#   bash bench/gpu/validate.sh [tests|sanitizer|death|partial|train|trainbench|demo|
#                              benchtests|cost|bench|sass ...]
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
        extra=""; [ "$n" -ge 2 ] && extra="NCCL_MAX_CTAS=8"
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
        extra=""; [ "$n" -ge 2 ] && extra="NCCL_MAX_CTAS=8"
        env $extra WAGMA_TEST_DIR=tests/gpu/mpi timeout 300 "$MPIEXEC" -n $n python3 tests/mpi/run.py -q \
          -k partial > "$OUT/gpu-partial-$n.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/gpu-partial-$n.log"
      done ;;
    train)
      for n in 1 2 4; do
        section "training on CUDA tensors (device buckets), $n ranks"
        # Two dtype buckets are two partial collectives whose rounds may reach
        # NCCL in another order on another rank: all kernels must fit at once.
        env NCCL_MAX_CTAS=8 WAGMA_TEST_DIR=tests/gpu/mpi timeout 400 "$MPIEXEC" -n $n python3 tests/mpi/run.py -q \
          -k train > "$OUT/gpu-train-$n.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/gpu-train-$n.log"
      done ;;
    trainbench)
      section "training iterations on the GPU: device vs host buckets vs torch DDP, 4 ranks"
      NCCL_MAX_CTAS=8 timeout 500 "$MPIEXEC" -n 4 python3 bench/gpu/train_step.py \
        --json "$OUT/gpu-train-step-4.json" 2>&1 | tee "$OUT/gpu-train-step-4.txt" | tail -30 ;;
    demo)
      section "wagma demo --device cuda, 4 ranks"
      NCCL_MAX_CTAS=8 timeout 500 "$MPIEXEC" -n 4 python3 -m wagma_comm.cli demo --device cuda \
        --seeds 1 --epochs 10 --plot "$OUT/gpu-demo-4.png" 2>&1 | tee "$OUT/gpu-demo-4.txt" | tail -25 ;;
    benchtests)
      for n in 2 4; do
        section "wagma bench --device cuda tests, $n ranks"
        extra=""; [ "$n" -ge 2 ] && extra="NCCL_MAX_CTAS=8"
        env $extra WAGMA_TEST_DIR=tests/gpu/mpi timeout 300 "$MPIEXEC" -n $n python3 tests/mpi/run.py -q \
          -k bench > "$OUT/gpu-benchtests-$n.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/gpu-benchtests-$n.log"
      done ;;
    cost)
      for n in 2 4; do
        section "communicator cost, $n ranks"
        extra=""; [ "$n" = 4 ] && extra="NCCL_MAX_CTAS=8"
        env $extra timeout 200 "$MPIEXEC" -n $n python3 bench/gpu/comm_cost.py 2>&1 | tee "$OUT/gpu-comm-cost-$n.txt" | tail -8
      done ;;
    bench)
      for n in 2 4; do
        section "wagma bench --device cuda, $n ranks, against torch.distributed nccl"
        extra=""; [ "$n" = 4 ] && extra="NCCL_MAX_CTAS=8"
        for coll in allreduce group_allreduce wait_avoiding; do
          env $extra timeout 200 "$MPIEXEC" -n $n python3 -m wagma_comm.cli bench $coll --device cuda \
            -b 8 -e 128M -f 64 -d bfloat16 -c 1 --vs nccl --json "$OUT/gpu-bench-$coll-$n.json" \
            2>&1 | tee -a "$OUT/gpu-bench.txt" | grep -v "^#" | tail -8
        done
      done ;;
    sass)
      section "resource report and SASS of the kernels (sm_90)"
      nvcc -std=c++17 -arch=sm_90 -cubin -Xptxas -v -o /tmp/k.cubin cuda/wagma_kernels.cu 2>&1 \
        | grep -E "spill|Used" | sort | uniq -c | sort -rn | head -6
      cuobjdump -sass /tmp/k.cubin > "$OUT/sass.txt"
      echo "16-byte loads (LDG.E.128): $(grep -c 'LDG.E.128' "$OUT/sass.txt")," \
        "16-byte stores (STG.E.128): $(grep -c 'STG.E.128' "$OUT/sass.txt")," \
        "local memory (LDL/STL): $(grep -cE 'LDL|STL' "$OUT/sass.txt")" ;;
    *) echo "unknown section $what"; exit 2 ;;
  esac
done
