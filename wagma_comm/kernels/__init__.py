"""Reduction kernels: ``host`` (numba, host memory) and ``device`` (CUDA)."""
