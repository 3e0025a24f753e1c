# Source from the repository root on a GPU machine whose image has a Python
# with torch, cupy, numba, cuda-core and pytest (docs/gpu.md): installs the
# wheels carried in .whl/ (mpich, mpi4py, nccl4py) into that Python's own
# environment (a throw-away machine) and puts this checkout on the path.
PY=$(command -v python3)
"$PY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || return 1
export PATH=$(dirname "$PY"):$PATH PYTHONPATH=$PWD PYTHONUNBUFFERED=1
