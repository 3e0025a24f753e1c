#!/bin/bash
# Session 37's A/B of WAGMA's board step: COMMIT's tree ("before") against
# the working tree ("after"), alternating, 3 rounds, one sitting.
# Usage: bash bench/board_combine_ab.sh COMMIT > bench/results/board-combine-ab.txt
set -u
commit=${1:?usage: board_combine_ab.sh COMMIT}
cd "$(dirname "$0")/.."
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
git archive "$commit" wagma_comm | tar -x -C "$tree"
for round in 1 2 3; do
  for who in before after; do
    if [ "$who" = before ]; then cmd="bench/run_tree.py $tree"; else cmd="-m wagma_comm.cli"; fi
    for cfg in "2|-b 8 -e 8 -n 10000 --group-size 1" "2|-b 8 -e 8 -n 10000 --group-size 2" \
               "8|-b 1K -e 1M -f 32"; do
      n=${cfg%%|*}; args=${cfg#*|}
      echo "### round $round $who: mpiexec -n $n wagma bench wait_avoiding $args --progress off"
      timeout 400 .venv/bin/mpiexec -n "$n" .venv/bin/python $cmd bench wait_avoiding $args \
          --progress off 2>&1
      echo "rc=$?"
    done
  done
done
