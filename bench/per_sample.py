"""P@1 against samples: what a step of each engine is worth, one epoch at a time.

    python -m bench.per_sample --sets git_openstack --epochs 6 \\
        --engines slide,dense-sampled,dense-sampled+mined --out bench/results/per_sample_git

Each engine trains by ``fit`` for ``--epochs`` epochs (the rule's settings and its learning-rate
plan over that many epochs, no early stopping, seed ``--seed``) in a process of its own, and
after every epoch its top-5 on a fixed shuffled sample of ``--n-test`` test rows is scored. The
training seconds are recorded, but the point is the samples: the half of a plan's time to
accuracy that does not depend on the machine (docs/planner.md), so engines that a CPU runs
slowly (the dense reference on numpy) can be compared with the engine where a GPU is not at
hand. Engines: ``slide`` (on ``--threads``; ``slide+lsh`` / ``slide+clusters``: its hard
negatives from the LSH tables / the label clusters whatever the rule says), ``dense`` (full
softmax), ``dense-sampled`` (the batch's labels and ``--negatives`` random rows), with ``+mined``
also ``--mined`` hard negatives a row (``DenseClassifier(mined_negatives=...)``); the dense ones
on ``--device``.
Sets: as :mod:`bench.quality`'s (folders of ``--data-dir``, or presets such as
``amazon-670k:100000``). Writes ``OUT.json`` and ``OUT.md``.
"""
from __future__ import annotations

import argparse
import sys
import time

from bench.common import machine, run_isolated, write_json
from bench.quality import load_set

ENGINES = ("slide", "slide+lsh", "slide+clusters", "dense", "dense-sampled", "dense-sampled+mined")


def make(engine: str, args):
    """The model of ``engine`` for ``args`` (fixed epochs, no early stopping)."""
    common = dict(epochs=args.epochs, early_stopping=False, seed=args.seed)
    if engine.startswith("slide"):
        from slide import SlideClassifier
        return SlideClassifier(threads=args.threads, negatives_from=engine.partition("+")[2]
                               or None, **common)
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")
    from gpu_ref import DenseClassifier
    sampled = engine.startswith("dense-sampled")
    return DenseClassifier(device=args.device, negatives=args.negatives if sampled else None,
                           mined_negatives=args.mined if engine.endswith("+mined") else 0,
                           **common)


def _run(engine, spec, args, queue):
    from slide.data import shuffle_rows
    from slide.metrics import precision_at_k
    name, Xtr, Ytr, Xte, Yte = load_set(spec, args.data_dir, args.seed)
    Xs, Ys = shuffle_rows(Xte, Yte, seed=args.seed + 1, n=min(args.n_test, Xte.shape[0]))
    model = make(engine, args)
    curve = []

    def on_epoch(m, entry):
        p = precision_at_k(Ys, m.predict_topk(Xs, 5)[0], 5)
        curve.append({"epoch": entry["epoch"], "samples": entry["epoch"] * Xtr.shape[0],
                      "train_seconds": entry["train_seconds"], "P@1": float(p[0]),
                      "P@5": float(p[4])})
        print(f"[{name} {engine}] epoch {entry['epoch']}: P@1 {p[0]:.4f} P@5 {p[4]:.4f} "
              f"({entry['train_seconds']:.1f} s)", flush=True)

    t0 = time.perf_counter()
    model.fit(Xtr, Ytr, on_epoch=on_epoch)
    queue.put({"dataset": name, "engine": engine, "rows": Xtr.shape[0], "curve": curve,
               "seconds": time.perf_counter() - t0,
               "settings": {k: model.resolved_[k] for k in ("hidden", "lr", "batch_size")}})


def table(runs) -> str:
    epochs = max((len(r["curve"]) for r in runs), default=0)
    lines = ["| set | engine | " + " | ".join(f"P@1 after {e + 1}" for e in range(epochs)) + " |",
             "|---|---|" + "---|" * epochs]
    for r in runs:
        lines.append(f"| {r['dataset']} | {r['engine']} | "
                     + " | ".join(f"{c['P@1']:.4f}" for c in r["curve"]) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="git_openstack", help="comma-separated sets or presets")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--engines", default="slide,dense-sampled,dense-sampled+mined")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--n-test", type=int, default=3000, help="test rows scored after each epoch")
    p.add_argument("--negatives", type=int, default=4096)
    p.add_argument("--mined", type=int, default=16, help="hard negatives a row of +mined")
    p.add_argument("--device", choices=["cpu", "gpu", "auto"], default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/per_sample")
    args = p.parse_args(argv)
    engines = args.engines.split(",")
    for e in engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e!r}; choose from {ENGINES}")
    doc = {"machine": machine(), "args": vars(args), "runs": []}
    for spec in args.sets.split(","):
        for engine in engines:
            doc["runs"].append(run_isolated(_run, engine, spec, args))
            write_json(args.out + ".json", doc)
    with open(args.out + ".md", "w") as fh:
        fh.write(f"`python -m bench.per_sample {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n{table(doc['runs'])}\n")
    print(table(doc["runs"]))


if __name__ == "__main__":
    main()
