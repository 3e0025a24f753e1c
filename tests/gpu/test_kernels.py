"""cuda/wagma_kernels.cu against NumPy references on fresh random data: every
dtype, every op, odd lengths, misaligned starts (the element-wise variant) and
aligned ones (the 16-byte variant). Outputs are poisoned before each launch."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from wagma_comm import dtypes
from wagma_comm.kernels import device as dk

cp = pytest.importorskip("cupy")

LENGTHS = [1, 7, 8, 9, 1023, 4099, 1 << 20]
OFFSETS = [0, 1, 3]  # elements: 0 keeps 16-byte alignment, the others break it
RNG = np.random.default_rng()


def _random(dtype: dtypes.DType, n: int) -> np.ndarray:
    if dtype.is_float:
        x = RNG.standard_normal(n) * 8
        return x.astype(dtype.numpy)
    info = np.iinfo(dtype.numpy)
    return RNG.integers(info.min, info.max, n, dtype=dtype.numpy, endpoint=True)


def _device_copy(host: np.ndarray, offset: int):
    """A device buffer holding ``host`` starting ``offset`` elements in."""
    raw = cp.empty((host.size + offset) * host.itemsize + 16, dtype=cp.uint8)
    ptr = int(raw.data.ptr) + offset * host.itemsize
    mem = cp.cuda.MemoryPointer(raw.data.mem, offset * host.itemsize)
    cp.cuda.runtime.memcpy(ptr, host.ctypes.data, host.nbytes, 1)
    return raw, mem, ptr


def _to_host(ptr: int, like: np.ndarray) -> np.ndarray:
    out = np.empty_like(like)
    cp.cuda.runtime.memcpy(out.ctypes.data, ptr, out.nbytes, 2)
    return out


def _emulate(a: np.ndarray, b: np.ndarray, op: str, dtype: dtypes.DType) -> np.ndarray:
    """The kernel's arithmetic in NumPy: 16-bit floats through float32 with one
    round to nearest-even, integers wrapping."""
    fn = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    if dtype.is_half:
        return fn(a.astype(np.float32), b.astype(np.float32)).astype(dtype.numpy)
    with np.errstate(over="ignore", invalid="ignore"):
        return fn(a, b).astype(dtype.numpy)


@pytest.mark.parametrize("dtype", dtypes.ALL, ids=lambda d: d.name)
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("offset", OFFSETS)
def test_reduce_matches_reference(dtype, op, offset):
    k = dk.kernels(0)
    stream = cp.cuda.Stream(non_blocking=True)
    for n in LENGTHS:
        a, b = _random(dtype, n), _random(dtype, n)
        if dtype.is_float and n > 8:
            a[3], b[5] = np.nan, np.nan  # NaN propagates from either side
        keep_a, _, pa = _device_copy(a, offset)
        keep_b, _, pb = _device_copy(b, offset)
        k.reduce(pa, pb, n, op, dtype, stream)
        stream.synchronize()
        got, want = _to_host(pa, a), _emulate(a, b, op, dtype)
        if dtype.is_float:
            g, w = got.astype(np.float64), want.astype(np.float64)
            assert np.array_equal(np.isnan(g), np.isnan(w)), (n, offset)
            m = ~np.isnan(w)
            np.testing.assert_array_equal(g[m], w[m])
        else:
            np.testing.assert_array_equal(got, want)
        del keep_a, keep_b


@pytest.mark.parametrize("dtype", dtypes.ALL, ids=lambda d: d.name)
@pytest.mark.parametrize("divisor", [1, 3, 8])
def test_scale_matches_reference(dtype, divisor):
    k = dk.kernels(0)
    stream = cp.cuda.Stream(non_blocking=True)
    for offset in OFFSETS:
        for n in LENGTHS:
            x = _random(dtype, n)
            keep, _, p = _device_copy(x, offset)
            k.scale(p, n, divisor, dtype, stream)
            stream.synchronize()
            got = _to_host(p, x)
            if dtype.is_half:
                want = (x.astype(np.float32) / np.float32(divisor)).astype(dtype.numpy)
            elif dtype.is_float:
                want = (x / dtype.numpy.type(divisor)).astype(dtype.numpy)
            else:
                want = x // dtype.numpy.type(divisor)
            np.testing.assert_array_equal(got.view(dtype.storage), want.view(dtype.storage))
            del keep


@pytest.mark.parametrize("dtype", [dtypes.FLOAT16, dtypes.BFLOAT16, dtypes.FLOAT32,
                                   dtypes.FLOAT64], ids=lambda d: d.name)
@pytest.mark.parametrize("k_inputs", [1, 2, 5, 9])
@pytest.mark.parametrize("alias", [False, True])
def test_fused_average_against_float64(dtype, k_inputs, alias):
    k = dk.kernels(0)
    stream = cp.cuda.Stream(non_blocking=True)
    tol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-14}[dtype.name]
    for offset in OFFSETS:
        for n in LENGTHS:
            xs = [_random(dtype, n) for _ in range(k_inputs)]
            keeps = [_device_copy(x, offset) for x in xs]
            ptrs = [p for _, _, p in keeps]
            poison = np.full(n, np.nan, dtype=dtype.numpy)
            out_keep, _, out = (keeps[0] if alias else _device_copy(poison, offset))
            k.average(out, ptrs, n, k_inputs, dtype, stream)
            stream.synchronize()
            got = _to_host(out, xs[0]).astype(np.float64)
            ref = np.sum([x.astype(np.float64) for x in xs], axis=0) / k_inputs
            assert not np.isnan(got).any(), "an element was not written"
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert err < tol, (n, offset, err)
            del keeps, out_keep


def test_copy_segments_packs_and_unpacks():
    k = dk.kernels(0)
    stream = cp.cuda.Stream(non_blocking=True)
    sizes = [1, 15, 16, 17, 1000, 4096, 333333]
    tensors = [RNG.integers(0, 256, s, dtype=np.uint8) for s in sizes]
    srcs = [_device_copy(t, off) for t, off in zip(tensors, [0, 1, 0, 3, 5, 0, 7])]
    total = sum(sizes)
    flat = cp.full(total + 8, 0xAB, dtype=cp.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]) + 1  # flat misaligned too
    base = int(flat.data.ptr)
    k.copy_segments([base + int(o) for o in offsets], [p for _, _, p in srcs], sizes, stream)
    back = [_device_copy(np.zeros(s, np.uint8), 2) for s in sizes]
    k.copy_segments([p for _, _, p in back], [base + int(o) for o in offsets], sizes, stream)
    stream.synchronize()
    host_flat = cp.asnumpy(flat)
    assert host_flat[0] == 0xAB and (host_flat[total + 1:] == 0xAB).all()
    for t, o, (_, _, p) in zip(tensors, offsets, back):
        np.testing.assert_array_equal(host_flat[o:o + t.size], t)
        np.testing.assert_array_equal(_to_host(p, t), t)


def test_bfloat16_rounds_to_nearest_even():
    k = dk.kernels(0)
    stream = cp.cuda.Stream(non_blocking=True)
    # 1 + 2^-8 is exactly halfway between two bfloat16 values: ties go to even (1.0)
    a = np.array([1.0, 1.0078125], dtype=ml_dtypes.bfloat16)
    b = np.array([2.0 ** -8, 2.0 ** -8], dtype=ml_dtypes.bfloat16)
    keep, _, pa = _device_copy(a, 0)
    keep_b, _, pb = _device_copy(b, 0)
    k.reduce(pa, pb, 2, "sum", dtypes.BFLOAT16, stream)
    stream.synchronize()
    got = _to_host(pa, a).astype(np.float64)
    assert got[0] == 1.0 and got[1] == 1.015625


def test_pointer_tables_are_per_stream():
    """The average's pointer table is copied on the stream of its first use;
    another stream must get its own (not one whose copy may not have run)."""
    k = dk.kernels(0)
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    values = (4096, 8192, 12288)
    ta = k._pointer_array(values, a)
    assert k._pointer_array(values, a) is ta  # cached per stream
    tb = k._pointer_array(values, b)
    assert tb is not ta
    b.synchronize()
    assert cp.asnumpy(tb).tolist() == list(values)


_RACE = r"""
import numpy as np, cupy as cp
from wagma_comm import dtypes
from wagma_comm.kernels import device as dk
k = dk.kernels(0)
a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
n = 1 << 16
xs = [cp.full(n, float(i + 1), dtype=cp.float32) for i in range(3)]
out_a, out_b = cp.zeros(n, cp.float32), cp.zeros(n, cp.float32)
cp.cuda.Device().synchronize()
spin = cp.RawKernel('extern "C" __global__ void spin(long long c) '
                    '{ long long s = clock64(); while (clock64() - s < c) {} }', 'spin')
spin((1,), (1,), (np.int64(4_000_000_000),), stream=a)  # a is busy for seconds
ptrs = [int(x.data.ptr) for x in xs]
k.average(int(out_a.data.ptr), ptrs, n, 3.0, dtypes.FLOAT32, a)  # table copy queued on a
k.average(int(out_b.data.ptr), ptrs, n, 3.0, dtypes.FLOAT32, b)  # same pointers, stream b
b.synchronize()
assert not a.done, "the spin ended too early to test anything"
assert bool((out_b == 2.0).all()), cp.asnumpy(out_b)[:8]
a.synchronize()
assert bool((out_a == 2.0).all())
print("ok")
"""


def test_a_cached_pointer_table_is_not_read_before_its_copy():
    """Stream a is busy, so the table's copy queued on it has not run; the
    same average on stream b must not read that table (it used to: wrong
    pointers, an illegal address). In a subprocess: that error would leave
    this process's CUDA context unusable."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
