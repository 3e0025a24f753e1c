"""Host-memory reduction kernels for the progress engine.

The engine calls these from one thread on contiguous 1-D NumPy arrays whose dtype
is ``DType.storage`` (float16 and bfloat16 arrive as uint16 bit patterns, since
neither NumPy nor numba does bfloat16 arithmetic). Everything works in place on
``dst``.

Numerics (each point is checked by tests/unit/test_kernels_host.py):

* 16-bit floats are widened to float32, combined, and rounded back once,
  round-to-nearest-even (RNE). For ``+`` and ``*`` float32 has at least ``2p+2``
  bits for float16 (p=11) and bfloat16 (p=8), so this double rounding is
  innocuous: ``reduce_into`` returns the correctly rounded result, bit-identical
  to NumPy's ``(a.astype(f32) op b.astype(f32)).astype(half)`` and to PyTorch's
  ``(a.float() op b.float()).to(half)``.
* ``max``/``min`` propagate NaN (like ``np.maximum``/``np.minimum``) and otherwise
  return one of the inputs unchanged; ``max(+0, -0)`` is ``+0`` and
  ``min(+0, -0)`` is ``-0`` whatever the argument order.
* Every float reduce/scale/average result that is NaN is written as the
  canonical quiet NaN of the dtype (positive sign, only the quiet bit: f16
  ``0x7E00``, bf16 ``0x7FC0``, f32 ``0x7FC00000``, f64 ``0x7FF8000000000000``).
  x86 keeps the payload of the *first* NaN operand, so without this
  ``reduce_into(a, b)`` and ``reduce_into(b, a)`` would differ in NaN bits and
  group members would hold bitwise-different models. The scalar conversions, by
  contrast, keep the sign and the top payload bits and set the quiet bit.
* Integers wrap like NumPy (``sum``/``prod``); ``scale_into``/``average_into``
  floor-divide (NumPy ``//``).
* ``scale_into``/``average_into`` rounding: see their docstrings.

Implementation choices (figures from bench/bench_host_kernels.py):

* The half <-> float32 conversions are LLVM IR emitted through numba intrinsics
  on 32-bit lanes; numba's own integer typing widens every bit operation to
  int64, which halves the SIMD width. Inside the kernels bfloat16 NaNs are not
  quieted on the way in nor checked on the way out (every NaN result is
  replaced by the canonical one anyway). bfloat16 sum per 16 MiB: 1.8 ms with
  numba integer code, 1.1 ms with 32-bit IR, 0.74 ms without the redundant NaN
  handling (NumPy fallback: 12.5 ms). float16 uses the CPU's conversion
  instructions (LLVM ``half``: x86 F16C / AVX-512, AArch64 FCVT) where the
  compile target has them -- they round RNE and quiet NaNs exactly like the
  software path, which is kept for other targets (and tested on every
  machine): 0.67 ms vs 6.4 ms in software.
* float32/float64 reductions are numba loops too: NumPy's ``np.add(out=)`` is as
  fast but keeps the first operand's NaN payload (not symmetric, see above);
  the numba loop canonicalises NaN in the same pass. Loops peel a few elements
  so the stores are 64-byte aligned: NumPy allocates 16-byte aligned buffers
  and misaligned AVX-512 stores cost ~15 %.
* Integer ``reduce_into``/``scale_into`` use NumPy ufuncs with ``out=``: already
  vectorised, symmetric, no JIT cost; ``floor_divide`` by a scalar uses libdivide.
* Compilation is lazy and cached on disk (``cache=True``): importing this module
  compiles nothing (it only imports numba, ~0.3 s). Each reduction is one small
  kernel per (op, half kind) on uint16 and per op on floats (numba specialises
  those for float32 and float64), with op/kind as constants inlined into the
  loop: at most 8 + 8 specialisations, each compiled on first use (~0.5-1 s;
  ~10 ms when loaded from the cache). One kernel holding all ops took ~11 s to
  compile. ``average_into`` takes its parts by address (an int64 array), so
  the number of parts does not specialise it: 2 + 2 + 3 specialisations.
* The kernels assume the default floating-point environment (round to nearest,
  no flush-to-zero/denormals-are-zero), like NumPy does.
* Serial by default: MPI jobs often run several ranks per core and the kernels
  are memory bound. ``WAGMA_HOST_THREADS=N`` (N > 1, read once) splits arrays of
  at least 1 MiB into N chunks run on a small thread pool (the kernels release
  the GIL). A Python pool rather than numba's ``prange`` keeps one cached
  compiled kernel per dtype (a ``parallel=True`` twin of the same function
  would collide in numba's on-disk cache, which keys entries by function,
  signature and CPU but not by compile flags) and starts no numba threading
  layer (OpenMP/TBB) inside MPI processes.
"""

from __future__ import annotations

import os
import platform
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import numpy as np
from llvmlite import ir as llir
from numba import carray, config, njit, types
from numba.extending import intrinsic

from ..dtypes import DType
from ..errors import BufferError, InvalidArgumentError

__all__ = [
    "reduce_into",
    "reduce_views",
    "reducer",
    "scale_into",
    "average_into",
    "f16_bits_to_f32",
    "f32_to_f16_bits",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "to_float32",
    "from_float32",
    "REDUCE_OPS",
    "NATIVE_F16",
]

# Small-int codes; kernels branch on them outside their loops (see module doc).
_SUM, _PROD, _MAX, _MIN = 0, 1, 2, 3
_OP_CODES: dict[str, int] = {"sum": _SUM, "prod": _PROD, "max": _MAX, "min": _MIN}
REDUCE_OPS: tuple[str, ...] = tuple(_OP_CODES)
_F16, _BF16 = 0, 1

_F16_QNAN = 0x7E00
_BF16_QNAN = 0x7FC0

# Elements per block of average_into: the float32/float64 accumulator block stays
# in L1 while every part streams through it once.
_BLOCK = 2048
# Loops align their stores to this many bytes (one AVX-512 vector, a cache line).
_ALIGN = 64


def _target_has_f16_conversions() -> bool:
    """Whether numba's compile target converts half<->float in hardware.

    Read from the same feature string numba compiles with (NUMBA_CPU_FEATURES or
    the host's), so cached code and this choice always agree.
    """
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True  # FCVT half<->single is baseline ARMv8
    if machine not in ("x86_64", "amd64"):
        return False
    features = config.CPU_FEATURES
    if features is None:
        from numba.core.codegen import get_host_cpu_features

        features = get_host_cpu_features()
    return "+f16c" in str(features).split(",")


#: True where float16 conversions use the CPU's instructions (same results).
NATIVE_F16: bool = _target_has_f16_conversions()


# --------------------------------------------------------------------------
# Intrinsics: bit casts, pointers, 32-bit-lane conversions (LLVM IR)
# --------------------------------------------------------------------------

_I16 = llir.IntType(16)
_I32 = llir.IntType(32)
_F32 = llir.FloatType()


def _c32(value: int) -> llir.Constant:
    return llir.Constant(_I32, value)


def _as_i16(builder: llir.IRBuilder, value: llir.Value, ty: types.Integer) -> llir.Value:
    """The low 16 bits of an integer of any width."""
    if ty.bitwidth > 16:
        return builder.trunc(value, _I16)
    if ty.bitwidth < 16:
        return builder.zext(value, _I16)
    return value


@intrinsic
def _f32_from_bits(typingctx, bits):
    """float32 whose bit pattern is the low 32 bits of an integer."""
    if not isinstance(bits, types.Integer):
        return None
    width = bits.bitwidth

    def codegen(context, builder, signature, args):
        v = args[0]
        if width > 32:
            v = builder.trunc(v, _I32)
        elif width < 32:
            v = builder.zext(v, _I32)
        return builder.bitcast(v, _F32)

    return types.float32(bits), codegen


@intrinsic
def _f32_to_bits(typingctx, value):
    """The bit pattern of a float32 as a non-negative int64 (zero-extended)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], _I32), llir.IntType(64))

    return types.int64(value), codegen


@intrinsic
def _ptr_like(typingctx, addr, like):
    """A typed pointer (element type of array ``like``) from an integer address.

    Lets one compiled kernel read any number of arrays (average_into) without a
    typed list (slow to build) or a tuple (one specialisation per length).
    """
    if not isinstance(addr, types.Integer) or not isinstance(like, types.Array):
        return None
    ptrty = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptrty))

    return ptrty(addr, like), codegen


@intrinsic
def _bf16_widen(typingctx, h):
    """bfloat16 bits -> float32: shift into place, set the quiet bit of NaNs."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        bits = builder.shl(builder.zext(_as_i16(builder, args[0], h), _I32), _c32(16))
        magnitude = builder.and_(bits, _c32(0x7FFFFFFF))
        is_nan = builder.icmp_unsigned(">", magnitude, _c32(0x7F800000))
        bits = builder.select(is_nan, builder.or_(bits, _c32(0x00400000)), bits)
        return builder.bitcast(bits, _F32)

    return types.float32(h), codegen


@intrinsic
def _bf16_narrow(typingctx, f):
    """float32 -> bfloat16 bits, RNE; NaN keeps sign and top payload, gets quiet bit."""
    if f != types.float32:
        return None

    def codegen(context, builder, signature, args):
        x = builder.bitcast(args[0], _I32)
        high = builder.lshr(x, _c32(16))
        # RNE on the 16 dropped bits: add 0x7FFF plus the kept LSB; a carry may
        # ripple into the exponent (largest finite values round to inf). No
        # unsigned overflow for non-NaN inputs (max 0xFF7FFFFF + 0x8000).
        rounded = builder.add(builder.add(x, _c32(0x7FFF)), builder.and_(high, _c32(1)))
        rounded = builder.lshr(rounded, _c32(16))
        magnitude = builder.and_(x, _c32(0x7FFFFFFF))
        is_nan = builder.icmp_unsigned(">", magnitude, _c32(0x7F800000))
        out = builder.select(is_nan, builder.or_(high, _c32(0x40)), rounded)
        return builder.trunc(out, _I16)

    return types.uint16(f), codegen


@intrinsic
def _bf16_widen_raw(typingctx, h):
    """bfloat16 bits -> float32 without quieting NaNs: for kernels that
    canonicalise every NaN result anyway (saves four ops per operand)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        bits = builder.shl(builder.zext(_as_i16(builder, args[0], h), _I32), _c32(16))
        return builder.bitcast(bits, _F32)

    return types.float32(h), codegen


@intrinsic
def _bf16_round(typingctx, f):
    """float32 -> bfloat16 bits, RNE, for non-NaN inputs only (callers filter)."""
    if f != types.float32:
        return None

    def codegen(context, builder, signature, args):
        x = builder.bitcast(args[0], _I32)
        lsb = builder.and_(builder.lshr(x, _c32(16)), _c32(1))
        rounded = builder.lshr(builder.add(builder.add(x, _c32(0x7FFF)), lsb), _c32(16))
        return builder.trunc(rounded, _I16)

    return types.uint16(f), codegen


@intrinsic
def _f16_widen_hw(typingctx, h):
    """float16 bits -> float32 with the CPU's conversion (LLVM fpext half)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        half = builder.bitcast(_as_i16(builder, args[0], h), llir.HalfType())
        return builder.fpext(half, _F32)

    return types.float32(h), codegen


@intrinsic
def _f16_narrow_hw(typingctx, f):
    """float32 -> float16 bits with the CPU's conversion (LLVM fptrunc, RNE)."""
    if f != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], llir.HalfType()), _I16)

    return types.uint16(f), codegen


# --------------------------------------------------------------------------
# float16 in software (targets without half conversions; always tested)
# --------------------------------------------------------------------------


@njit(inline="always")
def _f16_to_f32_soft(h):
    x = np.int64(h) & 0xFFFF
    sign = (x & 0x8000) << 16
    em = x & 0x7FFF
    if em >= 0x7C00:  # inf, NaN (payload kept, quiet bit set)
        bits = 0x7F800000 | ((em & 0x3FF) << 13)
        if em != 0x7C00:
            bits |= 0x00400000
    elif em >= 0x0400:  # normal: rebias the exponent by 127 - 15
        bits = (em << 13) + 0x38000000
    else:
        # zero or subnormal, em * 2**-24: the float32 with bits 0x3F000000 | em is
        # exactly 0.5 + em * 2**-24, so subtracting 0.5 leaves the value exactly.
        bits = _f32_to_bits(_f32_from_bits(0x3F000000 | em) - np.float32(0.5))
    return _f32_from_bits(bits | sign)


@njit(inline="always")
def _f32_to_f16_soft(f):
    x = _f32_to_bits(f)
    sign = (x >> 16) & 0x8000
    a = x & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN: quiet it, keep the top payload bits
        h = 0x7E00 | ((a >> 13) & 0x3FF)
    elif a >= 0x477FF000:  # >= 65520, halfway past 65504 (odd, so ties go up): inf
        h = 0x7C00
    elif a >= 0x38800000:  # normal half: rebias, RNE on the 13 dropped bits
        h = (a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13
    else:
        # subnormal half or zero: in |f| + 0.5 the float32 ulp is 2**-24, the
        # half subnormal step, so the FPU's own RNE rounds; the result's
        # mantissa is the half pattern (0x400 = smallest normal on carry).
        h = _f32_to_bits(_f32_from_bits(a) + np.float32(0.5)) - 0x3F000000
    return np.uint16(h | sign)


# --------------------------------------------------------------------------
# Scalar conversions: inlined selectors and the public cached dispatchers
# --------------------------------------------------------------------------


@njit(inline="always")
def _f16_to_f32(h):
    if NATIVE_F16:
        return _f16_widen_hw(h)
    return _f16_to_f32_soft(h)


@njit(inline="always")
def _f32_to_f16(f):
    if NATIVE_F16:
        return _f16_narrow_hw(f)
    return _f32_to_f16_soft(f)


@njit(cache=True)
def f16_bits_to_f32(h):
    """float16 bit pattern (any int) -> float32, exact; NaN gets the quiet bit."""
    return _f16_to_f32(h)


@njit(cache=True)
def f32_to_f16_bits(f):
    """float32 -> float16 bits (uint16), RNE; overflow -> inf, subnormals kept,
    NaN quieted with sign and top payload bits. A float64 is first rounded to
    float32."""
    return _f32_to_f16(np.float32(f))


@njit(cache=True)
def bf16_bits_to_f32(h):
    """bfloat16 bit pattern (any int) -> float32, exact; NaN gets the quiet bit."""
    return _bf16_widen(h)


@njit(cache=True)
def f32_to_bf16_bits(f):
    """float32 -> bfloat16 bits (uint16), RNE; overflow -> inf, subnormals kept,
    NaN quieted with sign and top payload bits. A float64 is first rounded to
    float32."""
    return _bf16_narrow(np.float32(f))


# --------------------------------------------------------------------------
# Element ops (inlined; ``op``/``kind`` are constants after inlining)
# --------------------------------------------------------------------------


@njit(inline="always")
def _widen(h, kind):
    """Half bits -> float32 inside kernels, whose NaN results are canonicalised
    (so bfloat16 NaNs need not be quieted here)."""
    if kind == _BF16:
        return _bf16_widen_raw(h)
    return _f16_to_f32(h)


@njit(inline="always")
def _narrow_canon(f, kind):
    """Round a float32 to the half kind; any NaN becomes the canonical one."""
    if kind == _BF16:
        if f != f:
            return np.uint16(_BF16_QNAN)
        return _bf16_round(f)
    if f != f:
        return np.uint16(_F16_QNAN)
    return _f32_to_f16(f)


@njit(inline="always")
def _half_op(a, b, op, kind):
    wa = _widen(a, kind)
    wb = _widen(b, kind)
    if op == _SUM:
        return _narrow_canon(wa + wb, kind)
    if op == _PROD:
        return _narrow_canon(wa * wb, kind)
    # max/min return an input's bits unchanged (exact, nothing to round)
    if wa != wa or wb != wb:
        return np.uint16(_BF16_QNAN if kind == _BF16 else _F16_QNAN)
    if op == _MAX:
        if wa > wb:
            return a
        if wb > wa:
            return b
        return a & b  # equal: identical bits, or +0/-0 where AND gives +0
    if wa < wb:
        return a
    if wb < wa:
        return b
    return a | b  # equal: identical bits, or +0/-0 where OR gives -0


@njit(inline="always")
def _float_op(a, b, op, canon):
    if op == _SUM:
        r = a + b
    elif op == _PROD:
        r = a * b
    elif op == _MAX:
        if a > b:
            r = a
        elif b > a:
            r = b
        elif a == 0:
            r = a + b  # +0 unless both are -0 (RNE), in either order
        else:
            r = a  # equal non-zero (identical), or a NaN operand (below)
        if a != a or b != b:
            r = canon
    else:
        if a < b:
            r = a
        elif b < a:
            r = b
        elif a == 0:
            r = -((-a) + (-b))  # -0 unless both are +0
        else:
            r = a
        if a != a or b != b:
            r = canon
    if r != r:
        return canon
    return r


@njit(inline="always")
def _head(arr):
    """Elements to peel so that ``arr[head:]`` starts on an _ALIGN boundary."""
    head = ((-arr.ctypes.data) & (_ALIGN - 1)) // arr.itemsize
    return min(head, arr.size)


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


@njit(inline="always")
def _canonical_nan(arr):
    """The canonical quiet NaN in arr's dtype (what np.nan converts to)."""
    tmp = np.empty(1, arr.dtype)
    tmp[0] = np.nan
    return tmp[0]


@njit(inline="always")
def _half_loop(dst, src, op, kind):
    head = _head(dst)
    for i in range(head):
        dst[i] = _half_op(dst[i], src[i], op, kind)
    # slices, not range(head, n): an index numba cannot prove non-negative
    # gets a wraparound check that blocks vectorisation
    d = dst[head:]
    s = src[head:]
    for i in range(d.size):
        d[i] = _half_op(d[i], s[i], op, kind)


# One small compiled kernel per (op, half kind): each compiles on first use
# (~1 s) instead of all eight at once. Explicit top-level functions rather than
# closures from a factory, so numba's on-disk cache keys them plainly.
@njit(cache=True, nogil=True)
def _sum_f16(dst, src):
    _half_loop(dst, src, _SUM, _F16)


@njit(cache=True, nogil=True)
def _prod_f16(dst, src):
    _half_loop(dst, src, _PROD, _F16)


@njit(cache=True, nogil=True)
def _max_f16(dst, src):
    _half_loop(dst, src, _MAX, _F16)


@njit(cache=True, nogil=True)
def _min_f16(dst, src):
    _half_loop(dst, src, _MIN, _F16)


@njit(cache=True, nogil=True)
def _sum_bf16(dst, src):
    _half_loop(dst, src, _SUM, _BF16)


@njit(cache=True, nogil=True)
def _prod_bf16(dst, src):
    _half_loop(dst, src, _PROD, _BF16)


@njit(cache=True, nogil=True)
def _max_bf16(dst, src):
    _half_loop(dst, src, _MAX, _BF16)


@njit(cache=True, nogil=True)
def _min_bf16(dst, src):
    _half_loop(dst, src, _MIN, _BF16)


@njit(inline="always")
def _float_loop(dst, src, op, canon):
    head = _head(dst)
    for i in range(head):
        dst[i] = _float_op(dst[i], src[i], op, canon)
    # slices, not range(head, n): an index numba cannot prove non-negative
    # gets a wraparound check that blocks vectorisation
    d = dst[head:]
    s = src[head:]
    for i in range(d.size):
        d[i] = _float_op(d[i], s[i], op, canon)


# One kernel per op; numba specialises each for float32 and float64 arrays.
@njit(cache=True, nogil=True)
def _sum_float(dst, src):
    _float_loop(dst, src, _SUM, _canonical_nan(dst))


@njit(cache=True, nogil=True)
def _prod_float(dst, src):
    _float_loop(dst, src, _PROD, _canonical_nan(dst))


@njit(cache=True, nogil=True)
def _max_float(dst, src):
    _float_loop(dst, src, _MAX, _canonical_nan(dst))


@njit(cache=True, nogil=True)
def _min_float(dst, src):
    _float_loop(dst, src, _MIN, _canonical_nan(dst))


# Indexed by [op code] and [half kind][op code].
_FLOAT_KERNELS = (_sum_float, _prod_float, _max_float, _min_float)
_HALF_KERNELS = (
    (_sum_f16, _prod_f16, _max_f16, _min_f16),
    (_sum_bf16, _prod_bf16, _max_bf16, _min_bf16),
)


@njit(cache=True, nogil=True)
def _scale_float(dst, divisor):
    """dst = dst / divisor in dst's precision (one IEEE division), canonical NaN."""
    canon = _canonical_nan(dst)
    tmp = np.empty(1, dst.dtype)
    tmp[0] = divisor  # exact: divisor < 2**24 (float32) / 2**53 (float64)
    d = tmp[0]
    for i in range(dst.size):
        q = dst[i] / d
        dst[i] = canon if q != q else q


@njit(inline="always")
def _part_addresses(addrs, dst):
    """``addrs`` with every 0 replaced by ``dst``'s own address: how
    rows_reducer(with_dst=True) names ``dst`` as a part, so one address
    array serves every ``dst`` without taking its address in Python.
    ``addrs`` itself (no copy) where it names no 0: every other caller."""
    for i in range(addrs.size):
        if addrs[i] == 0:
            out = addrs.copy()
            for j in range(i, out.size):
                if out[j] == 0:
                    out[j] = dst.ctypes.data
            return out
    return addrs


@njit(inline="always")
def _avg_half_loop(dst, addrs, divisor, kind):
    addrs = _part_addresses(addrs, dst)
    n = dst.size
    k = addrs.size
    step = dst.itemsize
    d = np.float32(divisor)
    acc = np.empty(_BLOCK, np.float32)
    start = 0
    m = _head(dst)  # a short first block aligns the later ones
    if m == 0:
        m = min(_BLOCK, n)
    while start < n:
        p = carray(_ptr_like(addrs[0] + step * start, dst), m)
        if k == 1:
            for j in range(m):
                acc[j] = _widen(p[j], kind)
        else:  # first two parts in one sweep: one pass less over acc
            r = carray(_ptr_like(addrs[1] + step * start, dst), m)
            for j in range(m):
                acc[j] = _widen(p[j], kind) + _widen(r[j], kind)
        for t in range(2, k):
            p = carray(_ptr_like(addrs[t] + step * start, dst), m)
            for j in range(m):
                acc[j] += _widen(p[j], kind)
        out = dst[start:start + m]
        for j in range(m):
            out[j] = _narrow_canon(acc[j] / d, kind)
        start += m
        m = min(_BLOCK, n - start)


@njit(cache=True, nogil=True)
def _average_f16(dst, addrs, divisor):
    """dst = RN(RN_f32(sum_f32(parts) / divisor)); parts (uint16) by address."""
    _avg_half_loop(dst, addrs, divisor, _F16)


@njit(cache=True, nogil=True)
def _average_bf16(dst, addrs, divisor):
    """dst = RN(RN_f32(sum_f32(parts) / divisor)); parts (uint16) by address."""
    _avg_half_loop(dst, addrs, divisor, _BF16)


@njit(cache=True, nogil=True)
def _average_float(dst, addrs, divisor):
    """dst = RN(RN_f64(sum_f64(parts) / divisor)) for float32/float64 parts."""
    addrs = _part_addresses(addrs, dst)
    n = dst.size
    k = addrs.size
    step = dst.itemsize
    d = np.float64(divisor)
    canon = _canonical_nan(dst)
    acc = np.empty(_BLOCK, np.float64)
    start = 0
    m = _head(dst)
    if m == 0:
        m = min(_BLOCK, n)
    while start < n:
        p = carray(_ptr_like(addrs[0] + step * start, dst), m)
        if k == 1:
            for j in range(m):
                acc[j] = p[j]
        else:
            r = carray(_ptr_like(addrs[1] + step * start, dst), m)
            for j in range(m):
                acc[j] = np.float64(p[j]) + np.float64(r[j])
        for t in range(2, k):
            p = carray(_ptr_like(addrs[t] + step * start, dst), m)
            for j in range(m):
                acc[j] += p[j]
        out = dst[start:start + m]
        for j in range(m):
            q = acc[j] / d
            out[j] = canon if q != q else q
        start += m
        m = min(_BLOCK, n - start)


@njit(cache=True, nogil=True)
def _average_int(dst, addrs, divisor):
    """dst = floor(sum_i64(parts) / divisor) for integers (wraps like NumPy)."""
    addrs = _part_addresses(addrs, dst)
    n = dst.size
    k = addrs.size
    step = dst.itemsize
    d = np.int64(divisor)
    shift = -1  # power-of-two divisor: an arithmetic shift is floor division
    if (d & (d - 1)) == 0:
        shift = 0
        while (np.int64(1) << shift) != d:
            shift += 1
    acc = np.empty(_BLOCK, np.int64)
    for start in range(0, n, _BLOCK):
        m = min(_BLOCK, n - start)
        p = carray(_ptr_like(addrs[0] + step * start, dst), m)
        if k == 1:
            for j in range(m):
                acc[j] = p[j]
        else:
            r = carray(_ptr_like(addrs[1] + step * start, dst), m)
            for j in range(m):
                acc[j] = np.int64(p[j]) + np.int64(r[j])
        for t in range(2, k):
            p = carray(_ptr_like(addrs[t] + step * start, dst), m)
            for j in range(m):
                acc[j] += p[j]
        out = dst[start:start + m]
        if shift >= 0:
            for j in range(m):
                out[j] = acc[j] >> shift
        else:
            for j in range(m):
                out[j] = acc[j] // d


@njit(cache=True, nogil=True)
def _to_f32(src, out, kind):
    if kind == _BF16:
        for i in range(src.size):
            out[i] = _bf16_widen(src[i])
    else:
        for i in range(src.size):
            out[i] = _f16_to_f32(src[i])


@njit(cache=True, nogil=True)
def _from_f32(src, out, kind):
    if kind == _BF16:
        for i in range(src.size):
            out[i] = _bf16_narrow(src[i])
    else:
        for i in range(src.size):
            out[i] = _f32_to_f16(src[i])


# --------------------------------------------------------------------------
# Opt-in threading (WAGMA_HOST_THREADS)
# --------------------------------------------------------------------------

_MIN_SPLIT_BYTES = 1 << 20
MAX_HOST_THREADS = 1024
"""WAGMA_HOST_THREADS' ceiling: the pool starts a thread per chunk, and 100,000
failed with "can't start new thread" in the middle of a collective."""
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_nthreads: int | None = None


def _forget_pool_after_fork() -> None:
    """A forked child has none of the parent's pool threads: work submitted
    to the inherited pool would wait forever, so the child starts its own."""
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def host_threads() -> int:
    """WAGMA_HOST_THREADS, parsed once; 1 (serial) unless set to an int > 1
    (at most MAX_HOST_THREADS)."""
    global _nthreads
    if _nthreads is None:
        raw = os.environ.get("WAGMA_HOST_THREADS", "1").strip() or "1"
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if not 1 <= value <= MAX_HOST_THREADS:
            raise InvalidArgumentError(
                "WAGMA_HOST_THREADS",
                f"expected an integer from 1 to {MAX_HOST_THREADS}, got {raw!r}")
        _nthreads = value
    return _nthreads


def _chunks(n: int, itemsize: int) -> list[tuple[int, int]] | None:
    """Chunk bounds for a threaded run, or None to run serially."""
    t = host_threads()
    if t <= 1 or n * itemsize < _MIN_SPLIT_BYTES:
        return None
    per = -(-n // t)
    per = -(-per * itemsize // _ALIGN) * _ALIGN // itemsize  # whole cache lines
    return [(a, min(a + per, n)) for a in range(0, n, per)]


def _run(fn: Callable[[int, int], object], n: int, itemsize: int) -> None:
    """fn(0, n), or fn over chunks of [0, n) on the pool when threading is on."""
    global _pool
    bounds = _chunks(n, itemsize)
    if bounds is None:
        fn(0, n)
        return
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(host_threads(), thread_name_prefix="wagma-host")
        pool = _pool
    # Each task takes chunks until none is left, so a chunk runs exactly once
    # whichever thread takes it (deque.popleft is atomic).
    todo = deque(bounds)

    def take() -> None:
        while True:
            try:
                a, b = todo.popleft()
            except IndexError:
                return
            fn(a, b)

    futures = []
    try:
        for _ in bounds:
            futures.append(pool.submit(take))
    except RuntimeError:
        # At interpreter exit concurrent.futures refuses new work before the
        # atexit hooks run, and comm.py's hook still drains collectives in
        # flight: what no pool thread took runs here instead of failing them.
        take()
    for f in futures:
        f.result()


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def _flat(arr: object, dtype: DType, argument: str, n: int | None = None,
          writable: bool = False) -> np.ndarray:
    """Validate one kernel argument; returns a 1-D view of it."""
    if not isinstance(arr, np.ndarray):
        raise BufferError(argument, f"expected a numpy.ndarray, got {type(arr).__name__}")
    if arr.dtype != dtype.storage:
        raise BufferError(
            argument,
            f"expected dtype {dtype.storage} (storage of {dtype.name}), got {arr.dtype}",
        )
    if not arr.flags.c_contiguous:
        raise BufferError(argument, f"expected a C-contiguous array, got strides {arr.strides}")
    if writable and not arr.flags.writeable:
        raise BufferError(argument, "array is read-only")
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if n is not None and arr.size != n:
        raise BufferError(argument, f"expected {n} elements, got {arr.size}")
    return arr


def _check_no_overlap(d: np.ndarray, other: np.ndarray, argument: str) -> None:
    """``other`` is ``d``'s memory or disjoint from it: a partial overlap makes
    the element-wise result depend on the loop order (a prefix sum, not a sum)."""
    if np.may_share_memory(d, other) and other.ctypes.data != d.ctypes.data:
        raise BufferError(argument, "overlaps dst partially; pass dst itself or a "
                          "disjoint array")


def _part_list(parts: Iterable[np.ndarray]) -> Sequence[np.ndarray]:
    """``parts`` as a non-empty list or tuple; InvalidArgumentError naming
    it otherwise (not a TypeError from deep inside a kernel call)."""
    if not isinstance(parts, (list, tuple)):
        try:
            parts = list(parts)
        except TypeError:
            raise InvalidArgumentError(
                "parts", f"expected a sequence of arrays, got {type(parts).__name__}"
            ) from None
    if len(parts) == 0:
        raise InvalidArgumentError("parts", "expected at least one array")
    return parts


def _half_kind(dtype: DType) -> int:
    return _BF16 if dtype.name == "bfloat16" else _F16


def _check_divisor(divisor: object, dtype: DType) -> int:
    if isinstance(divisor, (bool, np.bool_)) or not isinstance(divisor, (int, np.integer)):
        raise InvalidArgumentError("divisor", f"expected an int >= 1, got {divisor!r}")
    value = int(divisor)
    limit = 1 << (24 if dtype.is_half or dtype.name == "float32" else 53)
    if not 1 <= value < limit:
        raise InvalidArgumentError(
            "divisor", f"expected an int in [1, 2**{limit.bit_length() - 1}) for "
            f"{dtype.name}, got {value}"
        )
    return value


def reduce_into(dst: np.ndarray, src: np.ndarray, op: str, dtype: DType) -> None:
    """``dst = op(dst, src)`` element-wise, in place; op: sum, prod, max, min.

    Symmetric bit for bit: ``reduce_into(a, b)`` and ``reduce_into(b, a)`` leave
    the same bits (NaN results are canonical), so group members that combine the
    same two buffers in different roles agree exactly. ``src`` may be ``dst``
    but must not otherwise overlap it (BufferError). Arrays: C-contiguous, dtype
    ``dtype.storage``, same size (any shape; treated as 1-D).
    """
    code = _OP_CODES.get(op) if isinstance(op, str) else None
    if code is None:
        raise InvalidArgumentError("op", f"unknown op {op!r}; expected one of {list(_OP_CODES)}")
    d = _flat(dst, dtype, "dst", writable=True)
    s = _flat(src, dtype, "src", d.size)
    _check_no_overlap(d, s, "src")
    if d.size == 0:
        return
    kernel = _reduce_kernel(dtype, code)
    _run(lambda a, b: kernel(d[a:b], s[a:b]), d.size, d.itemsize)


def _int_kernel(ufunc: np.ufunc) -> Callable[[np.ndarray, np.ndarray], object]:
    return lambda d, s: ufunc(d, s, out=d)


_INT_KERNELS = tuple(_int_kernel(u) for u in (np.add, np.multiply, np.maximum, np.minimum))


def _reduce_kernel(dtype: DType, code: int) -> Callable[[np.ndarray, np.ndarray], object]:
    """The in-place kernel ``(dst, src)`` for ``dtype`` and op ``code``."""
    if dtype.is_half:
        return _HALF_KERNELS[_half_kind(dtype)][code]
    if dtype.is_float:
        return _FLOAT_KERNELS[code]
    return _INT_KERNELS[code]


def reducer(op: str, dtype: DType, count: int) -> Callable[[np.ndarray, np.ndarray], object]:
    """The ``(dst, src)`` kernel :func:`reduce_views` would run for ``count``
    elements, chosen once: a schedule run many times (runtime/inline.py) then
    pays no dispatch per call."""
    if _chunks(count, dtype.itemsize) is not None:
        return lambda d, s: reduce_into(d, s, op, dtype)
    return _reduce_kernel(dtype, _OP_CODES[op])


def reduce_views(dst: np.ndarray, src: np.ndarray, op: str, dtype: DType) -> None:
    """:func:`reduce_into` for the engine's own views, which are 1-D,
    contiguous, of ``dtype.storage`` and of one size by construction: the same
    kernels without the argument checks, which cost more than the reduction of
    a small message. Large ones still go through reduce_into (threads)."""
    reducer(op, dtype, dst.size)(dst, src)


def _average(d: np.ndarray, parts: Sequence[np.ndarray], divisor: int, dtype: DType) -> None:
    addrs = np.array([p.ctypes.data for p in parts], dtype=np.int64)
    step = d.itemsize
    if dtype.is_half:
        average = _average_bf16 if _half_kind(dtype) == _BF16 else _average_f16

        def fn(a: int, b: int) -> None:
            average(d[a:b], addrs + a * step, divisor)
    elif dtype.is_float:

        def fn(a: int, b: int) -> None:
            _average_float(d[a:b], addrs + a * step, divisor)
    else:

        def fn(a: int, b: int) -> None:
            _average_int(d[a:b], addrs + a * step, divisor)
    _run(fn, d.size, step)


def scale_into(dst: np.ndarray, divisor: int, dtype: DType) -> None:
    """``dst = dst / divisor`` in place (the last step of an average).

    * float32/float64: one IEEE division in the element's precision, so the
      correctly rounded quotient (``divisor`` is exact in that precision).
    * float16/bfloat16: ``RN(RN_f32(x / divisor))``, identical to
      ``average_into(dst, [dst], divisor)``. That is the correctly rounded
      quotient whenever ``divisor < 2**(24-p)``, i.e. ``2**13`` for float16
      (p=11) and ``2**16`` for bfloat16 (p=8), subnormals included; for larger
      divisors it is within 1 ulp of it. Why: x and every rounding midpoint m
      of the half format are multiples of ``2**(e-p)`` (e: the quotient's
      binade, or the subnormal step), so ``|x/divisor - m| >= 2**(e-p)/divisor``,
      which exceeds the float32 half-ulp ``2**(e-24)``: the float32 rounding
      cannot carry the quotient onto or across a midpoint.
    * integers: floor division (NumPy ``//``), uint8 included.

    ``divisor``: an int in ``[1, 2**24)`` (half and float32 dtypes) or
    ``[1, 2**53)`` (float64, integers). NaN results are canonical.
    """
    value = _check_divisor(divisor, dtype)
    d = _flat(dst, dtype, "dst", writable=True)
    # divisor 1 still runs for floats: x / 1 is x, but NaNs must come out canonical
    if d.size == 0 or (value == 1 and not dtype.is_float):
        return
    if dtype.is_half:
        _average(d, (d,), value, dtype)
        return
    if dtype.is_float:
        _run(lambda a, b: _scale_float(d[a:b], value), d.size, d.itemsize)
        return
    info = np.iinfo(dtype.storage)
    if value > info.max:
        # NumPy refuses a scalar the dtype cannot hold; |x| < divisor here, so
        # floor(x / divisor) is 0 for x >= 0 and -1 for x < 0: the sign bit
        # shifted across (in place, no temporaries: uint8 avg over >= 256 ranks).
        if info.min == 0:
            d.fill(0)
        else:
            _run(lambda a, b: np.right_shift(d[a:b], info.bits - 1, out=d[a:b]),
                 d.size, d.itemsize)
        return
    divisor_arr = np.asarray(value, dtype=dtype.storage)
    _run(lambda a, b: np.floor_divide(d[a:b], divisor_arr, out=d[a:b]), d.size, d.itemsize)


def average_into(dst: np.ndarray, parts: Sequence[np.ndarray], divisor: int,
                 dtype: DType) -> None:
    """``dst = (sum of parts) / divisor`` in one pass: WAGMA's fused group average.

    ``parts`` (at least one) may include ``dst`` itself but must not otherwise
    overlap it (BufferError). Each element is accumulated in float32 for
    float16/bfloat16, float64 for float32/float64 and int64 for integers, in the order of
    ``parts`` -- pass them in the same order on every rank (e.g. rank order) for
    bitwise-identical results, since float addition is not associative. Then:

    * halves: ``RN(RN_f32(acc / divisor))``: the correctly rounded quotient of
      the float32 accumulator for ``divisor < 2**13`` (float16) / ``2**16``
      (bfloat16), within 1 ulp of it beyond (same argument as
      :func:`scale_into`; acc is a float32 and a multiple of the half's
      smallest subnormal). A bfloat16 sum beyond float32's range (~3.4e38)
      overflows the accumulator to inf;
    * float32/float64: ``RN(RN_f64(acc / divisor))``;
    * integers: ``floor(acc / divisor)``, wrapped to the dtype.

    NaN results are canonical. ``divisor``: as for :func:`scale_into`.
    """
    value = _check_divisor(divisor, dtype)
    d = _flat(dst, dtype, "dst", writable=True)
    parts = _part_list(parts)
    flat = [d if p is dst else _flat(p, dtype, f"parts[{i}]", d.size)
            for i, p in enumerate(parts)]
    for i, p in enumerate(flat):
        _check_no_overlap(d, p, f"parts[{i}]")
    if d.size == 0:
        return
    _average(d, flat, value, dtype)


def rows_reducer(op: str, dtype: DType, parts: Sequence[np.ndarray],
                 divisor: int = 1, *, with_dst: bool = False) -> Callable[[np.ndarray], None]:
    """``fn(dst)``: ``dst = op`` over ``parts`` in their order (sum and avg as
    :func:`average_into` with ``divisor``, one rounding at the end; prod, max
    and min pairwise, starting from a copy of ``parts[0]``). ``with_dst``
    (sum and avg only): ``dst``'s old value is one more part, after ``parts``.

    Why: ``parts`` fixed across calls (rows of a shared-memory segment,
    runtime/shared.py, partial/shared_wagma.py) are checked and their
    addresses taken once; a call then costs the kernel. ``dst``:
    C-contiguous, 1-D, ``dtype.storage``, the parts' size, overlapping none
    of them."""
    code = None
    if isinstance(op, str):
        code = _OP_CODES["sum"] if op == "avg" else _OP_CODES.get(op)
    if code is None:
        raise InvalidArgumentError("op", f"unknown op {op!r}")
    parts = _part_list(parts)
    if with_dst and code != _OP_CODES["sum"]:
        raise InvalidArgumentError("with_dst", f"only for sum and avg, not {op!r}")
    size = _flat(parts[0], dtype, "parts[0]").size  # checked before its size is used
    flat = [_flat(p, dtype, f"parts[{i}]", size) for i, p in enumerate(parts)]
    if code == _OP_CODES["sum"]:
        value = _check_divisor(divisor, dtype)
        chunked = _chunks(flat[0].size, flat[0].itemsize) is not None
        if chunked:  # large: split over the kernel threads
            if with_dst:
                return lambda d: _average(d, [*flat, d], value, dtype)
            return lambda d: _average(d, flat, value, dtype)
        # An address of 0 is the kernel's name for dst itself (_part_addresses).
        addrs = np.array([p.ctypes.data for p in flat] + [0] * with_dst, dtype=np.int64)
        if dtype.is_half:
            average = _average_bf16 if _half_kind(dtype) == _BF16 else _average_f16
        else:
            average = _average_float if dtype.is_float else _average_int
        # flat rides along: the kernel reads the parts by address only
        return lambda d, _keep=flat: average(d, addrs, value)
    first, rest = flat[0], flat[1:]
    kernel = reducer(op, dtype, first.size)

    def pairwise(d: np.ndarray) -> None:
        np.copyto(d, first)
        for part in rest:
            kernel(d, part)
    return pairwise


def to_float32(arr: np.ndarray, dtype: DType) -> np.ndarray:
    """Widen a float16/bfloat16 bit-pattern array (uint16) to a new float32 array."""
    if not dtype.is_half:
        raise InvalidArgumentError("dtype", f"expected float16 or bfloat16, got {dtype.name}")
    a = _flat(arr, dtype, "arr")
    out = np.empty(a.size, np.float32)
    if a.size:
        _to_f32(a, out, _half_kind(dtype))
    return out


def from_float32(arr: np.ndarray, dtype: DType) -> np.ndarray:
    """Round a float32 array to a new float16/bfloat16 bit-pattern array (RNE)."""
    if not dtype.is_half:
        raise InvalidArgumentError("dtype", f"expected float16 or bfloat16, got {dtype.name}")
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float32:
        got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
        raise BufferError("arr", f"expected a float32 numpy.ndarray, got {got}")
    a = np.ascontiguousarray(arr).reshape(-1)
    out = np.empty(a.size, np.uint16)
    if a.size:
        _from_f32(a, out, _half_kind(dtype))
    return out
