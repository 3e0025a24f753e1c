"""Process-shared, robust locks inside a shared-memory mapping.

Why: a wait-avoiding round through shared memory (partial/shared_wagma.py) is
computed by whichever member arrives first, so two members may try at once,
and a publisher may rewrite its model while a peer reads it. NumPy has no
atomic compare-and-swap; glibc's process-shared mutexes give mutual
exclusion, the memory ordering around it (on every architecture, unlike the
store order the small-reduction exchange relies on), a sleep in the kernel
instead of a spin while contended (ranks may outnumber cores), a deadline
(``pthread_mutex_clocklock``) and, being *robust*, an error instead of a hang
when the holder died.

Each lock takes :data:`LOCK_BYTES` of the mapping; rank 0 initialises them
before the others attach. Called through ctypes, which releases the GIL for
the call, so a contended lock never stalls the caller's other threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import time
from typing import Callable

LOCK_BYTES = 64
"""Room for one pthread_mutex_t (40 bytes on x86-64 glibc, 48 on aarch64)."""

CHECK_EVERY_S = 0.01
"""How long a contended wait sleeps in the kernel between calls of its
``check`` (:func:`acquire`): a cancel is seen within this long."""

_CLOCK_MONOTONIC = 1  # Linux
_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class LockTimeout(Exception):
    """The lock was not free before the deadline."""


_SYMBOLS = ("pthread_mutexattr_init", "pthread_mutexattr_setpshared",
            "pthread_mutexattr_setrobust", "pthread_mutexattr_destroy", "pthread_mutex_init",
            "pthread_mutex_trylock", "pthread_mutex_clocklock", "pthread_mutex_unlock",
            "pthread_mutex_consistent")


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """The library with every mutex call: libc, or libpthread where glibc
    before 2.34 (Debian 11, Ubuntu 20.04) kept the robust ones there."""
    problems = []
    for name in (ctypes.util.find_library("c") or "libc.so.6",
                 ctypes.util.find_library("pthread") or "libpthread.so.0"):
        try:
            lib = ctypes.CDLL(name, use_errno=False)
            for symbol in _SYMBOLS:
                getattr(lib, symbol)
        except (OSError, AttributeError) as exc:
            problems.append(str(exc))
            continue
        return lib, None
    return None, f"the C library has no robust process-shared mutexes ({'; '.join(problems)})"


_LIBC, UNAVAILABLE = _load()
if _LIBC is not None:
    for _fn in ("pthread_mutex_trylock", "pthread_mutex_unlock", "pthread_mutex_consistent"):
        getattr(_LIBC, _fn).argtypes = [ctypes.c_void_p]
        getattr(_LIBC, _fn).restype = ctypes.c_int
    _LIBC.pthread_mutex_clocklock.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                              ctypes.POINTER(_Timespec)]
    _LIBC.pthread_mutex_clocklock.restype = ctypes.c_int


def init_lock(address: int) -> None:
    """Initialise a robust process-shared mutex at ``address`` (rank 0, once,
    before any other process maps the memory)."""
    assert _LIBC is not None, UNAVAILABLE
    attr = ctypes.create_string_buffer(64)
    for call, args in (("pthread_mutexattr_init", ()),
                       ("pthread_mutexattr_setpshared", (_PTHREAD_PROCESS_SHARED,)),
                       ("pthread_mutexattr_setrobust", (_PTHREAD_MUTEX_ROBUST,))):
        rc = getattr(_LIBC, call)(attr, *args)
        if rc:
            raise OSError(rc, f"{call}: {errno.errorcode.get(rc, rc)}")
    rc = _LIBC.pthread_mutex_init(ctypes.c_void_p(address), attr)
    _LIBC.pthread_mutexattr_destroy(attr)
    if rc:
        raise OSError(rc, f"pthread_mutex_init: {errno.errorcode.get(rc, rc)}")


def acquire(address: int, deadline: float,
            check: Callable[[], None] | None = None) -> bool:
    """Lock the mutex at ``address``; ``deadline`` on ``time.monotonic()``.
    Returns False where the previous holder's process ended while holding
    it: the lock is then held (and usable again), but what it guarded may be
    half written, and the caller must make sure that nobody after it reads
    that as data (only it is told). Raises LockTimeout. While it waits
    (only then), ``check`` is called every CHECK_EVERY_S: what it raises
    ends the wait without the lock (a cancel must not wait for a holder
    that stopped until the deadline)."""
    assert _LIBC is not None, UNAVAILABLE
    rc = _LIBC.pthread_mutex_trylock(address)  # the common, uncontended case
    if rc == errno.EBUSY:
        when = _Timespec()
        while True:
            until = deadline if check is None else min(deadline,
                                                       time.monotonic() + CHECK_EVERY_S)
            # time.monotonic() is CLOCK_MONOTONIC on Linux, which clocklock takes.
            whole = int(until)
            when.tv_sec, when.tv_nsec = whole, min(int((until - whole) * 1e9), 999_999_999)
            rc = _LIBC.pthread_mutex_clocklock(address, _CLOCK_MONOTONIC, ctypes.byref(when))
            if rc != errno.ETIMEDOUT or until >= deadline:
                break
            assert check is not None
            check()
    if rc == 0:
        return True
    if rc == errno.ETIMEDOUT:
        raise LockTimeout()
    if rc == errno.EOWNERDEAD:
        # Not left inconsistent: glibc's trylock then returns ENOTRECOVERABLE
        # still holding the lock word, which hangs every other process.
        _LIBC.pthread_mutex_consistent(address)
        return False
    raise OSError(rc, f"pthread_mutex_lock: {errno.errorcode.get(rc, rc)}")


def release(address: int) -> None:
    """Unlock; raises OSError where the mutex stays locked (EPERM: a robust
    mutex unlocked by a thread that does not hold it), not silently."""
    assert _LIBC is not None, UNAVAILABLE
    rc = _LIBC.pthread_mutex_unlock(address)
    if rc:
        raise OSError(rc, f"pthread_mutex_unlock: {errno.errorcode.get(rc, rc)}")


__all__ = ["LOCK_BYTES", "CHECK_EVERY_S", "UNAVAILABLE", "LockTimeout", "init_lock",
           "acquire", "release"]
