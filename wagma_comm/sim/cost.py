"""The simulator's cost model: what a message, a reduction and an op cost.

A LogGP-flavoured model, kept small enough to calibrate from a few real runs:

* a message of ``n`` bytes from rank a to rank b occupies a's send port for
  ``op_overhead_s + n / bandwidth`` and lands ``latency`` later; the two
  numbers depend only on whether a and b share a node (``ranks_per_node``
  consecutive ranks form a node, as ``srun``/``mpiexec`` place them by default);
* a reduction or scale of ``n`` bytes costs ``op_overhead_s + n * reduce_s_per_byte``,
  a copy ``op_overhead_s + n * copy_s_per_byte``; a receive ``op_overhead_s``;
* every collective call (and every wait-avoiding round a progress thread starts)
  costs ``call_overhead_s`` before its first op.

``CostModel.load``/``save`` use a small JSON file, which is what
``wagma sim --calibrate`` writes and ``wagma sim --cost FILE`` reads.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..errors import InvalidArgumentError
from ..files import write_json

TOKEN_BYTES = 32  # an activation token: four int64 (collective id, round, root, sender)


@dataclass(frozen=True)
class CostModel:
    latency_intra_s: float
    latency_inter_s: float
    bandwidth_intra: float  # bytes/s, one direction, one pair of ranks
    bandwidth_inter: float
    reduce_s_per_byte: float
    copy_s_per_byte: float
    op_overhead_s: float
    call_overhead_s: float
    ranks_per_node: int
    name: str = "custom"
    source: str = ""  # where the numbers come from (a calibration run, a datasheet)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "source"):
                continue
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or math.isnan(value) or value < 0):
                raise InvalidArgumentError(f.name, f"expected a number >= 0, got {value!r}")
            # An infinite bandwidth is a free message; an infinite latency, rate
            # or overhead would make every simulated time infinite.
            if math.isinf(value) and not f.name.startswith("bandwidth_"):
                raise InvalidArgumentError(f.name, f"expected a finite number, got {value!r}")
        if self.bandwidth_intra <= 0 or self.bandwidth_inter <= 0:
            raise InvalidArgumentError("bandwidth", "bandwidths must be > 0 bytes/s")
        if int(self.ranks_per_node) != self.ranks_per_node or self.ranks_per_node < 1:
            raise InvalidArgumentError("ranks_per_node",
                                       f"expected an int >= 1, got {self.ranks_per_node!r}")

    def same_node(self, a: Any, b: Any) -> Any:
        """Whether ranks ``a`` and ``b`` share a node (works on NumPy arrays)."""
        return a // self.ranks_per_node == b // self.ranks_per_node

    def latency(self, a: int, b: int) -> float:
        return self.latency_intra_s if self.same_node(a, b) else self.latency_inter_s

    def bandwidth(self, a: int, b: int) -> float:
        return self.bandwidth_intra if self.same_node(a, b) else self.bandwidth_inter

    def with_(self, **changes: Any) -> "CostModel":
        return replace(self, **changes)

    # -- files ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        if not isinstance(data, dict):  # a list or a number was an AttributeError/TypeError
            raise InvalidArgumentError("cost", f"expected a JSON object of cost model "
                                       f"fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        missing = sorted(known - set(data) - {"name", "source"})
        if missing:
            raise InvalidArgumentError("cost", f"cost model lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: str, extra: dict[str, Any] | None = None) -> None:
        write_json(path, {"cost_model": self.to_dict(), **(extra or {})})

    @classmethod
    def load(cls, path: str) -> "CostModel":
        """A file written by :meth:`save` (or a bare dict of the fields), or a
        preset's name (``gpu-cluster``, ``zero``)."""
        if path in PRESETS:
            return PRESETS[path]
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError("cost", f"cannot read cost model {path!r}: {exc}") from exc
        return cls.from_dict(data.get("cost_model", data) if isinstance(data, dict) else data)


# A cluster of 8-GPU nodes (NVLink inside, one 200 Gb/s NIC per GPU between).
# Sources, see docs/scale.md: NVLink 4 is 900 GB/s bidirectional per H100 (NVIDIA
# Hopper architecture page), of which NCCL reaches about 783 GB/s (NVIDIA/nccl
# issue #1264); HDR InfiniBand is 200 Gb/s per port (the A100-cluster generation;
# the issue asks for a 100-200 Gb/s network). Reduction and copy rates are our own
# H100 kernel measurements (bench/results/gpu-kernels.txt: 2694 GB/s of memory
# traffic for the fused average, 2757 GB/s device copy): a reduce moves 3 bytes
# of memory traffic per byte reduced, a copy 2. Latencies and overheads are
# assumptions (typical NCCL/InfiniBand orders of magnitude), stated as such.
GPU_CLUSTER = CostModel(
    latency_intra_s=3e-6, latency_inter_s=6e-6,
    bandwidth_intra=783e9 / 2, bandwidth_inter=200e9 / 8,
    reduce_s_per_byte=3 / 2694e9, copy_s_per_byte=2 / 2757e9,
    op_overhead_s=5e-6, call_overhead_s=20e-6, ranks_per_node=8,
    name="gpu-cluster",
    source="NVLink 4 (783 GB/s measured bidirectional) inside 8-GPU nodes, 200 Gb/s "
           "per GPU between nodes, H100 kernel rates from bench/results/gpu-kernels.txt; "
           "latencies/overheads assumed (docs/scale.md)")

# Messages are free: only the schedule's structure and compute matter.
ZERO = CostModel(0.0, 0.0, float("inf"), float("inf"), 0.0, 0.0, 0.0, 0.0, 1, name="zero",
                 source="no communication cost")

PRESETS: dict[str, CostModel] = {"gpu-cluster": GPU_CLUSTER, "zero": ZERO}
