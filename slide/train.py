"""The one training loop, shared by the sparse engine, the dense reference and the heterogeneous
trainer, and the ``slide train`` run built on it.

A model takes part by implementing a small *step API* (:class:`TrainableMixin` supplies all
that is not engine-specific):

* ``fit_settings()``: early stopping, validation fraction, patience and seed (the current
  settings, valid before the model is fitted); after ``initialize``, ``resolved_["epochs"]``;
* ``check_data(X, Y, where, fitted)``: validated float32 CSR ``X`` and CSR indicator ``Y``;
* ``initialize(X, Y, choice=None)``: fit the preprocessing on the training rows (the mixin's
  ``fit_data``, which also records what the defaults rule reads from them), draw fresh
  parameters (``choice``: settings to use instead of the rule's, one of
  ``resolved_["choices"]``, a :func:`slide.config.next_choice` of one, or the best of those
  with one of ``resolved_["choices_on_best"]`` added);
* ``preprocess(X)``: the fitted preprocessing (CSR in, float32 CSR out);
* ``train_epoch(Xp, Y, order, progress)``: one pass over preprocessed rows in ``order``
  (the mixin runs ``train_step`` over consecutive batches of ``batch_size_``); returns a dict
  with the epoch's mean ``loss`` and anything else worth recording;
* ``train_step(Xp_batch, Y_batch) -> float``: one optimizer step on a preprocessed batch;
* ``snapshot(out=None)`` / ``restore(state)``: copy the parameters out (into ``out``'s
  arrays where given) and put them back;
* ``validation_metric()``: after ``initialize``, the early-stopping score, ``"loss"`` or
  ``"nDCG@5"`` (see :class:`EarlyStopping`);
* ``fitted_state()`` / ``restore_fitted(state)``: hold a fitted run's state while another run
  trains, and make it the model's again;
* ``evaluate(X, Y, k)``; attributes ``learning_rate_``, ``epoch_``, ``history_``.

:func:`fit_loop` holds the rest: the validation slice, the per-epoch record, the learning-rate
schedule (:func:`epoch_learning_rate`), early stopping with the best weights kept, the learning
rate lowered on a plateau, progress bars, callbacks.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import scipy.sparse as sp
from sklearn.exceptions import NotFittedError
from sklearn.utils import ClassifierTags

from slide.config import choice_name, idf_weighted, next_choice, rare_share
from slide.data import DataFormatError, read_dataset, shuffle_rows, take_rows
from slide.preprocess import Preprocessor
from slide.resources import ModelTooLargeError, peak_rss_mb
from slide.synthetic import load_default

__all__ = ["fit_loop", "EarlyStopping", "TrainableMixin", "run_training", "validation_split",
           "load_train_test", "softmax_loss", "epoch_learning_rate", "PLATEAU_FACTOR",
           "MAX_VALIDATION_ROWS"]

# After half the patience without improvement the learning rate is multiplied by this
# (ReduceLROnPlateau): the plateau is usually Adam's noise floor, which a lower rate gets under.
PLATEAU_FACTOR = 0.3
# Validation rows scored per evaluation, at most. Scoring is exact (every label), so on wide
# output layers a larger slice would cost more than the epoch it judges; 5,000 rows give P@1
# to about ±0.007.
MAX_VALIDATION_ROWS = 5000


# --------------------------------------------------------------------------------------------
# Early stopping
# --------------------------------------------------------------------------------------------
@dataclass
class EarlyStopping:
    """Validation bookkeeping: best score and epoch, evaluations without improvement.

    ``metric`` names the score (the engine's ``validation_metric()``): ``"loss"``, the
    validation cross-entropy against uniform targets over each row's labels, negated, for an
    output layer trained whole: on small validation slices it picked better epochs than P@k,
    which moves in steps of one row (bench/results/accuracy_experiments.md); or ``"nDCG@5"``
    for a sampled output layer, whose training never sees the full softmax's normaliser (at
    Amazon-670K shape the full loss rose while P@1 went from 0.07 to 0.25), and whose
    validation slices are large. ``patience`` evaluations without an improvement larger than
    ``tol`` (relative) stop the run; after every ``max(1, patience // 2)`` of them the
    learning rate is lowered.
    """
    patience: int = 5
    metric: str = "loss"
    tol: float = 1e-4
    best_score: float = -math.inf
    best_epoch: int = 0
    bad_epochs: int = 0
    lowered: int = 0
    stopped: str = ""
    scores: list = field(default_factory=list)

    def score(self, metrics: dict) -> float:
        if self.metric == "loss":
            return -float(metrics["val_loss"])
        return float(metrics[f"val_{self.metric}"])

    def update(self, epoch: int, metrics: dict) -> tuple[bool, bool]:
        """Record epoch ``epoch``'s metrics; returns ``(improved, lower_learning_rate)``."""
        s = self.score(metrics)
        self.scores.append(s)
        if not self.scores[:-1] or s > self.best_score + self.tol * abs(self.best_score):
            self.best_score, self.best_epoch, self.bad_epochs = s, epoch, 0
            return True, False
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            self.stopped = (f"no improvement of the validation score for {self.patience} epochs "
                            f"(best {self.best_score:.4f} at epoch {self.best_epoch})")
        lower = not self.stopped and self.bad_epochs % max(1, self.patience // 2) == 0
        self.lowered += lower
        return False, lower

    def to_json(self) -> dict:
        d = asdict(self)
        d["best_score"] = None if d["best_score"] == -math.inf else d["best_score"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "EarlyStopping":
        d = dict(d)
        d["best_score"] = -math.inf if d.get("best_score") is None else float(d["best_score"])
        return cls(**d)


def _is_label_vector(Y) -> bool:
    """A 1-D array of label ids (one label per row, scikit-learn's multi-class ``y``)."""
    if hasattr(Y, "ndim") and not hasattr(Y, "indptr"):
        return Y.ndim == 1
    return False


def validation_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, validation) row ids: a seeded random ``fraction`` of the n rows held out
    (at least one, at most :data:`MAX_VALIDATION_ROWS`, and never all of them)."""
    n_val = int(min(max(1, round(fraction * n)), MAX_VALIDATION_ROWS, n - 1))
    order = np.random.default_rng([seed, 4]).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def epoch_learning_rate(base: float, epoch: int, planned: int, lowered: int = 0) -> float:
    """The learning rate of epoch ``epoch`` (0-based) of a run planned for ``planned`` epochs
    after ``lowered`` plateau drops: ``base`` for the first third of the plan, then halved at
    1/3, 1/2, 2/3 and 5/6 of it (a multi-step schedule), times ``PLATEAU_FACTOR ** lowered``.

    At a constant rate, Adam's lazily updated output rows settle at a noise floor that the
    rate sets: at Amazon-670K shape P@1 stalled near 0.2 at 2e-3 and rose within an epoch of
    each halving. Gradual decays (linear, cosine) spent the early epochs, where the full rate
    learns fastest, at lower rates and were 0.01-0.03 P@1 behind at every point of a ten-minute
    run; on the small real sets, which stop early, the schedule changed nothing beyond noise
    (bench/results/accuracy_experiments.md).
    """
    halvings = min(4, max(0, int(6 * epoch / max(planned, 1)) - 1))  # epochs past the plan: the last
    return base * 0.5 ** halvings * PLATEAU_FACTOR ** lowered


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------
def fit_loop(model, X, Y, *, validation=None, progress: bool = False, on_epoch=None,
             continue_training: bool = False, until_epoch: int | None = None, eval_k: int = 5,
             save_every: int | None = None, on_save=None, distributed=None,
             choice: dict | None = None):
    """Train ``model`` (see the module docstring for the step API it provides).

    Parameters
    ----------
    X, Y : training rows (CSR-convertible [n, n_features]) and labels (CSR indicator or lists).
    validation : ``(X_val, Y_val)`` scored after every epoch, or None. With the model's
        ``early_stopping`` on and no ``validation`` given, a ``validation_fraction`` slice of
        the training rows is held out for it (seeded, so a resumed run holds out the same rows).
        Never pass the test set here if it is to measure anything afterwards.
    continue_training : keep the fitted parameters (``warm_start``, ``--resume``); otherwise
        the model is initialised afresh from the training rows.
    until_epoch : train until ``model.epoch_`` reaches it (``slide train --epochs`` counts the
        total); default: the model's planned epochs more (``resolved_["epochs"]``). With early
        stopping this is the most. The learning rate of each epoch follows
        :func:`epoch_learning_rate` over these planned epochs (a run resumed with the same plan
        continues the same schedule).
    on_epoch : ``on_epoch(model, record)`` after each epoch (metrics files, checkpoints).
    save_every, on_save : ``on_save(model)`` also after every ``save_every`` batches inside an
        epoch, with ``model.epoch_position_`` set to the samples of the epoch done so far; a run
        continued from such a checkpoint skips them (the epoch's order is a function of the seed
        and the epoch), so an interruption loses at most ``save_every`` batches. Engines whose
        epochs report progress once (the heterogeneous trainer) save at epoch ends only.
    distributed : a :class:`slide.distributed.DataParallel` (the sparse engine only): X, Y are
        this rank's shard; the validation slice is held out from each shard and scored over all
        of them; every epoch ends with the replicas equal (:meth:`DataParallel.finish`); a
        mid-epoch checkpoint position is not used (a resumed run starts its next epoch).
    choice : settings to initialise with instead of the rule's (see below).

    On return the model holds the best weights seen on the validation slice (when early
    stopping), and ``model.stopping_`` says which epoch it kept and why training stopped. Where
    ``resolved_["refit"]`` holds (small training sets, see :func:`slide.config.resolve`), a
    fresh fit that held its validation slice out of ``X`` then trains again from the start on
    every row for the kept epochs, at their learning rates (``stopping_["refit"]``); not with
    ``continue_training`` or ``distributed``. Where the model offers settings to choose among
    (``resolved_["choices"]``, see :func:`slide.config.resolve`) and there is a validation set,
    each is first trained with early stopping on it, and the one with the best validation score
    is kept (``stopping_["choice"]``; ``history_`` is the chosen run's): refitted where the
    refit runs, else as it was trained. Not with ``continue_training`` or ``distributed``.
    """
    s = model.fit_settings()
    if Y is None:
        raise ValueError(f"{type(model).__name__} requires y to be passed, but the target y is None")
    single_label = _is_label_vector(Y)
    X, Y = model.check_data(X, Y, where="fit", fitted=continue_training)
    if distributed is not None:
        if s.get("refit"):
            raise ValueError("refit=True needs every row in one process; distributed training "
                             "holds shards (set refit=False or leave it to the rule)")
        X, Y = distributed.agree_shapes(X, Y)
    held_out = False
    # every row, for the refit; let go below where there is none (a checked copy of X would
    # otherwise stay in memory beside the training rows for the whole run)
    every_row = (X, Y)
    if s["early_stopping"] and validation is None and X.shape[0] > 1:
        tr, va = validation_split(X.shape[0], s["validation_fraction"], s["seed"])
        validation, X, Y = (X[va], Y[va]), X[tr], Y[tr]
        held_out = True
    if not continue_training:
        if distributed is None:
            model.initialize(X, Y, choice=choice)
        else:
            model.initialize(X, Y, distributed=distributed)
        model.single_label_ = single_label
    refit = held_out and model.resolved_["refit"] and not continue_training and distributed is None
    if not refit:
        every_row = None
    if distributed is not None:
        distributed.start(model)
    if validation is not None:
        Xv, Yv = model.check_data(*validation, where="validation", fitted=True)
        if Xv.shape[0] > MAX_VALIDATION_ROWS:
            Xv, Yv = shuffle_rows(Xv, Yv, seed=s["seed"], n=MAX_VALIDATION_ROWS)
        validation = (Xv, Yv)
    choices = model.resolved_["choices"]
    if choices and validation is not None and not continue_training and distributed is None:
        chosen = _choose(model, X, Y, validation, choices, model.resolved_["choices_on_best"],
                         keep=not refit, held_out=held_out,
                         progress=progress, on_epoch=on_epoch, until_epoch=until_epoch,
                         eval_k=eval_k, save_every=save_every, on_save=on_save)
        if refit and model.early_stopping_.scores:
            _refit(model, *every_row, s["seed"], progress, on_epoch, choice=chosen)
        return model
    stopper = None
    if s["early_stopping"] and validation is not None:
        previous = model.early_stopping_ if continue_training else None
        stopper = previous if previous is not None and not previous.stopped else \
            EarlyStopping(patience=s["n_iter_no_change"], metric=model.validation_metric())
        if stopper is not previous:
            model.best_params_ = None
    model.early_stopping_ = stopper
    metric = model.validation_metric() if stopper is None else stopper.metric
    n_rows, Xp = X.shape[0], model.preprocess(X)
    del X  # the rows as split: not needed again (0.27 GB at the full Amazon-670K size)
    first = model.epoch_
    epochs = max(0, (first + model.resolved_["epochs"] if until_epoch is None else int(until_epoch)) - first)
    for _ in range(epochs):
        if stopper is not None and stopper.stopped:
            break
        model.learning_rate_ = epoch_learning_rate(model.resolved_["lr"], model.epoch_, first + epochs,
                                                   stopper.lowered if stopper is not None else 0)
        bar = _progress_bar(progress, n_rows, f"epoch {model.epoch_ + 1}/{first + epochs}")
        order = _epoch_order(s["seed"], model.epoch_, n_rows)
        start = min(getattr(model, "epoch_position_", 0), order.size) if continue_training else 0
        order = order[start:]  # a checkpoint taken inside this epoch already holds these rows
        if distributed is not None:
            order = distributed.epoch_order(order, model.batch_size_)
        sink = bar
        if save_every and on_save is not None:
            sink = _SavingProgress(model, bar, start, save_every * model.batch_size_, on_save)
        t0 = time.perf_counter()
        if distributed is None:
            record = model.train_epoch(Xp, Y, order, sink)
        else:
            model.distributed_ = distributed
            try:
                record = model.train_epoch(Xp, Y, order, sink)
                distributed.finish(model)  # one model again before it is scored or saved
            finally:
                model.distributed_ = None
        seconds = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        model.epoch_ += 1
        model.epoch_position_ = 0
        # the rate leaves out a first batch that compiled the kernels (recorded on its own)
        first_batch = record.get("first_batch_seconds", 0.0)
        ranks = 1 if distributed is None else distributed.size
        record = {"epoch": model.epoch_, "train_seconds": seconds,
                  "samples_per_second": ranks * order.size / max(seconds - first_batch, 1e-9), **record,
                  "learning_rate": float(model.learning_rate_)}
        if distributed is not None:  # the ranks' mean loss; rates count every rank's rows
            record = distributed.mean(record, order.size)
            record["ranks"] = ranks
        if validation is not None:
            t0 = time.perf_counter()
            # the full softmax's loss costs an exp per label and row: only where it is the score
            scores = model.evaluate(*validation, k=eval_k, loss=metric == "loss")
            if distributed is not None:  # every shard's slice: the same decision on every rank
                scores = distributed.mean(scores, validation[0].shape[0])
            record.update({f"val_{k}": v for k, v in scores.items()})
            record["eval_seconds"] = time.perf_counter() - t0
        if stopper is not None:
            improved, _ = stopper.update(model.epoch_, record)  # drops: stopper.lowered
            if improved:
                # copied now because training moves on; restored at the end if nothing beats it
                model.best_params_ = model.snapshot(out=model.best_params_)
            record["best_epoch"] = stopper.best_epoch
        model.history_.append(record)
        if on_epoch is not None:
            on_epoch(model, record)
    model.stopping_ = _outcome(model, stopper, held_out, first + epochs)
    if refit and stopper.scores:
        _refit(model, *every_row, s["seed"], progress, on_epoch)
    return model


def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The rows' order in epoch ``epoch``: a function of the seed and the epoch alone, so a
    resumed run and the refit see what an uninterrupted run would."""
    return np.random.default_rng([seed, 2, epoch]).permutation(n)


def _progress_bar(progress: bool, total: int, desc: str):
    if not progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="samples", unit_scale=True, leave=True, desc=desc)


def _choose(model, X, Y, validation, choices, on_best, keep, held_out, on_epoch=None, **fit_kw):
    """Train ``model`` afresh on ``X, Y`` with each choice in ``choices``, early-stopped on
    ``validation``, and after a run that scores best so far with its :func:`next_choice` too;
    then, one by one, the best choice so far with each of ``on_best``'s settings added
    (``resolved_["choices_on_best"]``). Return the choice with the best validation score
    (ties: the earlier one) and leave the model with that run's record (``history_``,
    ``early_stopping_``, ``stopping_`` with ``"choice"``: its name, its settings and every
    run's score). With ``keep`` the model is the chosen run as trained (the best run so far is
    held while the next trains: two models in memory); otherwise its parameters are the last
    run's until the refit replaces them. ``on_epoch`` sees each run's records with the name of
    its ``"choice"``. A choice too large for this machine's free memory is not tried.
    Checkpoints saved on the way hold the run in progress: one resumed from them continues
    that run, without choosing."""
    queue, on_best = list(choices), list(on_best)
    scores, best, records, state = {}, None, None, None
    for i, choice in enumerate(queue):  # the queue grows while a run is the best so far
        name = choice_name(choice)
        shown = None if on_epoch is None else \
            (lambda m, record, name=name: on_epoch(m, {**record, "choice": name}))
        try:
            fit_loop(model, X, Y, validation=validation, choice=choice, on_epoch=shown, **fit_kw)
            scores[name] = model.early_stopping_.best_score
        except ModelTooLargeError:
            if not scores:  # the rule's own settings do not fit: nothing to choose from
                raise
        # a run whose loss diverged scores NaN: it ranks below any other
        if name in scores and (best is None or
                               _ranked(scores[name]) > _ranked(scores[choice_name(best)])):
            best = choice
            if next_choice(choice) is not None:
                queue.append(next_choice(choice))
            # the refit needs the run's kept epochs and their learning rates; with keep, the
            # whole run is held while a later run replaces it (or fails half-way)
            records = (model.early_stopping_, model.history_, model.stopping_)
            later = i < len(queue) - 1 or bool(on_best)
            state = model.fitted_state() if keep and later else None
        if i == len(queue) - 1 and on_best:  # the choices are through: add to the best one
            queue.append({**best, **on_best.pop(0)})
    if state is not None:
        model.restore_fitted(state)
    model.early_stopping_, model.history_, model.stopping_ = records
    model.stopping_ = {**model.stopping_,
                       "validation": "held out from the training rows" if held_out else "given",
                       "choice": {"chosen": choice_name(best), "settings": dict(best),
                                  "validation_scores": scores}}
    return best


def _ranked(score: float) -> float:
    return -math.inf if math.isnan(score) else score


def _refit(model, X, Y, seed, progress, on_epoch, choice=None):
    """Train ``model`` again from its initialisation (with the settings ``choice`` where one
    was made) on every row ``X, Y`` (the held-out slice too) for the epochs early stopping kept,
    each at the learning rate it had then. The run adds one record to ``history_`` (and to
    ``on_epoch``), and ``stopping_["refit"]``. Not checkpointed on the way: a run interrupted
    here resumes as the early-stopped model."""
    kept = model.stopping_["kept_epoch"]
    rates = [r["learning_rate"] for r in model.history_[:kept]]
    history, stopping, single_label = model.history_, model.stopping_, model.single_label_
    t0 = time.perf_counter()
    model.initialize(X, Y, choice=choice)
    model.single_label_ = single_label
    Xp = model.preprocess(X)
    loss = float("nan")
    for rate in rates:
        model.learning_rate_ = rate
        bar = _progress_bar(progress, X.shape[0], f"refit {model.epoch_ + 1}/{kept}")
        order = _epoch_order(seed, model.epoch_, X.shape[0])
        loss = model.train_epoch(Xp, Y, order, bar)["loss"]
        if bar is not None:
            bar.close()
        model.epoch_ += 1
    seconds = time.perf_counter() - t0
    record = {"epoch": model.epoch_, "refit": True, "train_seconds": seconds,
              "samples_per_second": kept * X.shape[0] / max(seconds, 1e-9), "loss": loss,
              "learning_rate": float(model.learning_rate_)}
    model.history_ = history + [record]
    model.stopping_ = {**stopping, "refit": {"epochs": kept, "rows": int(X.shape[0]),
                                             "seconds": seconds}}
    if on_epoch is not None:
        on_epoch(model, record)


class _SavingProgress:
    """The epoch's progress sink (a tqdm bar or None) that also saves every ``every`` samples."""

    def __init__(self, model, bar, start, every, on_save):
        self.model, self.bar, self.done, self.every, self.on_save = model, bar, start, every, on_save
        self.next = start + every
        self.total = bar.total if bar is not None else None

    def update(self, n):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        if self.done >= self.next:
            self.model.epoch_position_ = self.done
            self.on_save(self.model)
            self.next = self.done + self.every

    def reset(self, total=None):
        if self.bar is not None:
            self.bar.reset(total=total)

    def set_postfix(self, *args, **kwargs):
        if self.bar is not None:
            self.bar.set_postfix(*args, **kwargs)

    def set_postfix_str(self, *args, **kwargs):
        if self.bar is not None:
            self.bar.set_postfix_str(*args, **kwargs)


def _outcome(model, stopper, held_out, planned) -> dict:
    """Put the best weights back if training went past them; say what was kept and why."""
    if stopper is None or not stopper.scores:
        return {"kept_epoch": model.epoch_, "reason": f"ran the planned {planned} epochs",
                "validation": None}
    if stopper.best_epoch != model.epoch_ and model.best_params_ is not None:
        model.restore(model.best_params_)
    model.best_params_ = None
    return {"kept_epoch": stopper.best_epoch,
            "reason": stopper.stopped or f"reached the planned {planned} epochs",
            "best_score": stopper.best_score,
            "validation": "held out from the training rows" if held_out else "given"}


def softmax_loss(S, Y) -> tuple[float, int]:
    """Summed cross-entropy of score rows ``S`` [n, L] (numpy or cupy) against uniform targets
    over the labels of CSR ``Y`` [n, L], and the number of rows with labels."""
    xp = _array_module(S)
    counts = np.diff(Y.indptr)
    rows = np.repeat(np.arange(S.shape[0]), counts)
    m = S.max(axis=1, keepdims=True)
    lse = (m + xp.log(xp.exp(S - m).sum(axis=1, keepdims=True)))[:, 0]
    picked = S[xp.asarray(rows), xp.asarray(Y.indices)]
    per_row = xp.bincount(xp.asarray(rows), weights=picked.astype(xp.float64),
                          minlength=S.shape[0]) / xp.asarray(np.maximum(counts, 1))
    has = xp.asarray(counts > 0)
    return float((lse.astype(xp.float64) - per_row)[has].sum()), int((counts > 0).sum())


#: engine classes whose kernels this process has already compiled (progress bars say so once)
_WARM: dict = {}


def _logsumexp_rows(S):
    """log Σ exp over each row of score rows ``S`` [n, L] (numpy or cupy), float32 [n]."""
    xp = _array_module(S)
    m = S.max(axis=1)
    return m + xp.log(xp.exp(S - m[:, None]).sum(axis=1))


def _array_module(a):
    """numpy, or cupy for a device array (cupy is imported only when one is passed)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy.get_array_module(a)


# --------------------------------------------------------------------------------------------
# What every trainable model shares
# --------------------------------------------------------------------------------------------
class TrainableMixin:
    """The engine-independent half of the step API and of the estimator interface.

    A subclass provides ``fit_settings``, ``check_data``, ``initialize`` (which sets
    ``config_`` and ``choice_``, then calls :meth:`fit_data`), ``train_step``,
    ``predict_topk`` and ``_params_changed`` (called after :meth:`restore`), and keeps its
    parameters in the dict ``params_`` (numpy or cupy arrays) and its preprocessing in
    ``preprocessor_``.
    """

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True  # CSR is the native input
        tags.target_tags.required = True
        tags.target_tags.multi_output = True  # Y: a label-indicator matrix or label lists
        tags.classifier_tags = ClassifierTags(multi_class=True, multi_label=True)
        return tags

    def fit_data(self, X, Y, distributed=None) -> None:
        """Learn what the defaults rule reads from the training rows (``initialize``'s first
        step, after ``config_`` and ``choice_`` are set): ``n_features_in_``, ``n_labels_``,
        ``n_train_``, the preprocessing ``preprocessor_`` (``config_.norm``, and idf weighting
        as :func:`slide.config.idf_weighted` says) fitted on ``X``,
        ``rare_share_`` (:func:`slide.config.rare_share`) and ``labels_per_row_``. With
        ``distributed`` (a :class:`slide.distributed.DataParallel`), ``X``, ``Y`` are this
        rank's shard and the counts and feature statistics are the whole data's."""
        n_train = X.shape[0] if distributed is None else distributed.total(X.shape[0])
        n_positives = Y.nnz if distributed is None else distributed.total(Y.nnz)
        self.n_features_in_, self.n_labels_, self.n_train_ = X.shape[1], Y.shape[1], n_train
        self.preprocessor_ = Preprocessor(self.config_.norm,
                                          idf_weighted(self.config_, self.choice_)).fit(X)
        if distributed is not None:
            distributed.merge_preprocessor(self.preprocessor_)
        self.rare_share_ = rare_share(self.preprocessor_.document_frequency_)
        self.labels_per_row_ = n_positives / max(n_train, 1)

    def preprocess(self, X):
        """The model's fitted preprocessing of CSR ``X`` (float32 CSR, same shape)."""
        return self.preprocessor_.transform(X)

    def train_epoch(self, Xp, Y, order, progress=None) -> dict:
        """One pass over preprocessed rows ``Xp``/``Y`` in ``order``, in consecutive batches."""
        bs = self.batch_size_
        total = 0.0
        compiling = not _WARM.get(type(self).__name__)
        compile_seconds = 0.0
        if compiling and progress is not None:  # numba compiles inside the first batch
            progress.set_postfix_str("compiling kernels (first run only)")
        Xb = Yb = None  # each batch's rows go into the matrices of the batch before
        for lo in range(0, order.size, bs):
            idx = np.sort(order[lo:lo + bs])
            t0 = time.perf_counter()
            Xb, Yb = take_rows(Xp, idx, out=Xb), take_rows(Y, idx, out=Yb)
            loss = self.train_step(Xb, Yb)
            total += loss * idx.size
            if compiling:
                _WARM[type(self).__name__] = True
                compiling = False
                compile_seconds = time.perf_counter() - t0
                if progress is not None:
                    progress.reset(total=progress.total)  # rate and time left start after compile
            if progress is not None:
                progress.update(idx.size)
                progress.set_postfix(batch_loss=f"{loss:.3f}", refresh=False)
        if compile_seconds:
            return {"loss": total / max(order.size, 1), "first_batch_seconds": compile_seconds}
        return {"loss": total / max(order.size, 1)}

    def snapshot(self, out: dict | None = None) -> dict:
        """A copy of the parameters (device arrays stay on their device); with ``out``, an
        earlier snapshot of the same arrays, copied into its arrays instead of new ones (early
        stopping's best weights: a second copy made beside the first was the peak of a whole
        run, 413 MB above the rest at 670K labels)."""
        if out is None or out.keys() != self.params_.keys() or \
                any(out[k].shape != v.shape for k, v in self.params_.items()):
            return {k: v.copy() for k, v in self.params_.items()}
        for k, v in self.params_.items():
            out[k][...] = v
        return out

    def restore(self, state: dict) -> None:
        """Put parameters from :meth:`snapshot` back in place."""
        for k, v in state.items():
            self.params_[k][...] = v
        self._params_changed()

    def fitted_state(self) -> dict:
        """The fitted model's attributes, for :meth:`restore_fitted` after another run (see
        :func:`fit_loop`'s choices). A shallow copy suffices: ``initialize`` binds every
        fitted attribute to new objects, so a later run leaves the ones held here untouched."""
        return dict(vars(self))

    def restore_fitted(self, state: dict) -> None:
        """Make the run :meth:`fitted_state` held the model's again (its settings included)."""
        vars(self).clear()
        vars(self).update(state)

    def evaluate(self, X, Y, k: int = 5, loss: bool = False, **predict_kw) -> dict:
        """P@1..k and nDCG@1..k (reported at 1, 3, 5 and k) of the top-k predictions, and with
        ``loss`` the mean cross-entropy against uniform targets over each row's labels (rows
        without labels are left out of it), from the same exact scores."""
        from slide.metrics import evaluate as evaluate_topk
        X, Y = self.check_data(X, Y, where="evaluate", fitted=True)
        if predict_kw or not loss:
            return evaluate_topk(Y, self.predict_topk(X, k, **predict_kw)[0], k)
        top = np.empty((X.shape[0], k), np.int64)
        total, rows = 0.0, 0
        for lo, hi, S in self.score_blocks(X):
            top[lo:hi] = self.block_topk(S, k)[0]
            s, n = softmax_loss(S, Y[lo:hi])
            total, rows = total + s, rows + n
        return {**evaluate_topk(Y, top, k), "loss": total / max(rows, 1)}

    def score(self, X, y=None) -> float:
        """P@1 (for scikit-learn's model selection)."""
        if y is None:
            self.check_data(X, where="score", fitted=True)
            raise ValueError("score needs the true labels y")
        return self.evaluate(X, y, k=1)["P@1"]

    def predict(self, X, k: int = 1):
        """Label-indicator matrix of each row's top ``k`` labels: scipy CSR [n, n_labels] of
        0/1 int8, the form scikit-learn's multi-label metrics and scorers take. A model fitted
        on a 1-D ``y`` (one label id per row) returns the top label ids, int64 [n], as
        scikit-learn's classifiers do."""
        if getattr(self, "single_label_", False) and k == 1:
            return self.predict_topk(X, 1)[0][:, 0]
        ids = self.predict_topk(X, k)[0]
        n = ids.shape[0]
        keep = ids >= 0
        indptr = np.concatenate([[0], np.cumsum(keep.sum(axis=1))])
        return sp.csr_matrix((np.ones(int(keep.sum()), np.int8), ids[keep], indptr),
                             shape=(n, self.n_labels_))

    def predict_proba(self, X) -> np.ndarray:
        """Softmax probability of every label, float32 [n, n_labels] on the host (dense: n ×
        n_labels × 4 bytes; for wide layers use :meth:`predict_topk_proba`)."""
        if not self.__sklearn_is_fitted__():
            raise NotFittedError(f"this {type(self).__name__} is not fitted yet; call fit first")
        X = self.check_data(X, where="predict_proba", fitted=True)
        out = np.empty((X.shape[0], self.n_labels_), np.float32)
        for lo, hi, S in self.score_blocks(X):
            xp = _array_module(S)
            P = xp.exp(S - _logsumexp_rows(S)[:, None])
            out[lo:hi] = P if xp is np else P.get()
        return out

    def predict_topk_proba(self, X, k: int = 5):
        """Exact top-k labels and their softmax probabilities (normalised over every label):
        ``(ids int64 [n, k], probabilities float32 [n, k])``, best first."""
        X = self.check_data(X, where="predict", fitted=True)
        ids = np.empty((X.shape[0], k), np.int64)
        probs = np.empty((X.shape[0], k), np.float32)
        for lo, hi, S in self.score_blocks(X):
            lse = _logsumexp_rows(S)
            ids[lo:hi], top = self.block_topk(S, k)
            lse = lse if isinstance(lse, np.ndarray) else lse.get()
            probs[lo:hi] = np.exp(top - lse[:, None])
        return ids, probs


# --------------------------------------------------------------------------------------------
# The ``slide train`` run
# --------------------------------------------------------------------------------------------
def _write_json(path, obj):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def load_train_test(train=None, test=None, seed=0, log=print):
    """Read the files (or generate the built-in dataset) and return train and test splits."""
    if train is None:
        log("no training file given: generating the built-in 'demo' dataset (synthetic, "
            "Amazon-670K-like, 20,000 train / 4,000 test samples)")
        return load_default(seed)
    Xtr, Ytr = read_dataset(train)
    Xte = Yte = None
    if test is not None:
        Xte, Yte = read_dataset(test, n_features=Xtr.shape[1], n_labels=Ytr.shape[1])
        if Xte.shape[1] != Xtr.shape[1] or Yte.shape[1] != Ytr.shape[1]:
            raise DataFormatError(f"{test}: {Xte.shape[1]} features / {Yte.shape[1]} labels, but "
                                  f"{train} has {Xtr.shape[1]} / {Ytr.shape[1]}")
    return Xtr, Ytr, Xte, Yte


def _shown_value(key, value):
    """A record's value as ``slide train`` prints it: floats to 4 decimals, the learning rate
    to 3 significant digits (late in the schedule it is below 1e-4)."""
    if key == "learning_rate":
        return f"{value:.3g}"
    return round(value, 4) if isinstance(value, float) else value


def run_training(model, Xtr, Ytr, Xte=None, Yte=None, epochs=None, metrics_json=None,
                 checkpoint_dir=None, progress=True, log=print, resume=False, save_every=None,
                 distributed=None):
    """Train ``model`` (engine, dense reference or heterogeneous trainer) the way ``slide
    train`` does: validation held out from the training rows, the test set (if any) scored
    after every epoch for the record only, ``metrics_json`` rewritten after every epoch (with
    ``resume``, the records already in it are kept and the new epochs appended) and a
    checkpoint saved to ``checkpoint_dir`` after every epoch and at the end.

    ``epochs`` is the total (with ``resume``, counting the checkpoint's epochs). ``save_every``
    also checkpoints every that many batches inside an epoch. ``distributed``: see
    :func:`fit_loop` (every rank calls this with its shard; give the outputs to rank 0 only).
    """
    test = None
    if Xte is not None:
        # test files may be sorted by label: score a seeded shuffled subsample
        test = shuffle_rows(Xte, Yte, seed=0, n=min(Xte.shape[0], MAX_VALIDATION_ROWS))
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in model.get_params().items()}
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

    def on_epoch(m, record):
        record = dict(record)
        if test is not None:
            t0 = time.perf_counter()
            record.update({f"test_{k}": v for k, v in m.evaluate(*test).items()})
            record["test_eval_seconds"] = time.perf_counter() - t0
        record["peak_rss_mb"] = peak_rss_mb()
        doc["epochs"].append(record)
        doc["peak_rss_mb"] = record["peak_rss_mb"]
        doc["resolved"] = getattr(m, "resolved_", None)
        if getattr(m, "timings_", None):
            doc["timings"] = dict(m.timings_)
        shown = {"epoch": "epoch", "loss": "mean_train_loss", "val_loss": "val_loss",
                 "val_nDCG@5": "val_nDCG@5", "val_P@1": "val_P@1", "learning_rate": "lr",
                 "test_P@1": "test_P@1", "test_P@5": "test_P@5", "samples_per_second": "samples/s",
                 "refit": "refit"}
        run = f"[{record['choice']}]  " if "choice" in record else ""  # a run fit chooses among
        log(run + "  ".join(f"{name}={_shown_value(k, record[k])}" for k, name in shown.items()
                            if k in record))
        if metrics_json:
            _write_json(metrics_json, doc)
        if checkpoint_dir:
            m.save(checkpoint_dir)

    t0 = time.perf_counter()
    fit_loop(model, Xtr, Ytr, until_epoch=epochs if epochs is not None else
             (model.resolved_["epochs"] if resume else None),
             progress=progress, on_epoch=on_epoch, continue_training=resume,
             save_every=save_every if checkpoint_dir else None,
             on_save=lambda m: m.save(checkpoint_dir), distributed=distributed)
    doc["wall_seconds"] = time.perf_counter() - t0
    doc["stopping"] = model.stopping_
    if test is not None:
        doc["test"] = model.evaluate(*test)
    if metrics_json:
        _write_json(metrics_json, doc)
    if checkpoint_dir:
        model.save(checkpoint_dir)
    return doc
