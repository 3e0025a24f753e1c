"""One rank is killed (SIGKILL) in the middle of a collective; the survivors
must fail with a typed error naming the collective, the round and the dead
rank, within the timeout, and the job must end.

Run under ``mpiexec -disable-auto-cleanup`` (else MPICH's launcher kills the
survivors itself) by tests/unit/test_rank_death.py:

    mpiexec -disable-auto-cleanup -n 4 python tests/faults/rank_death.py CASE VICTIM TIMEOUT OUTDIR

Each survivor writes OUTDIR/rank<r>.json: what it raised and when.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

import wagma_comm

CASE, VICTIM, TIMEOUT, OUT = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]


def die_soon(delay: float) -> None:
    """Kill this process ``delay`` seconds from now, from another thread, so
    the main thread is inside the collective when it happens."""
    threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()


def record(comm: wagma_comm.Communicator, call: Callable[[], Any]) -> None:
    """Run ``call``, which must fail; write what it raised."""
    started = time.monotonic()
    result: dict[str, Any] = {"rank": comm.rank}
    try:
        call()
        result["error"] = None
    except wagma_comm.WagmaError as exc:
        result.update(error=type(exc).__name__, message=str(exc),
                      collective=getattr(exc, "collective", None),
                      round=getattr(exc, "round", None),
                      ranks=list(getattr(exc, "ranks", ())))
    result["elapsed"] = time.monotonic() - started
    with open(os.path.join(OUT, f"rank{comm.rank}.json"), "w") as f:
        json.dump(result, f)


def report_device_free(me: int) -> None:
    """After a GPU case's failure: the GPU is free again (no survivor's kernel
    is stuck on the device, NCCL's were aborted); say so in the report."""
    import cupy

    probe = cupy.arange(1 << 20, dtype=cupy.float32)
    cupy.cuda.Device(0).synchronize()
    assert float(probe.sum()) == (1 << 20) * ((1 << 20) - 1) / 2
    path = os.path.join(OUT, f"rank{me}.json")
    with open(path) as f:
        report = json.load(f)
    report["device_free"] = True
    with open(path, "w") as f:
        json.dump(report, f)


def main() -> None:
    comm = wagma_comm.init(timeout=TIMEOUT)
    me = comm.rank
    comm.barrier()  # round 0: everybody is up
    big = np.ones(4 << 20, np.float32)  # 16 MiB: many ring steps, so "in the middle"
    victim = me == VICTIM
    if CASE == "allreduce":  # round 1
        if victim:
            die_soon(0.02)
        record(comm, lambda: comm.allreduce(big, algorithm="ring"))
    elif CASE == "group_allreduce":  # round 1; then a global allreduce, round 2
        if victim:
            die_soon(0.02)

        def both() -> None:
            comm.group_allreduce(big, 2, 0, algorithm="ring")
            comm.allreduce(np.ones(4, np.float32))
        record(comm, both)
    elif CASE in ("wait_avoiding", "sync_round"):
        model = np.zeros(1 << 16, np.float32)
        sync_every = 1000 if CASE == "wait_avoiding" else 4
        wagma = comm.wait_avoiding_group_allreduce(model, group_size=2, sync_every=sync_every)
        for _ in range(3):  # group rounds that complete
            wagma.step(model)
        if victim:  # dies inside the 4th step: a group round, or the synchronous one
            die_soon(0.01)

        def steps() -> None:
            for _ in range(200):
                wagma.step(model)
                time.sleep(0.005)
        record(comm, steps)
    elif CASE == "majority":  # dies between steps: survivors wait for activations
        grads = np.ones(1 << 10, np.float32)
        majority = comm.majority_allreduce(grads, sync_every=1000)
        for _ in range(3):
            majority.step(grads)
        comm.barrier()
        if victim:
            os.kill(os.getpid(), signal.SIGKILL)

        def majority_steps() -> None:
            for _ in range(400):
                majority.step(grads)
                time.sleep(0.005)
        record(comm, majority_steps)
    elif CASE in ("shared_memory", "shared_memory_poll"):  # round 1, in the segment
        # The victim never takes part: it is killed while the others wait for
        # its row (blocking), or poll for it (non-blocking, nobody waits).
        if victim:
            die_soon(0.3)
            time.sleep(60)
        small = np.ones(1 << 10, np.float32)
        if CASE == "shared_memory":
            record(comm, lambda: comm.allreduce(small, algorithm="shared_memory"))
        else:
            def poll() -> None:
                handle = comm.allreduce(small, algorithm="shared_memory", async_op=True)
                while not handle.test():
                    time.sleep(0.001)
            record(comm, poll)
    elif CASE == "shared_memory_then_partial":
        # The death breaks the communicator in a shared-memory allreduce, which
        # stops no partial collective's service; their next steps, a solo
        # round (messages) and a group round (board), need nothing from the
        # communicator but must refuse at once with RankFailedError naming
        # the victim. Earlier in session 48 the board's said CommunicatorClosedError.
        grads = np.ones(1 << 10, np.float32)
        solo = comm.solo_allreduce(grads, sync_every=1000)
        model = np.zeros(1 << 10, np.float32)
        wagma = comm.wait_avoiding_group_allreduce(model, group_size=2, sync_every=1000)
        assert wagma.statistics()["path"] == "shared_memory"
        if victim:
            die_soon(0.3)
            time.sleep(60)

        def partial_steps() -> None:
            try:
                comm.allreduce(grads, algorithm="shared_memory")
            except wagma_comm.RankFailedError:
                pass
            try:
                solo.step(grads)
            except wagma_comm.RankFailedError as exc:
                if exc.collective != solo.kind or VICTIM not in exc.ranks:
                    raise wagma_comm.WagmaError(f"solo step: {exc!r}") from exc
            else:
                raise wagma_comm.WagmaError("a solo round ran after the death")
            wagma.step(model)  # must raise RankFailedError (recorded)
        record(comm, partial_steps)
    elif CASE in ("board_lock", "board_lock_unnamed"):  # WAGMA's round 1 on the board
        # The victim dies holding its own board lock, its published model
        # half rewritten (NaN): every survivor must be told, not only the
        # first to take that lock, and none may average the torn model.
        # "unnamed": it dies before writing its rank into the slot's HOLDER
        # word (which still names an earlier holder), so the survivors must
        # find it by liveness.
        model = np.zeros(1 << 10, np.float32)
        wagma = comm.wait_avoiding_group_allreduce(model, group_size=comm.size,
                                                   sync_every=1000)
        assert wagma.statistics()["path"] == "shared_memory"
        wagma.step(model)  # round 0
        comm.barrier()  # every member is done with round 0 (and the victim's lock)
        if victim:
            if CASE == "board_lock":
                wagma._hold(me, 1, time.monotonic() + TIMEOUT)  # as a round or publish does
            else:
                from wagma_comm.transport import shm_lock
                shm_lock.acquire(wagma._board.locks[me], time.monotonic() + TIMEOUT)
            wagma._published[me][: model.size // 2] = np.nan
        comm.barrier()  # from here the survivors' steps wait for the victim's lock
        if victim:
            os.kill(os.getpid(), signal.SIGKILL)

        def board_steps() -> None:
            for _ in range(50):
                mine = np.ones_like(model)
                wagma.step(mine)
                if np.isnan(mine).any():
                    raise wagma_comm.WagmaError("a round averaged the dead rank's torn model")
                time.sleep(0.002)
        record(comm, board_steps)
    elif CASE in ("gpu_allreduce", "gpu_group_allreduce", "gpu_absent"):
        # NCCL on GPU buffers: the victim dies inside the NCCL collective (or,
        # "gpu_absent", before it, so the survivors' kernels wait for a rank
        # that never posts). The survivors' GPU queue must abort NCCL, so no
        # kernel stays blocked, and fail with RankFailedError naming it.
        import cupy

        cupy.cuda.Device(0).use()
        gpu_big = cupy.ones(64 << 20, dtype=cupy.float32)  # 256 MiB
        comm.allreduce(cupy.ones(4, dtype=cupy.float32))  # NCCL is up (round 1)
        if victim:
            die_soon(0.3 if CASE == "gpu_absent" else 0.02)
            if CASE == "gpu_absent":
                time.sleep(60)
        if CASE == "gpu_group_allreduce":
            record(comm, lambda: [comm.group_allreduce(gpu_big, 2, s) for s in range(20)])
        else:
            record(comm, lambda: [comm.allreduce(gpu_big) for _ in range(20)])
        report_device_free(me)
    elif CASE in ("gpu_wait_avoiding", "gpu_sync_round"):
        # WAGMA on GPU buffers (partial/device.py): the victim dies inside its
        # 4th step, a group round or the synchronous one, whose NCCL allreduce
        # on the collective's own communicators then waits for it. The
        # survivors must abort those communicators and fail naming it.
        import cupy

        cupy.cuda.Device(0).use()
        gpu_model = cupy.zeros(16 << 20, dtype=cupy.float32)  # 64 MiB: long rounds
        sync_every = 1000 if CASE == "gpu_wait_avoiding" else 4
        wagma = comm.wait_avoiding_group_allreduce(gpu_model, group_size=2,
                                                   sync_every=sync_every)
        for _ in range(3):  # rounds that complete
            wagma.step(gpu_model)
        if victim:
            die_soon(0.01)

        def gpu_steps() -> None:
            for _ in range(200):
                wagma.step(gpu_model)
                time.sleep(0.005)
        record(comm, gpu_steps)
        report_device_free(me)
    elif CASE == "gpu_timeout":
        # The victim stays alive but never joins the NCCL collective: the
        # survivors' deadline must fire, abort NCCL (their kernels return)
        # and name the ranks NCCL could not vouch for; then every rank exits
        # normally.
        import cupy

        cupy.cuda.Device(0).use()
        comm.allreduce(cupy.ones(4, dtype=cupy.float32))  # NCCL is up (round 1)
        if victim:
            time.sleep(1.5 * TIMEOUT)
            return
        record(comm, lambda: comm.allreduce(cupy.ones(1 << 20, dtype=cupy.float32)))
        report_device_free(me)
        return
    elif CASE == "exit":  # survivors exit with a collective outstanding, no close()
        if victim:
            die_soon(0.01)
        comm.allreduce(big, algorithm="ring", async_op=True)
        time.sleep(0.5)  # the victim is dead before anybody exits
        return
    else:
        raise SystemExit(f"unknown case {CASE!r}")
    if victim:
        time.sleep(60)  # the timer kills us first


if __name__ == "__main__":
    main()
