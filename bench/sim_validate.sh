#!/usr/bin/env bash
# Validate the simulator against this machine (issue #8): for each job size,
# calibrate the cost model with real collectives, measure every method's
# iterations/s with `wagma imbalance`, then re-simulate the same workload and
# compare (target: within 20%). Two workloads: "default" (the imbalance
# benchmark's defaults: 50 ms compute, 256 KB model) and "comm" (10 ms compute,
# 4 MB model: communication-heavy). Writes bench/results/sim-*-P[-comm].*
#
# Usage: bash bench/sim_validate.sh [P ...]   (default: 2 4 8)
set -euo pipefail
# The simulator models the message schedules, not the one-host shared-memory
# paths (small blocking calls, WAGMA's board): measure those schedules too.
export WAGMA_SHM=${WAGMA_SHM:-0}
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=bench/results
sizes=("$@")
[ ${#sizes[@]} -eq 0 ] && sizes=(2 4 8)
for P in "${sizes[@]}"; do
  echo "== $P ranks"
  "$BIN/mpiexec" -n "$P" "$BIN/wagma" sim --calibrate --out "$OUT/sim-cost-$P.json" \
    | tee "$OUT/sim-cost-$P.txt"
  for workload in default comm; do
    suffix=""; extra=()
    if [ "$workload" = comm ]; then suffix="-comm"; extra=(--compute 0.01 --elements 1048576); fi
    "$BIN/mpiexec" -n "$P" "$BIN/wagma" imbalance "${extra[@]}" \
      --json "$OUT/sim-imbalance-$P$suffix.json" > "$OUT/sim-imbalance-$P$suffix.txt"
    "$BIN/wagma" sim --validate "$OUT/sim-imbalance-$P$suffix.json" \
      --cost "$OUT/sim-cost-$P.json" --json "$OUT/sim-validate-$P$suffix.json" \
      | tee "$OUT/sim-validate-$P$suffix.txt"
  done
done
