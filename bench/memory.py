"""Peak memory of training with the defaults, at a preset's full size or a slice of it.

    python -m bench.memory --preset amazon-670k --n-train 100000 --epochs 1

Generates the preset (train rows and a 2,000-row test sample), fits the engine with its defaults
for ``--epochs`` epochs (early stopping on, so the validation slice and the best-weights copy
are counted) and reports the process's peak resident set size (``ru_maxrss``, which includes
the data) beside the engine's own estimate of the model's bytes
(:func:`slide.resources.model_memory_bytes`) and the data's. Writes ``OUT.json`` with ``--out``.

A data file instead of a preset (``--data TRAIN`` with ``--test TEST``), and its labels spread
over a label space of ``--header-labels`` (a catalogue whose header declares far more labels
than the rows use: the model keeps rows for the labels that occur)::

    python -m bench.memory --data ../shared/data/git_openstack/train.txt \
        --test ../shared/data/git_openstack/test.txt --epochs 1
    python -m bench.memory --preset demo --n-train 11500 --header-labels 10000000

The peak less the resident memory once the data is in (``model_peak_bytes``) is what training
added; ``estimate_ratio`` is the estimate over it.

Resuming from a checkpoint, measured in a process of its own (the peak is the process's)::

    python -m bench.memory --n-train 100000 --epochs 1 --save /tmp/memory_model
    python -m bench.memory --n-train 100000 --epochs 1 --resume /tmp/memory_model

``--save DIR`` writes the fitted model (a training checkpoint: weights, Adam moments, the best
weights); ``--resume DIR`` loads it instead of starting afresh and trains ``--epochs`` more.
"""
from __future__ import annotations

import argparse
import resource
import time

import numba
import scipy.sparse as sp

from bench.common import dataset, machine, write_json


def main(argv=None):
    from slide.estimator import SlideClassifier
    from slide.resources import model_memory_bytes
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="amazon-670k")
    p.add_argument("--data", default=None, metavar="TRAIN", help="a training file (not a preset)")
    p.add_argument("--test", default=None, metavar="TEST", help="its test file")
    p.add_argument("--header-labels", type=int, default=None,
                   help="spread the labels over a label space this large")
    p.add_argument("--n-train", type=int, default=100000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--save", default=None, metavar="DIR", help="save the fitted model here")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="load this checkpoint and train --epochs more (the same data)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.data:
        from slide.data import read_dataset
        X, Y = read_dataset(args.data)
        Xte, Yte = read_dataset(args.test, n_features=X.shape[1], n_labels=Y.shape[1])
        Xte, Yte = Xte[:2000], Yte[:2000]
    else:
        X, Y, Xte, Yte = dataset(args.preset, args.n_train, 2000)
    if args.header_labels:  # label l becomes l * stride: the same rows in a wider space
        stride = max(1, args.header_labels // Y.shape[1])
        Y, Yte = (sp.csr_matrix((M.data, M.indices * stride, M.indptr),
                                shape=(M.shape[0], args.header_labels)) for M in (Y, Yte))
    data_bytes = sum(a.nbytes for M in (X, Y) for a in (M.data, M.indices, M.indptr))
    gen = time.perf_counter() - t0
    rss_data = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if args.resume:
        model = SlideClassifier.load(args.resume)
        model.set_params(warm_start=True, epochs=model.epoch_ + args.epochs, threads=args.threads)
    else:
        model = SlideClassifier(epochs=args.epochs, threads=args.threads)
    model.fit(X, Y)
    fit = time.perf_counter() - t0
    if args.save:
        model.save(args.save)
    p1 = model.evaluate(Xte, Yte)["P@1"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # a selection without a refit holds its best run while the next trains
    runs = 2 if (model.stopping_ or {}).get("choice") and not model.stopping_.get("refit") else 1
    estimate = model_memory_bytes(model.resolved_, X.shape[1], model.n_outputs_,
                                  args.threads or numba.config.NUMBA_NUM_THREADS,
                                  features_per_row=model.features_per_row_, runs=runs)["total"]
    doc = {"machine": machine(), "args": vars(args), "n_train": X.shape[0],
           "peak_rss_bytes": peak, "rss_after_data_bytes": rss_data, "data_bytes": data_bytes,
           "model_estimate_bytes": estimate, "model_peak_bytes": peak - rss_data,
           "estimate_ratio": estimate / max(peak - rss_data, 1), "n_labels": Y.shape[1],
           "n_outputs": model.n_outputs_, "runs_held": runs, "generate_seconds": gen, "fit_seconds": fit,
           "test_P@1": p1, "samples_per_second": model.history_[-1]["samples_per_second"]}
    print(f"{args.data or args.preset}, {X.shape[0]} train rows, {Y.shape[1]} labels "
          f"({model.n_outputs_} with rows){', resumed' if args.resume else ''}: "
          f"peak RSS {peak / 2**30:.2f} GiB (data {data_bytes / 2**30:.2f} GiB, training added "
          f"{(peak - rss_data) / 2**30:.2f} GiB, model estimate {estimate / 2**30:.2f} GiB, "
          f"ratio {estimate / max(peak - rss_data, 1):.2f}); fit {fit:.0f} s for {args.epochs} epoch(s), P@1 {p1:.4f}")
    if args.out:
        write_json(args.out, doc)


if __name__ == "__main__":
    main()
