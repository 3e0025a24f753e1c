"""Host reduction kernels (wagma_comm.kernels.host): bit-exact numerics, no MPI.

References are NumPy / ml_dtypes / PyTorch conversions and float64 arithmetic;
every float comparison is on bit patterns. NaN rule under test: reduce/scale/
average write the canonical quiet NaN; conversions keep sign + top payload bits
and set the quiet bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from numba import njit

from wagma_comm import dtypes as D
from wagma_comm.errors import BufferError, InvalidArgumentError
from wagma_comm.kernels import host as H

HALVES = [(D.FLOAT16, np.dtype(np.float16)), (D.BFLOAT16, np.dtype(ml_dtypes.bfloat16))]
HALF_IDS = ["float16", "bfloat16"]
LENGTHS = [0, 1, 7, 1023, 4097]
OPS = ["sum", "prod", "max", "min"]
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
CANON_NAN = {"float16": 0x7E00, "bfloat16": 0x7FC0, "float32": 0x7FC00000,
             "float64": 0x7FF8000000000000}


# ----------------------------------------------------------------- helpers


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(UINT[a.dtype.itemsize])


def half_isnan(u: np.ndarray, dt: D.DType) -> np.ndarray:
    inf = 0x7C00 if dt.name == "float16" else 0x7F80
    return (u & 0x7FFF) > inf


def isnan_storage(a: np.ndarray, dt: D.DType) -> np.ndarray:
    return half_isnan(a, dt) if dt.is_half else np.isnan(a)


def assert_bits(got: np.ndarray, ref: np.ndarray, dt: D.DType) -> None:
    """Bit-exact equality; where the reference is NaN the result must be the
    canonical NaN (the reference's payload is whatever NumPy happened to keep)."""
    got = np.asarray(got)
    ref = np.asarray(ref)
    assert got.shape == ref.shape
    if not dt.is_float:
        np.testing.assert_array_equal(got, ref)
        return
    gb, rb = bits(got), bits(ref)
    nan = isnan_storage(ref.view(got.dtype) if dt.is_half else ref, dt)
    assert np.all(gb[nan] == CANON_NAN[dt.name]), "NaN results must be canonical"
    bad = np.nonzero(gb[~nan] != rb[~nan])[0]
    assert bad.size == 0, (
        f"{bad.size} mismatches, first at {np.nonzero(~nan)[0][bad[0]]}: "
        f"got {hex(int(gb[~nan][bad[0]]))} expected {hex(int(rb[~nan][bad[0]]))}"
    )


def ordered(u: np.ndarray) -> np.ndarray:
    """Half bit patterns -> integers in value order (for ulp distances)."""
    u = u.astype(np.int64)
    mag = u & 0x7FFF
    return np.where(u & 0x8000, -mag, mag)


def round_f64_to_bf16(x: np.ndarray) -> np.ndarray:
    """Correctly rounded float64 -> bfloat16 bits (ml_dtypes rounds through
    float32, i.e. twice): round to odd into float32, then RNE to bfloat16."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32)
    u = f.view(np.uint32).copy()
    exact = f.astype(np.float64) == x
    finite = np.isfinite(f)
    away = ~exact & finite & (np.abs(f.astype(np.float64)) > np.abs(x))
    u[away] -= 1  # step the magnitude toward zero: truncation
    u[~exact & finite] |= 1  # sticky bit: round to odd
    return u.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def round_f64_to_half(x: np.ndarray, dt: D.DType) -> np.ndarray:
    if dt.name == "float16":
        with np.errstate(over="ignore"):
            return np.asarray(x, np.float64).astype(np.float16).view(np.uint16)  # direct RNE
    return round_f64_to_bf16(x)


def widen_ref(u: np.ndarray, npdt: np.dtype, to=np.float32) -> np.ndarray:
    return u.view(npdt).astype(to)


def sample(dt: D.DType, n: int, rng: np.random.Generator, specials: bool = True) -> np.ndarray:
    """Random values of dtype storage: mostly well-scaled, some specials."""
    if not dt.is_float:
        info = np.iinfo(dt.storage)
        return rng.integers(info.min, info.max, n, dtype=dt.storage, endpoint=True)
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 4, n)
    if dt.is_half:
        out = x.astype(np.float32).astype(dt.numpy).view(np.uint16)
        if specials and n:
            k = max(1, n // 8)
            idx = rng.integers(0, n, k)
            out[idx] = rng.integers(0, 1 << 16, k, dtype=np.uint16)  # any pattern
            sp = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x7C00 if dt.name == "float16"
                           else 0x7F80, 0xFC00 if dt.name == "float16" else 0xFF80],
                          np.uint16)
            out[rng.integers(0, n, k)] = rng.choice(sp, k)
        return out
    out = x.astype(dt.storage)
    if specials and n:
        k = max(1, n // 8)
        fi = np.finfo(dt.storage)
        sp = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, fi.max, -fi.max,
                       fi.smallest_subnormal, -fi.smallest_normal], dt.storage)
        out[rng.integers(0, n, k)] = rng.choice(sp, k)
        # NaNs with payloads and signs that differ from the canonical one
        u = bits(out)
        idx = rng.integers(0, n, max(1, n // 32))
        if dt.name == "float32":
            u[idx] = rng.choice(np.array([0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFA5A5A5],
                                         np.uint32), idx.size)
        else:
            u[idx] = rng.choice(np.array([0x7FF8000000000001, 0xFFF8000000000000,
                                          0x7FF0000000000001], np.uint64), idx.size)
    return out


def ref_float_op(a: np.ndarray, b: np.ndarray, op: str) -> np.ndarray:
    """op in a's float precision; max/min give +0/-0 for mixed zeros."""
    with np.errstate(all="ignore"):
        if op == "sum":
            return a + b
        if op == "prod":
            return a * b
        zeros = (a == b) & (a == 0)
        if op == "max":
            r = np.maximum(a, b)
            r[zeros] = (a + b)[zeros]
        else:
            r = np.minimum(a, b)
            r[zeros] = (-((-a) + (-b)))[zeros]
        return r


def ref_reduce(a: np.ndarray, b: np.ndarray, op: str, dt: D.DType) -> np.ndarray:
    if dt.is_half:
        r = ref_float_op(widen_ref(a, dt.numpy), widen_ref(b, dt.numpy), op)
        with np.errstate(all="ignore"):
            return r.astype(dt.numpy).view(np.uint16)
    if dt.is_float:
        return ref_float_op(a, b, op)
    ufunc = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    return ufunc(a, b)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


# ----------------------------------------------------------------- conversions

ALL16 = np.arange(1 << 16, dtype=np.uint16)


@njit(cache=False)
def _soft_widen(src, out):
    for i in range(src.size):
        out[i] = H._f16_to_f32_soft(src[i])


@njit(cache=False)
def _soft_narrow(src, out):
    for i in range(src.size):
        out[i] = H._f32_to_f16_soft(src[i])


def expected_widen(u: np.ndarray, npdt: np.dtype) -> np.ndarray:
    """Reference float32 bits; NaNs: the reference's payload plus the quiet bit."""
    ref = bits(u.view(npdt).astype(np.float32)).copy()
    nan = np.isnan(u.view(npdt).astype(np.float32))
    ref[nan] |= 0x00400000
    return ref


@pytest.mark.parametrize("dt,npdt", HALVES, ids=HALF_IDS)
def test_widen_all_patterns(dt: D.DType, npdt: np.dtype) -> None:
    ref = expected_widen(ALL16, npdt)
    np.testing.assert_array_equal(bits(H.to_float32(ALL16, dt)), ref)
    scalar = H.f16_bits_to_f32 if dt.name == "float16" else H.bf16_bits_to_f32
    got = np.array([scalar(int(h)) for h in ALL16], np.float32)
    np.testing.assert_array_equal(bits(got), ref)
    # uint16 scalars from a NumPy array take the same path
    assert bits(np.array([scalar(np.uint16(0x3C01 if dt.name == "float16" else 0x3F81))],
                         np.float32))[0] == ref[0x3C01 if dt.name == "float16" else 0x3F81]


def test_f16_software_widen_all_patterns() -> None:
    out = np.empty(ALL16.size, np.float32)
    _soft_widen(ALL16, out)
    np.testing.assert_array_equal(bits(out), expected_widen(ALL16, np.dtype(np.float16)))


def narrow_vectors(dt: D.DType, npdt: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """float32 inputs that exercise every rounding decision of float32 -> half:
    every half value, every midpoint between neighbouring halves (exact ties,
    RNE), the float32 neighbours of each midpoint, the overflow threshold,
    float32 subnormals, specials and random bit patterns."""
    top = 0x7BFF if dt.name == "float16" else 0x7F7F
    pos = np.arange(top + 1, dtype=np.uint16)
    lo = pos.view(npdt).astype(np.float64)
    hi = np.append(lo[1:], 65536.0 if dt.name == "float16" else 2.0 ** 128)
    mid = ((lo + hi) / 2).astype(np.float32)  # exact: one bit more than a half
    assert np.all(mid.astype(np.float64) == (lo + hi) / 2)
    up = np.nextafter(mid, np.float32(np.inf))
    down = np.nextafter(mid, np.float32(0))
    vals = np.concatenate([lo.astype(np.float32), mid, up, down])
    vals = np.concatenate([vals, -vals])
    special = np.array([0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000,
                        0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
                        0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA5A5A5, 0x7FBFFFFF,
                        0x7F802000, 0x7F801FFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x477FF000,
                        0x477FEFFF, 0x477FF001, 0x33000000, 0x33000001, 0x32FFFFFF,
                        0x7F7F8000, 0x7F7F7FFF], np.uint32).view(np.float32)
    rand = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32).view(np.float32)
    return np.concatenate([vals, special, rand])


def expected_narrow(x: np.ndarray, dt: D.DType, npdt: np.dtype) -> np.ndarray:
    with np.errstate(all="ignore"):
        ref = x.astype(npdt).view(np.uint16).copy()
    u = bits(x)
    nan = np.isnan(x)
    sign = ((u >> 16) & 0x8000).astype(np.uint16)
    if dt.name == "float16":
        ref[nan] = sign[nan] | 0x7E00 | ((u[nan] >> 13) & 0x3FF).astype(np.uint16)
    else:
        ref[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return ref


@pytest.mark.parametrize("dt,npdt", HALVES, ids=HALF_IDS)
def test_narrow_rne_ties_subnormals_overflow_nan(dt: D.DType, npdt: np.dtype,
                                                 rng: np.random.Generator) -> None:
    x = narrow_vectors(dt, npdt, rng)
    ref = expected_narrow(x, dt, npdt)
    got = H.from_float32(x, dt)
    bad = np.nonzero(got != ref)[0]
    assert bad.size == 0, f"{hex(int(bits(x)[bad[0]]))}: {hex(int(got[bad[0]]))} != {hex(int(ref[bad[0]]))}"
    scalar = H.f32_to_f16_bits if dt.name == "float16" else H.f32_to_bf16_bits
    some = np.concatenate([x[:: max(1, x.size // 5000)], x[-(1 << 20) - 27:-(1 << 20)]])
    some_ref = expected_narrow(some, dt, npdt)
    assert [scalar(v) for v in some] == some_ref.tolist()


def test_narrow_known_values() -> None:
    """Spot values with well-known answers, independent of NumPy."""
    f = np.array([1.0, 65504.0, 65519.99, 65520.0, 2.0 ** -24, 2.0 ** -25,
                  2.0 ** -25 * 1.0000001, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11], np.float32)
    assert H.from_float32(f, D.FLOAT16).tolist() == [
        0x3C00, 0x7BFF, 0x7BFF, 0x7C00, 0x0001, 0x0000, 0x0001, 0x3C00, 0x3C02]
    g = np.array([1.0, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 0.0, 0.0, -0.0], np.float32)
    g.view(np.uint32)[3:5] = [0x7F7F8000, 0x7F7F7FFF]  # tie above bf16 max (odd): inf
    assert H.from_float32(g, D.BFLOAT16).tolist() == [
        0x3F80, 0x3F80, 0x3F82, 0x7F80, 0x7F7F, 0x8000]
    assert H.f32_to_bf16_bits(np.float32(np.nan)) == 0x7FC0
    assert H.f32_to_f16_bits(-np.inf) == 0xFC00


def test_f16_software_narrow(rng: np.random.Generator) -> None:
    npdt = np.dtype(np.float16)
    x = narrow_vectors(D.FLOAT16, npdt, rng)
    out = np.empty(x.size, np.uint16)
    _soft_narrow(x, out)
    np.testing.assert_array_equal(out, expected_narrow(x, D.FLOAT16, npdt))


@pytest.mark.parametrize("dt,npdt", HALVES, ids=HALF_IDS)
def test_roundtrip_identity(dt: D.DType, npdt: np.dtype) -> None:
    """Widening then narrowing returns every non-NaN pattern unchanged."""
    back = H.from_float32(H.to_float32(ALL16, dt), dt)
    nan = half_isnan(ALL16, dt)
    np.testing.assert_array_equal(back[~nan], ALL16[~nan])
    assert np.all(half_isnan(back[nan], dt))


# ----------------------------------------------------------------- reduce_into


def buffers(dt: D.DType, n: int, rng: np.random.Generator, offset: int = 0):
    """Two sample arrays, optionally starting `offset` elements into a larger
    buffer so that the aligned-peel path sees every misalignment."""
    a = sample(dt, n + offset, rng)[offset:]
    b = sample(dt, n + offset, rng)[offset:]
    return a, b


@pytest.mark.parametrize("dt", D.ALL, ids=[d.name for d in D.ALL])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", LENGTHS)
def test_reduce_matches_reference(dt: D.DType, op: str, n: int,
                                  rng: np.random.Generator) -> None:
    for offset in (0, 3):
        a, b = buffers(dt, n, rng, offset)
        ref = ref_reduce(a, b, op, dt)
        got = a.copy() if offset == 0 else a  # exercise unaligned in-place too
        H.reduce_into(got, b, op, dt)
        assert_bits(got, ref, dt)


@pytest.mark.parametrize("dt,npdt", HALVES, ids=HALF_IDS)
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_half_reduce_is_correctly_rounded(dt: D.DType, npdt: np.dtype, op: str,
                                          rng: np.random.Generator) -> None:
    """float32 is wide enough (>= 2p+2 bits) that widen-op-round equals the
    correctly rounded float64 result."""
    a = rng.integers(0, 1 << 16, 200_000, dtype=np.uint16)
    b = rng.integers(0, 1 << 16, 200_000, dtype=np.uint16)
    keep = ~(half_isnan(a, dt) | half_isnan(b, dt))
    a, b = a[keep], b[keep]
    a64, b64 = widen_ref(a, npdt, np.float64), widen_ref(b, npdt, np.float64)
    with np.errstate(all="ignore"):
        exact = a64 + b64 if op == "sum" else a64 * b64
    ref = round_f64_to_half(exact, dt)
    got = a.copy()
    H.reduce_into(got, b, op, dt)
    assert_bits(got, ref.view(np.uint16), dt)


@pytest.mark.parametrize("dt", D.ALL, ids=[d.name for d in D.ALL])
@pytest.mark.parametrize("op", OPS)
def test_reduce_is_symmetric_bitwise(dt: D.DType, op: str, rng: np.random.Generator) -> None:
    n = 4097
    if dt.is_half:
        # every pattern against every kind of pattern: NaN payloads, +-0, inf
        a = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        b = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        a[:4] = [0x0000, 0x8000, 0x7E01, 0xFE00]
        b[:4] = [0x8000, 0x0000, 0xFE07, 0x7D00]
    elif dt.is_float:
        a = sample(dt, n, rng)
        b = sample(dt, n, rng)
        a[:3] = [0.0, -0.0, np.inf]
        b[:3] = [-0.0, 0.0, -np.inf]
        ub, ua = bits(b), bits(a)
        ua[3], ub[3] = (0x7FC00001, 0xFFC00002) if dt.name == "float32" else (
            0x7FF8000000000001, 0xFFF8000000000002)
    else:
        a, b = sample(dt, n, rng), sample(dt, n, rng)
    ab, ba = a.copy(), b.copy()
    H.reduce_into(ab, b, op, dt)
    H.reduce_into(ba, a, op, dt)
    np.testing.assert_array_equal(bits(ab) if dt.is_float else ab,
                                  bits(ba) if dt.is_float else ba)


def test_max_min_signed_zero_and_nan() -> None:
    a = np.array([0.0, -0.0, 1.0, np.nan, 2.0], np.float32)
    b = np.array([-0.0, 0.0, np.nan, 1.0, 2.0], np.float32)
    mx, mn = a.copy(), a.copy()
    H.reduce_into(mx, b, "max", D.FLOAT32)
    H.reduce_into(mn, b, "min", D.FLOAT32)
    assert bits(mx).tolist() == [0, 0, 0x7FC00000, 0x7FC00000, 0x40000000]
    assert bits(mn).tolist() == [0x80000000, 0x80000000, 0x7FC00000, 0x7FC00000, 0x40000000]


def test_integer_wraparound() -> None:
    a = np.array([250, 16], np.uint8)
    H.reduce_into(a, np.array([10, 16], np.uint8), "sum", D.UINT8)
    assert a.tolist() == [4, 32]
    b = np.array([2 ** 31 - 1], np.int32)
    H.reduce_into(b, np.array([2], np.int32), "prod", D.INT32)
    assert b.tolist() == [-2]


def test_reduce_into_self(rng: np.random.Generator) -> None:
    for dt in D.ALL:
        a = sample(dt, 1000, rng, specials=False)
        ref = ref_reduce(a, a, "sum", dt)
        H.reduce_into(a, a, "sum", dt)
        assert_bits(a, ref, dt)


# ----------------------------------------------------------------- scale_into


@pytest.mark.parametrize("dt", [D.FLOAT32, D.FLOAT64], ids=["float32", "float64"])
@pytest.mark.parametrize("n", LENGTHS)
def test_scale_native_float_is_ieee_division(dt: D.DType, n: int,
                                             rng: np.random.Generator) -> None:
    for divisor in (2, 3, 7, 1000, (1 << 24) - 3):
        x = sample(dt, n, rng)
        with np.errstate(invalid="ignore"):  # signalling NaNs in the sample
            ref = x / dt.storage.type(divisor)
        H.scale_into(x, divisor, dt)
        assert_bits(x, ref, dt)


@pytest.mark.parametrize("dt,npdt", HALVES, ids=HALF_IDS)
@pytest.mark.parametrize("n", LENGTHS)
def test_scale_half_bit_exact_f32_path(dt: D.DType, npdt: np.dtype, n: int,
                                       rng: np.random.Generator) -> None:
    """What scale_into computes: RN_half(RN_f32(x / divisor))."""
    for divisor in (3, 5, 1000, 123457):
        x = sample(dt, n, rng)
        with np.errstate(all="ignore"):
            ref = (widen_ref(x, npdt) / np.float32(divisor)).astype(npdt).view(np.uint16)
        H.scale_into(x, divisor, dt)
        assert_bits(x, ref, dt)


@pytest.mark.parametrize("dt,npdt", HALVES, ids=HALF_IDS)
def test_scale_half_vs_float64(dt: D.DType, npdt: np.dtype) -> None:
    """The stated guarantee against the correctly rounded float64 quotient, on
    every finite half (subnormals included): equal for divisor < 2**(24-p),
    within one ulp for any divisor."""
    x = ALL16[~half_isnan(ALL16, dt)]
    for divisor in (2, 3, 5, 6, 7, 9, 10, 11, 100, 255, 1000, 4095, 8191,
                    8193, 12345, 65535, 1_000_003, (1 << 24) - 1):
        got = x.copy()
        H.scale_into(got, divisor, dt)
        q = widen_ref(x, npdt, np.float64) / divisor
        ref = round_f64_to_half(q, dt)
        dist = np.abs(ordered(got) - ordered(ref))
        assert dist.max() <= 1, divisor
        if divisor < (1 << 13 if dt.name == "float16" else 1 << 16):
            np.testing.assert_array_equal(got, ref, err_msg=str(divisor))


@pytest.mark.parametrize("dt", [D.INT32, D.INT64, D.UINT8], ids=["int32", "int64", "uint8"])
@pytest.mark.parametrize("n", LENGTHS)
def test_scale_integer_floor_division(dt: D.DType, n: int, rng: np.random.Generator) -> None:
    for divisor in (1, 2, 3, 7, 8, 255, 256, 1000, 2 ** 40 + 1):
        x = sample(dt, n, rng)
        ref = np.array([int(v) // divisor for v in x.tolist()], dt.storage)
        H.scale_into(x, divisor, dt)
        np.testing.assert_array_equal(x, ref)


def test_scale_nan_is_canonical() -> None:
    x = np.array([0x7F800001, 0xFFC00005], np.uint32).view(np.float32)
    H.scale_into(x, 3, D.FLOAT32)
    assert bits(x).tolist() == [0x7FC00000, 0x7FC00000]
    h = np.array([0xFE01, 0x7C00], np.uint16)
    H.scale_into(h, 3, D.FLOAT16)
    assert h.tolist() == [0x7E00, 0x7C00]


# ----------------------------------------------------------------- average_into


def ref_average(parts: list[np.ndarray], divisor: int, dt: D.DType) -> np.ndarray:
    """The documented computation, in NumPy: accumulate in parts order."""
    with np.errstate(all="ignore"):
        if dt.is_half:
            acc = widen_ref(parts[0], dt.numpy)
            for p in parts[1:]:
                acc = acc + widen_ref(p, dt.numpy)
            return (acc / np.float32(divisor)).astype(dt.numpy).view(np.uint16)
        if dt.is_float:
            acc = parts[0].astype(np.float64)
            for p in parts[1:]:
                acc = acc + p
            return (acc / np.float64(divisor)).astype(dt.storage)
        acc = parts[0].astype(np.int64)
        for p in parts[1:]:
            acc = acc + p
        return (acc // divisor).astype(dt.storage)


@pytest.mark.parametrize("dt", D.ALL, ids=[d.name for d in D.ALL])
@pytest.mark.parametrize("n", LENGTHS + [3 * 2048 + 5])
def test_average_matches_reference(dt: D.DType, n: int, rng: np.random.Generator) -> None:
    for k, divisor, offset in ((1, 3, 0), (2, 2, 1), (3, 3, 0), (4, 5, 5), (5, 5, 0),
                               (9, 9, 2)):
        parts = [sample(dt, n + offset, rng)[offset:] for _ in range(k)]
        dst = parts[0].copy() if offset == 0 else sample(dt, n + offset, rng)[offset:]
        ref = ref_average(parts, divisor, dt)
        H.average_into(dst, parts, divisor, dt)
        assert_bits(dst, ref, dt)


@pytest.mark.parametrize("dt", D.ALL, ids=[d.name for d in D.ALL])
def test_average_parts_include_dst(dt: D.DType, rng: np.random.Generator) -> None:
    n = 5000
    for where in (0, 1, 3):
        others = [sample(dt, n, rng) for _ in range(3)]
        dst = sample(dt, n, rng)
        parts = list(others)
        parts.insert(where, dst)
        ref = ref_average([p.copy() for p in parts], 4, dt)
        H.average_into(dst, parts, 4, dt)
        assert_bits(dst, ref, dt)


@pytest.mark.parametrize("dt,npdt", HALVES, ids=HALF_IDS)
def test_average_half_vs_float64(dt: D.DType, npdt: np.dtype, rng: np.random.Generator) -> None:
    """Against float64: the quotient of the float32 accumulator is correctly
    rounded (divisor < 2**13); with same-sign data, where
    float32 accumulation of a few halves loses at most a float32 ulp or two,
    the average is within 1 ulp of the float64 average."""
    n = 100_000
    parts = [np.abs(rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n))
             .astype(np.float32).astype(npdt).view(np.uint16) for _ in range(5)]
    for divisor in (5, 6, 7):
        dst = np.empty(n, np.uint16)
        H.average_into(dst, parts, divisor, dt)
        acc32 = sum((widen_ref(p, npdt) for p in parts[1:]), widen_ref(parts[0], npdt))
        np.testing.assert_array_equal(
            dst, round_f64_to_half(acc32.astype(np.float64) / divisor, dt))
        exact = sum(widen_ref(p, npdt, np.float64) for p in parts) / divisor
        assert np.abs(ordered(dst) - ordered(round_f64_to_half(exact, dt))).max() <= 1
    # any finite patterns (subnormals, huge and tiny mixed), larger divisors
    raw = [rng.integers(0, 1 << 16, n, dtype=np.uint16) for _ in range(3)]
    finite = ~np.any([half_isnan(r, dt) | ((r & 0x7FFF) == (0x7C00 if dt.name == "float16"
                                                           else 0x7F80)) for r in raw], axis=0)
    raw = [r[finite] for r in raw]
    with np.errstate(over="ignore"):  # bf16 sums can leave float32's range
        acc32 = widen_ref(raw[0], npdt) + widen_ref(raw[1], npdt) + widen_ref(raw[2], npdt)
    ok = np.isfinite(acc32)
    for divisor in (3, 7, 1000, 8191) + ((12345, 65535) if dt.name == "bfloat16" else ()):
        dst = np.empty(raw[0].size, np.uint16)
        H.average_into(dst, raw, divisor, dt)
        ref = round_f64_to_half(acc32.astype(np.float64) / divisor, dt)
        np.testing.assert_array_equal(dst[ok], ref[ok], err_msg=str(divisor))


def test_average_integer_floor_and_wrap() -> None:
    a = np.array([-7, 7, 2 ** 31 - 1], np.int32)
    b = np.array([0, 0, 2 ** 31 - 1], np.int32)
    H.average_into(a, [a, b], 2, D.INT32)
    assert a.tolist() == [-4, 3, 2 ** 31 - 1]  # int64 accumulator: no overflow
    c = np.array([-7, 7], np.int64)
    H.average_into(c, [c, np.zeros(2, np.int64)], 3, D.INT64)
    assert c.tolist() == [-3, 2]
    u = np.array([255, 255, 1], np.uint8)
    H.average_into(u, [u, u, u], 1, D.UINT8)  # 765 wraps to 253, like NumPy
    assert u.tolist() == [253, 253, 3]


def test_torch_average_bits() -> None:
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    for tdt, dt in ((torch.bfloat16, D.BFLOAT16), (torch.float16, D.FLOAT16)):
        ts = [torch.randn(10_001, generator=g).to(tdt) for _ in range(3)]
        expected = ((ts[0].float() + ts[1].float() + ts[2].float()) / 3).to(tdt)
        parts = [t.view(torch.int16).numpy().view(np.uint16) for t in ts]
        dst = np.empty_like(parts[0])
        H.average_into(dst, parts, 3, dt)
        np.testing.assert_array_equal(dst, expected.view(torch.int16).numpy().view(np.uint16))


# ----------------------------------------------------------------- PyTorch


@pytest.mark.parametrize("op", OPS)
def test_torch_reduce_bits(op: str) -> None:
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(7)
    for tdt, dt in ((torch.bfloat16, D.BFLOAT16), (torch.float16, D.FLOAT16)):
        a = (torch.randn(20_011, generator=g) * 100).to(tdt)
        b = (torch.randn(20_011, generator=g) * 100).to(tdt)
        b[:5] = torch.tensor([0.0, float("inf"), -float("inf"), 1e-40, float("nan")])
        fa, fb = a.float(), b.float()
        r = {"sum": fa + fb, "prod": fa * fb, "max": torch.maximum(fa, fb),
             "min": torch.minimum(fa, fb)}[op]
        expected = r.to(tdt).view(torch.int16).numpy().view(np.uint16)
        got = a.clone().view(torch.int16).numpy().view(np.uint16)  # a view of the tensor
        H.reduce_into(got, b.view(torch.int16).numpy().view(np.uint16), op, dt)
        assert_bits(got, expected, dt)


# ----------------------------------------------------------------- API contract


def test_bad_arguments() -> None:
    a = np.zeros(8, np.float32)
    with pytest.raises(InvalidArgumentError):
        H.reduce_into(a, a, "avg", D.FLOAT32)
    with pytest.raises(BufferError):
        H.reduce_into(a, np.zeros(8, np.float64), "sum", D.FLOAT32)
    with pytest.raises(BufferError):
        H.reduce_into(a, np.zeros(9, np.float32), "sum", D.FLOAT32)
    with pytest.raises(BufferError):
        H.reduce_into(np.zeros(16, np.float32)[::2], a, "sum", D.FLOAT32)
    ro = np.zeros(8, np.float32)
    ro.flags.writeable = False
    with pytest.raises(BufferError):
        H.reduce_into(ro, a, "sum", D.FLOAT32)
    with pytest.raises(BufferError):
        H.reduce_into(a.astype(np.float16), a.astype(np.float16), "sum", D.FLOAT16)
    for bad in (0, -2, 2.0, True, 1 << 24):
        with pytest.raises(InvalidArgumentError):
            H.scale_into(a, bad, D.FLOAT32)
    with pytest.raises(InvalidArgumentError):
        H.average_into(a, [], 2, D.FLOAT32)
    with pytest.raises(BufferError):
        H.average_into(a, [a, np.zeros(7, np.float32)], 2, D.FLOAT32)
    with pytest.raises(InvalidArgumentError):
        H.to_float32(a, D.FLOAT32)


def test_multidimensional_contiguous_is_flattened(rng: np.random.Generator) -> None:
    a = sample(D.FLOAT32, 64, rng, specials=False).reshape(8, 8)
    b = sample(D.FLOAT32, 64, rng, specials=False).reshape(8, 8)
    ref = a + b
    H.reduce_into(a, b, "sum", D.FLOAT32)
    np.testing.assert_array_equal(a, ref)


def test_threaded_chunks_match_serial(monkeypatch: pytest.MonkeyPatch,
                                      rng: np.random.Generator) -> None:
    """WAGMA_HOST_THREADS > 1 splits into chunks; results must not change."""
    n = 100_003
    cases = []
    for dt in D.ALL:
        a, b, c = (sample(dt, n, rng) for _ in range(3))
        serial = [a.copy(), a.copy(), a.copy()]
        H.reduce_into(serial[0], b, "sum", dt)
        H.average_into(serial[1], [serial[1], b, c], 3, dt)
        H.scale_into(serial[2], 3, dt)
        cases.append((dt, a, b, c, serial))
    monkeypatch.setattr(H, "_nthreads", 3)
    monkeypatch.setattr(H, "_MIN_SPLIT_BYTES", 4096)
    for dt, a, b, c, serial in cases:
        assert H._chunks(n, dt.itemsize) is not None
        got = [a.copy(), a.copy(), a.copy()]
        H.reduce_into(got[0], b, "sum", dt)
        H.average_into(got[1], [got[1], b, c], 3, dt)
        H.scale_into(got[2], 3, dt)
        for g, s in zip(got, serial):
            np.testing.assert_array_equal(bits(g) if dt.is_float else g,
                                          bits(s) if dt.is_float else s)


def test_threads_env_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(H, "_nthreads", None)
    for bad in ("lots", "0", "100000"):  # 100000 failed to start threads mid-collective
        monkeypatch.setenv("WAGMA_HOST_THREADS", bad)
        with pytest.raises(InvalidArgumentError, match="WAGMA_HOST_THREADS"):
            H.host_threads()
    monkeypatch.setenv("WAGMA_HOST_THREADS", str(H.MAX_HOST_THREADS))
    assert H.host_threads() == H.MAX_HOST_THREADS
    monkeypatch.setattr(H, "_nthreads", None)
    monkeypatch.setenv("WAGMA_HOST_THREADS", "4")
    assert H.host_threads() == 4


def _run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter that imports this checkout; its stdout."""
    root = Path(H.__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=120,
                          capture_output=True, text=True, check=True).stdout


def test_import_compiles_nothing() -> None:
    """Importing the module leaves every numba dispatcher uncompiled (lazy JIT)."""
    code = (
        "from numba.core.dispatcher import Dispatcher\n"
        "import wagma_comm.kernels.host as H\n"
        "ds = [v for v in vars(H).values() if isinstance(v, Dispatcher)]\n"
        "assert len(ds) > 10, len(ds)\n"
        "compiled = [d.py_func.__name__ for d in ds if d.signatures]\n"
        "assert not compiled, compiled\n"
    )
    _run_python(code)


@pytest.mark.parametrize("name", sorted(D.BY_NAME))
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("n", [1, 7, 1 << 19])
def test_reduce_views_is_reduce_into_bit_for_bit(name: str, op: str, n: int,
                                                 rng: np.random.Generator) -> None:
    """The engine's unchecked entry point runs the same kernels: same bits,
    NaN and signed zeros included."""
    dt = D.BY_NAME[name]
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    raw[: min(n, 4) * dt.itemsize] = 0xFF  # NaN patterns in float types
    a = raw.view(dt.storage)
    b = np.roll(raw, 3).view(dt.storage)
    expected = a.copy()
    H.reduce_into(expected, b, op, dt)
    got = a.copy()
    H.reduce_views(got, b, op, dt)
    assert got.tobytes() == expected.tobytes()


# ----------------------------------------------------------------- rows_reducer


@pytest.mark.parametrize("dt", D.ALL, ids=[d.name for d in D.ALL])
@pytest.mark.parametrize("op", OPS + ["avg"])
@pytest.mark.parametrize("n", [1, 7, 1023])
def test_rows_reducer_is_reduce_into_and_average_into_in_part_order(
        dt: D.DType, op: str, n: int, rng: np.random.Generator) -> None:
    """The shared-memory exchange's reduction (fixed parts, made once) gives
    the bits of the checked kernels: pairwise from a copy of the first part
    for prod/max/min, average_into (one rounding) for sum and avg."""
    parts = [sample(dt, n, rng) for _ in range(5)]
    divisor = len(parts) if op == "avg" else 1
    ref = np.empty_like(parts[0])
    if op in ("sum", "avg"):
        H.average_into(ref, parts, divisor, dt)
    else:
        np.copyto(ref, parts[0])
        for p in parts[1:]:
            H.reduce_into(ref, p, op, dt)
    reduce = H.rows_reducer(op, dt, parts, divisor)
    for _ in range(2):  # made once, run many times
        got = np.zeros_like(parts[0])
        reduce(got)
        assert_bits(got, ref, dt)


@pytest.mark.parametrize("dt", D.ALL, ids=[d.name for d in D.ALL])
@pytest.mark.parametrize("threaded", [False, True], ids=["serial", "threaded"])
@pytest.mark.parametrize("n", [1, 7, 1023, 100_003])
def test_rows_reducer_with_dst_is_average_into_with_dst_last(
        dt: D.DType, threaded: bool, n: int, rng: np.random.Generator,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """WAGMA's board combine, normalization "wagma": ``dst = (total + dst) /
    (n + 1)`` made once for the fixed result row, run on each step's
    buffer. Same bits as average_into(dst, [*parts, dst]), for two
    different ``dst`` arrays (the kernel finds each one's address)."""
    if threaded:
        monkeypatch.setattr(H, "_nthreads", 3)
        monkeypatch.setattr(H, "_MIN_SPLIT_BYTES", 4096)
    parts = [sample(dt, n, rng) for _ in range(2)]
    reduce = H.rows_reducer("avg", dt, parts, 3, with_dst=True)
    for _ in range(2):
        dst = sample(dt, n, rng)
        ref = dst.copy()
        H.average_into(ref, [*parts, ref], 3, dt)
        reduce(dst)
        assert_bits(dst, ref, dt)


def test_rows_reducer_checks_its_parts_when_made() -> None:
    with pytest.raises(InvalidArgumentError, match="op"):
        H.rows_reducer("mean", D.FLOAT32, [np.zeros(2, np.float32)])
    with pytest.raises(InvalidArgumentError, match="parts"):
        H.rows_reducer("sum", D.FLOAT32, [])
    with pytest.raises(BufferError, match="parts"):
        H.rows_reducer("sum", D.FLOAT32, [np.zeros(2, np.float32), np.zeros(3, np.float32)])
    with pytest.raises(InvalidArgumentError, match="with_dst"):
        H.rows_reducer("max", D.FLOAT32, [np.zeros(2, np.float32)], with_dst=True)


# ----------------------------------------------------------------- review regressions


@pytest.mark.parametrize("dt", [D.FLOAT16, D.BFLOAT16, D.FLOAT32, D.FLOAT64],
                         ids=["float16", "bfloat16", "float32", "float64"])
def test_scale_by_one_still_canonicalises_nan(dt: D.DType) -> None:
    """x / 1 is x, but a NaN result must still be the canonical NaN (a group
    of one averages too), and scale_into(x, 1) must equal
    average_into(x, [x], 1) as its docstring says."""
    if dt.is_half:
        x = np.array([0xFE01, 0x7D00, 0x3C00] if dt.name == "float16"
                     else [0xFF81, 0x7F81, 0x3F80], np.uint16)
    else:
        u = np.array([0x7F800001, 0xFFC00005, 0x3F800000], np.uint32)
        if dt.name == "float64":
            u = np.array([0x7FF0000000000001, 0xFFF8000000000005, 0x3FF0000000000000],
                         np.uint64)
        x = u.view(dt.storage)
    via_avg = x.copy()
    H.average_into(via_avg, [via_avg], 1, dt)
    H.scale_into(x, 1, dt)
    assert bits(x).tolist() == bits(via_avg).tolist()
    assert bits(x).tolist()[:2] == [CANON_NAN[dt.name]] * 2
    assert x[2] == via_avg[2]  # 1.0 unchanged


@pytest.mark.parametrize("dt", [D.UINT8, D.INT32], ids=["uint8", "int32"])
def test_scale_integer_divisor_beyond_dtype_makes_no_temporaries(
        dt: D.DType, rng: np.random.Generator) -> None:
    """uint8 ``avg`` over >= 256 ranks divides by more than the dtype holds:
    the floor is then 0 or -1, written in place; it used to build an int64
    temporary 8x the buffer (plus two more)."""
    import tracemalloc

    n = 1 << 20
    x = sample(dt, n, rng)
    divisor = 300 if dt.name == "uint8" else (1 << 31) + 5
    ref = np.array([int(v) // divisor for v in x[:4096].tolist()], dt.storage)
    tracemalloc.start()
    try:
        H.scale_into(x, divisor, dt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(x[:4096], ref)
    assert set(np.unique(x).tolist()) <= ({0} if dt.name == "uint8" else {0, -1})
    assert peak < x.nbytes // 4, f"scale_into allocated {peak} bytes for a {x.nbytes}-byte buffer"


def test_rows_reducer_keeps_its_parts_alive() -> None:
    """The reducer reads its parts by address: it must hold them, or a
    caller that keeps only the reducer reads freed memory."""
    import gc
    import weakref

    for op in ("sum", "avg", "max"):
        part = np.full(5000, 3.0)
        alive = weakref.ref(part)
        reduce = H.rows_reducer(op, D.FLOAT64, [part], 1)
        del part
        gc.collect()
        assert alive() is not None, op
        clobber = [np.full(5000, 7.0) for _ in range(8)]  # would reuse the freed block
        out = np.zeros(5000)
        reduce(out)
        assert np.all(out == 3.0), op
        del clobber


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_threaded_kernels_work_in_a_forked_child() -> None:
    """A child forked after the kernel thread pool started inherits the pool
    object but none of its threads: a threaded reduction there waited
    forever. The child must get a pool of its own."""
    code = (
        "import os, signal, numpy as np\n"
        "from wagma_comm import dtypes as D\n"
        "from wagma_comm.kernels import host as H\n"
        "H._nthreads = 2\n"
        "a = np.ones(1 << 20, np.float32)\n"
        "H.reduce_into(a, a, 'sum', D.FLOAT32)  # starts the pool\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(30)  # a hung child dies instead of lingering\n"
        "    b = np.ones(1 << 20, np.float32)\n"
        "    H.reduce_into(b, b, 'sum', D.FLOAT32)\n"
        "    os._exit(0 if np.all(b == 2) else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    child = _run_python(code).strip().splitlines()[-1]
    assert child == "0", f"forked child: exit status {child} (-14: hung until SIGALRM)"


def test_partial_overlap_with_dst_is_refused() -> None:
    """src/parts overlapping dst without being dst computed a running sum
    (the loop reads elements it already wrote) with no error; now a
    BufferError naming the argument. dst itself, as any view, still works."""
    buf = np.arange(20.0)
    with pytest.raises(BufferError, match="src"):
        H.reduce_into(buf[1:], buf[:-1], "sum", D.FLOAT64)
    with pytest.raises(BufferError, match=r"parts\[1\]"):
        H.average_into(buf[:10], [np.zeros(10), buf[5:15]], 2, D.FLOAT64)
    np.testing.assert_array_equal(buf, np.arange(20.0))  # nothing written
    same = buf[:10].view()  # dst's memory through another array object
    H.reduce_into(buf[:10], same, "sum", D.FLOAT64)
    H.average_into(buf[:10], [same, np.zeros(10)], 2, D.FLOAT64)
    np.testing.assert_array_equal(buf[:10], np.arange(10.0))
    H.reduce_into(buf[:10], buf[10:], "sum", D.FLOAT64)  # adjacent, disjoint
    np.testing.assert_array_equal(buf[:10], np.arange(10.0) + np.arange(10.0, 20.0))


@pytest.mark.parametrize("pool_started", [False, True], ids=["pool_unstarted", "pool_started"])
def test_threaded_kernels_work_in_an_atexit_hook(pool_started: bool) -> None:
    """concurrent.futures refuses new work once the interpreter starts to
    exit, before atexit hooks run; comm.py's exit hook still drains the
    collectives in flight, whose threaded reductions then raised
    RuntimeError ('cannot schedule new futures after interpreter
    shutdown') and failed. They must run on the calling thread instead."""
    code = (
        "import atexit, numpy as np\n"
        "from wagma_comm import dtypes as D\n"
        "from wagma_comm.kernels import host as H\n"
        "H._nthreads = 3\n"
        "n = 1 << 19  # 1 MiB of 16-bit elements: threaded\n"
        f"if {pool_started}:\n"
        "    w = np.ones(n, np.float32)\n"
        "    H.reduce_into(w, w, 'sum', D.FLOAT32)\n"
        "def at_exit():\n"
        "    for dt in (D.FLOAT32, D.BFLOAT16, D.INT32):\n"
        "        one = np.ones(n, D.FLOAT32.numpy).astype(dt.numpy).view(dt.storage)\n"
        "        a = one.copy()\n"
        "        try:\n"
        "            H.reduce_into(a, one, 'sum', dt)\n"
        "            H.average_into(a, [a, one, one], 2, dt)\n"
        "            H.scale_into(a, 2, dt)\n"
        "        except Exception as exc:\n"
        "            print(dt.name, 'failed', repr(exc))\n"
        "            continue\n"
        "        got = a.view(dt.numpy).astype(np.float64)\n"
        "        print(dt.name, 'ok' if np.all(got == 1) else 'wrong values')\n"
        "atexit.register(at_exit)\n"
    )
    out = _run_python(code).strip().splitlines()
    assert out == ["float32 ok", "bfloat16 ok", "int32 ok"], out


def test_malformed_parts_and_op_get_typed_errors_naming_them() -> None:
    """A part list that is no sequence, a first part that is no array, or an
    op that is no string used to escape as TypeError/AttributeError from
    the middle of the code; each is now the typed error naming the argument."""
    a = np.zeros(4, np.float32)
    for bad_parts in (None, 3):
        with pytest.raises(InvalidArgumentError, match="parts"):
            H.average_into(a, bad_parts, 2, D.FLOAT32)
        with pytest.raises(InvalidArgumentError, match="parts"):
            H.rows_reducer("sum", D.FLOAT32, bad_parts)
    with pytest.raises(BufferError, match=r"parts\[0\]"):
        H.rows_reducer("sum", D.FLOAT32, [[1.0, 2.0, 3.0, 4.0], a])
    with pytest.raises(InvalidArgumentError, match="op"):
        H.rows_reducer(["sum"], D.FLOAT32, [a])
    # a 2-D array is still a sequence of parts (its rows)
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    H.rows_reducer("sum", D.FLOAT32, rows)(a)
    np.testing.assert_array_equal(a, rows[0] + rows[1])
