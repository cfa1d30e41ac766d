"""Data-parallel training of a NumPy MLP with ``nc.Reducer``.

Each rank holds a copy of the weights and a shard of the global batch. Backward
runs layer by layer from the output and marks each gradient ready as soon as it
is computed, so the Reducer's bucket allreduces run while the earlier layers'
gradients are still being computed. After every step each rank holds the
average gradient -- the gradient of the full batch -- so the weights stay
identical on every rank and equal to single-process full-batch training::

    python -m numcoll.examples.data_parallel --world-size 4 --steps 20

prints the largest difference from single-process training and how much of the
communication overlapped the backward pass. On a small machine set
``OPENBLAS_NUM_THREADS=1``: ranks times BLAS threads would oversubscribe the cores.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import numcoll as nc

__all__ = ["make_data", "init_params", "loss_and_grads", "train_single", "train_rank",
           "train_data_parallel", "main"]


def make_data(n_samples: int, sizes: list[int], seed: int = 0):
    """A synthetic regression problem: inputs and the targets of a random teacher."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_samples, sizes[0])).astype(np.float32)
    teacher = rng.standard_normal((sizes[0], sizes[-1])).astype(np.float32)
    y = np.tanh(x @ teacher).astype(np.float32)
    return x, y


def init_params(sizes: list[int], seed: int = 1) -> list[np.ndarray]:
    """[W0, b0, W1, b1, ...], float32, scaled for tanh layers."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append((rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in))
                      .astype(np.float32))
        params.append(np.zeros(fan_out, np.float32))
    return params


def loss_and_grads(params, x, y, grads, on_ready=lambda i: None) -> float:
    """Mean squared error of the MLP (tanh hidden layers, linear output) on (x, y).

    Writes d loss / d params[i] into ``grads[i]`` during backward, last layer first,
    and calls ``on_ready(i)`` right after each one.
    """
    layers = len(params) // 2
    activations = [x]
    for k in range(layers):
        z = activations[-1] @ params[2 * k] + params[2 * k + 1]
        activations.append(np.tanh(z) if k < layers - 1 else z)
    out = activations[-1]
    diff = out - y
    loss = float(np.mean(diff * diff))
    delta = (2.0 / diff.size) * diff                        # d loss / d output
    for k in reversed(range(layers)):
        np.sum(delta, axis=0, out=grads[2 * k + 1])
        on_ready(2 * k + 1)
        np.matmul(activations[k].T, delta, out=grads[2 * k])
        on_ready(2 * k)
        if k:
            delta = (delta @ params[2 * k].T) * (1.0 - activations[k] ** 2)
    return loss


def train_single(steps: int, sizes: list[int], n_samples: int, lr: float = 0.05) -> list:
    """Full-batch gradient descent in one process: the reference."""
    x, y = make_data(n_samples, sizes)
    params = init_params(sizes)
    grads = [np.zeros_like(p) for p in params]
    for _ in range(steps):
        loss_and_grads(params, x, y, grads)
        for p, g in zip(params, grads):
            p -= lr * g
    return params


def train_rank(steps: int, sizes: list[int], n_samples: int, lr: float = 0.05,
               bucket_cap_mb: float = 25, gradient_as_bucket_view: bool = False):
    """One rank of data-parallel training; returns (params, losses, overlap stats)."""
    rank, world = nc.get_rank(), nc.get_world_size()
    if n_samples % world:
        raise ValueError(f"n_samples ({n_samples}) must divide evenly among {world} ranks")
    x, y = make_data(n_samples, sizes)
    shard = slice(rank * n_samples // world, (rank + 1) * n_samples // world)
    x, y = x[shard], y[shard]
    params = init_params(sizes)
    reducer = nc.Reducer([np.zeros_like(p) for p in params], bucket_cap_mb=bucket_cap_mb,
                         first_bucket_mb=min(1.0, bucket_cap_mb),
                         gradient_as_bucket_view=gradient_as_bucket_view)
    losses, stats = [], []
    for _ in range(steps):
        # reducer.grads may be new arrays after the first step (the buckets are
        # rebuilt), so look them up every step.
        losses.append(loss_and_grads(params, x, y, reducer.grads, reducer.mark_ready))
        reducer.finalize()
        stats.append(reducer.stats)
        for p, g in zip(params, reducer.grads):
            p -= lr * g
    return params, losses, stats


def train_data_parallel(world_size: int, steps: int, sizes: list[int], n_samples: int,
                        lr: float = 0.05, mode: str = "thread", **reducer_options):
    """Run :func:`train_rank` on ``world_size`` ranks; returns every rank's result."""
    return nc.launch(_with_options, world_size,
                     args=(steps, sizes, n_samples, lr, reducer_options), mode=mode)


def _with_options(steps, sizes, n_samples, lr, options):
    return train_rank(steps, sizes, n_samples, lr, **options)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sizes", default="64,256,256,256,16",
                        help="layer widths, input first")
    parser.add_argument("--samples", type=int, default=256, help="global batch size")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.25)
    parser.add_argument("--mode", choices=("thread", "process"), default="thread")
    parser.add_argument("--view", action="store_true", help="gradient_as_bucket_view=True")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    start = time.perf_counter()
    results = train_data_parallel(args.world_size, args.steps, sizes, args.samples,
                                  mode=args.mode, bucket_cap_mb=args.bucket_cap_mb,
                                  gradient_as_bucket_view=args.view)
    elapsed = time.perf_counter() - start
    reference = train_single(args.steps, sizes, args.samples)
    params, losses, stats = results[0]
    worst = max(float(np.max(np.abs(p - q))) for p, q in zip(params, reference))
    same = all(all(np.array_equal(p, q) for p, q in zip(params, r[0])) for r in results)
    nbytes = sum(p.nbytes for p in params)
    later = stats[1:] or stats            # the first step runs before the rebuild
    comm = sum(s["comm_s"] for s in later)
    overlapped = sum(s["overlapped_s"] for s in later)
    backward = sum(s["backward_s"] for s in later)
    print(f"{args.world_size} ranks ({args.mode} mode), {args.steps} steps, MLP {sizes}: "
          f"{len(params)} gradients, {nbytes / 2**20:.2f} MiB, {stats[-1]['buckets']} buckets "
          f"of <= {args.bucket_cap_mb} MiB; {elapsed:.2f} s")
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f}")
    print(f"weights identical on every rank: {same}; largest difference from single-process "
          f"full-batch training: {worst:.2e}")
    print(f"communication overlapped with backward: {overlapped * 1e3:.1f} of "
          f"{comm * 1e3:.1f} ms ({100 * overlapped / comm if comm else 0:.0f}%), backward "
          f"passes took {backward * 1e3:.1f} ms (steps 2-{args.steps}, rank 0)")


if __name__ == "__main__":
    main()
