"""Scores at prediction less τ · log(label prior): P@1, P@5 and PSP@5 of one model per set at
each τ (post-hoc: the model is trained once; logit adjustment, Menon et al. 2021).

    python -m bench.prior_correction --taus 0,0.1,0.2,0.3
    python -m bench.prior_correction --model DIR --data TRAIN --test TEST

Without ``--model`` each real set of ``--data-dir`` is fitted with the defaults (``--seed``,
``--threads``); with it the saved model is scored on ``--test``, the priors coming from
``--data``. The prior of a label is ``(training count + 1) / (positives + labels)``;
propensities for PSP@5 are the usual ones (A 0.55, B 1.5). Writes ``OUT.json``.
"""
from __future__ import annotations

import argparse
import glob
import os

import numpy as np

from bench.common import machine, write_json


def _scores(model, X, Y, Xt, Yt, taus, k=5):
    from slide.metrics import evaluate, propensities, topk
    counts = np.bincount(Y.indices, minlength=Y.shape[1]).astype(np.float64)
    log_prior = np.log((counts + 1) / (counts.sum() + Y.shape[1]))[model.labels_.ids]
    log_prior = log_prior.astype(np.float32)
    tops = {t: np.empty((Xt.shape[0], k), np.int64) for t in taus}
    for lo, hi, S in model.score_blocks(Xt, block=512):
        for t in taus:
            rows = topk(np.ascontiguousarray(S - np.float32(t) * log_prior), k)[0]
            tops[t][lo:hi] = model.labels_.to_labels(rows)
    prop = propensities(Y)
    return {str(t): {m: float(v) for m, v in evaluate(Yt, tops[t], k, propensities=prop).items()
                     if m in ("P@1", "P@5", "PSP@5")} for t in taus}


def main(argv=None):
    from slide.data import read_dataset
    from slide.estimator import SlideClassifier
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--taus", default="0,0.1,0.2,0.3")
    p.add_argument("--data-dir", default=os.path.join("..", "shared", "data"))
    p.add_argument("--model", default=None)
    p.add_argument("--data", default=None, metavar="TRAIN")
    p.add_argument("--test", default=None, metavar="TEST")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/prior_correction")
    args = p.parse_args(argv)
    taus = [float(t) for t in args.taus.split(",")]
    runs = {}
    if args.model:
        X, Y = read_dataset(args.data)
        Xt, Yt = read_dataset(args.test, n_features=X.shape[1], n_labels=Y.shape[1])
        model = SlideClassifier.load(args.model).set_params(threads=args.threads)
        runs[args.model] = _scores(model, X, Y, Xt, Yt, taus)
    else:
        for folder in sorted(glob.glob(os.path.join(args.data_dir, "*", ""))):
            train = sorted(glob.glob(os.path.join(folder, "*train*")))
            test = sorted(glob.glob(os.path.join(folder, "*test*")))
            if not train or not test:
                continue
            X, Y = read_dataset(train[0])
            Xt, Yt = read_dataset(test[0], n_features=X.shape[1], n_labels=Y.shape[1])
            model = SlideClassifier(threads=args.threads, seed=args.seed).fit(X, Y)
            runs[os.path.basename(folder.rstrip(os.sep))] = _scores(model, X, Y, Xt, Yt, taus)
    for name, by_tau in runs.items():
        print(name, " | ".join(f"τ {t}: " + " / ".join(f"{v:.3f}" for v in r.values())
                               for t, r in by_tau.items()), flush=True)
    write_json(args.out + ".json", {"machine": machine(), "args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
