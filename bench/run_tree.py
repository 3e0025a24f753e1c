"""Run the ``wagma`` CLI from another copy of the package, for A/B runs.

Usage: ``python bench/run_tree.py TREE ARGS...`` where ``TREE`` holds a
``wagma_comm/`` directory (e.g. ``git archive <commit> wagma_comm | tar -x
-C TREE``). Why: the project's editable install puts an import hook ahead of
``sys.path``, so ``PYTHONPATH=TREE`` alone would still import the working
tree; this drops that hook first.
"""

import sys


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    tree = sys.argv.pop(1)
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, tree)
    from wagma_comm.cli import main as wagma_main
    sys.argv[0] = "wagma"
    return wagma_main()


if __name__ == "__main__":
    sys.exit(main())
