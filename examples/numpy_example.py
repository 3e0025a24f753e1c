"""NumPy-only data-parallel training with WAGMA-SGD (no deep-learning framework).

Softmax regression on synthetic Gaussian blobs; each rank trains on its own
shard, gradients by hand, momentum SGD by hand. ``wagma_comm.train.Averager``
keeps the weights as one flat bucket and averages them in place each
iteration, in WAGMA-SGD's order: gradient at the pre-averaging weights, group
average, then the optimizer step.

    mpiexec -n 4 .venv/bin/python examples/numpy_example.py [--method wagma]
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import wagma_comm
from wagma_comm.train import Averager

CLASSES, FEATURES = 4, 10


def make_data(seed: int = 0, n: int = 4000) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 2.0, (CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, n)
    x = (centres[y] + rng.normal(0, 2.0, (n, FEATURES))).astype(np.float32)
    return x[:3000], y[:3000], x[3000:], y[3000:]


def gradient(w: np.ndarray, b: np.ndarray, x: np.ndarray,
             y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cross-entropy gradient of softmax regression."""
    logits = x @ w + b
    logits -= logits.max(1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return (x.T @ p).astype(np.float32), p.sum(0).astype(np.float32)


def main(comm: Any = None, method: str = "wagma", steps: int = 200, lr: float = 0.1,
         momentum: float = 0.9, batch: int = 32, **knobs: Any) -> float:
    """Train; returns the test accuracy of the final (globally averaged) model."""
    own = comm is None
    comm = comm or wagma_comm.init()
    x, y, xt, yt = make_data()
    shard = np.arange(comm.rank, len(y), comm.size)
    rng = np.random.default_rng(comm.rank)
    # Different on every rank on purpose: the Averager broadcasts rank 0's.
    w = rng.normal(0, 0.01, (FEATURES, CLASSES)).astype(np.float32)
    b = np.zeros(CLASSES, np.float32)
    gw, gb = np.zeros_like(w), np.zeros_like(b)
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    avg = Averager(comm, [w, b], method, names=["w", "b"], **knobs)
    for _ in range(steps):
        idx = rng.choice(shard, batch)
        gw[...], gb[...] = gradient(w, b, x[idx], y[idx])  # at the pre-averaging weights
        avg.average([w, b], [gw, gb])   # model methods average w, b; others gw, gb
        vw[...] = momentum * vw + gw    # then the optimizer step
        vb[...] = momentum * vb + gb
        w -= lr * vw
        b -= lr * vb
    done = avg.finalize([w, b], [gw, gb])
    if done.apply:  # eager-SGD: contributions that missed their rounds
        w -= lr * gw
        b -= lr * gb
    avg.close()
    acc = float(((xt @ w + b).argmax(1) == yt).mean())
    if comm.rank == 0:
        print(f"{method}: test accuracy {100 * acc:.1f}% after {steps} steps on "
              f"{comm.size} ranks ({avg.statistics()['mean_wait_s'] * 1e3:.2f} ms wait/step)")
    if own:
        comm.close()
    return acc


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--method", default="wagma")
    ap.add_argument("--steps", type=int, default=200)
    main(method=ap.parse_args().method, steps=ap.parse_args().steps)
