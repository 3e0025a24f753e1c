"""The public errors and handles as a caller's code treats them: errors
pickled (mpi4py's ``comm.gather(err)``, multiprocessing) and copied,
``Handle.wait`` given any real number of seconds, and a buffer's refusal
saying what is wrong with it."""

from __future__ import annotations

import copy
import pickle
import time

import numpy as np
import pytest

import wagma_comm
from wagma_comm import dtypes, errors
from wagma_comm.buffers import as_buffer
from wagma_comm.runtime.handle import Handle
from wagma_comm.train.bucket import host_view
from wagma_comm.train.specs import ParameterMismatchError

ATTRIBUTES = ("argument", "collective", "round", "ranks", "detail", "details", "code",
              "expected", "received", "index")

SAMPLES = [
    errors.InvalidArgumentError("op", "unknown op 'x'"),
    errors.BufferError("buf", "buffer is read-only"),
    errors.UnsupportedError("algorithm", "no native sum for float16"),
    errors.CommunicatorClosedError("communicator is closed"),
    errors.WaitTimeoutError("allreduce (round 3) still running after wait(1)"),
    errors.CollectiveError("allreduce", 3, [2, 1], "failed"),
    errors.CollectiveTimeoutError("group_allreduce", 4, [1], "deadline passed"),
    errors.MismatchError("allreduce", 2, {1: "allreduce(count=5)"}, "allreduce(count=4)"),
    errors.RankFailedError("broadcast", 7, [0], "rank 0 died"),
    errors.TransportError("MPI_Isend failed", code=5),
    errors.MessageSizeError("allreduce", 0, 1, 16, 20),
    errors.MessageSizeError("allreduce", 0, 1, 16, None),
    errors.ScheduleError("cycle"),
    ParameterMismatchError("ranks disagree", 3, [2, 0]),
]


@pytest.mark.parametrize("error", SAMPLES, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_every_error_pickles_and_copies_with_its_message_and_attributes(
        error: Exception, how: str) -> None:
    """Every subclass whose __init__ takes other arguments than its message
    raised TypeError when unpickled or copied (Python rebuilds an exception
    as cls(*args)): a rank gathering its peers' errors over mpi4py
    (``comm.gather(err)``) crashed in its error report, with
    "BufferError.__init__() missing 1 required positional argument"."""
    again = {"pickle": lambda e: pickle.loads(pickle.dumps(e)), "copy": copy.copy,
             "deepcopy": copy.deepcopy}[how](error)
    assert type(again) is type(error)
    assert str(again) == str(error) and again.args == error.args
    for name in ATTRIBUTES:
        assert getattr(again, name, None) == getattr(error, name, None), name
    assert isinstance(again, wagma_comm.WagmaError)
    with pytest.raises(type(error)):
        raise again


def test_a_timeout_error_stays_a_timeout_error_when_unpickled() -> None:
    error = pickle.loads(pickle.dumps(errors.CollectiveTimeoutError("barrier", 1, [3], "late")))
    assert isinstance(error, TimeoutError) and isinstance(error, errors.CollectiveError)
    assert error.ranks == (3,) and "barrier (round 1)" in str(error)


def _done_handle() -> Handle:
    handle = Handle("allreduce", 0, time.monotonic() + 60.0, lambda: True)
    handle._complete("result")
    return handle


def test_wait_takes_an_int_too_large_for_a_float_as_no_limit() -> None:
    """wait(timeout=10**400) raised a bare OverflowError (math.isnan
    converts to float) where 1e300 meant no limit of its own."""
    assert _done_handle().wait(timeout=10**400) == "result"


@pytest.mark.parametrize("bad", [-10**400, -1, float("nan")], ids=["-10**400", "-1", "nan"])
def test_wait_refuses_a_negative_or_nan_timeout_by_name(bad: object) -> None:
    with pytest.raises(wagma_comm.InvalidArgumentError, match="^timeout: ") as info:
        _done_handle().wait(timeout=bad)
    assert info.value.argument == "timeout"


class _Sub(np.ndarray):
    pass


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">i4", ">i8", ">f2"])
@pytest.mark.parametrize("shape", [(3,), (), (2, 2)])
def test_a_supported_type_in_non_native_byte_order_is_refused_saying_so(
        dtype: str, shape: tuple[int, ...]) -> None:
    """A big-endian float32 array is refused (its bytes are no float32
    numbers the kernels or MPI could reduce), but the message read
    "unsupported dtype >f4; expected one of [..., 'float32', ...]"."""
    arr = np.zeros(shape, dtype=dtype)
    native = arr.dtype.newbyteorder("=").name
    for obj in (arr, arr.view(_Sub)):  # an ndarray subclass takes the same intake
        with pytest.raises(wagma_comm.BufferError,
                           match=f"{native} in non-native byte order") as info:
            as_buffer(obj, "grads")
        assert info.value.argument == "grads" and "astype" in str(info.value)
    with pytest.raises(wagma_comm.BufferError, match="non-native byte order"):
        host_view(arr, "params[0]", writable=True)


def test_other_unsupported_types_do_not_mention_byte_order() -> None:
    for dtype in ("<f4", "i1", ">c8", "|u1"):
        text = dtypes.unsupported(np.dtype(dtype))
        assert text.startswith("unsupported dtype") and "byte order" not in text, dtype
