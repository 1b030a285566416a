"""Training and inference throughput of the engine against its thread count.

    python -m bench.thread_scaling --threads 1,2 --out bench/results/thread_scaling.json
    python -m bench.thread_scaling --threads 1,4,8,16 --layers omp,tbb   # a 16-core machine

For each threading layer (its own process, since numba fixes the layer at the first parallel
call) and thread count: the median samples/s of windows of ``--window`` training batches
(the engine's own epoch loop over a seeded order, after a warm-up call that compiles; the first
window, which holds the epoch's opening rehash, is left out), and the exact top-5 of 512 rows
(median of 3 calls after a warm-up call). Prints the machine's affinity and OpenMP settings
too, since thread placement decides these figures.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from bench.common import dataset, machine, run_isolated, write_json


class _Clock:
    """A progress sink that times windows of ``window`` samples of the engine's own loop."""

    def __init__(self, window):
        self.window, self.count, self.rates = window, 0, []
        self.t0 = time.perf_counter()

    def update(self, n):
        self.count += n
        if self.count >= self.window:
            now = time.perf_counter()
            self.rates.append(self.count / (now - self.t0))
            self.count, self.t0 = 0, now

    def set_postfix(self, *args, **kwargs):
        pass


def _run(layer, args, queue):
    try:
        _measure(layer, args, queue)
    except Exception as e:  # e.g. a layer numba cannot load here: report it, go on to the next
        queue.put({"layer": layer, "error": f"{type(e).__name__}: {e}"})


def _measure(layer, args, queue):
    if layer != "default":
        os.environ["NUMBA_THREADING_LAYER"] = layer
    import numba

    from slide.estimator import SlideClassifier
    Xtr, Ytr, Xte, Yte = dataset(args.preset, args.n_train, 512, 0)
    out = {"layer": layer, "rows": []}
    for threads in args.threads:
        if threads > numba.config.NUMBA_NUM_THREADS:
            continue
        model = SlideClassifier(hidden=(128,), sparsity=args.sparsity, batch_size=128,
                                threads=threads, seed=0)
        model.partial_fit(Xtr[:1024], Ytr[:1024])  # initialise, compile, fill the tables
        Xp, Yr = model.preprocess(Xtr), model.targets(Xtr, Ytr)
        clock = _Clock(128 * args.window)
        model.train_epoch(Xp, Yr, np.random.default_rng(0).permutation(Xtr.shape[0]), progress=clock)
        rates = clock.rates[1:]  # the first window holds the epoch's opening rehash
        model.predict_topk(Xte, 5)  # compile (or load the cached kernels)
        seconds = []
        for _ in range(3):
            t0 = time.perf_counter()
            model.predict_topk(Xte, 5)
            seconds.append(time.perf_counter() - t0)
        infer = 512 / float(np.median(seconds))
        out["rows"].append({"threads": threads, "train_samples_per_second": float(np.median(rates)),
                            "windows": len(rates), "predict_rows_per_second": infer})
        out["threading_layer"] = numba.threading_layer()
        print(f"[{layer}] {threads:2d} threads: train {np.median(rates):8.0f} samples/s "
              f"(median of {len(rates)}), exact top-5 {infer:6.0f} rows/s", flush=True)
    queue.put(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="amazon-670k")
    p.add_argument("--n-train", type=int, default=20_000)
    p.add_argument("--sparsity", type=float, default=0.005)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--layers", default="default", help="comma-separated: default, omp, tbb")
    p.add_argument("--window", type=int, default=10, help="batches per timed window")
    p.add_argument("--out", default="bench/results/thread_scaling.json")
    args = p.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",")]
    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "GOMP", "NUMBA_", "MKL_", "OPENBLAS"))}
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    print(f"cpus {os.cpu_count()}, affinity {affinity}, env {env}")
    doc = {"machine": machine(), "args": vars(args), "affinity": affinity, "env": env,
           "runs": [run_isolated(_run, layer, args) for layer in args.layers.split(",")]}
    for run in doc["runs"]:
        if "error" in run:
            print(f"[{run['layer']}] not measured: {run['error']}")
    write_json(args.out, doc)


if __name__ == "__main__":
    main()
