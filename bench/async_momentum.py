"""Asynchrony as momentum (Omnivore): the explicit ``beta1`` that learns most per sample at 1,
2 and 4 asynchronous groups.

    python -m bench.async_momentum --train /tmp/amz_train.txt --out bench/results/async_momentum

Groups are ``slide train`` processes averaging every ``--average-every`` steps
(``--distributed local``; one group: one process without MPI), every process on one thread, for
the same ``--epochs`` over the same rows, at each ``beta1`` of ``--beta1``. Omnivore's model:
G groups add about ``1 - 1/G`` of implicit momentum, so the best explicit momentum falls as
groups are added (to about 0.9 - (1 - 1/G) for a total of 0.9). Each run records the validation
score after every epoch (samples seen: epochs x rows, whatever the groups); the table gives the
last epoch's score per (groups, beta1) and the best beta1 per group count. Writes ``OUT.json``
and ``OUT.md``. Processes share the machine's cores, so only samples, not seconds, compare.
"""
from __future__ import annotations

import argparse
import sys

from bench.common import machine, mpiexec, slide_train, write_json
from slide.loop import EarlyStopping


def _run(train, groups, beta1, epochs, every):
    args = ["--threads", "1", "--epochs", str(epochs), "--beta1", str(beta1)]
    if groups > 1:
        args += ["--distributed", "local", "--average-every", str(every)]
    doc = slide_train(train, *args, launcher=mpiexec(groups) if groups > 1 else ())
    metric = "nDCG@5" if doc["resolved"]["sampled"] else "loss"
    score = EarlyStopping(metric=metric).score  # the score early stopping keeps
    return {"groups": groups, "beta1": beta1, "metric": f"val_{metric}",
            "scores": [score(e) for e in doc["epochs"]],
            "P@1": [e["val_P@1"] for e in doc["epochs"]]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", required=True)
    ap.add_argument("--groups", default="1,2,4")
    ap.add_argument("--beta1", default="0.9,0.7,0.5,0.0")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--average-every", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    runs = []
    for g in (int(x) for x in a.groups.split(",")):
        for b in (float(x) for x in a.beta1.split(",")):
            runs.append(_run(a.train, g, b, a.epochs, a.average_every))
            print(runs[-1], flush=True)
    best = {}
    for r in runs:
        if r["groups"] not in best or r["scores"][-1] > best[r["groups"]]["scores"][-1]:
            best[r["groups"]] = r
    doc = {"machine": machine(), "command": "python -m bench.async_momentum "
           + " ".join(argv or sys.argv[1:]), "runs": runs,
           "best_beta1": {g: r["beta1"] for g, r in best.items()}}
    write_json(a.out + ".json", doc)
    betas = sorted({r["beta1"] for r in runs}, reverse=True)
    lines = [f"# Asynchrony as momentum: {runs[0]['metric']} after {a.epochs} epochs", "",
             f"`{doc['command']}`; groups average every {a.average_every} steps (`local`).", "",
             "| groups | " + " | ".join(f"beta1 {b:g}" for b in betas)
             + " | best beta1 | Omnivore's 0.9 - (1 - 1/G) |",
             "|---" * (len(betas) + 3) + "|"]
    for g, r in sorted(best.items()):
        cells = [f"{next(x['scores'][-1] for x in runs if x['groups'] == g and x['beta1'] == b):.4f}"
                 for b in betas]
        lines.append(f"| {g} | " + " | ".join(cells)
                     + f" | {r['beta1']:g} | {max(0.0, 0.9 - (1 - 1 / g)):.2f} |")
    with open(a.out + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
