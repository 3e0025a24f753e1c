"""Per-iteration waiting and staleness, summed: what the demo's table reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .methods.base import AveragingInfo


@dataclass
class WaitStats:
    """Counters over iterations (``wait_time_s``: seconds blocked waiting for
    averaging results, summed)."""

    iterations: int = 0
    communicating: int = 0
    synchronized: int = 0
    wait_time_s: float = 0.0
    max_staleness: int = 0
    staleness: dict[int, int] = field(default_factory=dict)

    def record(self, info: AveragingInfo) -> None:
        self.iterations += 1
        self.communicating += info.averaged is not None
        self.synchronized += info.synchronized
        self.wait_time_s += info.wait_s
        self.max_staleness = max(self.max_staleness, info.staleness)
        self.staleness[info.staleness] = self.staleness.get(info.staleness, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {"iterations": self.iterations, "communicating": self.communicating,
                "synchronized": self.synchronized, "wait_time_s": self.wait_time_s,
                "mean_wait_s": self.wait_time_s / self.iterations if self.iterations else 0.0,
                "max_staleness": self.max_staleness, "staleness": dict(self.staleness)}
