"""Handle: the application's side of an in-flight collective."""

from __future__ import annotations

import math
import numbers
import os
import threading
import time
from _thread import allocate_lock
from typing import Any, Callable

from ..errors import (
    CollectiveTimeoutError,
    CommunicatorClosedError,
    InvalidArgumentError,
    WaitTimeoutError,
)

# How long a waiter trusts the engine past the collective's own deadline before
# concluding the progress thread itself is gone (it fails runs at the deadline).
_GRACE_S = 5.0


class Handle:
    """Completion of one non-blocking collective.

    ``wait()`` returns the collective's result (the user's buffer, or what the
    collective defines) or raises the collective's error. Handles complete in any
    order. Each is completed once (a second completion is ignored), by
    whichever thread drives the engine at the time.
    """

    __slots__ = ("collective", "round", "_pending", "_claim", "_done", "_result", "_error",
                 "_deadline", "_engine_alive", "_drive", "_nudge", "started", "finished")

    def __init__(self, collective: str, round: int, deadline: float,
                 engine_alive: Callable[[], bool],
                 drive: Callable[["Handle", float], None] | None = None,
                 nudge: Callable[["Handle"], None] | None = None) -> None:
        self.collective = collective
        self.round = round
        # Held until completion: a bare lock is what a threading.Event is
        # built on, at a fifth of its cost (small calls make one per call).
        self._pending = allocate_lock()
        self._pending.acquire()
        self._claim = allocate_lock()  # taken by the one completion that counts
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._deadline = deadline
        self._engine_alive = engine_alive
        # Engine.drive_until: a waiter first lends its thread to the engine.
        self._drive = drive
        # Engine.nudge: test() runs a turn of the engine, as MPI_Test does.
        self._nudge = nudge
        self.started = time.monotonic()
        self.finished: float | None = None

    # -- progress-thread side ----------------------------------------------
    def _complete(self, result: Any = None, error: BaseException | None = None) -> None:
        if not self._claim.acquire(False):
            return  # completed already (or being completed): the first outcome stands
        self._result, self._error = result, error
        self.finished = time.monotonic()
        self._done = True
        self._pending.release()

    def _wait_done(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for completion (Event.wait)."""
        if self._done:
            return True
        if self._pending.acquire(timeout=timeout):
            self._pending.release()  # let every other waiter through too
            return True
        return self._done

    # -- application side -----------------------------------------------------
    @property
    def done(self) -> bool:
        """True once the collective finished (successfully or not)."""
        return self._done

    def test(self) -> bool:
        """Non-blocking: True if finished. Raises the collective's error if it
        failed, so a polling loop cannot miss a failure, and the error wait()
        raises when nobody will finish it (the progress engine stopped, or
        it is unfinished well past its deadline), so such a loop ends."""
        if not self._done:
            if self._nudge is not None:
                self._nudge(self)  # Engine.nudge: a turn of the engine, as MPI_Test
            else:
                os.sched_yield()  # a polling loop lets the progress thread have the GIL
            if not self._done:
                stalled = self._stalled()
                if not self._done:  # (it may have finished meanwhile)
                    if stalled is not None:
                        raise stalled
                    return False
        if self._error is not None:
            raise self._error
        return True

    def wait(self, timeout: float | None = None) -> Any:
        """Block until finished and return the result.

        Without ``timeout`` it waits at most until the collective's own deadline
        (when the engine turns a hang into CollectiveTimeoutError). With
        ``timeout`` it raises WaitTimeoutError after that many seconds, and the
        collective keeps running. A ``timeout`` beyond what a lock wait takes
        (``threading.TIMEOUT_MAX``, infinity, ``10**400``) is the same as none. Either way
        a handle nobody will finish raises at once: CommunicatorClosedError
        once the progress engine stopped, CollectiveTimeoutError ``_GRACE_S``
        past the collective's deadline.
        """
        given = timeout
        if timeout is not None:
            timeout = check_wait_timeout(timeout)
        start = time.monotonic()
        if self._drive is not None and not self._done:
            self._drive(self, self._deadline if timeout is None else start + timeout)
        # In slices, so a dead or stuck engine is noticed with or without a
        # timeout (a timed wait on a dead engine said "still running, call
        # wait() again", after the whole timeout, for ever).
        end = None if timeout is None else start + timeout
        while not self._wait_done(0.5 if end is None
                                  else min(0.5, max(0.0, end - time.monotonic()))):
            stalled = self._stalled()
            if stalled is not None and not self._done:
                raise stalled
            if end is not None and time.monotonic() >= end and not self._done:
                raise WaitTimeoutError(
                    f"{self.collective} (round {self.round}) still running after "
                    f"wait({given}); call wait() again"
                )
        if self._error is not None:
            raise self._error
        return self._result

    def _stalled(self) -> BaseException | None:
        """The error of a handle nobody will complete (None while someone
        may): its progress engine stopped, or it is still running
        ``_GRACE_S`` past its deadline, which the engine fails runs at."""
        if not self._engine_alive():
            return CommunicatorClosedError(
                f"{self.collective} (round {self.round}): the progress engine "
                "stopped before completing it")
        if time.monotonic() > self._deadline + _GRACE_S:
            return CollectiveTimeoutError(
                self.collective, self.round, (),
                f"not finished {_GRACE_S:g} s after its deadline, and the progress "
                "engine (still running) did not fail it: which ranks it waits for "
                "is unknown; treat the communicator as broken")
        return None

    @property
    def elapsed(self) -> float | None:
        """Seconds from submission to completion (None while running)."""
        return None if self.finished is None else self.finished - self.started

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"<Handle {self.collective} round={self.round} {state}>"


def check_wait_timeout(timeout: Any) -> float | None:
    """``wait``'s timeout as seconds, or None for no limit of its own. Checked
    first: a string failed deep inside with a bare TypeError, NaN waited out
    the collective's whole deadline and 1e300 overflowed the lock wait. An
    int past a float's range is judged by its sign (10**400 is no limit,
    -10**400 refused; math.isnan raised a bare OverflowError for both)."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidArgumentError("timeout", f"expected seconds as a number or None, "
                                              f"got {timeout!r}")
    try:
        value = float(timeout)
    except OverflowError:
        value = math.inf if timeout > 0 else -math.inf
    if math.isnan(value) or value < 0:
        raise InvalidArgumentError("timeout", f"must be >= 0 seconds or None, got {timeout!r}")
    return None if value >= threading.TIMEOUT_MAX else value
