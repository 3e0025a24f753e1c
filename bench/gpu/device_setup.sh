# Source from the repository root on a GPU machine whose image has Python with
# torch, cupy, numba and cuda-core (docs/gpu.md): makes a virtualenv over that
# Python and installs the wheels carried in .whl/ (mpich, mpi4py, nccl4py).
python3 -m venv --system-site-packages /tmp/wv || return 1
/tmp/wv/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || return 1
export PATH=/tmp/wv/bin:$PATH PYTHONPATH=$PWD PYTHONUNBUFFERED=1
