"""What the received-size check costs per test call: MPI_Testall over a
2-element receive and send to this process itself, without statuses, with
statuses, and with the receive's byte count read (docs/benchmarks.md,
"The received-size check on the message path").

Usage: .venv/bin/python bench/status_cost.py [--calls 20000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
from mpi4py import MPI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_SELF.Dup()
    send, recv = np.zeros(2, np.float32), np.zeros(2, np.float32)
    statuses = [MPI.Status(), MPI.Status()]
    test_all, get_count = MPI.Request.Testall, MPI.Status.Get_count

    def plain() -> None:
        requests = [comm.Irecv(recv, 0, 5), comm.Isend(send, 0, 5)]
        while not test_all(requests):
            pass

    def with_statuses() -> None:
        requests = [comm.Irecv(recv, 0, 5), comm.Isend(send, 0, 5)]
        while not test_all(requests, statuses):
            pass

    def with_count() -> None:
        with_statuses()
        if get_count(statuses[0]) != 8:
            raise AssertionError("the receive got another size")

    print(f"# one process, {args.calls} calls, best of {args.repeat}; us per call "
          "(post a receive and a send to itself, MPI_Testall until done)")
    for name, fn in (("no statuses", plain), ("statuses", with_statuses),
                     ("statuses + Get_count", with_count)):
        best = min(timeit.repeat(fn, number=args.calls, repeat=args.repeat)) / args.calls
        print(f"{name:>22}: {best * 1e6:.3f}")
    comm.Free()


if __name__ == "__main__":
    main()
