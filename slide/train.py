"""The training run behind ``slide train``: data, epochs, evaluation, metrics JSON, checkpoints."""
from __future__ import annotations

import json
import os
import resource
import sys
import time


from slide.data import load_default, read_dataset, shuffle_rows
from slide.network import default_batch_size, default_epochs

__all__ = ["run_training", "peak_rss_mb"]


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (Linux reports KiB)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1024 if sys.platform != "darwin" else r / 2**20


def _write_json(path, obj):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def load_train_test(train=None, test=None, seed=0, log=print):
    """Read the files (or generate the built-in dataset) and return train and test splits."""
    if train is None:
        log("no training file given: generating the built-in 'demo' dataset "
            "(synthetic, Amazon-670K-shaped, 20,000 train / 4,000 test samples)")
        Xtr, Ytr, Xte, Yte = load_default(seed)
        return Xtr, Ytr, Xte, Yte
    Xtr, Ytr = read_dataset(train)
    Xte = Yte = None
    if test is not None:
        Xte, Yte = read_dataset(test, n_features=Xtr.shape[1], n_labels=Ytr.shape[1])
        if Xte.shape[1] != Xtr.shape[1] or Yte.shape[1] != Ytr.shape[1]:
            from slide.data import DataFormatError
            raise DataFormatError(f"{test}: {Xte.shape[1]} features / {Yte.shape[1]} labels, but "
                                  f"{train} has {Xtr.shape[1]} / {Ytr.shape[1]}")
    return Xtr, Ytr, Xte, Yte


def run_training(model, Xtr, Ytr, Xte=None, Yte=None, epochs=None, metrics_json=None,
                 checkpoint_dir=None, eval_samples=None, progress=True, log=print, resume=False):
    """Train ``model`` (engine or dense reference) for ``epochs`` with per-epoch evaluation.

    Writes ``metrics_json`` after every epoch (epoch, train_seconds, samples_per_second, loss,
    P@1/3/5, nDCG@5, the config and peak RSS) and saves a checkpoint to ``checkpoint_dir``.
    With ``resume``, ``model`` was loaded from a checkpoint and ``epochs`` is the total.
    ``epochs=None`` uses :func:`slide.network.default_epochs`.
    """
    validation = None
    if Xte is not None:
        # test files may be sorted by label: evaluate on a shuffled (sub)sample
        n = Xte.shape[0] if eval_samples is None else min(eval_samples, Xte.shape[0])
        validation = shuffle_rows(Xte, Yte, seed=0, n=n)
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in model.get_params().items()}
    log_doc = {"config": config, "n_train": int(Xtr.shape[0]), "n_features": int(Xtr.shape[1]),
               "n_labels": int(Ytr.shape[1]), "epochs": []}
    if hasattr(model, "resolved_config"):
        log_doc["resolved"] = model.resolved_config(Ytr.shape[1], Xtr.shape[0])

    def on_epoch(m, record):
        record = dict(record)
        record["peak_rss_mb"] = peak_rss_mb()
        log_doc["epochs"].append(record)
        log_doc["peak_rss_mb"] = record["peak_rss_mb"]
        if getattr(m, "timings_", None):
            log_doc["timings"] = dict(m.timings_)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()
                 if k in ("epoch", "loss", "P@1", "P@3", "P@5", "nDCG@5", "samples_per_second")}
        log("  ".join(f"{k}={v}" for k, v in shown.items()))
        if metrics_json:
            _write_json(metrics_json, log_doc)
        if checkpoint_dir:
            m.save(checkpoint_dir)

    if epochs is None:
        bs = getattr(model, "batch_size_", None) or model.get_params()["batch_size"] \
            or default_batch_size(Xtr.shape[0])
        epochs = default_epochs(Xtr.shape[0], bs)
    log_doc["epochs_planned"] = epochs
    remaining = epochs - model.epoch_ if resume else epochs
    t0 = time.perf_counter()
    model.fit(Xtr, Ytr, epochs=max(0, remaining), validation=validation, progress=progress,
              on_epoch=on_epoch)
    log_doc["wall_seconds"] = time.perf_counter() - t0
    if metrics_json:
        _write_json(metrics_json, log_doc)
    return log_doc
