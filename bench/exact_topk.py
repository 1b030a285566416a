"""Exact top-k over a wide output layer: the fused tiled kernel against the score matrix.

    python -m bench.exact_topk --labels 670091 --hidden 128 --rows 1,128,1024 --threads 1,2

For each batch of rows and thread count, the median seconds (after a warm-up) of

* ``matrix``: the whole score block ``S = H @ W.T + b`` (one BLAS product into a [rows, L]
  array, as evaluation did before), then :func:`slide.metrics.topk` over it;
* ``fused``: :func:`slide.metrics.topk_product`, which goes through the labels in tiles that stay
  in cache and never forms S.

Both give the same ids (checked). The weights are random (speed does not depend on them). Writes
``OUT.json`` and prints rows/s and the ratio.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits

from bench.common import machine, write_json


def _median_seconds(fn, reps):
    fn()  # warm-up: compile, page in
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv=None):
    from lsh import set_num_threads
    from slide.metrics import topk, topk_product
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--labels", type=int, default=670091)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--rows", default="1,128,1024")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    W = rng.standard_normal((args.labels, args.hidden), np.float32)
    b = rng.standard_normal(args.labels, np.float32)
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        set_num_threads(threads)
        with threadpool_limits(limits=threads, user_api="blas"):
            for n in (int(r) for r in args.rows.split(",")):
                H = np.maximum(rng.standard_normal((n, args.hidden), np.float32), 0)

                def matrix():
                    S = H @ W.T
                    S += b
                    return topk(S, args.k)

                def fused():
                    return topk_product(H, W, b, args.k)

                assert np.array_equal(matrix()[0], fused()[0])
                reps = max(2, args.reps if n <= 128 else args.reps // 2)
                t_m, t_f = _median_seconds(matrix, reps), _median_seconds(fused, reps)
                results.append({"threads": threads, "rows": n, "matrix_seconds": t_m,
                                "fused_seconds": t_f, "speedup": t_m / t_f})
                print(f"threads {threads:2d}  rows {n:5d}  matrix {1e3 * t_m:9.2f} ms  "
                      f"fused {1e3 * t_f:9.2f} ms  ({n / t_f:9.0f} rows/s)  x{t_m / t_f:.2f}", flush=True)
    if args.out:
        write_json(args.out, {"machine": machine(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
