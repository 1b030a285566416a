"""Serving under load while the model is retrained: queries from many Python threads while
another thread trains a clone with ``partial_fit`` and swaps it in.

    python -m bench.serving_load --model DIR --data TRAIN --test TEST --seconds 60 --clients 8

``--clients`` threads send single test rows (``predict_topk``, ``--mode``) to whichever model is
current; a trainer thread repeatedly copies it, trains the copy on the next ``--chunk``
training rows and swaps it in (one assignment). Every answer is kept with the model version
that gave it, and a sample of them is checked against a single-threaded query of that version
afterwards. Reports queries/s, p50/p99/max latency, swaps, answers checked and wrong. Writes
``OUT.json``.
"""
from __future__ import annotations

import argparse
import copy
import threading
import time

import numpy as np

from bench.common import machine, write_json


def main(argv=None):
    from slide.data import read_dataset
    from slide.estimator import SlideClassifier
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="training rows for the clone's partial_fit")
    p.add_argument("--test", required=True, help="rows to query")
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--mode", default="exact")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--check", type=int, default=500, help="answers checked afterwards")
    p.add_argument("--out", default="bench/results/serving_load")
    args = p.parse_args(argv)
    model = SlideClassifier.load(args.model)
    X, Y = read_dataset(args.data, n_features=model.n_features_in_, n_labels=model.n_labels_)
    Xq, _ = read_dataset(args.test, n_features=model.n_features_in_, n_labels=model.n_labels_)
    model.predict_topk(Xq[:1], args.k, mode=args.mode)  # compile, build what serving builds
    versions = [model]
    current = {"model": model, "version": 0}
    stop = threading.Event()
    answers = [[] for _ in range(args.clients)]
    times = [[] for _ in range(args.clients)]
    errors = []

    def trainer():
        lo = 0
        try:
            while not stop.is_set():
                clone = copy.deepcopy(current["model"])
                rows = np.arange(lo, lo + args.chunk) % X.shape[0]
                clone.partial_fit(X[rows], Y[rows])
                clone.predict_topk(Xq[:1], args.k, mode=args.mode)  # built before it serves
                versions.append(clone)
                current.update(model=clone, version=len(versions) - 1)
                lo += args.chunk
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    def client(c):
        rng = np.random.default_rng(c)
        try:
            while not stop.is_set():
                held = dict(current)  # the model and its version, as one read
                i = int(rng.integers(0, Xq.shape[0]))
                t0 = time.perf_counter()
                ids = held["model"].predict_topk(Xq[i], args.k, mode=args.mode)[0][0]
                times[c].append(time.perf_counter() - t0)
                answers[c].append((held["version"], i, ids))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    threads.append(threading.Thread(target=trainer))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = np.concatenate([np.array(t) for t in times]) * 1e3
    flat = [a for per in answers for a in per]
    rng = np.random.default_rng(0)
    checked = [flat[j] for j in rng.choice(len(flat), min(args.check, len(flat)), replace=False)]
    wrong = sum(not np.array_equal(ids, versions[v].predict_topk(Xq[i], args.k, mode=args.mode)[0][0])
                for v, i, ids in checked)
    doc = {"machine": machine(), "args": vars(args), "seconds": wall, "queries": int(lat.size),
           "queries_per_s": lat.size / wall, "p50_ms": float(np.percentile(lat, 50)),
           "p99_ms": float(np.percentile(lat, 99)), "max_ms": float(lat.max()),
           "swaps": len(versions) - 1, "checked": len(checked), "wrong": int(wrong),
           "errors": errors}
    print(f"{doc['queries']:,} queries in {wall:.0f} s from {args.clients} threads "
          f"({doc['queries_per_s']:.0f}/s): p50 {doc['p50_ms']:.2f} ms, p99 {doc['p99_ms']:.2f} ms, "
          f"max {doc['max_ms']:.1f} ms; {doc['swaps']} models swapped in; {wrong} wrong of "
          f"{len(checked)} checked; {len(errors)} errors", flush=True)
    write_json(args.out + ".json", doc)


if __name__ == "__main__":
    main()
