"""Recommend the files a change will touch, from its commit message: a recommender pipeline on
``../shared/data/git_openstack`` (commit message → files touched, 21,316 files).

    python examples/recommend_files.py                     # the whole set, 2 threads
    python examples/recommend_files.py --train-rows 20000  # a quicker cut

1. Train on the older commits (all training rows but the newest ``--new-share``; the file's
   order stands in for time). Files first touched by the newest commits have no row yet.
2. The newest commits arrive: ``partial_fit`` on them gives each new file its row (started from
   the hidden vectors of the commits that touch it) and trains.
3. Serve the top-10 files of the test commits through a sub-linear index (``mode="ann"``: the
   files of the k-means clusters of file vectors that score best), printing its recall against
   the exact top-10 and its latency beside the exact mode's, and one commit's recommendations
   by name.
4. Export the file and commit vectors for other tools (``slide export --embeddings``).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from slide import SlideClassifier
from slide.data import read_dataset, shuffle_rows
from slide.export import export_embeddings
from slide.metrics import recall_against

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "shared", "data", "git_openstack")


def _latency_ms(predict, X, reps=200):
    """Median milliseconds of single-row queries."""
    times = []
    for i in range(min(reps, X.shape[0])):
        t0 = time.perf_counter()
        predict(X[i])
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", default=os.path.join(DATA, "train.txt"))
    p.add_argument("--test", default=os.path.join(DATA, "test.txt"))
    p.add_argument("--names", default=os.path.join(DATA, "labels.txt"),
                   help="one label name a line (optional)")
    p.add_argument("--train-rows", type=int, default=None, help="use the first N training rows")
    p.add_argument("--test-rows", type=int, default=2000)
    p.add_argument("--new-share", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--export", default=None, metavar="DIR", help="write the vectors here")
    args = p.parse_args(argv)

    X, Y = read_dataset(args.train)
    if args.train_rows:
        X, Y = X[:args.train_rows], Y[:args.train_rows]
    Xte, Yte = read_dataset(args.test, n_features=X.shape[1], n_labels=Y.shape[1])
    Xte, Yte = shuffle_rows(Xte, Yte, seed=0, n=min(args.test_rows, Xte.shape[0]))
    cut = int(round(X.shape[0] * (1 - args.new_share)))

    model = SlideClassifier(threads=args.threads, seed=0, epochs=args.epochs)
    t0 = time.perf_counter()
    model.fit(X[:cut], Y[:cut])
    print(f"1. trained on {cut:,} older commits in {time.perf_counter() - t0:.0f} s: "
          f"{model.n_outputs_:,} of {model.n_labels_:,} files have a row; "
          f"test P@1 {model.evaluate(Xte, Yte)['P@1']:.3f}")

    known = model.n_outputs_
    t0 = time.perf_counter()
    model.partial_fit(X[cut:], Y[cut:])
    print(f"2. {X.shape[0] - cut:,} newest commits: {model.n_outputs_ - known:,} new files got a "
          f"row; {time.perf_counter() - t0:.1f} s; test P@1 {model.evaluate(Xte, Yte)['P@1']:.3f}")

    mode = "ann"
    exact = model.predict_topk(Xte, 10)[0]
    t0 = time.perf_counter()
    found = model.predict_topk(Xte, 10, mode=mode)[0]  # builds the index
    built = time.perf_counter() - t0
    recall = recall_against(found, exact)
    fast = _latency_ms(lambda x: model.predict_topk(x, 10, mode=mode), Xte)
    slow = _latency_ms(lambda x: model.predict_topk(x, 10), Xte)
    print(f"3. top-10 through mode={mode!r} (index built in {built:.1f} s): recall@10 against "
          f"exact {recall:.3f}; a single commit in {fast:.2f} ms, exact {slow:.2f} ms")
    names = None
    if args.names and os.path.exists(args.names):
        with open(args.names) as fh:
            names = [line.rstrip("\n") for line in fh]
    row = int(np.argmax(np.diff(Yte.indptr) > 0))
    truth = set(Yte.indices[Yte.indptr[row]:Yte.indptr[row + 1]].tolist())
    shown = [(names[i] if names and i < len(names) else f"label {i}") + (" *" if i in truth else "")
             for i in found[row][:5] if i >= 0]
    print("   test commit", row, "-> " + "; ".join(shown), "(* touched)")

    if args.export:
        record = export_embeddings(model, args.export, Xte)
        print(f"4. wrote {', '.join(record['files'].values())} to {args.export}")
    return {"recall@10": float(recall), "mode": mode, "new_rows": model.n_outputs_ - known}


if __name__ == "__main__":
    main()
