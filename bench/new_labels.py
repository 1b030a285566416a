"""Labels that arrive after training: added to a fitted model against a model that had them
from the start.

    python -m bench.new_labels --data ../shared/data/git_openstack/train.txt \\
        --test ../shared/data/git_openstack/test.txt --threads 2

The file's last ``--new-share`` of training rows stand for the newest: the labels with no
positive before them are the new labels. One model is fitted (defaults) on every training row
with the new labels taken out of ``Y`` (``--protocol labels``; ``rows``: on the rows before the
newest only); the rows that carry a new label are then given, with all their labels, to
``partial_fit`` ``--passes`` times (the first gives every new label its row, from the hidden
vectors of its rows, then trains; with ``--replay R``, beside R times as many other rows drawn at
random). A second model is fitted on
every row from the start. Reported on the test rows: the new labels' P@5 on the rows that hold
one (hits on new labels only), every row's P@1 on the old labels, each model's P@1 and P@5, and
the seconds each step took. Writes ``OUT.json``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.sparse as sp

from bench.common import machine, write_json


def _restricted_precision(Y, top, labels, k, rows):
    """P@k over ``rows`` of ``top`` [n, >=k] against ``Y`` with only ``labels`` counted."""
    keep = np.zeros(Y.shape[1], bool)
    keep[labels] = True
    hits = 0
    for i in rows:
        truth = Y.indices[Y.indptr[i]:Y.indptr[i + 1]]
        truth = set(truth[keep[truth]].tolist())
        hits += sum(1 for j in top[i, :k] if j in truth)
    return hits / max(1, k * len(rows))


def _scores(model, Xte, Yte, new, old):
    top = model.predict_topk(Xte, 5)[0]
    holds_new = np.flatnonzero(np.asarray(Yte[:, new].sum(axis=1)).ravel() > 0)
    holds_old = np.flatnonzero(np.asarray(Yte[:, old].sum(axis=1)).ravel() > 0)
    res = model.evaluate(Xte, Yte)
    return {"new_P@5": _restricted_precision(Yte, top, new, 5, holds_new),
            "new_P@1": _restricted_precision(Yte, top, new, 1, holds_new),
            "old_P@1": _restricted_precision(Yte, top, old, 1, holds_old),
            "P@1": res["P@1"], "P@5": res["P@5"], "test_rows_with_new": int(holds_new.size)}


def main(argv=None):
    from slide.data import read_dataset
    from slide.estimator import SlideClassifier
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--new-share", type=float, default=0.1)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--replay", type=float, default=0.0)
    p.add_argument("--protocol", choices=["labels", "rows"], default="labels")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/new_labels")
    args = p.parse_args(argv)
    X, Y = read_dataset(args.data)
    Xte, Yte = read_dataset(args.test, n_features=X.shape[1], n_labels=Y.shape[1])
    cut = int(round(X.shape[0] * (1 - args.new_share)))
    before = np.bincount(Y[:cut].indices, minlength=Y.shape[1]) > 0
    after = np.bincount(Y[cut:].indices, minlength=Y.shape[1]) > 0
    new, old = np.flatnonzero(after & ~before), np.flatnonzero(before)
    carry = cut + np.flatnonzero(np.asarray(Y[cut:][:, new].sum(axis=1)).ravel() > 0)
    print(f"{cut} earlier rows, {X.shape[0] - cut} newest; {new.size} new labels on "
          f"{carry.size} rows", flush=True)
    doc = {"machine": machine(), "args": vars(args), "earlier_rows": cut, "new_labels": int(new.size),
           "rows_with_new": int(carry.size)}
    t0 = time.perf_counter()
    if args.protocol == "labels":  # every row, the new labels left out
        without = Y.tolil()[:, :]
        without[:, new] = 0
        model = SlideClassifier(threads=args.threads, seed=0).fit(X, sp.csr_matrix(without))
    else:
        model = SlideClassifier(threads=args.threads, seed=0).fit(X[:cut], Y[:cut])
    doc["fit_seconds"] = time.perf_counter() - t0
    doc["before"] = _scores(model, Xte, Yte, new, old)
    print("fitted without the new labels:", doc["before"], flush=True)
    rng = np.random.default_rng(0)
    doc["passes"] = []
    for k in range(args.passes):
        rows = carry
        if args.replay:
            rows = np.concatenate((carry, rng.choice(cut, int(args.replay * carry.size),
                                                     replace=False)))
        rows = rng.permutation(rows)
        t0 = time.perf_counter()
        model.partial_fit(X[rows], sp.csr_matrix(Y[rows]))
        entry = {"pass": k + 1, "seconds": time.perf_counter() - t0,
                 **_scores(model, Xte, Yte, new, old)}
        doc["passes"].append(entry)
        print(entry, flush=True)
    t0 = time.perf_counter()
    full = SlideClassifier(threads=args.threads, seed=0).fit(X, Y)
    doc["every_label_fit_seconds"] = time.perf_counter() - t0
    doc["every_label"] = _scores(full, Xte, Yte, new, old)
    print("fitted on every row:", doc["every_label"], flush=True)
    write_json(args.out + ".json", doc)


if __name__ == "__main__":
    main()
