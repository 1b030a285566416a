"""Throughput, accuracy and memory of the sparse engine against the dense reference, side by side.

    python -m bench.engine_vs_dense --preset amazon-670k --n-train 100000 --epochs 1 \
        --threads 2 --out bench/results/engine_vs_dense.json

Both train the same architecture on the same data for the same number of epochs; throughput is
the median of per-window samples/s over the epoch (windows of 20 batches), accuracy is P@1/3/5 of
the exact top-k on a fixed test sample. Engine variants are given as JSON overrides with
``--engine-configs``. Each engine runs in its own process so peak RSS is its own.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.common import dataset, machine, run_isolated, write_json


def _run(kind, overrides, args, queue):
    from slide.resources import peak_rss_mb
    Xtr, Ytr, Xte, Yte = dataset(args.preset, args.n_train, args.n_test, args.seed)
    base_rss = peak_rss_mb()
    if kind == "slide":
        from slide.estimator import SlideClassifier
        model = SlideClassifier(hidden=(args.hidden,), sparsity=args.sparsity, batch_size=args.batch_size,
                                threads=args.threads, seed=args.seed, **overrides)
        model.partial_fit(Xtr[:2 * args.batch_size], Ytr[:2 * args.batch_size])  # compile
        model = SlideClassifier(hidden=(args.hidden,), sparsity=args.sparsity, batch_size=args.batch_size,
                                threads=args.threads, seed=args.seed, **overrides)
    else:
        from gpu_ref import DenseClassifier
        model = DenseClassifier(hidden=(args.hidden,), batch_size=args.batch_size, seed=args.seed,
                                device="gpu" if kind == "dense-gpu" else "cpu")
    # per-window throughput: time partial_fit over windows of 20 batches of a seeded order
    window = 20 * args.batch_size
    rates = []
    t_all = time.perf_counter()
    for epoch in range(args.epochs):
        order = np.random.default_rng([args.seed, epoch]).permutation(Xtr.shape[0])
        for lo in range(0, Xtr.shape[0], window):
            idx = np.sort(order[lo:lo + window])
            t0 = time.perf_counter()
            model.partial_fit(Xtr[idx], Ytr[idx])
            if hasattr(model, "synchronize"):
                model.synchronize()
            rates.append(idx.size / (time.perf_counter() - t0))
            if args.max_seconds and time.perf_counter() - t_all > args.max_seconds:
                break
    train_seconds = time.perf_counter() - t_all
    t0 = time.perf_counter()
    res = model.evaluate(Xte, Yte, k=5)
    out = {"engine": kind, "overrides": overrides, "samples_per_second_median": float(np.median(rates)),
           "samples_per_second_windows": len(rates), "train_seconds": train_seconds,
           "samples_trained": int(min(len(rates) * window, args.epochs * Xtr.shape[0])),
           "eval_seconds": time.perf_counter() - t0, **res, "peak_rss_mb": peak_rss_mb(),
           "data_rss_mb": base_rss}
    if kind == "slide":
        out["timings"] = model.timings_
        out["resolved"] = model.resolved_
    queue.put(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="amazon-670k")
    p.add_argument("--n-train", type=int, default=100_000)
    p.add_argument("--n-test", type=int, default=5_000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--sparsity", type=float, default=0.005)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", default="slide,dense-cpu", help="slide, dense-cpu, dense-gpu")
    p.add_argument("--engine-configs", default="{}", help="JSON list of override dicts for slide")
    p.add_argument("--max-seconds", type=float, default=None, help="cap each engine's training time")
    p.add_argument("--out", default="bench/results/engine_vs_dense.json")
    args = p.parse_args(argv)
    configs = json.loads(args.engine_configs)
    configs = configs if isinstance(configs, list) else [configs]
    results = []
    for kind in args.engines.split(","):
        for overrides in (configs if kind == "slide" else [{}]):
            res = run_isolated(_run, kind, overrides, args)
            print(json.dumps({k: v for k, v in res.items() if k not in ("timings", "resolved")}), flush=True)
            results.append(res)
            write_json(args.out, {"machine": machine(), "args": vars(args), "results": results})
    dense = [r for r in results if r["engine"] == "dense-cpu"]
    if dense:
        for r in results:
            if r["engine"] == "slide":
                print(f"slide {r['overrides']}: {r['samples_per_second_median'] / dense[0]['samples_per_second_median']:.1f}x "
                      f"dense-cpu throughput, P@1 {r['P@1']:.4f} vs {dense[0]['P@1']:.4f}")


if __name__ == "__main__":
    main()
