"""How much of a sample's exact top scores its hard negatives hold: the LSH tables against the
label clusters.

    python -m bench.negatives_recall --sets git_openstack --epochs 6 \\
        --out bench/results/negatives_recall_git

The engine trains with its defaults but the LSH tables (``negatives_from="lsh"``) for
``--epochs`` epochs, without early stopping. After each epoch, for ``--rows`` training rows,
each row's exact top ``--k`` output rows by ``h · w + b`` (the labels aside) are compared with
what each source offers it:
``lsh union``, every id of the row's buckets in the training tables (as last rehashed);
``lsh``, the ``lsh_cap`` of them the step keeps (ranked by the tables that found them); and
``clusters``, the answer of the output layer's label clusters as ``negatives_from="clusters"``
builds them (:mod:`slide.candidates`) from the same weights, ``cluster_negatives`` a row.
Writes ``OUT.json`` and ``OUT.md``.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from bench.common import machine, run_isolated, write_json
from bench.quality import load_set


def _recalls(model, X, Y, rows, k):
    """The three sources' recall of the exact top ``k`` (labels aside) for ``rows``."""
    from slide.candidates import ClusterCandidates
    from slide.config import CLUSTER_NEGATIVES
    from slide.metrics import recall_against, topk_product
    from slide.runtime import engine_threads
    state, r = model.state_, model.resolved_
    Xp, T = model.preprocess(X[rows]), model.targets(X[rows], Y[rows])
    with engine_threads(model.threads):
        h = np.ascontiguousarray(state.last(state.forward(Xp)))
        W = np.ascontiguousarray(state.params["W"])
        top, _ = topk_product(h, W, state.params["b"], k + int(np.diff(T.indptr).max()))
        union, n_union = state.tables.query(h)
        capped, _ = state.tables.query(h, max_out=r["lsh_cap"], rank=True)
        clusters = ClusterCandidates(state.n_labels, state.params,
                                     min(CLUSTER_NEGATIVES, r["lsh_cap"]), seed=0)
        clusters.rehash(state.params["W"])
        found = clusters.lookup(h)[1][0]
    exact = np.array([[i for i in t if i not in labels][:k] for t, labels in
                      zip(top, (set(T.indices[a:b]) for a, b in zip(T.indptr, T.indptr[1:])))])
    return {"lsh union": recall_against(union, exact), "lsh": recall_against(capped, exact),
            "clusters": recall_against(found, exact),
            "union size": float(n_union.mean()), "lsh_cap": int(r["lsh_cap"]),
            "cluster negatives": int(found.shape[1])}


def _run(spec, args, queue):
    from slide import SlideClassifier
    name, Xtr, Ytr, _, _ = load_set(spec, args.data_dir, args.seed)
    rows = np.random.default_rng(args.seed).choice(Xtr.shape[0], min(args.rows, Xtr.shape[0]),
                                                   replace=False)
    points = []

    def on_epoch(m, entry):
        point = {"epoch": entry["epoch"], **_recalls(m, Xtr, Ytr, rows, args.k)}
        points.append(point)
        print(f"[{name}] epoch {entry['epoch']}: " + ", ".join(
            f"{key} {point[key]:.3f}" for key in ("lsh union", "lsh", "clusters")), flush=True)

    model = SlideClassifier(threads=args.threads, seed=args.seed, epochs=args.epochs,
                            early_stopping=False, negatives_from="lsh")
    model.fit(Xtr, Ytr, on_epoch=on_epoch)
    queue.put({"dataset": name, "points": points})


def table(runs, k) -> str:
    lines = [f"| set | epoch | recall of the exact top {k}: lsh union | lsh (kept) | clusters | "
             "union size | lsh_cap | cluster negatives |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for p in run["points"]:
            lines.append(f"| {run['dataset']} | {p['epoch']} | {p['lsh union']:.3f} | "
                         f"{p['lsh']:.3f} | {p['clusters']:.3f} | {p['union size']:.0f} | "
                         f"{p['lsh_cap']} | {p['cluster negatives']} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="git_openstack", help="comma-separated sets or presets")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--rows", type=int, default=1000, help="training rows asked after each epoch")
    p.add_argument("--k", type=int, default=16, help="the exact top k a source should hold")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/negatives_recall")
    args = p.parse_args(argv)
    doc = {"machine": machine(), "args": vars(args), "runs": []}
    for spec in args.sets.split(","):
        doc["runs"].append(run_isolated(_run, spec, args))
        write_json(args.out + ".json", doc)
    with open(args.out + ".md", "w") as fh:
        fh.write(f"`python -m bench.negatives_recall {' '.join(sys.argv[1:] if argv is None else argv)}`"
                 f"\n\n{table(doc['runs'], args.k)}\n")
    print(table(doc["runs"], args.k))


if __name__ == "__main__":
    main()
