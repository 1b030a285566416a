"""Hyperparameters, the rule that derives the unset ones from the data's shape, and the
parameter layout shared by the sparse engine and the dense reference.

:class:`SlideConfig` is the one validated record of a model's settings; ``None`` in a field
means "derive it from the data" and :func:`resolve` applies the documented rule (see its
docstring and the README) to the training set's rows, features and labels.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np

from lsh import autotune
from lsh.tables import bucket_size_for
from slide.loop import FIRST_CYCLE, first_cycle

__all__ = ["SlideConfig", "resolve", "active_target", "FULL_OUTPUT_LABELS", "NEGATIVE_SOURCES", "CLUSTER_NEGATIVES", "CLUSTER_LABELS", "tables_for_rows", "MAX_BUCKET_SIZE", "checked_setting", "checked_choice", "idf_weighted", "CHOICE_CHECKS", "sampled_width", "sample_negatives", "touched_share",
           "rare_share", "planned_epochs", "init_parameters", "hidden_blocks", "hidden_block", "FIXED_AFTER_FIT",
           "HASH_FAMILIES", "BUCKET_POLICIES", "ACTIVATIONS"]

HASH_FAMILIES = ("dwta", "wta", "simhash")
#: where a sample's hard negatives come from: the LSH tables, or the label clusters
#: (:mod:`slide.candidates`)
NEGATIVE_SOURCES = ("lsh", "clusters")
BUCKET_POLICIES = ("reservoir", "fifo")
#: the hidden layers' activation: max(0, a) or a itself (scikit-learn's names)
ACTIVATIONS = ("relu", "identity")
#: settings that fix the shapes of the parameters, tables and scratch, or what the weights mean:
#: a fitted model cannot change them and continue training (the estimator refuses, and so does
#: ``slide train --resume`` for the flags that set them)
FIXED_AFTER_FIT = ("hidden", "hidden_sparsity", "activation", "sparsity", "hard_negatives",
                   "negatives_from", "hash_family", "K", "L", "range_pow", "bucket_size",
                   "bucket_policy", "norm", "tfidf")


def _number(name, value, *, lo=None, hi=None, integer=False, none=True, lo_open=False):
    """Validate one numeric setting: a finite real (or int) within [lo, hi] (or (lo, hi])."""
    if value is None:
        if none:
            return None
        raise ValueError(f"{name} must be set")
    if type(value) is int and (lo is None or (value > lo if lo_open else value >= lo)) and \
            (hi is None or value <= hi):
        return value if integer else float(value)  # the common case, without the ABCs' checks
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if integer and not (isinstance(value, numbers.Integral) or float(value).is_integer()):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")
    return int(value) if integer else float(value)


def _flag(name, value, *, none=True):
    """Validate one switch: True or False (or None, "not given", with ``none``)."""
    if value is None and none:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True{', False or None' if none else ' or False'}, "
                        f"got {value!r}")
    return bool(value)


#: the bounds each numeric setting is checked against (:func:`_number`'s keywords)
_NUMBER_CHECKS = {
    "sparsity": dict(lo=0, hi=1, lo_open=True),
    "hard_negatives": dict(lo=0, hi=1 << 20, integer=True),
    "K": dict(lo=1, hi=32, integer=True), "L": dict(lo=1, hi=4096, integer=True),
    "range_pow": dict(lo=1, hi=30, integer=True), "bucket_size": dict(lo=1, hi=1 << 16, integer=True),
    "rehash_every": dict(lo=1, integer=True), "rebuild_every": dict(lo=1, integer=True),
    "rehash_growth": dict(lo=1, hi=100, none=False),
    "lr": dict(lo=0, hi=10, lo_open=True), "beta1": dict(lo=0, hi=0.999999, none=False),
    "beta2": dict(lo=0, hi=0.999999, none=False), "eps": dict(lo=0, hi=1, lo_open=True, none=False),
    "weight_decay": dict(lo=0, hi=1e4), "batch_size": dict(lo=1, hi=1 << 20, integer=True),
    "epochs": dict(lo=1, hi=100_000, integer=True),
    "validation_fraction": dict(lo=0, hi=0.5, lo_open=True, none=False),
    "n_iter_no_change": dict(lo=1, hi=10_000, integer=True, none=False),
    "threads": dict(lo=1, hi=4096, integer=True),
    "seed": dict(lo=0, hi=2**32 - 1, integer=True, none=False),
}


def checked_setting(name: str, value):
    """One numeric setting of :class:`SlideConfig` (``threads``, ``epochs``, ...) validated as
    the config does, for a setting read again after fitting (a query's ``threads``)."""
    return _number(name, value, **_NUMBER_CHECKS[name])


@dataclass(frozen=True)
class SlideConfig:
    """Hyperparameters of a model; ``None`` means "derive from the data" (:func:`resolve`).

    Network
        hidden : hidden layer sizes, input side first.
        hidden_sparsity : per hidden layer, the fraction of its neurons computed per sample
            (1.0 dense; None all dense). The first layer reads the sparse input: always dense.
        activation : the hidden layers' activation, "relu" or "identity" (None: from the
            rule, see :func:`resolve`). "identity" needs every hidden layer dense.
        sparsity : fraction of output neurons active per sample while training (labels, LSH
            hard negatives and random negatives shared by the batch); 1.0 is the exact softmax.
        hard_negatives : the most hard negatives in a sample's active set (the LSH tables'
            candidates, or the label clusters' answer: ``negatives_from``); the rest of the
            active set is the batch's shared random negatives. 0: none.
        negatives_from : where a sample's hard negatives come from: "lsh", the layer's hash
            tables, or "clusters", the best-scoring labels of its k-means label clusters
            (:mod:`slide.candidates`; ``hard_negatives`` of them, default 16). None: the
            clusters up to ``CLUSTER_LABELS`` labels, the tables above.
    LSH tables of the sampled layers
        hash_family, K, L, range_pow, bucket_size, bucket_policy; rehash_every (samples
        between rehashes, growing by ``rehash_growth`` after each), rebuild_every (samples
        between new hash functions).
    Features
        norm : "l2" scales every row to unit norm (None: as given). tfidf : idf weighting
        fitted on the training rows, before the norm; None: chosen on the held-out slice
        where :func:`resolve` offers it, else off.
    Optimisation
        lr, beta1, beta2, eps : Adam. weight_decay : decoupled (AdamW) decay, as a multiple of
        the learning rate, applied to the weight rows a step touches. batch_size. epochs : the
        number of epochs (the most, with early stopping); ``fit`` lowers ``lr`` over them in
        steps (:func:`slide.loop.epoch_learning_rate`).
    Early stopping (as scikit-learn's)
        early_stopping : hold out ``validation_fraction`` of the training rows (at most 5,000),
        score them after every epoch (the loss, or nDCG@5 for a sampled output layer: see
        :class:`slide.loop.EarlyStopping`), lower the learning rate when the score stalls, stop after
        ``n_iter_no_change`` epochs without improvement and keep the best weights.
        refit : then train again from the start on every row, the held-out slice too, for
        the epochs kept at the learning rates they had (None: where the training rows are
        fewer than :data:`REFIT_ROWS`; see :func:`resolve`).
    Run
        threads : numba threads (None: all cores). seed : fixes initialisation, data order and
        sampling. warm_start : ``fit`` continues from the fitted parameters instead of starting
        over.
    """
    hidden: tuple | None = None
    hidden_sparsity: tuple | None = None
    activation: str | None = None
    sparsity: float | None = None
    hard_negatives: int | None = None
    negatives_from: str | None = None
    hash_family: str = "dwta"
    K: int | None = None
    L: int | None = None
    range_pow: int | None = None
    bucket_size: int | None = None
    bucket_policy: str = "reservoir"
    rehash_every: int | None = None
    rehash_growth: float = 1.25
    rebuild_every: int | None = None
    norm: str | None = "l2"
    tfidf: bool | None = None
    lr: float | None = None
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float | None = None
    batch_size: int | None = None
    epochs: int | None = None
    early_stopping: bool = True
    validation_fraction: float = 0.1
    n_iter_no_change: int = 5
    refit: bool | None = None
    threads: int | None = None
    seed: int = 0
    warm_start: bool = False

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.hidden is not None:
            hidden = (self.hidden,) if isinstance(self.hidden, numbers.Number) else tuple(self.hidden)
            if not hidden:
                raise ValueError("hidden must list at least one layer size")
            set_("hidden", tuple(_number("hidden", h, lo=1, integer=True, none=False) for h in hidden))
        if self.hidden_sparsity is not None:
            hs = tuple(_number("hidden_sparsity", v, lo=0, hi=1, lo_open=True, none=False)
                       for v in self.hidden_sparsity)
            if self.hidden is None or len(hs) != len(self.hidden):
                raise ValueError(f"hidden_sparsity needs one value in (0, 1] per hidden layer "
                                 f"(and hidden set), got {hs}")
            if hs[0] != 1:
                raise ValueError("the first hidden layer reads the sparse input and must be dense "
                                 "(hidden_sparsity[0] = 1.0)")
            set_("hidden_sparsity", hs)
        if self.activation not in (None, *ACTIVATIONS):
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)} or None, "
                             f"got {self.activation!r}")
        if self.activation == "identity" and self.hidden_sparsity is not None \
                and min(self.hidden_sparsity) < 1:
            # a sampled layer's neurons that are not computed are 0, and the backward pass
            # tells them apart from computed ones by their activation, which only ReLU allows
            raise ValueError("activation='identity' needs every hidden layer dense "
                             f"(hidden_sparsity all 1.0), got {self.hidden_sparsity}")
        if self.negatives_from not in (None, *NEGATIVE_SOURCES):
            raise ValueError(f"negatives_from must be one of {', '.join(NEGATIVE_SOURCES)} or None, "
                             f"got {self.negatives_from!r}")
        if self.hash_family not in HASH_FAMILIES:
            raise ValueError(f"hash_family must be one of {', '.join(HASH_FAMILIES)}, got {self.hash_family!r}")
        if self.bucket_policy not in BUCKET_POLICIES:
            raise ValueError(f"bucket_policy must be one of {', '.join(BUCKET_POLICIES)}, "
                             f"got {self.bucket_policy!r}")
        if self.norm not in ("l2", None):
            raise ValueError(f"norm must be 'l2' or None, got {self.norm!r}")
        for name in ("early_stopping", "warm_start"):
            set_(name, _flag(name, getattr(self, name), none=False))
        for name in ("tfidf", "refit"):
            set_(name, _flag(name, getattr(self, name)))
        for name, kw in _NUMBER_CHECKS.items():
            set_(name, _number(name, getattr(self, name), **kw))

    def replace(self, **changes) -> "SlideConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


FIELDS = [f.name for f in dataclasses.fields(SlideConfig)]


# --------------------------------------------------------------------------------------------
# The defaults rule
# --------------------------------------------------------------------------------------------
#: the most LSH candidates per sample by default: each sample's candidates are rows of its own
#: to read, update and pass through Adam, so more cost step time faster than they add accuracy
#: (docs/active-set.md)
HARD_NEGATIVES = 256
#: hard negatives a sample asks of the label clusters: its best 16 were worth as much per
#: sample as its best 128 on git_openstack (docs/active-set.md)
CLUSTER_NEGATIVES = 16
#: the most labels whose hard negatives come from the label clusters by default: they gained
#: P@1 at 9K-21K labels, lost a little at 100K-131K and more at 670K, where 16 negatives a
#: sample leave most of the layer untouched and the clusters' upkeep grows with it
#: (docs/active-set.md)
CLUSTER_LABELS = 1 << 16

#: every output neuron is computed up to this many labels; above it the output is sampled
FULL_OUTPUT_LABELS = 1024
#: a sampled output's active set per sample, at the least: ACTIVE_PER_LABEL neurons for each
#: label a training row carries on average, within ACTIVE_FLOOR; where rows carry few labels
#: half the set trains 1.7x the samples a second to the same accuracy, and where they carry
#: many it gives accuracy up (docs/active-set.md)
ACTIVE_PER_LABEL = 128
ACTIVE_FLOOR = (512, 1024)

#: optimizer steps the planned epochs cover, at most, when early stopping may end the run sooner
EARLY_STOPPING_STEPS = 10_000

#: below this many training rows (after the held-out slice) ``fit`` trains again on every row
#: once early stopping has chosen the epochs: the held-out tenth is worth most where rows are
#: few, and there a second run costs seconds (docs/refit.md)
REFIT_ROWS = 10_000

#: a sampled output layer is as wide as its state (weights, two Adam moments and early
#: stopping's best weights: 16 bytes a weight) allows within this budget, 512 at most, 128 at
#: least: width is what a few thousand labels lack, and at hundreds of thousands it costs speed
#: and memory without a gain in time (docs/hidden-width.md)
OUTPUT_STATE_BYTES = 1 << 30

#: where the output is sampled, weight decay is set so that the mean output row decays by
#: SAMPLED_DECAY x lr per step (at most 1 x lr per touch): a row decays only in the steps that
#: touch it, and the share of rows a step touches varies with the label count by orders of
#: magnitude (docs/weight-decay.md)
SAMPLED_DECAY = 0.1


#: a feature is rare when fewer than RARE_ROWS training rows hold it; where at least RARE_SHARE
#: of the training non-zeros are in rare features, most input rows are updated in few steps,
#: as a sampled output's rows are, and get the same settings (docs/slow-rows.md)
RARE_ROWS = 25
RARE_SHARE = 0.5

#: where the features the rows hold are at least WIDE_FEATURES times the rows (wide, few rows, as
#: tf-idf text of a few thousand rows), most input rows are updated in few steps whatever the
#: rare share says, and get the same settings (docs/slow-rows.md)
WIDE_FEATURES = 2.5

#: an output row whose label is a positive in fewer than this many samples of a step, on average
#: (:func:`positives_per_step`), learns from few steps too, even where the output is computed
#: whole, and gets the same settings (docs/slow-rows.md)
RARE_POSITIVES = 0.1


#: the settings ``fit`` may choose on a held-out slice instead of the rule's (:func:`resolve`),
#: each with the check of the setting it stands for: a hidden layer's size, ``lr``,
#: ``weight_decay`` and ``tfidf``
CHOICE_CHECKS = {
    "width": functools.partial(_number, lo=1, integer=True, none=False),
    "lr": functools.partial(_number, **_NUMBER_CHECKS["lr"], none=False),
    "weight_decay": functools.partial(_number, **_NUMBER_CHECKS["weight_decay"], none=False),
    "tfidf": functools.partial(_flag, none=False),
}


def checked_choice(choice) -> dict:
    """``choice`` (a dict of :data:`CHOICE_CHECKS`' keys, or None) validated; ``{}`` for None."""
    if choice is None:
        return {}
    if not isinstance(choice, dict) or not set(choice) <= set(CHOICE_CHECKS):
        raise ValueError(f"a choice is a dict of {', '.join(CHOICE_CHECKS)}, got {choice!r}")
    return {k: CHOICE_CHECKS[k](k, v) for k, v in choice.items()}


def idf_weighted(config: SlideConfig, choice: dict | None) -> bool:
    """Whether the features are idf-weighted: ``config.tfidf`` where given, else as ``choice``
    (the settings chosen on the held-out slice, or None) says, else not."""
    if config.tfidf is not None:
        return config.tfidf
    return checked_choice(choice).get("tfidf", False)


def rare_share(document_frequency) -> float:
    """Share of the training non-zeros in rare features (fewer than :data:`RARE_ROWS` rows),
    from the features' document frequencies (int [n_features])."""
    df = np.asarray(document_frequency)
    total = df.sum()
    return float(df[df < RARE_ROWS].sum() / total) if total else 0.0


def positives_per_step(n_labels: int, batch_size: int, labels_per_row: float) -> float:
    """Mean number of a batch's samples in which one output row's label is a positive:
    ``batch_size x labels_per_row / n_labels``."""
    return batch_size * labels_per_row / max(n_labels, 1)


def active_target(n_labels: int, labels_per_row: float | None) -> int:
    """Output neurons a sample computes by default: every one up to
    :data:`FULL_OUTPUT_LABELS` labels, else ``max(floor, 0.005 · labels)`` with the floor
    :data:`ACTIVE_PER_LABEL` per label a row carries within :data:`ACTIVE_FLOOR` (its top where
    ``labels_per_row`` is not known, as in checkpoints written before it was recorded)."""
    if n_labels <= FULL_OUTPUT_LABELS:
        return n_labels
    lo, hi = ACTIVE_FLOOR
    floor = hi if labels_per_row is None else \
        int(min(hi, max(lo, math.ceil(ACTIVE_PER_LABEL * labels_per_row))))
    return min(n_labels, max(floor, math.ceil(0.005 * n_labels)))


def sampled_width(n_labels: int) -> int:
    """Hidden width of a network whose output layer is sampled: the widest of 512, 256 and 128
    whose output-layer state fits :data:`OUTPUT_STATE_BYTES` (128 when none does)."""
    for width in (512, 256):
        if 16 * width * n_labels <= OUTPUT_STATE_BYTES:
            return width
    return 128


def sample_negatives(resolved: dict) -> int:
    """A sample's own hard negatives in ``resolved`` settings: the label clusters' answer where
    they give them, else the tables' cap (:func:`resolve`)."""
    return resolved.get("cluster_negatives", resolved["lsh_cap"])


def touched_share(n_labels: int, batch_size: int, own: int, pool: int) -> float:
    """Expected share of a sampled output layer's rows that one step touches: the batch's
    ``batch_size x own`` hard negatives and the ``pool`` shared negatives taken as uniform
    draws (``1 - exp(-draws / n_labels)``)."""
    return 1.0 - math.exp(-(batch_size * own + pool) / max(n_labels, 1))


def default_batch_size(n_train: int) -> int:
    """Small data needs more, smaller steps: 32 below ~14K samples, 128 above ~56K."""
    return int(np.clip(2 ** round(math.log2(max(n_train, 1) / 300)), 32, 128))


def planned_epochs(n_train: int, batch_size: int, early_stopping: bool = True) -> int:
    """The rule's planned epochs: enough for :data:`EARLY_STOPPING_STEPS` optimizer steps
    (between 5 and 100) with early stopping, for 3,000 (between 5 and 30) without."""
    steps = math.ceil(n_train / batch_size)
    if early_stopping:
        return int(np.clip(math.ceil(EARLY_STOPPING_STEPS / steps), 5, 100))
    return int(np.clip(math.ceil(3000 / steps), 5, 30))


#: the most slots a hash bucket of the defaults rule holds (docs/tables.md)
MAX_BUCKET_SIZE = 64


def resolve(config: SlideConfig, n_features: int, n_labels: int, n_train: int,
            rare_fraction: float = 0.0, choice: dict | None = None,
            labels_per_row: float | None = None, slow_rows: bool | None = None) -> dict:
    """Concrete settings for a training set of ``n_train`` rows, ``n_features`` features (those
    the rows hold) and ``n_labels`` labels: every ``None`` in ``config`` replaced by the rule
    below.

    * batch_size: :func:`default_batch_size` (32 to 128 by rows).
    * epochs: enough for about 3,000 optimizer steps, between 5 and 30; with early stopping,
      which ends the run when the validation score stops improving, the most for about
      :data:`EARLY_STOPPING_STEPS` steps, between 5 and 100, and where the output is sampled
      the learning-rate plan's short first cycle on top (:func:`slide.loop.first_cycle`).
      ``fit``'s learning-rate schedule is laid over these epochs.
    * output active set: :func:`active_target` (every neuron up to 1,024 labels, else
      ``max(floor, 0.005 · labels)``, the floor 128 per label a row carries, 512 to 1,024);
      a quarter of it, at most :data:`HARD_NEGATIVES`, the sample's LSH hard negatives, the
      rest random negatives shared by the batch, to which every label of the batch is added
      (so the other samples' labels are negatives too, in proportion to how often labels occur).
    * refit (with early stopping): train again on every row for the kept epochs where
      ``n_train`` (the rows left after the held-out slice) is below :data:`REFIT_ROWS`.
    * hidden: 512 where the output is computed whole, :func:`sampled_width` where it is
      sampled (512 down to 128 as the label count grows).
    * activation: "identity" where the output is sampled and every hidden layer is dense,
      "relu" otherwise.
    * lr, weight_decay, input_init (the input layer's initial standard deviation): where rows
      are updated in few steps, i.e. the output is sampled, ``rare_fraction`` (the training
      non-zeros' share in rare features, :func:`rare_share`) is at least :data:`RARE_SHARE`, the
      features are at least :data:`WIDE_FEATURES` times the rows, or an output row's label is
      a positive in fewer than :data:`RARE_POSITIVES` samples a step
      (:func:`positives_per_step` of ``labels_per_row``, the training rows' mean label count;
      None, as in checkpoints written before it was recorded, leaves this test out): 4e-3,
      ``min(1, SAMPLED_DECAY / s)`` with ``s`` the share of output rows a step touches
      (:func:`touched_share`; 1 for a whole output) and 0.1; otherwise 1e-3, 1 and 0.5. See
      the README's "Defaults" section. ``slow_rows`` given (True / False) stands for that test
      (a refit's: the run it repeats decided it on fewer rows); ``out["slow_rows"]`` records it.
    * tfidf: whether the features are idf-weighted (:func:`idf_weighted`: as given, else as
      ``choice`` says).
    """
    c = config
    out = {}
    batch_size = c.batch_size or default_batch_size(n_train)
    epochs = c.epochs or planned_epochs(n_train, batch_size, c.early_stopping)
    out.update(batch_size=batch_size, epochs=epochs,
               refit=c.early_stopping and (c.refit if c.refit is not None else n_train < REFIT_ROWS))
    if c.sparsity is None:
        target = active_target(n_labels, labels_per_row)
    else:
        target = min(n_labels, max(1, math.ceil(c.sparsity * n_labels)))
    sampled = target < n_labels
    # a quarter of the active set, at most HARD_NEGATIVES, is each sample's own LSH candidates
    # (hard negatives), the rest a random pool shared by the batch (dense matrix products, few
    # distinct rows to update), which the engine extends by the batch's labels; without
    # sampling the pool is every neuron
    if not sampled:
        lsh_cap = 0
    elif c.hard_negatives is not None:
        lsh_cap = min(c.hard_negatives, target)
    else:
        lsh_cap = min(target // 4, HARD_NEGATIVES)
    source = (c.negatives_from or ("clusters" if n_labels <= CLUSTER_LABELS else "lsh")
              if sampled else None)
    out.update(active_target=target, sampled=sampled, lsh_cap=lsh_cap, pool=target - lsh_cap,
               negatives_from=source)
    if source == "clusters":
        # the clusters' best few are as much per sample as the tables' quarter; the pool is
        # kept as it is, so a step is as wide as the tables' or narrower
        out["cluster_negatives"] = lsh_cap if c.hard_negatives is not None else \
            min(lsh_cap, CLUSTER_NEGATIVES)
    if sampled and c.early_stopping and not c.epochs:
        # the rule's epochs are the plan's second cycle: the first comes on top
        out["epochs"] = epochs + first_cycle("nDCG@5", epochs + FIRST_CYCLE)
    chosen = checked_choice(choice)
    hidden = c.hidden or ((chosen["width"],) if "width" in chosen else
                          (sampled_width(n_labels),) if sampled else (512,))
    # a sampled output row is updated only in the steps that select it, and so is an input row
    # of a rare feature; an output row whose label is rarely a positive learns from few steps
    # too, though every step moves it: such rows get a larger step, which fit's schedule and
    # plateau drops bring down once it stops paying, and a decay per step sized to how often
    # they are touched (a decay of 1 every step shrinks a rarely positive row to nothing)
    rare_positives = (labels_per_row is not None
                      and positives_per_step(n_labels, batch_size, labels_per_row) < RARE_POSITIVES)
    if slow_rows is None:
        wide = n_features >= WIDE_FEATURES * n_train
        slow_rows = sampled or rare_fraction >= RARE_SHARE or rare_positives or wide
    out["slow_rows"] = bool(slow_rows)
    out.update(hidden=list(hidden),
               lr=c.lr or chosen.get("lr") or (4e-3 if slow_rows else 1e-3))
    if c.weight_decay is not None:
        out["weight_decay"] = c.weight_decay
    elif "weight_decay" in chosen:
        out["weight_decay"] = chosen["weight_decay"]
    elif slow_rows:
        share = touched_share(n_labels, batch_size, sample_negatives(out), out["pool"]) \
            if sampled else 1.0
        out["weight_decay"] = min(1.0, SAMPLED_DECAY / share)
    else:
        out["weight_decay"] = 1.0
    out["tfidf"] = idf_weighted(c, choice)
    # an input row is trained only in the steps whose samples hold its feature, and a rare
    # feature's random start stays noise in every row holding it (docs/slow-rows.md)
    out["input_init"] = 0.1 if slow_rows else 0.5
    if sampled:
        over = {k: getattr(c, k) for k in ("K", "L", "range_pow", "bucket_size") if getattr(c, k)}
        # the tables only supply lsh_cap candidates per sample, so fewer and smaller than
        # BOLT's rule asks for (docs/tables.md)
        tc = autotune(n_labels, target / n_labels, family=c.hash_family, policy=c.bucket_policy,
                      max_tables=24, max_bucket_size=MAX_BUCKET_SIZE, **over)
        out["tables"] = dataclasses.asdict(tc)
    hs = c.hidden_sparsity or (1.0,) * len(hidden)
    # where the output is sampled the hidden layer's identity generalised better than its
    # ReLU; where it is computed whole, ReLU did (docs/activation.md)
    out["activation"] = c.activation or ("identity" if sampled and min(hs) == 1 else "relu")
    out["hidden_layers"] = [None] * len(hidden)
    for l in range(1, len(hidden)):
        if hs[l] < 1:
            tc = autotune(hidden[l], hs[l], family=c.hash_family, policy=c.bucket_policy,
                          max_tables=24, max_bucket_size=MAX_BUCKET_SIZE)
            out["hidden_layers"][l] = {"target": max(1, math.ceil(hs[l] * hidden[l])),
                                       "tables": dataclasses.asdict(tc)}
    per_batch = 64 * batch_size
    out["rehash_every"] = c.rehash_every or per_batch
    out["rebuild_every"] = c.rebuild_every or 16 * per_batch
    return out


# --------------------------------------------------------------------------------------------
# Parameter layout
# --------------------------------------------------------------------------------------------
def hidden_blocks(hidden) -> list:
    """(weight offset, bias offset, n_out, n_in) of each layer of the flat hidden stack
    ``Wh``/``bh``, which holds hidden layers 1..len(hidden)-1 as [n_out, n_in] blocks."""
    blocks, off, boff = [], 0, 0
    for n_in, n_out in zip(hidden[:-1], hidden[1:]):
        blocks.append((off, boff, int(n_out), int(n_in)))
        off += int(n_out * n_in)
        boff += int(n_out)
    return blocks


def hidden_block(p, blk):
    """Weights [n_out, n_in] and bias [n_out] of one hidden block: views into p["Wh"], p["bh"]."""
    off, boff, n_out, n_in = blk
    return p["Wh"][off:off + n_out * n_in].reshape(n_out, n_in), p["bh"][boff:boff + n_out]


def parameter_shapes(hidden, n_features: int, n_labels: int) -> dict:
    """Shape of every parameter array (checkpoints are checked against it)."""
    sizes = [int(h) for h in hidden]
    n_stack = sum(a * b for a, b in zip(sizes[:-1], sizes[1:]))
    return {"W0": (n_features, sizes[0]), "b0": (sizes[0],), "Wh": (n_stack,),
            "bh": (sum(sizes[1:]),), "W": (n_labels, sizes[-1]), "b": (n_labels,)}


def tables_for_rows(config, tables: dict, n_rows: int) -> dict:
    """``resolve``'s output tables (``tables``) for a layer of ``n_rows`` rows instead (a label
    shard's): the same hash functions (K, L, range_pow), buckets sized for the rows as
    :func:`lsh.autotune` sizes them, unless the settings fix ``bucket_size``."""
    out = dict(tables)
    if not config.bucket_size:
        out["bucket_size"] = bucket_size_for(n_rows, tables["range_pow"], MAX_BUCKET_SIZE)
    return out


def init_parameters(hidden, n_features: int, n_labels: int, seed: int, seen_features,
                    input_scale: float, first_row: int = 0) -> dict:
    """Initial float32 parameters (``W0, b0, Wh, bh, W, b``) for a seed; shared with gpu_ref.
    ``input_scale``: the standard deviation of the input layer's weights (``resolve``'s
    ``input_init``).

    ``seen_features`` (bool [n_features]) marks the features the training rows contain: the
    others' input rows start at zero. They would never be trained, and random rows would add
    noise to every test row holding such a feature (a tenth of the non-zeros on small sets).

    ``first_row``: the output rows are rows ``first_row`` onwards of a larger layer's (a label
    shard's, :mod:`slide.shards`): the rows before are drawn and dropped a block at a time, so
    a shard starts exactly as its rows of the whole layer would.
    """
    rng = np.random.default_rng(seed)
    sizes = [int(h) for h in hidden]
    p = {}
    # input rows are L2-normalised sparse vectors, so a row's pre-activations have the spread
    # of one input row (input_scale) whatever its length
    p["W0"] = rng.standard_normal((n_features, sizes[0]), np.float32) * np.float32(input_scale)
    if seen_features is not None:
        p["W0"][~np.asarray(seen_features, bool)] = 0.0
    p["b0"] = np.zeros(sizes[0], np.float32)
    blocks = [rng.standard_normal((sizes[l], sizes[l - 1]), np.float32) * np.float32(math.sqrt(2.0 / sizes[l - 1]))
              for l in range(1, len(sizes))]
    p["Wh"] = np.concatenate([b.ravel() for b in blocks]) if blocks else np.zeros(0, np.float32)
    p["bh"] = np.zeros(sum(sizes[1:]), np.float32)
    for lo in range(0, first_row, 1 << 16):  # numpy draws the same numbers block by block
        rng.standard_normal((min(1 << 16, first_row - lo), sizes[-1]), np.float32)
    p["W"] = rng.standard_normal((n_labels, sizes[-1]), np.float32) * np.float32(1.0 / math.sqrt(sizes[-1]))
    p["b"] = np.zeros(n_labels, np.float32)
    return p
