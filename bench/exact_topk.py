"""Exact top-k over a wide output layer: the int8-screened and the fused float32 kernels
against the score matrix.

    python -m bench.exact_topk --labels 670091 --hidden 128 --rows 1,128,1024 --threads 1,2
    python -m bench.exact_topk --model MODEL_DIR --data TEST.txt --rows 1,128,1024 --threads 1,2

For each batch of rows and thread count, the median seconds (after a warm-up) of

* ``matrix``: the whole score block ``S = H @ W.T + b`` (one BLAS product into a [rows, L]
  array, as evaluation did before), then :func:`slide.metrics.topk` over it;
* ``fused``: :func:`slide.metrics.topk_product`, which goes through the labels in tiles that stay
  in cache and never forms S;
* ``screened``: :func:`slide.screen.screened_topk` (what exact ``predict_topk`` runs at 32K+
  labels on CPUs with AVX-512 VNNI): int8 scores with an error bound, float32 for the few
  labels the bound cannot rule out. Building its int8 copy of W (once per model) is timed apart.

All give the same ids (checked). With ``--model`` (a saved :class:`slide.SlideClassifier`) and
``--data`` (rows in the repository text format) the weights and the rows' last hidden layer are
the model's; otherwise both are random, whose scores spread more than a trained model's and so
leave the screen fewer candidates (``--activation identity``: signed hidden rows, which the
screen quantises with a zero point). Writes ``OUT.json`` and prints rows/s and the ratios.
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
    from slide.runtime import set_num_threads
    from slide.config import ACTIVATIONS
    from slide.metrics import topk, topk_product
    from slide.screen import has_int8_dot, quantize_rows, screened_topk
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--labels", type=int, default=670091)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--rows", default="1,128,1024")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--model", default=None, help="a saved SlideClassifier (its W, b, hidden layer)")
    p.add_argument("--data", default=None, help="with --model: rows whose hidden layer is scored")
    p.add_argument("--activation", choices=ACTIVATIONS, default="relu",
                   help="without --model: random hidden rows of a ReLU layer (>= 0) or of an "
                        "identity layer (signed)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.model:
        from slide import SlideClassifier
        from slide.data import read_dataset
        model = SlideClassifier.load(args.model)
        W, b = model.params_["W"], model.params_["b"]
        X, _ = read_dataset(args.data, n_features=model.n_features_in_, n_labels=model.n_labels_)
        hidden = model.embed(X[:max(int(r) for r in args.rows.split(","))])
        args.labels, args.hidden = W.shape
    else:
        W = rng.standard_normal((args.labels, args.hidden), np.float32)
        b = rng.standard_normal(args.labels, np.float32)
    screen = None
    if has_int8_dot():
        quantize_rows(W[:64], b[:64])  # compile
        t0 = time.perf_counter()
        screen = quantize_rows(W, b)
        print(f"int8 copy of W: {time.perf_counter() - t0:.3f} s, {screen.nbytes / 2 ** 20:.0f} MiB")
    else:
        print("this CPU has no AVX-512 VNNI: the screened kernel is not timed")
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        set_num_threads(threads)
        with threadpool_limits(limits=threads, user_api="blas"):
            for n in (int(r) for r in args.rows.split(",")):
                H = hidden[:n] if args.model else rng.standard_normal((n, args.hidden), np.float32)
                if not args.model and args.activation == "relu":
                    H = np.maximum(H, 0)

                def matrix():
                    S = H @ W.T
                    S += b
                    return topk(S, args.k)

                def fused():
                    return topk_product(H, W, b, args.k)

                def screened():
                    return screened_topk(H, W, b, args.k, screen)

                assert np.array_equal(matrix()[0], fused()[0])
                reps = max(2, args.reps if n <= 128 else args.reps // 2)
                t_m, t_f = _median_seconds(matrix, reps), _median_seconds(fused, reps)
                row = {"threads": threads, "rows": n, "matrix_seconds": t_m, "fused_seconds": t_f,
                       "speedup": t_m / t_f}
                line = (f"threads {threads:2d}  rows {n:5d}  matrix {1e3 * t_m:9.2f} ms  "
                        f"fused {1e3 * t_f:9.2f} ms  x{t_m / t_f:.2f}")
                if screen is not None:
                    assert np.array_equal(matrix()[0], screened()[0])
                    t_s = _median_seconds(screened, reps)
                    row.update(screened_seconds=t_s, screened_speedup=t_m / t_s)
                    line += f"  screened {1e3 * t_s:9.2f} ms ({n / t_s:7.0f} rows/s) x{t_m / t_s:.2f}"
                results.append(row)
                print(line, flush=True)
    if args.out:
        write_json(args.out, {"machine": machine(), "args": vars(args), "results": results,
                              "int8_copy": None if screen is None else
                              {"bytes": screen.nbytes}})


if __name__ == "__main__":
    main()
