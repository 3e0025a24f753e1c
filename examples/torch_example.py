"""PyTorch: an existing training loop adopts WAGMA-SGD with three changed lines.

    mpiexec -n 4 .venv/bin/python examples/torch_example.py [--method wagma]

The lines marked ``# wagma`` are the whole integration; the rest is a plain
PyTorch loop (an MLP on scikit-learn's digits if installed, else on random
blobs).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

import wagma_comm                                        # wagma
from wagma_comm.train import DistributedOptimizer        # wagma


def data(rank: int, size: int) -> tuple[torch.Tensor, ...]:
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target)
    except ImportError:  # the demo extra is not installed: synthetic data
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, 10, (1800,), generator=g)
        x = torch.randn(10, 64, generator=g)[y] + torch.randn(1800, 64, generator=g)
    return x[:1400][rank::size], y[:1400][rank::size], x[1400:], y[1400:]


def main(comm: Any = None, method: str = "wagma", epochs: int = 5, **knobs: Any) -> float:
    own = comm is None
    comm = comm or wagma_comm.init()                     # wagma
    x, y, xt, yt = data(comm.rank, comm.size)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = DistributedOptimizer(opt, comm, method, model=model, **knobs)   # wagma
    for _ in range(epochs):
        for i in range(0, len(y) - 15, 16):
            opt.zero_grad()
            F.cross_entropy(model(x[i:i + 16]), y[i:i + 16]).backward()
            opt.step()
    opt.finalize()   # optional: one global average, so every rank ends with the same model
    opt.close()
    with torch.no_grad():
        acc = float((model(xt).argmax(1) == yt).float().mean())
    if comm.rank == 0:
        print(f"{method}: test accuracy {100 * acc:.1f}% on {comm.size} ranks "
              f"({opt.statistics()['mean_wait_s'] * 1e3:.2f} ms wait/step)")
    if own:
        comm.close()
    return acc


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--method", default="wagma")
    ap.add_argument("--epochs", type=int, default=5)
    a = ap.parse_args()
    main(method=a.method, epochs=a.epochs)
