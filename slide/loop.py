"""The one training loop: epochs over a written protocol, returning the run's record.

A model takes part by providing :class:`Trainable` (the engine, the dense reference); the
epochs themselves run through a :class:`EpochRunner`, the model by default, or a way of running
them over the same training state (the heterogeneous trainer). The loop holds the learning-rate
plan (:func:`epoch_learning_rate`), the per-epoch record, validation, early stopping with the
best weights kept, the learning rate lowered on a plateau, progress bars, callbacks and
mid-epoch checkpoints. Everything it decides goes into a :class:`FitRecord`, which it returns;
it sets nothing on the model.

What surrounds the loop (the validation slice, the settings chosen on it, the refit on every
row) is :func:`slide.fitting.fit_model`.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

from slide import signals

__all__ = ["Trainable", "EpochRunner", "FitRecord", "EarlyStopping", "run_epochs",
           "refit_epochs", "epoch_learning_rate", "epoch_order", "validation_split",
           "PLATEAU_FACTOR", "MAX_VALIDATION_ROWS", "MIN_RATE_SHARE", "FLAT_GAIN", "FIRST_CYCLE",
           "first_cycle"]

# After half the patience without improvement the learning rate is multiplied by this
# (ReduceLROnPlateau): the plateau is usually Adam's noise floor, which a lower rate gets under.
PLATEAU_FACTOR = 0.3
# With early stopping, a run stops once the plan and the plateau drops have taken the learning
# rate below this share of its start: the epochs left would move the weights too little to
# change the ranking (docs/early-stopping.md).
MIN_RATE_SHARE = 0.01
# While the rate is the plan's first, an epoch whose validation nDCG@5 moves by less than this
# share of itself (and by less than twice it over two epochs) ends that first phase: the plan is
# cut to three times the epochs run, so that its halvings follow at once, each phase half as
# long as the first (docs/learning-rate.md).
FLAT_GAIN = 0.02
# A sampled output's learning-rate plan starts with a cycle of this many epochs (its rates: the
# first, half of it, an eighth), then runs again from its first rate: the first cycle's end is
# ranked well after a few epochs, which the long plan reaches only after its first halving
# (docs/learning-rate.md).
FIRST_CYCLE = 3
# Validation rows scored per evaluation, at most. Scoring is exact (every label), so on wide
# output layers a larger slice would cost more than the epoch it judges; 5,000 rows give P@1
# to about ±0.007.
MAX_VALIDATION_ROWS = 5000


class EpochRunner(Protocol):
    """Runs one epoch (or a stream's pass) of preprocessed rows over a model's parameters."""

    def train_epoch(self, Xp, Y, order, progress=None, learning_rate: float | None = None) -> dict:
        """One pass over rows ``order`` of ``Xp`` / ``Y`` at ``learning_rate``; returns a dict
        with the mean ``loss`` and anything else worth recording."""


class Trainable(EpochRunner, Protocol):
    """What the loop needs of a model (the engine, the dense reference).

    ``batch_size_`` (the steps' batch), ``resolved_`` (concrete settings: ``epochs``,
    ``refit``, ``lr``, ``choices``) and ``record_`` (the :class:`FitRecord` that
    ``initialize`` starts) are read; the model's own attributes are never written.
    """

    batch_size_: int
    resolved_: dict
    record_: "FitRecord"

    def fit_settings(self) -> dict:
        """early_stopping, validation_fraction, n_iter_no_change, refit and seed, valid before
        the model is fitted."""

    def check_data(self, X, Y=None, where: str = "input", fitted: bool = True): ...

    def initialize(self, X, Y, choice: dict | None = None, distributed=None,
                   stream: bool = False, slow_rows: bool | None = None) -> None:
        """Fresh preprocessing fitted on X, fresh parameters and a fresh ``record_``;
        ``slow_rows``: the decision of rows updated in few steps, where it stands."""

    def preprocess(self, X): ...

    def snapshot(self, out: dict | None = None) -> dict: ...

    def restore(self, params: dict) -> None: ...

    def evaluate(self, X, Y, k: int = 5, loss: bool = False) -> dict: ...

    def validation_metric(self) -> str:
        """``"loss"`` or ``"nDCG@5"`` (see :class:`EarlyStopping`)."""

    def fitted_state(self) -> dict: ...

    def restore_fitted(self, state: dict) -> None: ...


@dataclass
class EarlyStopping:
    """Validation bookkeeping: best score and epoch, evaluations without improvement.

    ``metric`` names the score: ``"loss"``, the validation cross-entropy against uniform
    targets over each row's labels, negated, for an output layer trained whole (on small
    validation slices it picks better epochs than P@k, which moves in steps of one row); or
    ``"nDCG@5"`` for a sampled output layer, whose training never sees the full softmax's
    normaliser (docs/early-stopping.md). ``patience`` evaluations without an improvement larger
    than ``tol`` (relative) stop the run; after every ``max(1, patience // 2)`` of them the
    learning rate is lowered. ``plan_end``: the epochs the learning-rate plan was cut to when
    the score flattened at its first rate (:meth:`cut_plan`; 0: not cut).

    ``first_cycle``: the epochs of a short first cycle of the learning-rate plan
    (:func:`epoch_learning_rate`; 0: none). At its end (:meth:`restart`) the plan starts again
    from its first rate, and patience, plateau drops and the cut judge that second cycle's
    scores alone (``scores``, ``cycle_best``), while ``best_score`` and ``best_epoch`` stay the
    whole run's, whose weights are kept: a second cycle that never passes the first's best
    ends with the first's weights.
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
    plan_end: int = 0
    first_cycle: int = 0
    cycle_best: float = -math.inf

    def score(self, metrics: dict) -> float:
        if self.metric == "loss":
            return -float(metrics["val_loss"])
        return float(metrics[f"val_{self.metric}"])

    def update(self, epoch: int, metrics: dict) -> tuple[bool, bool]:
        """Record epoch ``epoch``'s metrics; returns ``(best of the run, lower_learning_rate)``."""
        s = self.score(metrics)
        self.scores.append(s)
        best = self.best_epoch == 0 or s > self.best_score + self.tol * abs(self.best_score)
        if best:
            self.best_score, self.best_epoch = s, epoch
        if len(self.scores) == 1 or s > self.cycle_best + self.tol * abs(self.cycle_best):
            self.cycle_best, self.bad_epochs = s, 0
            return best, False
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            self.stopped = (f"no improvement of the validation score for {self.patience} epochs "
                            f"(best {self.best_score:.4f} at epoch {self.best_epoch})")
        lower = not self.stopped and self.bad_epochs % max(1, self.patience // 2) == 0
        self.lowered += lower
        return False, lower

    def restart(self) -> None:
        """The learning-rate plan's second cycle begins (see the class docstring)."""
        self.scores, self.cycle_best, self.bad_epochs, self.lowered = [], -math.inf, 0, 0

    def cut_plan(self, epoch: int, planned: int, first_rate: bool) -> int:
        """The planned epochs after epoch ``epoch`` (1-based) of a plan of ``planned``:
        ``3 x`` the epochs of the plan's cycle so far (after the first cycle, where there is
        one) where the score is flat at the plan's first rate (``first_rate``) and the plan
        was not cut before; the plan as it stands otherwise.

        Flat: this epoch moved the score by less than :data:`FLAT_GAIN` of it, up or down (the
        floor's noise goes both ways), and the last two epochs together by less than twice
        that (one epoch's change is noisy: a dip that the next epoch recovers, or a small step
        between two large ones, is not the floor). A larger fall is not flat either: the rate is
        too high for the data, which the plateau's drop answers without shortening the plan.
        Only a ranking score (nDCG@5, a sampled output's) is judged: a loss can fall by under
        2% an epoch while the ranking it scores still gains, and whole outputs lost P@1 to the
        cut."""
        if self.plan_end:
            return min(planned, self.plan_end)
        s = self.scores
        if self.metric != "loss" and first_rate and len(s) >= 3 and not self.lowered and \
                epoch > self.first_cycle:
            flat = abs(s[-1] - s[-2]) < FLAT_GAIN * abs(s[-1]) and \
                abs(s[-1] - s[-3]) < 2 * FLAT_GAIN * abs(s[-1])
            cut = self.first_cycle + 3 * (epoch - self.first_cycle)
            if flat and cut < planned:
                self.plan_end = cut
                return self.plan_end
        return planned

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("best_score", "cycle_best"):
            d[k] = None if d[k] == -math.inf else d[k]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "EarlyStopping":
        d = dict(d)
        d["best_score"] = -math.inf if d.get("best_score") is None else float(d["best_score"])
        # written before cycles: one cycle, whose best is the run's
        d["cycle_best"] = d["best_score"] if "cycle_best" not in d else \
            -math.inf if d["cycle_best"] is None else float(d["cycle_best"])
        return cls(**d)


@dataclass
class FitRecord:
    """What a run decided and measured; saved with the model.

    ``epoch``: epochs trained; ``epoch_position``: samples of the next epoch already trained
    (a mid-epoch checkpoint); ``history``: one dict per epoch; ``early_stopping``; ``best_params``
    (the best epoch's weights while the run goes on); ``stopping``: the epoch kept and why the
    run stopped (and ``"choice"``, ``"refit"`` where those ran); ``single_label``: fitted on a
    1-D ``y``; ``plan``: the planner's report (:class:`slide.planner.Planner`), if one planned.
    """
    epoch: int = 0
    epoch_position: int = 0
    history: list = field(default_factory=list)
    early_stopping: EarlyStopping | None = None
    best_params: dict | None = None
    stopping: dict | None = None
    single_label: bool = False
    plan: dict | None = None

    def to_checkpoint(self, host=None) -> tuple[dict, dict]:
        """``(arrays, meta)`` for a checkpoint: the best weights as ``best.*`` arrays (through
        ``host``, which brings device arrays home), the rest as JSON."""
        best = self.best_params or {}
        arrays = {f"best.{k}": v if host is None else host(v) for k, v in best.items()}
        meta = {"epoch": self.epoch, "epoch_position": self.epoch_position,
                "history": self.history, "stopping": self.stopping,
                "single_label": bool(self.single_label), "plan": self.plan,
                "early_stopping": self.early_stopping.to_json() if self.early_stopping else None}
        return arrays, meta

    @classmethod
    def from_checkpoint(cls, ck, shapes: dict) -> "FitRecord":
        """The record a :class:`slide.checkpoint.Checkpoint` holds; ``shapes``: the parameters'
        shapes, which its best weights are checked against."""
        best = ck.arrays_like(shapes, prefix="best.", missing_ok=True)
        return cls(epoch=ck.epoch,
                   epoch_position=ck.int("epoch_position", 0, minimum=0, maximum=ck.n_train),
                   history=ck.records("history"),
                   early_stopping=ck.parsed("early_stopping", EarlyStopping.from_json),
                   best_params=best or None, stopping=ck.object("stopping"),
                   single_label=bool(ck.meta.get("single_label", False)),
                   plan=ck.object("plan"))


def validation_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, validation) row ids: a seeded random ``fraction`` of the n rows held out
    (at least one, at most :data:`MAX_VALIDATION_ROWS`, and never all of them)."""
    n_val = int(min(max(1, round(fraction * n)), MAX_VALIDATION_ROWS, n - 1))
    order = np.random.default_rng([seed, 4]).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def epoch_learning_rate(base: float, epoch: int, planned: int, lowered: int = 0,
                        first_cycle: int = 0) -> float:
    """The learning rate of epoch ``epoch`` (0-based) of a run planned for ``planned`` epochs
    after ``lowered`` plateau drops: ``base`` for the first third of the plan, then halved at
    1/3, 1/2, 2/3 and 5/6 of it, times ``PLATEAU_FACTOR ** lowered``. At a constant rate Adam's
    lazily updated rows settle at a noise floor the rate sets (docs/learning-rate.md).

    With a ``first_cycle``, the plan runs twice: first over that many epochs (three: ``base``,
    ``base / 2``, ``base / 8``), which gives a model ranked well early, then over the rest from
    ``base`` again, which gives the final one (docs/learning-rate.md)."""
    if epoch < first_cycle:
        return epoch_learning_rate(base, epoch, first_cycle)
    epoch, planned = epoch - first_cycle, planned - first_cycle
    halvings = min(4, max(0, int(6 * epoch / max(planned, 1)) - 1))  # past the plan: the last
    return base * 0.5 ** halvings * PLATEAU_FACTOR ** lowered


def first_cycle(metric: str, planned: int) -> int:
    """The epochs of the learning-rate plan's short first cycle for a run of ``planned`` epochs
    judged by ``metric``: :data:`FIRST_CYCLE` where the score ranks (a sampled output's) and the
    plan leaves the second cycle at least twice as many epochs; none otherwise (whole outputs
    stop early long before a second cycle would matter)."""
    if metric == "loss" or planned < 3 * FIRST_CYCLE:
        return 0
    return FIRST_CYCLE


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The rows' order in epoch ``epoch``: a function of the seed and the epoch alone, so a
    resumed run and the refit see what an uninterrupted run would."""
    return np.random.default_rng([seed, 2, epoch]).permutation(n)


def progress_bar(progress: bool, total: int, desc: str):
    if not progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="samples", unit_scale=True, leave=True, desc=desc)


def run_epochs(model: Trainable, Xp, Y, *, record: FitRecord, seed: int, validation=None,
               stopper: EarlyStopping | None = None, planned: int, runner: EpochRunner = None,
               progress: bool = False, on_epoch=None, continue_training: bool = False,
               eval_k: int = 5, save_every: int | None = None, on_save=None,
               distributed=None, held_out: bool = False) -> FitRecord:
    """Train ``model`` on preprocessed rows ``Xp`` / ``Y`` until ``record.epoch`` reaches
    ``planned`` or ``stopper`` stops the run; returns ``record`` with the epochs added.

    Each epoch runs through ``runner`` (default: the model) at the rate of
    :func:`epoch_learning_rate` over the ``planned`` epochs. ``validation`` ``(X, Y)``, checked,
    is scored after each; with ``stopper`` the best weights are kept in ``record.best_params``
    and put back at the end (``record.stopping`` says which epoch and why). ``on_epoch(model,
    entry)`` after each epoch; ``on_save(model)`` also every ``save_every`` batches inside one,
    ``record.epoch_position`` then giving the samples done (a run continued from such a
    checkpoint skips them, ``continue_training``). ``distributed``: a
    :class:`slide.distributed.DataParallel`; ``Xp``, ``Y`` are this rank's shard, and the
    loss, rates and validation scores are the ranks' means.
    """
    runner = model if runner is None else runner
    metric = model.validation_metric() if stopper is None else stopper.metric
    n_rows = Xp.shape[0]
    if stopper is not None and stopper.plan_end:  # cut before this call (a resumed run)
        planned = max(record.epoch, min(planned, stopper.plan_end))
    first_cycle = stopper.first_cycle if stopper is not None else 0
    while record.epoch < planned:
        if stopper is not None and stopper.stopped:
            break
        if first_cycle and record.epoch == first_cycle:
            stopper.restart()  # idempotent: a resumed run may come here twice
        rate = epoch_learning_rate(model.resolved_["lr"], record.epoch, planned,
                                   stopper.lowered if stopper is not None else 0, first_cycle)
        if stopper is not None and stopper.scores and rate < MIN_RATE_SHARE * model.resolved_["lr"]:
            stopper.stopped = (f"the learning rate fell below {MIN_RATE_SHARE:g} of its start "
                               f"(best {stopper.best_score:.4f} at epoch {stopper.best_epoch})")
            break
        bar = progress_bar(progress, n_rows, f"epoch {record.epoch + 1}/{planned}")
        order = epoch_order(seed, record.epoch, n_rows)
        start = min(record.epoch_position, order.size) if continue_training else 0
        order = order[start:]  # a checkpoint taken inside this epoch already holds these rows
        if distributed is not None:
            order = distributed.epoch_order(order, model.batch_size_)
        sink = _EpochProgress(model, record, bar, start, distributed,
                              save_every * model.batch_size_ if save_every and on_save else None,
                              on_save)
        t0 = time.perf_counter()
        entry = runner.train_epoch(Xp, Y, order, sink, learning_rate=rate)
        seconds = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        record.epoch += 1
        record.epoch_position = 0
        # the rate leaves out a first batch that compiled the kernels (recorded on its own)
        first_batch = entry.get("first_batch_seconds", 0.0)
        ranks = 1 if distributed is None else distributed.replicas
        entry = {"epoch": record.epoch, "train_seconds": seconds,
                 "samples_per_second": ranks * order.size / max(seconds - first_batch, 1e-9),
                 **entry, "learning_rate": float(rate)}
        if distributed is not None:  # the ranks' mean loss; rates count every rank's rows
            entry = distributed.mean(entry, order.size)
            entry["ranks"] = distributed.ranks
        if validation is not None:
            t0 = time.perf_counter()
            # the full softmax's loss costs an exp per label and row: only where it is the score
            scores = model.evaluate(*validation, k=eval_k, loss=metric == "loss")
            if distributed is not None:  # every shard's slice: the same decision on every rank
                scores = distributed.mean(scores, validation[0].shape[0])
            entry.update({f"val_{k}": v for k, v in scores.items()})
            entry["eval_seconds"] = time.perf_counter() - t0
        if stopper is not None:
            improved, _ = stopper.update(record.epoch, entry)  # drops: stopper.lowered
            if improved:
                # copied now because training moves on; restored at the end if nothing beats it
                record.best_params = model.snapshot(out=record.best_params)
            entry["best_epoch"] = stopper.best_epoch
            cut = stopper.cut_plan(record.epoch, planned, rate == model.resolved_["lr"])
            if cut < planned:  # a new cut: three times the cycle's epochs, so never behind them
                planned = cut
                entry["planned_epochs"] = planned
        record.history.append(entry)
        if on_epoch is not None:
            on_epoch(model, entry)
    record.stopping = _outcome(model, record, stopper, held_out, planned)
    return record


def refit_epochs(model: Trainable, Xp, Y, rates: list, *, seed: int, runner=None,
                 progress: bool = False) -> tuple[float, float]:
    """Train a freshly initialised ``model`` on every row for ``len(rates)`` epochs, epoch e at
    ``rates[e]`` in epoch e's order; returns (last epoch's loss, seconds)."""
    runner = model if runner is None else runner
    record = model.record_
    t0 = time.perf_counter()
    loss = float("nan")
    for rate in rates:
        bar = progress_bar(progress, Xp.shape[0], f"refit {record.epoch + 1}/{len(rates)}")
        order = epoch_order(seed, record.epoch, Xp.shape[0])
        sink = _EpochProgress(model, record, bar, 0, None, None, None)
        try:
            loss = runner.train_epoch(Xp, Y, order, sink, learning_rate=rate)["loss"]
        except signals.TrainingStopped as e:
            raise signals.TrainingStopped(e.signum, resumable=False) from None
        if bar is not None:
            bar.close()
        record.epoch += 1
    return loss, time.perf_counter() - t0


class _EpochProgress:
    """The epoch's progress sink, told of every batch: it moves the bar (a tqdm bar or None),
    keeps ``record.epoch_position``, saves every ``every`` samples where that is set, and ends
    the epoch with :class:`slide.signals.TrainingStopped` at a stop request (the position then
    holds the batches done, for a checkpoint of it)."""

    def __init__(self, model, record, bar, start, distributed, every, on_save):
        self.model, self.record, self.bar = model, record, bar
        self.done, self.every, self.on_save = start, every, on_save
        self.distributed = distributed
        self.next = start + every if every else None
        self.total = bar.total if bar is not None else None

    def update(self, n):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        self.record.epoch_position = self.done
        if self.next is not None and self.done >= self.next:
            self.on_save(self.model)
            self.next = self.done + self.every
        signals.check(self.distributed)

    def reset(self, total=None):
        if self.bar is not None:
            self.bar.reset(total=total)

    def set_postfix(self, *args, **kwargs):
        if self.bar is not None:
            self.bar.set_postfix(*args, **kwargs)

    def set_postfix_str(self, *args, **kwargs):
        if self.bar is not None:
            self.bar.set_postfix_str(*args, **kwargs)


def _outcome(model, record: FitRecord, stopper, held_out, planned) -> dict:
    """Put the best weights back if training went past them; say what was kept and why."""
    if stopper is None or not stopper.best_epoch:
        return {"kept_epoch": record.epoch, "reason": f"ran the planned {planned} epochs",
                "validation": None}
    if stopper.best_epoch != record.epoch and record.best_params is not None:
        model.restore(record.best_params)
    record.best_params = None
    return {"kept_epoch": stopper.best_epoch,
            "reason": stopper.stopped or f"reached the planned {planned} epochs",
            "best_score": stopper.best_score,
            "validation": "held out from the training rows" if held_out else "given"}
