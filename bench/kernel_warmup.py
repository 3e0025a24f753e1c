# Usage: NUMBA_CACHE_DIR=$(mktemp -d) .venv/bin/python bench/kernel_warmup.py
"""Seconds the first add and average of a dtype take (numba compiles them)
against the second, with an empty numba cache: why creation warms them."""
import time

from wagma_comm.dtypes import lookup
from wagma_comm.partial.memory import HostMemory

mem = HostMemory(lookup("float16"))
one = mem.zeros(1)
for label, call in (("add", lambda: mem.add(one, one)),
                    ("average", lambda: mem.average(one, [one], 1))):
    t0 = time.perf_counter(); call(); first = time.perf_counter() - t0
    t0 = time.perf_counter(); call(); second = time.perf_counter() - t0
    print(f"{label}: first call {first:.3f} s, second {second * 1e6:.1f} us")
