"""The ``slide train`` run: files in, a trained model, per-epoch records and checkpoints out."""
from __future__ import annotations

import json
import os
import time

from slide.data import DataFormatError, read_dataset, shuffle_rows
from slide.loop import MAX_VALIDATION_ROWS
from slide.resources import peak_rss_mb
from slide.signals import TrainingStopped
from slide.synthetic import PRESETS, load_default

__all__ = ["run_training", "load_train_test"]


def _write_json(path, obj):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def load_train_test(train=None, test=None, seed=0, log=print):
    """Read the files (or generate the built-in dataset) and return train and test splits."""
    if train is None:
        shape = PRESETS["demo"]
        log(f"no training file given: generating the built-in 'demo' dataset (synthetic, "
            f"Amazon-670K-like: {shape.n_train:,} train / {shape.n_test:,} test samples, "
            f"{shape.n_features:,} features, {shape.n_labels:,} labels)")
        return load_default(seed)
    Xtr, Ytr = read_dataset(train)
    Xte = Yte = None
    if test is not None:
        Xte, Yte = read_dataset(test, n_features=Xtr.shape[1], n_labels=Ytr.shape[1])
        if Xte.shape[1] != Xtr.shape[1] or Yte.shape[1] != Ytr.shape[1]:
            raise DataFormatError(f"{test}: {Xte.shape[1]} features / {Yte.shape[1]} labels, but "
                                  f"{train} has {Xtr.shape[1]} / {Ytr.shape[1]}")
    return Xtr, Ytr, Xte, Yte


def _settings(model) -> dict:
    """The model's constructor settings as JSON has them."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in model.get_params().items()}


def _shown_value(key, value):
    """A record's value as ``slide train`` prints it: floats to 4 decimals, the learning rate
    to 3 significant digits (late in the schedule it is below 1e-4)."""
    if key == "learning_rate":
        return f"{value:.3g}"
    return round(value, 4) if isinstance(value, float) else value


def run_training(model, Xtr, Ytr, Xte=None, Yte=None, epochs=None, metrics_json=None,
                 checkpoint_dir=None, progress=True, log=print, resume=False, save_every=None,
                 distributed=None, runner=None, planner=None):
    """Train ``model`` (the engine or the dense reference) the way ``slide train`` does: validation held out from the training rows, the test set (if any) scored
    after every epoch for the record only, ``metrics_json`` rewritten after every epoch (with
    ``resume``, the records already in it are kept and the new epochs appended) and a
    checkpoint saved to ``checkpoint_dir`` after every epoch and at the end.

    ``epochs`` is the total (with ``resume``, counting the checkpoint's epochs). ``save_every``
    also checkpoints every that many batches inside an epoch. ``distributed``, ``runner``: see
    :func:`slide.fitting.fit_model` (with ``distributed`` every rank calls this with its shard;
    give the outputs to rank 0 only). ``planner``: a :class:`slide.planner.Planner` that
    probes plans and trains the model by the one it chooses (its report in the record's
    ``"plan"``).
    """
    test = None
    if Xte is not None:
        # test files may be sorted by label: score a seeded shuffled subsample
        test = shuffle_rows(Xte, Yte, seed=0, n=min(Xte.shape[0], MAX_VALIDATION_ROWS))
    config = _settings(model)
    if runner is not None:  # the heterogeneous trainer's settings beside the model's
        config.update({f"hetero_{k}": v for k, v in runner.settings().items()})
    doc = {"config": config, "n_train": int(Xtr.shape[0]), "n_features": int(Xtr.shape[1]),
           "n_labels": int(Ytr.shape[1]), "epochs": []}
    if resume and metrics_json and os.path.exists(metrics_json):
        try:
            with open(metrics_json) as fh:
                earlier = json.load(fh).get("epochs", [])
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{metrics_json}: cannot append to it ({e}); move it away or "
                             "choose another --metrics-json") from None
        # keep the records of epochs the checkpoint holds (a crash may have written later ones)
        doc["epochs"] = [r for r in earlier if isinstance(r, dict) and r.get("epoch", 0) <= model.epoch_]

    scoring = [0.0]  # seconds spent scoring the test rows: not training

    def on_epoch(m, record):
        record = dict(record)
        # the run's clock at the epoch's end: from the start of training (initialisation and any
        # planning included), less the test scoring
        record["elapsed"] = time.perf_counter() - started - scoring[0]
        if test is not None:
            t0 = time.perf_counter()
            record.update({f"test_{k}": v for k, v in m.evaluate(*test).items()})
            record["test_eval_seconds"] = time.perf_counter() - t0
            scoring[0] += record["test_eval_seconds"]
        record["peak_rss_mb"] = peak_rss_mb()
        doc["epochs"].append(record)
        doc["peak_rss_mb"] = record["peak_rss_mb"]
        doc["resolved"] = getattr(m, "resolved_", None)
        if getattr(m, "timings_", None):
            doc["timings"] = dict(m.timings_)
        shown = {"epoch": "epoch", "loss": "mean_train_loss", "val_loss": "val_loss",
                 "val_nDCG@5": "val_nDCG@5", "val_P@1": "val_P@1", "learning_rate": "lr",
                 "test_P@1": "test_P@1", "test_P@5": "test_P@5", "samples_per_second": "samples/s",
                 "refit": "refit", "planned_epochs": "plan_cut_to"}
        run = f"[{record['choice']}]  " if "choice" in record else ""  # a run fit chooses among
        log(run + "  ".join(f"{name}={_shown_value(k, record[k])}" for k, name in shown.items()
                            if k in record))
        if metrics_json:
            _write_json(metrics_json, doc)
        if checkpoint_dir:
            m.save(checkpoint_dir)

    started = time.perf_counter()
    until = epochs if epochs is not None else (model.resolved_["epochs"] if resume else None)
    callback, report = on_epoch, None
    if planner is not None:
        if resume or distributed is not None or runner is not None:
            raise ValueError("planning starts a run on one process: not with --resume, "
                             "--distributed or --mode hetero")
        report = planner.prepare(model, Xtr, Ytr)
        doc["plan"] = report
        doc["config"].update(_settings(model))  # the chosen plan's
        if report["chosen"]["epochs"] is not None:
            resume, until = True, report["chosen"]["epochs"]
        callback = planner.watch(report, on_epoch)
    try:
        model.train(Xtr, Ytr, until_epoch=until,
                    progress=progress, on_epoch=callback, continue_training=resume,
                    save_every=save_every if checkpoint_dir else None,
                    on_save=lambda m: m.save(checkpoint_dir), distributed=distributed,
                    runner=runner)
    except TrainingStopped as e:
        # stopped at a batch boundary (slide.signals): the model is whole there
        e.saved = bool(checkpoint_dir and e.resumable and model._is_fitted())
        if e.saved:
            model.save(checkpoint_dir)
        e.position = (model.epoch_, model.epoch_position_) if model._is_fitted() else (0, 0)
        raise
    doc["wall_seconds"] = time.perf_counter() - started
    doc["stopping"] = model.stopping_
    if report is not None:
        model.record_.plan = report
    if test is not None:
        doc["test"] = model.evaluate(*test)
    if metrics_json:
        _write_json(metrics_json, doc)
    if checkpoint_dir:
        model.save(checkpoint_dir)
    return doc
