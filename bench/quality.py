"""Accuracy with default settings, side by side: the engine, the dense reference and the linear
XMC methods (XR-Linear, Parabel).

    python -m bench.quality                      # every set in ../shared/data, then the presets
    python -m bench.quality --sets Enron,Medical --engines slide,xr-linear
    python -m bench.quality --data-dir DIR --presets demo,amazon-670k:100000 --engines slide,knn
    python -m bench.quality --sets single:Corel5k --presets shape:5000/1000/15000/3000/236/1.5
    python -m bench.quality --sets cut:git_openstack/4000,cut:git_openstack/15000 --presets ""

Engines: ``slide`` (the engine), ``dense`` (the dense reference on numpy), ``xr-linear``
(PECOS), ``parabel`` (omikuji's implementation, Parabel's settings), ``knn`` (a cosine
10-nearest-neighbour vote, the simple baseline the presets are calibrated against; its
"training seconds" are its prediction time).

Every engine trains with its defaults on the training file and is scored once on the test file
(P@1/3/5, PSP@5 with Jain et al.'s propensities from the training labels), with its training
seconds and peak RSS, each in its own process. Real sets are the folders of ``--data-dir``
holding ``train.txt`` and ``test.txt`` (``single:NAME``: the folder made multi-class, each row
keeping the first label it lists and rows without one left out; ``cut:NAME/ROWS``: a cut of
ROWS training rows, shaped as wide tf-idf data, :func:`cut_rows`); presets are synthetic (``NAME``
or ``NAME:N_TRAIN``, or a shape of the generator's, ``shape:FEATURES/LABELS/TRAIN/TEST/
FEATURES_PER_ROW/LABELS_PER_ROW``, with its other knobs at the presets' values).

The linear peers run in their own environment because libpecos pins older numpy and scipy:
``python -m venv .peers && .peers/bin/pip install libpecos omikuji``, then pass
``--peers-python .peers/bin/python`` (the default when that file exists; also
``$SLIDE_PEERS_PYTHON``). Without it their columns are skipped, and the table says so.
Writes ``OUT.json`` and ``OUT.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import scipy.sparse as sp

from bench import peers
from bench.common import machine, run_isolated, write_json
from slide.config import NEGATIVE_SOURCES

ENGINES = ("slide", "dense", *peers.WORKERS, "knn")
PROPENSITY_AB = {"amazon": (0.6, 2.6), "wikilshtc": (0.5, 0.4)}


def first_labels(X, Y):
    """``(X, Y)`` made multi-class: each row keeps the first label its CSR row lists (the file's
    order); rows without a label are left out."""
    Y = sp.csr_matrix(Y)
    rows = np.flatnonzero(np.diff(Y.indptr) > 0)
    first = sp.csr_matrix((np.ones(rows.size, np.float32), Y.indices[Y.indptr[rows]],
                           np.arange(rows.size + 1)), shape=(rows.size, Y.shape[1]))
    return sp.csr_matrix(X)[rows], first


#: a cut keeps the labels with at least this many positives among its rows
CUT_POSITIVES = 4


def cut_rows(Xtr, Ytr, Xte, Yte, n_rows: int, seed: int):
    """A few-row cut of a real set, shaped as wide tf-idf data: ``n_rows`` training rows drawn
    at random, the labels with at least :data:`CUT_POSITIVES` positives among them, the rows
    left without a label out (training and test), the features the cut's rows hold,
    idf-weighted from the cut and L2-normalised; every test row is scored."""
    from sklearn.preprocessing import normalize
    rows = np.sort(np.random.default_rng(seed).choice(Xtr.shape[0], n_rows, replace=False))
    X, Y = sp.csr_matrix(Xtr)[rows], sp.csr_matrix(Ytr)[rows]
    labels = np.flatnonzero(np.diff(Y.tocsc().indptr) >= CUT_POSITIVES)
    Y, Yte = Y[:, labels], sp.csr_matrix(Yte)[:, labels]
    kept, kept_te = np.diff(Y.indptr) > 0, np.diff(Yte.indptr) > 0
    X, Y, Xte, Yte = X[kept], Y[kept], sp.csr_matrix(Xte)[kept_te], Yte[kept_te]
    df = np.diff(X.tocsc().indptr)
    features = np.flatnonzero(df)
    idf = (np.log(X.shape[0] / df[features]) + 1).astype(np.float32)
    weigh = sp.diags(idf)
    X, Xte = (normalize(A[:, features] @ weigh).astype(np.float32) for A in (X, Xte))
    return X, Y, Xte, Yte


def load_set(spec, data_dir, seed):
    """(name, X_train, Y_train, X_test, Y_test) of a real folder or a preset spec."""
    from slide.data import read_dataset
    from slide.synthetic import PRESETS, DatasetShape, make_dataset
    name, _, n = spec.partition(":")
    if name == "shape":
        try:
            f, lab, n_train, n_test, fpr, lpr = (float(v) for v in n.split("/"))
        except ValueError:
            raise SystemExit(f"bad shape {spec!r}: give shape:FEATURES/LABELS/TRAIN/TEST/"
                             "FEATURES_PER_ROW/LABELS_PER_ROW, e.g. shape:5000/1000/15000/3000/236/1.5")
        shape = DatasetShape(spec, int(f), int(lab), int(n_train), int(n_test), fpr, lpr)
        return (spec, *make_dataset(shape, seed=seed))
    if name == "single":
        name, Xtr, Ytr, Xte, Yte = load_set(n, data_dir, seed)
        return (spec, *first_labels(Xtr, Ytr), *first_labels(Xte, Yte))
    if name == "cut":
        folder, _, rows = n.rpartition("/")
        if not folder or not rows.isdigit():
            raise SystemExit(f"bad cut {spec!r}: give cut:FOLDER/ROWS, e.g. cut:git_openstack/15000")
        name, Xtr, Ytr, Xte, Yte = load_set(folder, data_dir, seed)
        return (spec, *cut_rows(Xtr, Ytr, Xte, Yte, int(rows), seed))
    if name in PRESETS and not os.path.isdir(os.path.join(data_dir, name)):
        shape = PRESETS[name]
        n_train = int(n) if n else shape.n_train
        n_test = min(shape.n_test, max(2000, n_train // 10))
        return (spec, *make_dataset(name, n_train=n_train, n_test=n_test, seed=seed))
    folder = os.path.join(data_dir, name)
    Xtr, Ytr = read_dataset(os.path.join(folder, "train.txt"))
    Xte, Yte = read_dataset(os.path.join(folder, "test.txt"), n_features=Xtr.shape[1],
                            n_labels=Ytr.shape[1])
    return name, Xtr, Ytr, Xte, Yte


def _scores(top, Ytr, Yte, name) -> dict:
    from slide.metrics import evaluate, propensities
    a, b = next((v for k, v in PROPENSITY_AB.items() if k in name.lower()), (0.55, 1.5))
    res = evaluate(Yte, top, 5, propensities=propensities(Ytr, a, b))
    return {k: res[k] for k in ("P@1", "P@3", "P@5", "PSP@5")}


def _run_network(engine, spec, args, queue):
    """Train one of our engines with defaults in this (fresh) process and score it."""
    from slide.resources import peak_rss_mb
    name, Xtr, Ytr, Xte, Yte = load_set(spec, args.data_dir, args.seed)
    if engine == "slide":
        from slide import SlideClassifier
        model = SlideClassifier(threads=args.threads, seed=args.seed,
                                negatives_from=args.negatives_from)
    else:
        from gpu_ref import DenseClassifier
        model = DenseClassifier(seed=args.seed, device="cpu")
    # P@1 on the test rows after every epoch, against the training seconds so far (every run
    # the model trains counted, the first batch's kernel compile not): when it passes a peer
    curve, spent, scoring = [], [0.0], [0.0]

    def on_epoch(m, entry):
        t = time.perf_counter()
        spent[0] += entry["train_seconds"] - entry.get("first_batch_seconds", 0.0)
        p1 = _scores(m.predict_topk(Xte, 5)[0], Ytr, Yte, name)["P@1"]
        curve.append([spent[0], p1, entry.get("choice", "refit" if entry.get("refit") else "")])
        scoring[0] += time.perf_counter() - t

    t0 = time.perf_counter()
    model.fit(Xtr, Ytr, on_epoch=on_epoch)
    seconds = time.perf_counter() - t0 - scoring[0]  # fit's wall time, the curve's scoring not
    top, _ = model.predict_topk(Xte, 5)
    queue.put({"dataset": name, "engine": engine, **_scores(top, Ytr, Yte, name),
               "train_seconds": seconds, "peak_rss_mb": peak_rss_mb(), "curve": curve,
               "epochs": sum(1 for h in model.history_ if not h.get("refit")),
               "kept_epoch": model.stopping_["kept_epoch"], "refit": "refit" in model.stopping_,
               "choice": model.stopping_.get("choice", {}).get("chosen"),
               "choices_tried": list(model.stopping_.get("choice", {}).get("validation_scores", [])),
               "settings": {k: model.resolved_[k]
                            for k in ("hidden", "activation", "lr", "weight_decay", "batch_size")}})


def _run_peer(engine, spec, args):
    """A linear peer (:data:`bench.peers.WORKERS`) in the peers environment."""
    name, Xtr, Ytr, Xte, Yte = load_set(spec, args.data_dir, args.seed)
    try:
        res = peers.run(engine, Xtr, Ytr, Xte, args.peers_python, args.threads)
    except RuntimeError as e:
        raise RuntimeError(f"on {name}: {e}") from None
    return {"dataset": name, "engine": engine, **_scores(res["top"], Ytr, Yte, name),
            "train_seconds": res["train_seconds"], "peak_rss_mb": res["peak_rss_mb"]}


def knn_topk(Xtr, Ytr, Xte, k=5, neighbours=10, block=512):
    """Top-k labels of a cosine ``neighbours``-NN vote (rows L2-normalised; votes weighted by
    similarity): the simple baseline the presets are calibrated against."""
    from sklearn.preprocessing import normalize
    A, B = normalize(Xtr).T.tocsc(), normalize(Xte).tocsr()
    Ytr = sp.csr_matrix(Ytr)
    top = np.full((Xte.shape[0], k), -1, np.int64)
    for lo in range(0, Xte.shape[0], block):
        S = (B[lo:lo + block] @ A).toarray()
        idx = np.argpartition(-S, min(neighbours, S.shape[1] - 1), axis=1)[:, :neighbours]
        sims = np.take_along_axis(S, idx, 1)
        rows = np.repeat(np.arange(idx.shape[0]), neighbours)
        votes = sp.csr_matrix((sims.ravel(), (rows, idx.ravel())), shape=(idx.shape[0], Xtr.shape[0])) @ Ytr
        votes = votes.toarray()
        best = np.argsort(-votes, axis=1, kind="stable")[:, :k]
        top[lo:lo + block] = np.where(np.take_along_axis(votes, best, 1) > 0, best, -1)
    return top


def _run_knn(spec, args, queue):
    from slide.resources import peak_rss_mb
    name, Xtr, Ytr, Xte, Yte = load_set(spec, args.data_dir, args.seed)
    t0 = time.perf_counter()
    top = knn_topk(Xtr, Ytr, Xte)
    queue.put({"dataset": name, "engine": "knn", **_scores(top, Ytr, Yte, name),
               "train_seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()})


def seconds_to_pass(curve, p1: float):
    """The training seconds of the first point of ``curve`` ([seconds, P@1, run] after each
    epoch) whose P@1 is above ``p1``; None where none is."""
    return next((t for t, p, *_ in curve if p > p1), None)


def passing_table(rows, engines) -> list:
    """Lines of a markdown table: per dataset, the training seconds at which the engine's test
    P@1 first passed each peer's, beside the peer's own training seconds and their ratio."""
    compared = [e for e in peers.WORKERS if e in engines]
    by = {(r["dataset"], r["engine"]): r for r in rows}
    sets = [s for s in dict.fromkeys(r["dataset"] for r in rows)
            if by.get((s, "slide"), {}).get("curve") and any((s, e) in by for e in compared)]
    if not sets:
        return []
    head = "| dataset | " + " | ".join(f"slide s to pass {peers.NAMES[e]} | {peers.NAMES[e]} s"
                                       for e in compared) + " |"
    lines = ["", head, "|" + "---|" * (head.count("|") - 1)]
    for s in sets:
        cells = []
        for e in compared:
            peer = by.get((s, e))
            if peer is None:
                cells += ["–", "–"]
                continue
            t = seconds_to_pass(by[(s, "slide")]["curve"], peer["P@1"])
            ratio = f" ({t / max(peer['train_seconds'], 1e-9):.1f}×)" if t is not None else ""
            cells += ["never" if t is None else f"{t:.1f}{ratio}", f"{peer['train_seconds']:.1f}"]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


def table(rows, engines) -> str:
    """A markdown table: one row per dataset, P@1 of each engine, then the details, then when
    the engine passed each peer (:func:`passing_table`)."""
    sets = list(dict.fromkeys(r["dataset"] for r in rows))
    by = {(r["dataset"], r["engine"]): r for r in rows}
    head = "| dataset | " + " | ".join(f"{e} P@1" for e in engines)
    compared = [e for e in peers.WORKERS if e in engines] if "slide" in engines else []
    head += "".join(f" | slide − {peers.NAMES[e]}" for e in compared)
    lines = [head + " |", "|" + "---|" * (head.count("|"))]
    for s in sets:
        cells = [f"{by[(s, e)]['P@1']:.3f}" if (s, e) in by else "–" for e in engines]
        for e in compared:
            cells.append(f"{by[(s, 'slide')]['P@1'] - by[(s, e)]['P@1']:+.3f}"
                         if (s, "slide") in by and (s, e) in by else "–")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "| dataset | engine | P@1 | P@3 | P@5 | PSP@5 | train s | peak RSS MiB | settings |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        settings = dict(r.get("settings") or {})
        extra = "" if not settings else ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in settings.items()) + \
            (f" ({r['choice']}, of {' / '.join(r['choices_tried'])})" if r.get("choices_tried") else "") + \
            f"; epoch {r['kept_epoch']} of {r['epochs']}" + \
            (", then refit on every row" if r.get("refit") else "")
        lines.append(f"| {r['dataset']} | {r['engine']} | {r['P@1']:.3f} | {r['P@3']:.3f} | "
                     f"{r['P@5']:.3f} | {r['PSP@5']:.3f} | {r['train_seconds']:.1f} | "
                     f"{r['peak_rss_mb']:.0f} | {extra} |")
    lines += passing_table(rows, engines)
    return "\n".join(lines) + "\n"


def run(args) -> dict:
    specs = []
    if args.sets != "":
        found = sorted(d for d in os.listdir(args.data_dir)
                       if os.path.exists(os.path.join(args.data_dir, d, "train.txt"))) \
            if os.path.isdir(args.data_dir) else []
        specs += found if args.sets is None else args.sets.split(",")
    specs += [p for p in args.presets.split(",") if p]
    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            raise SystemExit(f"unknown engine {e!r}; choose from {', '.join(ENGINES)}")
    notes = []
    if not args.peers_python:
        for e in [e for e in engines if e in peers.WORKERS]:
            engines.remove(e)
            notes.append(f"{peers.NAMES[e]} skipped: no peers environment "
                         "(see python -m bench.quality --help)")
    doc = {"machine": machine(), "args": vars(args), "notes": notes, "rows": []}
    for spec in specs:
        for engine in engines:
            target, extra = (_run_knn, ()) if engine == "knn" else (_run_network, (engine,))
            if engine in peers.WORKERS:
                row = _run_peer(engine, spec, args)
            elif args.in_process:
                import queue
                q = queue.SimpleQueue()
                target(*extra, spec, args, q)
                row = q.get()
            else:
                row = run_isolated(target, *extra, spec, args)
            print(f"{row['dataset']:>22} {engine:>9}: P@1 {row['P@1']:.3f}  P@5 {row['P@5']:.3f}  "
                  f"PSP@5 {row['PSP@5']:.3f}  {row['train_seconds']:.1f}s  {row['peak_rss_mb']:.0f} MiB",
                  flush=True)
            doc["rows"].append(row)
            write_json(args.out + ".json", doc)
    doc["table"] = table(doc["rows"], engines)
    write_json(args.out + ".json", doc)
    with open(args.out + ".md", "w") as fh:
        fh.write("\n".join(notes + [""]) + doc["table"] if notes else doc["table"])
    return doc


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.path.join("..", "shared", "data"))
    p.add_argument("--sets", default=None, help="comma-separated folders of --data-dir (default: all; "
                   "'' none), single:NAME for a folder made multi-class by each row's first label, "
                   "or cut:NAME/ROWS for a few-row tf-idf cut of one (bench.quality.cut_rows)")
    p.add_argument("--presets", default="demo", help="synthetic presets, NAME or NAME:N_TRAIN, or "
                   "shape:FEATURES/LABELS/TRAIN/TEST/FEATURES_PER_ROW/LABELS_PER_ROW")
    p.add_argument("--engines", default="slide,dense,xr-linear,parabel")
    p.add_argument("--peers-python", default=peers.default_python())
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--negatives-from", choices=NEGATIVE_SOURCES, default=None,
                   help="the slide engine's source of hard negatives (negatives_from; default: "
                        "the rule's)")
    p.add_argument("--in-process", action="store_true", help="no child process per run (tests)")
    p.add_argument("--out", default="bench/results/quality")
    args = p.parse_args(argv)
    doc = run(args)
    print(doc["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
