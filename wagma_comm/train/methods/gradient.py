"""Methods that average gradients: Allreduce-SGD and eager-SGD (solo, majority).

Replicas that start equal stay equal: every rank applies the same averaged
gradient each iteration (eager-SGD's partial collectives guarantee it by giving
every rank the result of its own round; see docs/partial.md).
"""

from __future__ import annotations

import time
from typing import Any

from ...errors import InvalidArgumentError
from .base import (
    GRADIENTS,
    AveragingInfo,
    BucketBuffer,
    Method,
    any_bit_set,
    bucket_statistics,
    check_int,
    release,
    zeros_like,
)


class AllreduceSGD(Method):
    """Synchronous data-parallel SGD: the global mean of the gradients every
    iteration (everyone waits for the slowest rank)."""

    name = "allreduce"
    averages = GRADIENTS

    def __init__(self) -> None:
        super().__init__()
        self._handles: list[Any] = []

    def _start(self, t: int, buffers: list[BucketBuffer]) -> None:
        self._handles = [self.comm.allreduce(b, "avg", async_op=True) for b in buffers]

    def _finish(self, t: int) -> AveragingInfo:
        t0 = time.perf_counter()
        for h in self._handles:
            h.wait()
        self._handles = []
        return AveragingInfo(t, self.name, GRADIENTS, True, time.perf_counter() - t0)


class EagerSGD(Method):
    """eager-SGD: gradients averaged by a solo or majority partial allreduce,
    with a blocking global round every ``sync_every`` iterations. Not
    deterministic: which contributions are fresh depends on timing."""

    averages = GRADIENTS
    deterministic = False

    def __init__(self, kind: str, sync_every: int = 10, seed: int = 0) -> None:
        super().__init__()
        if kind not in ("solo", "majority"):
            raise InvalidArgumentError("kind", f"expected 'solo' or 'majority', got {kind!r}")
        self.name = kind  # type: ignore[misc]
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.seed = check_int("seed", seed, 0)
        self._colls: list[Any] = []
        self._handles: list[Any] = []

    def _setup(self, comm: Any, buffers: list[BucketBuffer]) -> None:
        if self.first_iteration % self.sync_every:
            raise InvalidArgumentError(
                "first_iteration", f"{self.name} resumes only at a multiple of sync_every="
                f"{self.sync_every}, got {self.first_iteration}")
        majority = self.name == "majority"
        create = comm.majority_allreduce if majority else comm.solo_allreduce
        kw = {"seed": self.seed} if majority else {}
        made: list[Any] = []
        try:
            for b in buffers:
                made.append(create(zeros_like(b), self.sync_every,
                                   first_round=self.first_iteration, **kw))
        except BaseException as exc:
            release(made, exc)  # the earlier buckets' collectives, made for nothing
            raise
        self._colls = made

    def _start(self, t: int, buffers: list[BucketBuffer]) -> None:
        self._handles = [c.step(b, async_op=True) for c, b in zip(self._colls, buffers)]

    def _finish(self, t: int) -> AveragingInfo:
        t0 = time.perf_counter()
        infos = tuple(h.wait() for h in self._handles)
        self._handles = []
        return AveragingInfo(t, self.name, GRADIENTS, infos[0].synchronized,
                             time.perf_counter() - t0, infos,
                             max(i.staleness for i in infos))

    def finalize(self, buffers: Any) -> bool:
        """Flush: contributions that missed their rounds land in ``buffers``."""
        self._check_live("finalize")
        nonzero = False
        for c, b in zip(self._colls, buffers):
            c.flush(b)
            nonzero |= any_bit_set(b)  # every rank gets the same result
        return nonzero

    def close(self) -> None:
        """Collective (idempotent). Every bucket's collective is released even
        when an earlier one's close fails: the first error is raised after."""
        colls, self._colls, self._handles = self._colls, [], []
        super().close()
        error = release(colls)
        if error is not None:
            raise error

    def checkpoint_error(self, t: int) -> str | None:
        if t % self.sync_every:
            return (f"{self.name} checkpoints resume only at iterations that are a multiple "
                    f"of sync_every={self.sync_every} (after a sync round), not {t}")
        return None

    def statistics(self) -> dict[str, Any]:
        """Every bucket's collective (:func:`~.base.bucket_statistics`)."""
        return bucket_statistics(self._colls)

    def describe(self) -> str:
        """Name and every knob that changes the result (the set-up compares
        it across ranks): majority's seed picks each round's activator."""
        seed = f", seed {self.seed}" if self.name == "majority" else ""
        return f"{self.name} (sync every {self.sync_every}{seed})"
