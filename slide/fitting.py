"""What ``fit`` does around the loop: the validation slice, the settings chosen on it, the refit.

:func:`fit_model` serves every model that provides :class:`slide.loop.Trainable` (the engine,
the dense reference; the heterogeneous trainer as a ``runner`` of the engine's epochs). It
returns the run's :class:`slide.loop.FitRecord` (the model's ``record_``, which
``initialize`` started).
"""
from __future__ import annotations

import time

from slide.ann import CALIBRATION_ROWS
from slide.data import shuffle_rows
from slide.loop import (MAX_VALIDATION_ROWS, EarlyStopping, FitRecord, first_cycle, refit_epochs,
                        run_epochs, validation_split)
from slide.selection import choice_name, offered_to, select

__all__ = ["fit_model", "hold_out"]


def _is_label_vector(Y) -> bool:
    """A 1-D array of label ids (one label per row, scikit-learn's multi-class ``y``)."""
    return hasattr(Y, "ndim") and not hasattr(Y, "indptr") and Y.ndim == 1


def fit_model(model, X, Y, *, validation=None, progress: bool = False, on_epoch=None,
              continue_training: bool = False, until_epoch: int | None = None, eval_k: int = 5,
              save_every: int | None = None, on_save=None, distributed=None,
              runner=None) -> FitRecord:
    """Train ``model`` on ``X`` (CSR-convertible [n, n_features]) and ``Y`` (CSR indicator or
    label lists); returns the run's record.

    validation : ``(X_val, Y_val)`` scored after every epoch, or None. With the model's
        ``early_stopping`` on and none given, a ``validation_fraction`` slice of the training
        rows is held out (seeded, so a resumed run holds out the same rows). Never pass the
        test set here if it is to measure anything afterwards.
    continue_training : keep the fitted parameters and record (``warm_start``, ``--resume``);
        otherwise the model is initialised afresh from the training rows.
    until_epoch : train until the record's ``epoch`` reaches it (``slide train --epochs``
        counts the total); default: the model's planned epochs more. The learning rate of
        each epoch follows :func:`slide.loop.epoch_learning_rate` over these planned epochs.
    on_epoch, save_every, on_save, eval_k : see :func:`slide.loop.run_epochs`.
    distributed : a :class:`slide.distributed.DataParallel` (the engine only): X, Y are this
        rank's shard; every epoch ends with the replicas equal.
    runner : what runs the epochs (default: the model; see :class:`slide.loop.EpochRunner`).

    Where the model offers settings to choose (:func:`slide.selection.offered`) and there is a
    validation set, each is trained with early stopping on it and the best kept
    (``stopping["choice"]``), refitted where the refit runs, else as it was trained. Where
    ``resolved_["refit"]`` holds and the slice was held out of ``X``, the kept settings are
    then trained again from the start on every row for the kept epochs, at their learning
    rates (``stopping["refit"]``). Neither with ``continue_training`` or ``distributed``.
    """
    s = model.fit_settings()
    if Y is None:
        raise ValueError(f"{type(model).__name__} requires y to be passed, but the target y is None")
    single_label = _is_label_vector(Y)
    X, Y = model.check_data(X, Y, where="fit", fitted=continue_training,
                            grow=distributed is None)
    if distributed is not None:
        if s.get("refit"):
            raise ValueError("refit=True needs every row in one process; distributed training "
                             "holds shards (set refit=False or leave it to the rule)")
        X, Y = distributed.agree_shapes(X, Y)
    every_row = (X, Y)  # for the refit; let go below where there is none
    X, Y, validation, held_out = hold_out(X, Y, s, validation)
    if not continue_training:
        model.initialize(X, Y, distributed=distributed)
        model.record_.single_label = single_label
    # over the output rows: the labels with a training positive
    Yr = model.targets(X, Y, grow=distributed is None)
    alone = not continue_training and distributed is None
    refit = held_out and model.resolved_["refit"] and alone
    if not refit:
        every_row = None
    if distributed is not None:
        model.join(distributed)
    if validation is not None:
        Xv, Yv = model.check_data(*validation, where="validation", fitted=True)
        if Xv.shape[0] > MAX_VALIDATION_ROWS:
            Xv, Yv = shuffle_rows(Xv, Yv, seed=s["seed"], n=MAX_VALIDATION_ROWS)
        validation = (Xv, Yv)
    # rows no step trains on, for mode="ann" to choose its probe by (a refit trains on them)
    if validation is not None and not refit:
        model.held_out_ = shuffle_rows(validation[0], validation[1], seed=s["seed"],
                                       n=min(CALIBRATION_ROWS, validation[0].shape[0]))[0]
    elif not continue_training:
        model.held_out_ = None
    run = dict(seed=s["seed"], validation=validation, until_epoch=until_epoch, runner=runner,
               progress=progress, eval_k=eval_k, save_every=save_every, on_save=on_save,
               distributed=distributed, held_out=held_out, patience=s["n_iter_no_change"],
               early_stopping=s["early_stopping"])
    candidates = offered_to(model) if validation is not None and alone else []
    if not candidates:
        record = _run(model, X, Yr, on_epoch=on_epoch, continue_training=continue_training, **run)
        if refit and record.early_stopping.best_epoch:
            record = _refit(model, *every_row, record, s["seed"], progress, on_epoch, runner,
                            slow_rows=model.resolved_["slow_rows"])
        return record

    def train(choice):
        name = choice_name(choice)
        shown = None if on_epoch is None else \
            (lambda m, entry: on_epoch(m, {**entry, "choice": name}))
        model.initialize(X, Y, choice=choice)  # the same labels: Yr holds
        model.record_.single_label = single_label
        return _run(model, X, Yr, on_epoch=shown, **run).early_stopping.best_score

    # with a refit the chosen run's record is enough (the refit trains it again); without, the
    # whole run is held while later runs train (two models in memory)
    best, scores, (state, record, slow_rows) = select(
        train, candidates, lambda: (None if refit else model.fitted_state(), model.record_,
                                    model.resolved_["slow_rows"]))
    if state is not None:
        model.restore_fitted(state)
    record.stopping = {**record.stopping,
                       "validation": "held out from the training rows" if held_out else "given",
                       "choice": {"chosen": choice_name(best), "settings": dict(best),
                                  "validation_scores": scores}}
    if refit and record.early_stopping.best_epoch:
        return _refit(model, *every_row, record, s["seed"], progress, on_epoch, runner,
                      choice=best, slow_rows=slow_rows)
    return record


def hold_out(X, Y, settings: dict, validation=None):
    """``(X, Y, validation, held_out)``: with early stopping and no ``validation`` given, a
    seeded ``validation_fraction`` slice of the rows held out of ``X``, ``Y`` (``settings``:
    the model's :meth:`fit_settings`); otherwise the rows and ``validation`` as given."""
    if settings["early_stopping"] and validation is None and X.shape[0] > 1:
        tr, va = validation_split(X.shape[0], settings["validation_fraction"], settings["seed"])
        return X[tr], Y[tr], (X[va], Y[va]), True
    return X, Y, validation, False


def _run(model, X, Y, *, seed, validation, until_epoch, patience, early_stopping, on_epoch,
         continue_training=False, **kw) -> FitRecord:
    """The loop over the model as it is initialised (or fitted, ``continue_training``)."""
    record = model.record_
    stopper = None
    target = record.epoch + model.resolved_["epochs"] if until_epoch is None else int(until_epoch)
    if early_stopping and validation is not None:
        previous = record.early_stopping if continue_training else None
        stopper = previous
        if previous is None or previous.stopped:
            metric = model.validation_metric()
            # a model that has trained whole epochs trains on (warm start) without a first cycle
            stopper = EarlyStopping(patience=patience, metric=metric, first_cycle=0 if record.epoch
                                    else first_cycle(metric, target))
            record.best_params = None
    record.early_stopping = stopper
    Xp = model.preprocess(X)
    return run_epochs(model, Xp, Y, record=record, seed=seed, validation=validation,
                      stopper=stopper, planned=max(record.epoch, target), on_epoch=on_epoch,
                      continue_training=continue_training, **kw)


def _refit(model, X, Y, kept: FitRecord, seed, progress, on_epoch, runner,
           choice=None, slow_rows=None) -> FitRecord:
    """Train ``model`` again from its initialisation (with the settings ``choice`` where one
    was made) on every row ``X, Y`` for the epochs ``kept`` kept, each at the learning rate it
    had then, with the kept run's decision ``slow_rows`` of rows updated in few steps: a tenth
    more rows can move the rule across a threshold (features a row, rare share, label rate),
    and the refit would then train other settings than the ones early stopping judged. The new
    record is ``kept``'s with one more history entry (also given to
    ``on_epoch``) and ``stopping["refit"]``. Not checkpointed on the way: a run interrupted
    here resumes as the early-stopped model."""
    epochs = kept.stopping["kept_epoch"]
    rates = [entry["learning_rate"] for entry in kept.history[:epochs]]
    t0 = time.perf_counter()
    model.initialize(X, Y, choice=choice, slow_rows=slow_rows)
    record = model.record_
    loss, _ = refit_epochs(model, model.preprocess(X), model.targets(X, Y), rates, seed=seed,
                           runner=runner,
                           progress=progress)
    seconds = time.perf_counter() - t0
    entry = {"epoch": record.epoch, "refit": True, "train_seconds": seconds,
             "samples_per_second": epochs * X.shape[0] / max(seconds, 1e-9), "loss": loss,
             "learning_rate": float(rates[-1]) if rates else float(model.resolved_["lr"])}
    record.history = kept.history + [entry]
    record.early_stopping = kept.early_stopping
    record.single_label = kept.single_label
    record.stopping = {**kept.stopping, "refit": {"epochs": epochs, "rows": int(X.shape[0]),
                                                  "seconds": seconds}}
    if on_epoch is not None:
        on_epoch(model, entry)
    return record
