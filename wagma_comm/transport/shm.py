"""A shared-memory segment for the ranks of one host: rows and flags.

Why: where ranks outnumber cores, a small allreduce costs what its ranks'
turns on the cores cost. Recursive doubling needs log2(P) rounds of matched
messages, each waiting for a peer to be scheduled; one exchange through shared
memory needs each rank on a core once (docs/benchmarks.md, "Shared memory").
The protocol that uses the segment is runtime/shared.py; this module only
makes, maps and lays it out.

The segment is a POSIX shared-memory file ``/dev/shm/wagma-<nonce>``: rank 0
creates it before ``init()``'s gather of identities, the others map it after,
and rank 0 unlinks it once every rank has said whether it could (so nothing is
left in /dev/shm after init, and each rank's mapping is released locally at
close: no collective free, unlike an MPI window). Not
``multiprocessing.shared_memory``: on Python 3.11 its resource tracker
unlinks, at a process's exit, segments that process only attached to.

Layout, for ``depth`` row sets (a call with index ``k`` uses set ``k % depth``)
and ``P`` ranks::

    control[depth, P]  CONTROL_BYTES each: arrive, done, print, reduced, pieces
                       (int64 words), then text
    rows[depth, P]     slot_bytes each: a rank's contribution

Only x86-64 is supported: its stores are seen in program order (TSO), so a
flag written after a row is never seen before the row. Elsewhere a fence
would be needed between them, which NumPy cannot issue; the segment is then
not made and the algorithm is unavailable.
"""

from __future__ import annotations

import mmap
import gc
import os
import platform

import numpy as np

SLOT_BYTES = 1 << 20
"""Largest row: a rank's part of one piece of a reduction (bytes). A larger
buffer is exchanged in pieces of a row; rows are smaller where more ranks
share the host (:func:`slot_bytes_for`)."""

DEPTH = 4
"""Row sets: pieces in flight at once. A rank may be this many pieces ahead
of a peer before it waits for the peer to have read its row."""

CONTROL_BYTES = 256  # per rank and row set: four cache lines
ROWS_MAX_BYTES = 16 << 20
"""All rows of a segment together stay within this (16 MiB: a segment of 8
ranks has rows of 512 KiB, of 64 ranks 64 KiB); /dev/shm is often small, 64
MiB in a default Docker container."""
TEXT_OFFSET = 64  # the call's description, for a mismatch error, starts here
TEXT_BYTES = CONTROL_BYTES - TEXT_OFFSET
ARRIVE, DONE, PRINT, REDUCED, PIECES = 0, 1, 2, 3, 4  # int64 words of a control block
_DIR = "/dev/shm"


def unavailable_reason() -> str | None:
    """Why this process cannot take part in a shared-memory exchange, or None."""
    if os.environ.get("WAGMA_SHM", "1").strip() == "0":
        return "disabled by WAGMA_SHM=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return (f"needs x86-64's store order (this is {platform.machine()}): NumPy "
                "cannot fence a row before its flag")
    if not os.path.isdir(_DIR):
        return f"{_DIR} does not exist"
    return None


def slot_bytes_for(size: int) -> int:
    """Row size for ``size`` ranks: the largest power of two up to SLOT_BYTES
    that keeps the rows within ROWS_MAX_BYTES (at least 64)."""
    fits = max(64, min(SLOT_BYTES, ROWS_MAX_BYTES // (DEPTH * size)))
    return 1 << (fits.bit_length() - 1)


def segment_path(nonce: str) -> str:
    return f"{_DIR}/wagma-{nonce}"


def create_file(path: str, total: int) -> int:
    """Make a zeroed shared-memory file of ``total`` bytes, its pages reserved
    (a sparse file would fail later, as SIGBUS on the first store to a page
    /dev/shm has no room for). Returns an open descriptor; raises OSError
    (no space, name taken) leaving no file behind, as does any other
    exception: a signal during the reservation (tmpfs stops it with EINTR,
    and Python then runs the handler, which may raise: Ctrl-C) made one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


class Segment:
    """One mapping of the segment. :meth:`create` (rank 0) or :meth:`attach`."""

    def __init__(self, path: str, size: int, slot_bytes: int, fd: int) -> None:
        self.path, self.size, self.slot_bytes = path, size, slot_bytes
        control = DEPTH * size * CONTROL_BYTES
        total = control + DEPTH * size * slot_bytes
        try:
            if os.fstat(fd).st_size != total:
                raise OSError(f"{path} is {os.fstat(fd).st_size} bytes, expected {total}")
            self._map: mmap.mmap | None = mmap.mmap(fd, total)
        finally:
            os.close(fd)  # the mapping keeps the memory
        memory = np.frombuffer(self._map, dtype=np.uint8)
        self.control = memory[:control].reshape(DEPTH, size, CONTROL_BYTES)
        # control words: flags[set, rank, ARRIVE | DONE | PRINT]
        self.flags = memory[:control].view(np.int64).reshape(DEPTH, size, CONTROL_BYTES // 8)
        self.rows = memory[control:].reshape(DEPTH, size, slot_bytes)

    @classmethod
    def create(cls, nonce: str, size: int) -> "Segment":
        """Make the file (zeroed: no call has arrived) and map it. Raises
        OSError where it cannot (no space in /dev/shm, a name taken, no
        address space to map it), leaving no file behind."""
        path = segment_path(nonce)
        slot = slot_bytes_for(size)
        fd = create_file(path, DEPTH * size * (CONTROL_BYTES + slot))
        try:
            return cls(path, size, slot, fd)
        except BaseException:  # a signal's exception (Ctrl-C) too, as create_file
            os.unlink(path)  # nobody else knows the file yet
            raise

    @classmethod
    def attach(cls, nonce: str, size: int) -> "Segment":
        """Map rank 0's file. Raises OSError where it is not there (another
        host, another /dev/shm)."""
        path = segment_path(nonce)
        return cls(path, size, slot_bytes_for(size), os.open(path, os.O_RDWR))

    def unlink(self) -> None:
        """Remove the name (rank 0, once every rank attached or gave up)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap (local). Views still held elsewhere keep the mapping alive."""
        memory, self._map = self._map, None
        self.control = self.flags = self.rows = None  # type: ignore[assignment]
        if memory is not None:
            try:
                memory.close()
            except BufferError:
                # Views in reference cycles (a call's pieces refer to each
                # other) go with a collection; one still used elsewhere keeps
                # the mapping until it goes.
                gc.collect()
                try:
                    memory.close()
                except BufferError:
                    pass


__all__ = ["Segment", "create_file", "unavailable_reason", "slot_bytes_for", "SLOT_BYTES", "DEPTH",
           "ARRIVE", "DONE", "PRINT", "REDUCED", "PIECES", "TEXT_OFFSET", "TEXT_BYTES"]
