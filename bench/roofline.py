"""A memory roofline for the engine's training step: how fast could it go, and how far is it.

    python -m bench.roofline --preset amazon-670k --n-train 20000 --threads 2

1. **This machine's memory bandwidth**: a STREAM-like triad ``a = b + s·c`` over float32 arrays
   of ``--stream-mb`` each (far larger than any cache), numba-parallel, on 1 thread and on
   ``--threads``; best of 5 (STREAM's convention: 3 arrays' bytes per pass).
2. **The bytes one training sample must move**, from the engine's resolved settings and the
   data's shape (per batch, divided by the batch size), counting each distinct row once (the
   least any implementation of this step moves), by phase:

   * ``forward_hidden``: the input rows of the sample's non-zero features (``nnz · H0 · 4``);
   * ``select+output``: the hash-table buckets it reads (``tables · bucket · 4``) and its own
     output rows (labels + LSH candidates): weights read, gradient rows read and written;
   * ``pool_matmul``: the batch's shared rows, read (gathered) and their gradient rows
     written, over the batch;
   * ``backward_hidden``: the gradient rows of the input features, read and written;
   * ``adam``: weights, both moments and the gradient of every distinct touched row, read and
     written (output and input rows);
   * ``rehash``: re-inserting every output row (weights read, tables written), spread over the
     samples between rehashes.

   Distinct rows per batch are estimated as draws without overlap structure:
   ``n · (1 - exp(-draws / n))`` for n rows and the batch's draws.
3. **The engine's measured time per phase** (its own ``timings_``, steady state after a warm-up
   epoch slice, ``--steps`` batches), and the fraction of the roofline it reaches: per phase
   ``(bytes / bandwidth) / measured seconds``, and overall ``measured samples/s / limit``.

Writes ``OUT.json`` with ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
from numba import njit, prange

from bench.common import dataset, machine, write_json


@njit(cache=True, nogil=True, parallel=True)
def _triad(a, b, c, s):
    for i in prange(a.size):
        a[i] = b[i] + s * c[i]


def stream_bandwidth(mb: int, threads: int, reps: int = 5) -> float:
    """Bytes per second of the triad on ``threads`` numba threads (best of ``reps``)."""
    from lsh import set_num_threads
    set_num_threads(threads)
    n = mb * (1 << 20) // 4
    a, b, c = np.zeros(n, np.float32), np.ones(n, np.float32), np.full(n, 2.0, np.float32)
    _triad(a, b, c, np.float32(3.0))  # compile, page in
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        _triad(a, b, c, np.float32(3.0))
        best = min(best, time.perf_counter() - t0)
    return 3 * n * 4 / best


def _distinct(n: int, draws: float) -> float:
    return n * (1.0 - math.exp(-draws / max(n, 1)))


def bytes_per_sample(resolved: dict, n_features: int, n_labels: int, nnz: float,
                     labels: float) -> dict:
    """The least bytes per training sample, by phase (see the module docstring)."""
    B = resolved["batch_size"]
    H0, H = resolved["hidden"][0], resolved["hidden"][-1]
    own = resolved["lsh_cap"] + labels  # a sample's own output rows
    pool = resolved["pool"]
    t = resolved.get("tables") or {}
    n_tables, bucket = t.get("L", 0), t.get("bucket_size", 0)
    u_own = _distinct(n_labels, B * own)  # distinct own rows of a batch
    u_out = _distinct(n_labels, B * own + pool)
    u_in = _distinct(n_features, B * nnz)
    per = {
        "forward_hidden": nnz * H0 * 4,
        "select+output": n_tables * bucket * 4 + (u_own * H * 4 + u_own * H * 8) / B,
        "pool_matmul": pool * (H * 4 + H * 8) / B,
        "backward_hidden": u_in * H0 * 8 / B,
        "adam": (u_out * (H + 1) + u_in * H0) * 8 * 4 / B,
        "rehash": (n_labels * H * 4 + n_tables * n_labels * 4) / resolved["rehash_every"],
    }
    per["total"] = sum(per.values())
    return per


def main(argv=None):
    from slide.network import SlideClassifier
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="amazon-670k")
    p.add_argument("--n-train", type=int, default=20000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="timed batches")
    p.add_argument("--stream-mb", type=int, default=512)
    p.add_argument("--config", default="{}", help="JSON overrides of the engine's settings")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    bw1 = stream_bandwidth(args.stream_mb, 1)
    bw = stream_bandwidth(args.stream_mb, args.threads)
    print(f"triad bandwidth: {bw1 / 1e9:.1f} GB/s on 1 thread, {bw / 1e9:.1f} GB/s on {args.threads}")

    X, Y, _, _ = dataset(args.preset, args.n_train, 10)
    model = SlideClassifier(threads=args.threads, early_stopping=False, seed=0,
                            **json.loads(args.config))
    model.initialize(X, Y)
    B = model.batch_size_
    order = np.random.default_rng(0).permutation(X.shape[0])
    Xp = model.preprocess(X)
    warm = order[:8 * B]
    model.train_rows(Xp, Y, warm)  # compile, first rehash
    model.timings_ = {}
    timed = order[8 * B:(8 + args.steps) * B]
    t0 = time.perf_counter()
    model.train_rows(Xp, Y, timed)
    seconds = time.perf_counter() - t0
    rate = timed.size / seconds
    need = bytes_per_sample(model.resolved_, X.shape[1], Y.shape[1], X.nnz / X.shape[0],
                            Y.nnz / Y.shape[0])
    limit = bw / need["total"]
    print(f"{args.preset}, {args.n_train} rows, batch {B}, hidden {model.resolved_['hidden']}, "
          f"active {model.resolved_['active_target']} ({model.resolved_['lsh_cap']} LSH + "
          f"{model.resolved_['pool']} shared), {args.threads} threads")
    print(f"{'phase':16s} {'KB/sample':>10s} {'us/sample':>10s} {'GB/s':>7s} {'of roofline':>12s}")
    phases = []
    for name, b in need.items():
        if name == "total":
            continue
        sec = model.timings_.get(name, 0.0) / timed.size
        phases.append({"phase": name, "bytes_per_sample": b, "seconds_per_sample": sec,
                       "bytes_per_second": b / sec if sec else None,
                       "fraction_of_roofline": (b / bw) / sec if sec else None})
        print(f"{name:16s} {b / 1e3:10.1f} {1e6 * sec:10.1f} {b / sec / 1e9 if sec else 0:7.2f} "
              f"{(b / bw) / sec if sec else 0:12.1%}")
    other = seconds - sum(model.timings_.values())
    print(f"{'(outside phases)':16s} {'':10s} {1e6 * other / timed.size:10.1f}")
    print(f"total: {need['total'] / 1e3:.1f} KB/sample; roofline {limit:.0f} samples/s at "
          f"{bw / 1e9:.1f} GB/s; measured {rate:.0f} samples/s = {rate / limit:.1%} of it")
    if args.out:
        write_json(args.out, {"machine": machine(), "args": vars(args),
                              "bandwidth": {"1": bw1, str(args.threads): bw},
                              "resolved": model.resolved_, "bytes_per_sample": need,
                              "phases": phases, "measured_samples_per_second": rate,
                              "roofline_samples_per_second": limit,
                              "fraction": rate / limit})


if __name__ == "__main__":
    main()
