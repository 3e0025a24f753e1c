"""A discrete-event simulator of wagma_comm's compiled schedules.

It answers "what will this runtime do on my cluster?" before the cluster is
booked: the very schedules the compiler emits are timed under a calibrated
cost model (:mod:`.cost`, :mod:`.dag`), composed into training iterations of
every method under the load-imbalance injectors (:mod:`.training`), and swept
to recommend a group size and sync period (:mod:`.plan`). ``wagma sim`` and
``wagma plan`` are the command lines; :mod:`.calibrate` measures the cost
model on the machine it runs on.
"""

from .collectives import Collectives, token_arrivals
from .cost import GPU_CLUSTER, PRESETS, CostModel
from .dag import TimedDag, native_cost
from .training import METHODS, SimResult, Workload, simulate

__all__ = ["CostModel", "GPU_CLUSTER", "PRESETS", "TimedDag", "native_cost", "Collectives",
           "token_arrivals", "Workload", "SimResult", "simulate", "METHODS"]
