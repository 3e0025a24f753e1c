#!/bin/bash
# Session 38's A/B of the received-size check on the message path: COMMIT's
# tree ("before", no check) against the working tree ("after"), alternating,
# 3 rounds, one sitting, every rank without the shared-memory segment.
# Usage: bash bench/size_check_ab.sh COMMIT > bench/results/size-check-ab.txt
WAGMA_SHM=0 exec bash "$(dirname "$0")/ab_trees.sh" "${1:?usage: size_check_ab.sh COMMIT}" \
  "2|bench allreduce -b 8 -e 8 -n 20000 --vs mpi" \
  "8|bench allreduce -b 8 -e 8 -n 3000 --vs mpi" \
  "8|bench allreduce -b 1K -e 1M -f 32 --vs mpi"
