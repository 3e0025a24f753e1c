#!/bin/bash
# A/B of two trees in one sitting: COMMIT's wagma_comm ("before") against the
# working tree ("after"), alternating, ROUNDS rounds (default 3). Each CFG is
# "RANKS|wagma CLI arguments"; the environment passes through to every rank
# (e.g. WAGMA_SHM=0 for the message path).
# Usage: [ROUNDS=3] bash bench/ab_trees.sh COMMIT "2|bench allreduce -b 8 -e 8" ...
set -u
commit=${1:?usage: ab_trees.sh COMMIT "RANKS|ARGS" ...}
shift
cd "$(dirname "$0")/.."
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
git archive "$commit" wagma_comm | tar -x -C "$tree"
for round in $(seq 1 "${ROUNDS:-3}"); do
  for who in before after; do
    if [ "$who" = before ]; then cmd="bench/run_tree.py $tree"; else cmd="-m wagma_comm.cli"; fi
    for cfg in "$@"; do
      n=${cfg%%|*}; args=${cfg#*|}
      echo "### round $round $who: mpiexec -n $n wagma $args"
      timeout 400 .venv/bin/mpiexec -n "$n" .venv/bin/python $cmd $args 2>&1
      echo "rc=$?"
    done
  done
done
