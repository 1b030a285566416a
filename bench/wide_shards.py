"""A label space too wide for one process's memory limit, trained on label shards under it.

    python -m bench.wide_shards --labels 10000000 --n-train 2000000 --limit 7.5G \
        --out bench/results/wide_shards

Generates a synthetic set with Amazon-670K's features and labels a row (``--features-per-row``
non-zeros) over ``--labels`` labels (the generator's power law of popularity: the output rows
are the labels with a training positive),
saves it once, then:

1. one process with ``SLIDE_MEMORY_LIMIT=--limit`` tries to fit the engine with its defaults
   (early stopping off, ``--epochs``): the memory check refuses it before allocating anything,
   and its message names the shards that would fit (recorded);
2. ``mpiexec -n --ranks`` with :class:`slide.shards.LabelShards` under the same per-rank limit
   trains it, each rank on one thread, and scores P@1 and P@5 on ``--n-test`` rows, beside the
   popularity baseline (every row's top-k the k most frequent training labels). Each rank
   records its peak resident memory and its output layer's bytes.

Writes ``OUT.json`` and ``OUT.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import scipy.sparse as sp

from bench.common import machine, mpiexec, write_json


def _paths(work):
    return {k: os.path.join(work, f"{k}.npz") for k in ("X", "Y", "Xte", "Yte")}


def _generate(args):
    from slide.synthetic import PRESETS, DatasetShape, make_dataset
    base = PRESETS["amazon-670k"]
    shape = DatasetShape("wide", base.n_features, args.labels, args.n_train, args.n_test,
                         args.features_per_row, base.labels_per_sample)
    t0 = time.perf_counter()
    data = make_dataset(shape, seed=0)
    os.makedirs(args.work, exist_ok=True)
    for (k, path), M in zip(_paths(args.work).items(), data):
        sp.save_npz(path, M, compressed=False)
    return time.perf_counter() - t0


def _load(work):
    return [sp.load_npz(p).tocsr().astype(np.float32) for p in _paths(work).values()]


def _settings(args):
    return dict(threads=1, seed=0, epochs=args.epochs, early_stopping=False, refit=False)


def _one_process(args) -> dict:
    """The single process under the limit: refused up front (the check's message), or trained
    where it fits."""
    from slide.estimator import SlideClassifier
    from slide.resources import ModelTooLargeError
    X, Y, _, _ = _load(args.work)
    try:
        SlideClassifier(**_settings(args)).initialize(X, Y)
    except ModelTooLargeError as e:
        return {"refused": True, "message": str(e)}
    return {"refused": False}


def _worker(args):
    import resource

    from slide.estimator import SlideClassifier
    from slide.shards import LabelShards
    dp = LabelShards()
    X, Y, Xte, Yte = _load(args.work)
    t0 = time.perf_counter()
    model = SlideClassifier(**_settings(args)).fit(X, Y, distributed=dp)
    fit = time.perf_counter() - t0
    ev = model.evaluate(Xte, Yte, k=5)
    s = model.state_
    out_bytes = s.row_blocks()["W"].nbytes + 3 * s.params["b"].nbytes + \
        (s.tables.nbytes if s.tables is not None else 0)
    mine = {"rank": dp.rank, "rows": int(model.n_outputs_), "output_layer_bytes": int(out_bytes),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    everyone = dp.comm.gather(mine)
    if dp.rank == 0:
        # the popularity baseline: every row's top-k the k most frequent training labels
        counts = np.bincount(Y.indices, minlength=Y.shape[1])
        top = np.argsort(-counts, kind="stable")[:5]
        from slide.metrics import evaluate as evaluate_topk
        base = evaluate_topk(Yte, np.tile(top, (Yte.shape[0], 1)), 5)
        write_json(args.result, {
            "ranks": dp.size, "per_rank": everyone, "n_outputs": int(model.n_outputs_fitted_),
            "n_labels": int(model.n_labels_), "hidden": model.resolved_["hidden"],
            "batch": model.batch_size_, "epochs": model.epoch_, "fit_seconds": fit,
            "samples_per_second": model.history_[-1]["samples_per_second"],
            "test_P@1": ev["P@1"], "test_P@5": ev["P@5"],
            "popularity_P@1": base["P@1"], "popularity_P@5": base["P@5"]})


def _table(doc) -> str:
    r = doc["sharded"]
    lines = [f"{doc['n_train']:,} training rows over {r['n_labels']:,} labels "
             f"({r['n_outputs']:,} with a training positive: the output rows), hidden "
             f"{r['hidden']}, {r['epochs']} epoch(s), per-process limit {doc['limit']}.", "",
             f"One process: {doc['one_process'].get('message', 'fits')}", "",
             "| rank | output rows | output layer (GiB) | peak RSS (GiB) |", "|---|---|---|---|"]
    for p in r["per_rank"]:
        lines.append(f"| {p['rank']} | {p['rows']:,} | {p['output_layer_bytes'] / 2**30:.2f} | "
                     f"{p['peak_rss_bytes'] / 2**30:.2f} |")
    lines += ["", f"Test P@1 {r['test_P@1']:.4f}, P@5 {r['test_P@5']:.4f}; popularity baseline "
                  f"P@1 {r['popularity_P@1']:.4f}, P@5 {r['popularity_P@5']:.4f}; "
                  f"{r['samples_per_second']:.0f} samples/s, fit {r['fit_seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--labels", type=int, default=10_000_000)
    p.add_argument("--n-train", type=int, default=2_000_000)
    p.add_argument("--n-test", type=int, default=5_000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--features-per-row", type=float, default=40.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--limit", default="7.5G", help="memory limit of each process (SLIDE_MEMORY_LIMIT)")
    p.add_argument("--work", default="/tmp/wide_shards", help="where the generated set is kept")
    p.add_argument("--out", default="bench/results/wide_shards")
    p.add_argument("--check-only", action="store_true",
                   help="run the one-process check again and update OUT.json's record of it")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    from slide.resources import MEMORY_LIMIT_ENV
    if args.check_only:
        with open(args.out + ".json") as fh:
            doc = json.load(fh)
        os.environ[MEMORY_LIMIT_ENV] = doc["limit"]
        doc["one_process"] = _one_process(args)
        write_json(args.out + ".json", doc)
        with open(args.out + ".md", "w") as fh:
            fh.write(_table(doc))
        return print(doc["one_process"])
    doc = {"machine": machine(), "args": vars(args), "limit": args.limit, "n_train": args.n_train}
    if not os.path.exists(_paths(args.work)["Yte"]):
        doc["generate_seconds"] = _generate(args)
    os.environ[MEMORY_LIMIT_ENV] = args.limit
    doc["one_process"] = _one_process(args)
    print("one process:", doc["one_process"], flush=True)
    result = args.out + ".tmp.json"
    cmd = [sys.executable, "-m", "bench.wide_shards", "--worker", f"--result={result}",
           f"--work={args.work}", f"--epochs={args.epochs}"]
    cmd = mpiexec(args.ranks) + cmd
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(result) as fh:
        doc["sharded"] = json.load(fh)
    os.remove(result)
    write_json(args.out + ".json", doc)
    with open(args.out + ".md", "w") as fh:
        fh.write(_table(doc))
    print(_table(doc))


if __name__ == "__main__":
    main()
