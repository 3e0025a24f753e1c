"""The shared-memory board of one wait-avoiding collective on one host.

Why: a WAGMA group round that goes through messages needs every member's
progress thread to take part, so a round costs each member CPU on the cores
its application needs (docs/training.md, "Why the second target is missed").
On one host a round can instead be computed by whichever member arrives
first, from the models its peers last published on the board, without any
peer running anything (partial/shared_wagma.py has the protocol).

One block per rank, each guarded by its own robust process-shared lock
(transport/shm_lock.py)::

    lock      LOCK_BYTES
    words     8 x int64: HOLDER (rank holding the lock, for a waiter's
              timeout to name; -1: nobody, or a holder that has not yet
              written it: each holder clears it before letting go),
              PUBLISHED (round of the published model, -1: the initial
              model), RESULT (the newest
              round whose result is in this block, -1: none), ACTIVATOR,
              DIED (a rank that died holding the lock, -1: none; set by the
              holder after it, so that every later holder is told too),
              ARRIVED (how many blocking rounds this rank has entered, -1:
              none; written by its owner without the lock, read only to
              name the ranks a timed-out sync round waited for)
    flags     one byte per member of RESULT's group: its contribution was fresh
    published the model this rank last published
    result    the group sum of round RESULT, for this rank

Made like the communicator's segment (transport/shm.py): rank 0 creates the
file and its locks, the others map it, rank 0 unlinks the name once every
rank has said whether it could; each rank unmaps locally at close.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from . import shm_lock
from .shm import create_file

HOLDER, PUBLISHED, RESULT, ACTIVATOR, DIED, ARRIVED = 0, 1, 2, 3, 4, 5
_WORDS = 8


def _pad(n: int) -> int:
    return (n + 63) // 64 * 64


def block_bytes(size: int, nbytes: int) -> int:
    """Bytes of one rank's block for ``size`` ranks and an ``nbytes`` model."""
    return shm_lock.LOCK_BYTES + 8 * _WORDS + _pad(size) + 2 * _pad(nbytes)


class Board:
    """One mapping of the board. :meth:`create` (rank 0) or :meth:`attach`."""

    def __init__(self, path: str, size: int, nbytes: int, fd: int) -> None:
        self.path, self.size, self.nbytes = path, size, nbytes
        block = block_bytes(size, nbytes)
        total = size * block
        try:
            if os.fstat(fd).st_size != total:
                raise OSError(f"{path} is {os.fstat(fd).st_size} bytes, expected {total}")
            self._map: mmap.mmap | None = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        memory = np.frombuffer(self._map, dtype=np.uint8)
        base = memory.ctypes.data
        words_at = shm_lock.LOCK_BYTES
        flags_at = words_at + 8 * _WORDS
        published_at = flags_at + _pad(size)
        result_at = published_at + _pad(nbytes)
        self.locks = [base + k * block for k in range(size)]
        self.words = [memory[k * block + words_at:k * block + flags_at].view(np.int64)
                      for k in range(size)]
        self.flags = [memory[k * block + flags_at:k * block + flags_at + size]
                      for k in range(size)]
        self.published = [memory[k * block + published_at:k * block + published_at + nbytes]
                          for k in range(size)]
        self.result = [memory[k * block + result_at:k * block + result_at + nbytes]
                       for k in range(size)]

    @classmethod
    def create(cls, path: str, size: int, nbytes: int) -> "Board":
        """Make the file with its locks initialised and every round marked
        unpublished. Raises OSError where it cannot (no space, a name taken,
        no address space to map it), leaving no file behind."""
        fd = create_file(path, size * block_bytes(size, nbytes))
        board: Board | None = None
        try:
            board = cls(path, size, nbytes, fd)
            for k in range(size):
                shm_lock.init_lock(board.locks[k])
                board.words[k][:] = -1
        except BaseException:  # a signal's exception (Ctrl-C) too, as create_file
            os.unlink(path)  # nobody else knows the file yet
            if board is not None:
                board.close()  # the traceback would keep the mapping alive
            raise
        return board

    @classmethod
    def attach(cls, path: str, size: int, nbytes: int) -> "Board":
        """Map rank 0's file. Raises OSError where it is not there."""
        return cls(path, size, nbytes, os.open(path, os.O_RDWR))

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    @property
    def closed(self) -> bool:
        return self._map is None

    def close(self) -> None:
        """Unmap (local). Views still held elsewhere keep the mapping alive."""
        memory, self._map = self._map, None
        self.words = self.flags = self.published = self.result = []
        self.locks = []
        if memory is not None:
            try:
                memory.close()
            except BufferError:
                pass  # a view is still exported: the mapping goes with it


__all__ = ["Board", "block_bytes", "HOLDER", "PUBLISHED", "RESULT", "ACTIVATOR", "DIED",
           "ARRIVED"]
