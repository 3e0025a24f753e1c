"""Host memory over MPI (mpi4py).

Each channel is its own duplicate of the user's communicator, so user MPI
traffic and ours can never match each other. Within a channel the MPI tag is
``(seq mod window) << MSG_BITS | msg``: the window is derived from MPI_TAG_UB and
the engine never lets two collectives ``window`` apart be in flight together.
"""

from __future__ import annotations

import os
import pickle
import secrets
import time
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from ..dtypes import DType
from ..errors import CollectiveTimeoutError, TransportError
from ..runtime.liveness import identity
from .base import CHANNELS, MSG_BITS, Transport
from . import shm
from .doorbell import Doorbell, doorbell_key
from .shm import Segment

# Channel communicators closed while messages to them may be in flight (a
# collective that failed or was never closed). Freeing one would let MPI give
# its context to a later communicator, whose receives would then match those
# messages (docs/partial.md, "Closing"); they are kept, unfreed, instead.
# A broken communicator's communicators and abandoned buffers join them.
_KEPT: list[Any] = []
# (what a request still uses: its communicator or buffer, the request) of MPI
# operations abandoned at their deadline: MPI cannot cancel a non-blocking
# collective, and a receive may still land, so both stay referenced, unfreed.
ABANDONED: list[tuple[Any, MPI.Request]] = []


def mpi_error(what: str, exc: MPI.Exception, round: int = -1, step: str = "") -> TransportError:
    """``exc`` as the TransportError the library promises (never a bare
    mpi4py exception), naming the call ``what`` (its ``round``, if any, and
    the ``step`` of it that failed)."""
    where = what if round < 0 else f"{what} (round {round})"
    failed = f"{step} failed: " if step else ""
    return TransportError(f"{where}: {failed}MPI error: {exc.Get_error_string()}",
                          exc.Get_error_code())


def wait_with_deadline(request: MPI.Request, uses: Any, deadline: float, what: str,
                       ranks: Sequence[int] = (), detail: str = "did not complete",
                       nap_limit: float = 1e-3, round: int = -1, step: str = "") -> None:
    """Test ``request`` until it completes, napping up to ``nap_limit`` s between
    tests (ranks may outnumber cores; 0 spins). Past ``deadline``
    (``time.monotonic()``) the request and what it ``uses`` go to ABANDONED
    (MPI may still write into it) and CollectiveTimeoutError names ``what``,
    its ``round`` and the ``ranks`` waited for. A request MPI fails (e.g. a
    duplication with no context id left) raises TransportError naming ``what``
    and the ``step`` it was."""
    nap = 0.0
    try:
        while not request.Test():
            if time.monotonic() > deadline:
                ABANDONED.append((uses, request))
                raise CollectiveTimeoutError(what, round, ranks, detail)
            if nap_limit:
                nap = min(nap_limit, nap * 2 or 2e-5)
                time.sleep(nap)
    except MPI.Exception as exc:
        raise mpi_error(what, exc, round, step) from exc


def dup_with_deadline(comm: MPI.Comm, timeout: float, what: str) -> MPI.Comm:
    """``comm.Dup()`` that raises CollectiveTimeoutError after ``timeout``
    seconds (MPI_Comm_idup) instead of waiting forever for a rank that never
    takes part. ``what`` names the call in the error. MPI cannot say which
    ranks are missing from a duplication, so the error names none. An MPI
    error (no context id left) raises TransportError naming ``what``."""
    try:
        dup, request = comm.Idup()
    except MPI.Exception as exc:
        raise mpi_error(what, exc, step="duplicating the MPI communicator") from exc
    wait_with_deadline(request, dup, time.monotonic() + timeout, what,
                       detail=f"duplicating the MPI communicator did not complete within "
                       f"{timeout:g} s: some rank never called {what}",
                       step="duplicating the MPI communicator")
    return dup


_MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}


class _SendRequest(MPI.Request):
    """The request of a send, told apart from receives by :meth:`MPITransport.abandon`
    (same MPI handle, wrapped once when the send is posted)."""


class _NativeRequest(MPI.Request):
    """The request of a native collective, which MPI_Cancel must not be given
    (erroneous by the standard; MPICH says "unknown type of request")."""


class MPITransport(Transport):
    name = "mpi"
    _segment_problem: str | None = None  # this rank's OSError making or mapping the segment

    def __init__(self, comm: MPI.Comm, timeout: float = 300.0) -> None:
        # Every rank must arrive within ``timeout``, and every step after the
        # first duplication is bounded by the same deadline: a rank whose peer
        # gave up on init() at its own deadline (the peer's duplication timed
        # out just as this rank's completed) raises here instead of blocking
        # for ever in a collective that peer never calls.
        deadline = time.monotonic() + timeout
        self._timeout = timeout  # what later blocking set-ups wait at most
        user_comm, comm = comm, dup_with_deadline(comm, timeout, "init()")
        made = [comm]  # kept, never freed, if a later step fails (see _abandon_init)
        segment: Segment | None = None
        self.doorbell, self.shared_segment = None, None
        try:
            self._base = comm
            self._comms = {}
            for ch in CHANNELS:
                self._comms[ch] = dup = self._init_dup(comm, deadline, timeout, f"channel {ch!r}")
                made.append(dup)
                dup.Set_errhandler(MPI.ERRORS_RETURN)
            self.rank = comm.Get_rank()
            self.size = comm.Get_size()
            # (host, pid) of every rank, for the liveness check, and what
            # decides whether doorbells and the shared-memory segment reach
            # everyone. Rank 0 makes the segment first, so the others can map
            # it as soon as the gather tells them its name.
            nonce = secrets.token_hex(8)
            segment = self._create_segment(nonce)
            gathered = self._init_allgather(
                comm, (identity(), doorbell_key(), nonce, segment is not None), deadline, timeout)
            self.identities = [who for who, _, _, _ in gathered]
            self.doorbell, self.shared_segment = self._agree_on_host_paths(
                comm, gathered, segment, deadline, timeout)
            segment = None  # _agree_on_host_paths owns it now
            # Group creation gets a communicator of its own: Create_group's tag
            # must not collide with any (seq, msg) tag of a channel.
            self._create_comm = self._init_dup(comm, deadline, timeout, "group creation")
            made.append(self._create_comm)
        except BaseException as exc:
            self._abandon_init(made, segment)
            if isinstance(exc, MPI.Exception):  # an MPI call of a step failed
                raise mpi_error("init()", exc) from exc
            raise
        tag_ub = user_comm.Get_attr(MPI.TAG_UB) or 32767
        self._window = max(1, (int(tag_ub) + 1) >> MSG_BITS)
        self._world_group = self._comms[CHANNELS[0]].Get_group()
        self._groups: dict[tuple[int, ...], MPI.Comm] = {}
        self._everyone = tuple(range(self.size))
        self._bound: dict[str, tuple[Any, Any]] = {}  # channel -> (Isend, Irecv)

    @staticmethod
    def _init_wait(request: MPI.Request, uses: Any, deadline: float, timeout: float,
                   step: str) -> None:
        """Wait for one of init()'s collective steps until init()'s deadline."""
        wait_with_deadline(request, uses, deadline, "init()",
                           detail=f"{step} did not complete within the {timeout:g} s of "
                           "init(): a rank gave up on init() at its own deadline, or "
                           "stopped before this step", step=step)

    def _init_dup(self, comm: MPI.Comm, deadline: float, timeout: float,
                  purpose: str) -> MPI.Comm:
        dup, request = comm.Idup()
        self._init_wait(request, dup, deadline, timeout,
                        f"duplicating the communicator for {purpose}")
        return dup

    def _init_allgather(self, comm: MPI.Comm, mine: Any, deadline: float,
                        timeout: float) -> list[Any]:
        """``comm.allgather(mine)`` bounded by ``deadline`` (non-blocking: the
        lengths, then the pickled objects)."""
        data = np.frombuffer(pickle.dumps(mine), dtype=np.uint8)
        length = np.array([data.size], dtype=np.int64)
        lengths = np.zeros(comm.Get_size(), dtype=np.int64)
        self._init_wait(comm.Iallgather([length, MPI.INT64_T], [lengths, MPI.INT64_T]),
                        (length, lengths), deadline, timeout, "the exchange of identities")
        counts = [int(n) for n in lengths]
        displs = [0] * len(counts)
        for r in range(1, len(counts)):
            displs[r] = displs[r - 1] + counts[r - 1]
        out = np.empty(sum(counts), dtype=np.uint8)
        self._init_wait(comm.Iallgatherv([data, MPI.BYTE], [out, (counts, displs), MPI.BYTE]),
                        (data, out), deadline, timeout, "the exchange of identities")
        return [pickle.loads(out[d:d + n].tobytes()) for d, n in zip(displs, counts)]

    def _abandon_init(self, made: list[MPI.Comm], segment: Segment | None) -> None:
        """After a failed init(): nothing left in /dev/shm, no bell bound, and
        the communicators made so far kept, never freed (a peer whose init()
        completed may already send on them; a freed context would be reused)."""
        _KEPT.extend(made)
        for held in (segment, self.shared_segment):
            if held is not None:
                if self.rank == 0:
                    held.unlink()
                held.close()
        self.shared_segment = None
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None

    def _create_segment(self, nonce: str) -> Segment | None:
        """Rank 0's shared-memory segment (None elsewhere, or where it cannot
        be made: any rank may still fail to map it, decided in
        :meth:`_agree_on_host_paths`)."""
        if self.rank != 0 or self.size < 2 or shm.unavailable_reason() is not None:
            return None
        try:
            return Segment.create(nonce, self.size)
        except OSError as exc:  # said where the segment is refused (a full /dev/shm)
            self._segment_problem = f"rank 0 could not create the segment ({exc})"
            return None

    def _agree_on_host_paths(
            self, comm: MPI.Comm, gathered: list[tuple[tuple[str, int], str | None, str, bool]],
            segment: Segment | None, deadline: float,
            timeout: float) -> tuple[Doorbell | None, Segment | None]:
        """Doorbells when every rank shares this host and network namespace,
        and the shared-memory segment when every rank could map it (decided
        alike everywhere: one reduction of what each rank managed), both
        under rank 0's nonce. A rank that cannot bind its bell or map the
        segment, or was started with ``WAGMA_DOORBELL=0`` / ``WAGMA_SHM=0``
        (A/B measurements), makes nobody use it."""
        one_host = len({who[0] for who, _, _, _ in gathered}) == 1
        nonce = gathered[0][2]
        bell: Doorbell | None = None
        if (one_host and len({key for _, key, _, _ in gathered}) == 1
                and gathered[0][1] is not None
                and os.environ.get("WAGMA_DOORBELL", "1") != "0"):
            try:
                bell = Doorbell(nonce, self.rank, self.size)
            except OSError:
                pass  # this rank has none, so nobody uses them
        if (segment is None and one_host and gathered[0][3]
                and shm.unavailable_reason() is None):
            try:
                segment = Segment.attach(nonce, self.size)
            except OSError as exc:  # this rank cannot map it, so nobody uses it
                self._segment_problem = f"rank {self.rank} could not map the segment ({exc})"
        flags = np.array([(bell is not None) | (segment is not None) << 1], dtype=np.int64)
        try:
            self._init_wait(comm.Iallreduce(MPI.IN_PLACE, [flags, MPI.INT64_T], MPI.BAND),
                            flags, deadline, timeout, "the agreement on doorbells and "
                            "shared memory")
        except BaseException:
            if segment is not None:
                if self.rank == 0:
                    segment.unlink()
                segment.close()
            if bell is not None:
                bell.close()
            raise
        agreed = int(flags[0])
        if self.rank == 0 and segment is not None:
            segment.unlink()  # every rank has mapped it or given up
        if not agreed & 1 and bell is not None:
            bell.close()
            bell = None
        if not agreed & 2 and segment is not None:
            segment.close()
            segment = None
        if segment is None:
            self.shared_unavailable = (
                "a single rank has nothing to exchange" if self.size < 2
                else shm.unavailable_reason() or self._segment_problem
                or ("the ranks are on more than one host" if not one_host else
                    "a rank could not map the segment, or was started with WAGMA_SHM=0"))
        return bell, segment

    @property
    def seq_window(self) -> int:
        return self._window

    def _tag(self, seq: int, msg: int) -> int:
        return ((seq % self._window) << MSG_BITS) | msg

    def isend(self, array: np.ndarray, peer: int, channel: str, seq: int, msg: int) -> Any:
        return _SendRequest(self._comms[channel].Isend(array, peer, self._tag(seq, msg)))

    def irecv(self, array: np.ndarray, peer: int, channel: str, seq: int, msg: int) -> Any:
        return self._comms[channel].Irecv([array, MPI.BYTE], peer, self._tag(seq, msg))

    def receive_buffer(self, array: np.ndarray) -> Any:
        # Receive bytes: a message that is no whole number of the array's
        # elements (ranks passing dtypes of different sizes) then reaches the
        # size check (MessageSizeError) instead of MPICH's typed unpack, which
        # aborts the job on it. Posting costs the same
        # (bench/results/receive-bytes-ab.txt).
        return [array, MPI.BYTE]

    def posters(self, channel: str) -> tuple[Callable[[np.ndarray, int, int], Any],
                                             Callable[[np.ndarray, int, int], Any]]:
        # The bare mpi4py calls, bound once per channel: no wrapper object per
        # message (the small-message path, docs/benchmarks.md).
        bound = self._bound.get(channel)
        if bound is None:
            comm = self._comms[channel]
            self._bound[channel] = bound = (comm.Isend, comm.Irecv)
        return bound

    def tag_base(self, seq: int) -> int:
        return (seq % self._window) << MSG_BITS

    def as_send(self, request: Any) -> Any:
        return request if isinstance(request, _SendRequest) else _SendRequest(request)

    def irecv_any(self, array: np.ndarray, channel: str) -> Any:
        return self._comms[channel].Irecv(array, MPI.ANY_SOURCE, self._tag(0, 0))

    def open_channels(self, names: Sequence[str]) -> None:
        # Bounded by the communicator's timeout: the barrier before this call
        # completing here does not mean every rank saw it complete (a peer's
        # may have timed out just before), and such a peer never duplicates.
        base = self._comms[CHANNELS[0]]
        deadline = time.monotonic() + self._timeout
        for name in names:
            if name in self._comms:
                raise TransportError(f"channel {name!r} already open")
            what = f"set-up of channels {list(names)}"
            step = f"duplicating the communicator for channel {name!r}"
            try:
                comm, request = base.Idup()
            except MPI.Exception as exc:
                raise mpi_error(what, exc, step=step) from exc
            wait_with_deadline(
                request, comm, deadline, what,
                detail=f"{step} did not complete within {self._timeout:g} s: a rank gave up "
                "on the set-up (its barrier timed out) or stopped", step=step)
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            self._comms[name] = comm

    def close_channels(self, names: Sequence[str], free: bool = True) -> None:
        for name in names:
            self._bound.pop(name, None)
            comm = self._comms.pop(name, None)
            if comm is None:
                continue
            if not free:
                _KEPT.append(comm)  # never freed: its context is never reused
                continue
            try:
                comm.Free()
            except MPI.Exception:
                pass

    def exchange_bytes(self, data: bytes | None, nbytes: int, deadline: float) -> bytes:
        """Rank 0's ``data`` (``nbytes`` long) on every rank, e.g. the NCCL
        unique id. Non-blocking broadcast polled until ``deadline``: a rank
        that never comes makes this raise CollectiveTimeoutError (a
        TimeoutError) instead of hanging, the buffer kept for MPI.
        Progress thread only (the creation communicator is its own)."""
        buf = bytearray(nbytes)
        if self.rank == 0:
            if data is None or len(data) != nbytes:
                raise TransportError(f"exchange_bytes: rank 0 must give {nbytes} bytes")
            buf[:] = data
        request = self._create_comm.Ibcast([buf, MPI.BYTE], root=0)
        wait_with_deadline(request, buf, deadline, "exchange of the NCCL unique id",
                           detail="not every rank joined it by the deadline",
                           nap_limit=50e-6)
        return bytes(buf)

    # -- native collectives -------------------------------------------------
    def _group_comm(self, ranks: Sequence[int]) -> MPI.Comm:
        key = tuple(ranks)
        if key == self._everyone:
            return self._comms["data"]
        return self._groups[key]

    def has_group(self, ranks: Sequence[int]) -> bool:
        # Asked on every call of a native collective: no tuple made for the
        # common case, a tuple of ranks already.
        key = ranks if type(ranks) is tuple else tuple(ranks)
        return key == self._everyone or key in self._groups

    def create_group(self, ranks: Sequence[int]) -> None:
        key = tuple(ranks)
        if self.has_group(key):
            return
        group = self._world_group.Incl(list(key))
        try:
            comm = self._create_comm.Create_group(group, tag=0)
        finally:
            group.Free()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._groups[key] = comm

    def supports_native(self, op: str, dtype: DType) -> bool:
        return dtype.mpi_name is not None and op in _MPI_OPS

    def native_allreduce(self, array: np.ndarray, op: str, dtype: DType,
                         ranks: Sequence[int]) -> Any:
        return self._allreduce_starter(op, dtype, ranks)(array)

    def native_broadcast(self, array: np.ndarray, root: int, ranks: Sequence[int]) -> Any:
        return self._broadcast_starter(root, ranks)(array)

    def native_starter(self, op: Any, dtype: DType) -> Callable[[np.ndarray], Any]:
        if op.kind == "allreduce":
            return self._allreduce_starter(op.op, dtype, op.ranks)
        return self._broadcast_starter(op.root, op.ranks)

    def _allreduce_starter(self, op: str, dtype: DType,
                           ranks: Sequence[int]) -> Callable[[np.ndarray], Any]:
        if not self.supports_native(op, dtype):
            raise TransportError(f"MPI cannot reduce {dtype.name} with {op}")
        comm = self._group_comm(ranks)
        mpi_type, mpi_op = getattr(MPI, dtype.mpi_name), _MPI_OPS[op]  # type: ignore[arg-type]
        return lambda arr: _NativeRequest(comm.Iallreduce(MPI.IN_PLACE, [arr, mpi_type], mpi_op))

    def _broadcast_starter(self, root: int, ranks: Sequence[int]) -> Callable[[np.ndarray], Any]:
        comm, local_root = self._group_comm(ranks), list(ranks).index(root)
        return lambda arr: _NativeRequest(comm.Ibcast([arr, MPI.BYTE], root=local_root))

    # -- progress -------------------------------------------------------------
    raw_errors = (MPI.Exception,)

    def error_of(self, exc: BaseException) -> BaseException:
        if isinstance(exc, MPI.Exception):
            return TransportError(f"MPI error: {exc.Get_error_string()}", exc.Get_error_code())
        return super().error_of(exc)

    def test_some(self, requests: list[Any], statuses: list[Any] | None = None) -> list[int]:
        try:
            done = MPI.Request.Testsome(requests, statuses)
        except MPI.Exception as exc:
            raise self._error_in_statuses(exc, statuses) from exc
        return done or []

    def _error_in_statuses(self, exc: MPI.Exception,
                           statuses: list[Any] | None) -> BaseException:
        """``exc`` as a TransportError; where it is MPI_ERR_IN_STATUS ("see the
        MPI_ERROR field"), saying what the first failed status says (e.g. a
        truncated message), its code kept (overlong() reads it)."""
        error = self.error_of(exc)
        code = exc.Get_error_code()
        if statuses and MPI.Get_error_class(code) == MPI.ERR_IN_STATUS:
            failed = [st.Get_error() for st in statuses
                      if MPI.Get_error_class(st.Get_error()) not in (MPI.SUCCESS, MPI.ERR_PENDING)]
            if failed:
                return TransportError(f"MPI error: {MPI.Get_error_string(failed[0])}", code)
        return error

    def test_one(self, request: Any, status: Any = None) -> bool:
        try:
            return request.Test(status)
        except MPI.Exception as exc:
            raise self.error_of(exc) from exc

    def tester(self) -> Callable[[list[Any], Any], bool]:
        # MPI_Testall completes all of the requests or none (runtime/straight.py
        # hands the uncompleted ones over as they are).
        return MPI.Request.Testall

    # MPI accepts a message shorter than the receive's buffer without an
    # error; only the status says how long it was (about 0.15 us per test
    # call and received message, bench/results/size-check-ab.txt).
    def statuses(self, n: int) -> list[Any] | None:
        return [MPI.Status() for _ in range(n)]

    received_bytes = staticmethod(MPI.Status.Get_count)  # the bare call: in bytes by default

    def overlong(self, error: TransportError,
                 statuses: list[Any]) -> list[tuple[int, int, int]]:
        if error.code is None:
            return []
        kind = MPI.Get_error_class(error.code)
        if kind == MPI.ERR_TRUNCATE:  # a test of one request: its status has no error
            return [(0, statuses[0].Get_source(), statuses[0].Get_tag())] if statuses else []
        if kind != MPI.ERR_IN_STATUS:
            return []
        # A test of several writes every status it returns, errors included,
        # so a truncation seen here is this call's.
        return [(k, status.Get_source(), status.Get_tag()) for k, status in enumerate(statuses)
                if MPI.Get_error_class(status.Get_error()) == MPI.ERR_TRUNCATE]

    def abandon(self, request: Any) -> None:
        # Receives only. Cancelling a send is deprecated (MPI-4) and MPICH 5.0
        # segfaults cancelling a large (rendezvous) send in flight, as
        # close(cancel=True) did. An abandoned send may still finish in the
        # background; the engine keeps its buffer alive.
        if isinstance(request, (_SendRequest, _NativeRequest)):
            return  # a native collective cannot be cancelled either
        try:
            request.Cancel()
        except MPI.Exception:
            pass

    def cancel_recv(self, request: Any) -> None:
        # Cancelling a receive is local, so the wait returns at once; it hands
        # the request back to MPI (else MPI reports it leaked at finalize).
        try:
            request.Cancel()
            request.Wait()
        except MPI.Exception:
            pass

    def close(self, keep: list[Any] | None = None) -> None:
        # Channels still open belong to persistent collectives that were never
        # closed: their peers' messages may still arrive, so they are kept.
        self.close_channels([name for name in self._comms if name not in CHANNELS],
                            free=False)
        comms = (list(self._groups.values()) + list(self._comms.values())
                 + [self._create_comm, self._base])
        if keep is not None:
            # A freed context id is reused by the next communicator MPI makes;
            # a message a peer sent for a call given up on here (a timed-out
            # native allreduce, a send of a cancelled round) would then be
            # received by that communicator's calls: a wrong result.
            _KEPT.extend(comms)
            _KEPT.extend(keep)
            comms = []
        for comm in comms:
            try:
                comm.Free()
            except MPI.Exception:
                pass
        self._groups.clear()
        self._comms.clear()
        self._bound.clear()
        if self.doorbell is not None:
            self.doorbell.close()
        if self.shared_segment is not None:
            self.shared_segment.close()
            self.shared_segment = None
        try:
            self._world_group.Free()
        except MPI.Exception:
            pass
