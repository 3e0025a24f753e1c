#!/bin/bash
# Session 37's A/B of WAGMA's board step: COMMIT's tree ("before") against
# the working tree ("after"), alternating, 3 rounds, one sitting.
# Usage: bash bench/board_combine_ab.sh COMMIT > bench/results/board-combine-ab.txt
exec bash "$(dirname "$0")/ab_trees.sh" "${1:?usage: board_combine_ab.sh COMMIT}" \
  "2|bench wait_avoiding -b 8 -e 8 -n 10000 --group-size 1 --progress off" \
  "2|bench wait_avoiding -b 8 -e 8 -n 10000 --group-size 2 --progress off" \
  "8|bench wait_avoiding -b 1K -e 1M -f 32 --progress off"
