"""JAX + optax data-parallel training with WAGMA-SGD through DLPack.

JAX arrays are immutable, so the training layer only reads them (DLPack) and
hands the averaged tensors back as fresh NumPy arrays (``copy=True``), which
JAX imports through DLPack again. The order is WAGMA-SGD's: gradient at the
pre-averaging weights, group average, then the optax update.

    mpiexec -n 4 .venv/bin/python examples/jax_example.py [--method wagma]

Needs the ``jax`` extra (jax, optax).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import wagma_comm
from wagma_comm.train import Averager

CLASSES, FEATURES, HIDDEN = 4, 10, 16


def make_data(seed: int = 0, n: int = 4000) -> tuple[np.ndarray, ...]:
    """Gaussian blobs (the NumPy example's data)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 2.0, (CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, n)
    x = (centres[y] + rng.normal(0, 2.0, (n, FEATURES))).astype(np.float32)
    return x[:3000], y[:3000], x[3000:], y[3000:]


def main(comm: Any = None, method: str = "wagma", steps: int = 150, lr: float = 0.05,
         batch: int = 32, **knobs: Any) -> float:
    """Train a small MLP; returns the final model's test accuracy."""
    import jax
    import jax.numpy as jnp
    import optax

    own = comm is None
    comm = comm or wagma_comm.init()
    x, y, xt, yt = make_data()
    shard = np.arange(comm.rank, len(y), comm.size)
    rng = np.random.default_rng(comm.rank)
    key = jax.random.PRNGKey(comm.rank)  # different per rank: rank 0's is broadcast
    k1, k2 = jax.random.split(key)
    params = {"w1": 0.3 * jax.random.normal(k1, (FEATURES, HIDDEN)), "b1": jnp.zeros(HIDDEN),
              "w2": 0.3 * jax.random.normal(k2, (HIDDEN, CLASSES)), "b2": jnp.zeros(CLASSES)}

    def loss_fn(p: Any, xb: Any, yb: Any) -> Any:
        h = jax.nn.relu(xb @ p["w1"] + p["b1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"],
                                                               yb).mean()

    grad_fn = jax.jit(jax.grad(loss_fn))
    leaves, tree = jax.tree_util.tree_flatten(params)
    names = [jax.tree_util.keystr(path)
             for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    avg = Averager(comm, leaves, method, names=names, **knobs)
    params = jax.tree_util.tree_unflatten(tree, [jnp.from_dlpack(a) for a in avg.model()])
    tx = optax.sgd(lr, momentum=0.9)
    state = tx.init(params)
    for _ in range(steps):
        idx = rng.choice(shard, batch)
        grads = grad_fn(params, x[idx], y[idx])  # at the pre-averaging weights
        out = avg.average(jax.tree_util.tree_leaves(params),
                          jax.tree_util.tree_leaves(grads), copy=True)
        params = jax.tree_util.tree_unflatten(tree, [jnp.from_dlpack(a) for a in out.params])
        grads = jax.tree_util.tree_unflatten(tree, [jnp.from_dlpack(a) for a in out.grads])
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    done = avg.finalize(jax.tree_util.tree_leaves(params), copy=True)
    params = jax.tree_util.tree_unflatten(tree, [jnp.from_dlpack(a) for a in done.params])
    if done.apply:  # eager-SGD leftovers
        g = jax.tree_util.tree_unflatten(tree, [jnp.from_dlpack(a) for a in done.grads])
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    avg.close()
    h = jax.nn.relu(xt @ params["w1"] + params["b1"])
    acc = float((np.asarray(h @ params["w2"] + params["b2"]).argmax(1) == yt).mean())
    if comm.rank == 0:
        print(f"{method}: test accuracy {100 * acc:.1f}% after {steps} steps on {comm.size} "
              "ranks (JAX)")
    if own:
        comm.close()
    return acc


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--method", default="wagma")
    ap.add_argument("--steps", type=int, default=150)
    a = ap.parse_args()
    main(method=a.method, steps=a.steps)
