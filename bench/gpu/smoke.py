"""Smallest GPU check: one allreduce of a torch CUDA tensor, with the GPU
queue's debug log on and a thread dump if it takes longer than 40 s."""

import faulthandler
import logging
import sys

faulthandler.dump_traceback_later(15, exit=True)
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr,
                    format="%(relativeCreated)8.0f ms %(name)s %(message)s")
logging.getLogger("wagma_comm.gpu").setLevel(logging.DEBUG)

import torch  # noqa: E402

import wagma_comm  # noqa: E402

c = wagma_comm.init(timeout=30)
logging.getLogger("wagma_comm.gpu").debug("rank %d of %d initialised", c.rank, c.size)
t = torch.ones(10, device="cuda")
c.allreduce(t)
print("ok", c.rank, t[:3].tolist(), flush=True)
c.close()
