"""The scikit-learn face of the engine: :class:`SlideClassifier`.

The estimator holds the settings, validates at the boundary and delegates: training to its
:class:`slide.step.TrainingState` (``state_``) driven by :func:`slide.fitting.fit_model`,
queries to its :class:`slide.serving.Server` (``server_``), files to :mod:`slide.checkpoint`.
"""
from __future__ import annotations

import contextlib
import threading

import numba
import numpy as np
from sklearn.base import BaseEstimator

from slide.base import TrainableMixin
from slide.config import FIXED_AFTER_FIT, SlideConfig
from slide.fitting import fit_model
from slide.persistence import Persistence
from slide.metrics import check_k, topk
from slide.resources import check_fits, model_memory_bytes
from slide.serving import Server, ServingSettings
from slide.shards import shard_bounds, shard_settings
from slide.step import TrainingState

__all__ = ["SlideClassifier"]

#: guards the check-and-set of a model's training thread (:meth:`SlideClassifier._training`)
_TRAINER_LOCK = threading.Lock()


def _from_state(name: str, doc: str):
    """A fitted attribute read from the training state."""
    return property(lambda self: getattr(self.state_, name), doc=doc)


class SlideClassifier(ServingSettings, TrainableMixin, Persistence, BaseEstimator):
    """Extreme multi-label classifier trained sparsely on CPU threads.

    Parameters are those of :class:`slide.config.SlideConfig` (``None``: derived from the
    training data by :func:`slide.config.resolve`).

    Fitted attributes: ``config_`` (the validated settings), ``resolved_`` (the concrete
    ones), ``n_features_in_``, ``n_labels_`` (the label space), ``labels_`` (the labels with an
    output row, :class:`slide.labels.LabelMap`), ``preprocessor_``, ``state_`` (the training
    state: ``params_``, ``moments_``, ``step_``, ``learning_rate_``, ``tables_`` and
    ``timings_`` read from it), ``server_`` (top-k queries), ``record_`` (the run's record:
    ``epoch_``, ``history_``, ``stopping_`` read from it; ``stopping_["choice"]`` where
    settings were chosen on the validation set), ``choice_`` (the settings chosen, ``{}`` for
    the rule's own; None where there was no choice), ``held_out_`` (up to 512 rows held out of
    training, by which ``mode="ann"`` chooses its probe; None without such rows).
    """

    _fitted_attribute = "state_"

    params_ = _from_state("params", "Parameters: dict of float32 arrays.")
    moments_ = _from_state("moments", "Adam's moments, by parameter name + '.m' / '.v'.")
    step_ = _from_state("step", "Optimizer steps taken.")
    samples_seen_ = _from_state("samples_seen", "Training samples seen.")
    learning_rate_ = property(
        lambda self: self.state_.learning_rate,
        lambda self, rate: setattr(self.state_, "learning_rate", float(rate)),
        doc="The learning rate of the next step (``fit`` sets it each epoch; a stream of "
            "``partial_fit`` calls may set it).")
    hash_seed_ = _from_state("hash_seed", "The output tables' hash seed.")
    tables_ = _from_state("tables", "The output layer's training tables (None: every output).")
    timings_ = _from_state("timings", "Seconds per phase of the training step.")
    serving_tables_ = property(lambda self: self.server_.tables, doc="LSH serving's tables.")
    serving_candidates_ = property(lambda self: self.server_.candidates,
                                   doc="LSH serving's candidates a row.")

    def __init__(self, hidden=None, hidden_sparsity=None, activation=None, sparsity=None,
                 hard_negatives=None, negatives_from=None, hash_family="dwta", K=None, L=None,
                 range_pow=None, bucket_size=None, bucket_policy="reservoir", rehash_every=None,
                 rehash_growth=1.25, rebuild_every=None, norm="l2", tfidf=None, lr=None,
                 beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=None, batch_size=None,
                 epochs=None, early_stopping=True, validation_fraction=0.1, n_iter_no_change=5,
                 refit=None, threads=None, seed=0, warm_start=False):
        self.hidden = hidden
        self.hidden_sparsity = hidden_sparsity
        self.activation = activation
        self.sparsity = sparsity
        self.hard_negatives = hard_negatives
        self.negatives_from = negatives_from
        self.hash_family = hash_family
        self.K = K
        self.L = L
        self.range_pow = range_pow
        self.bucket_size = bucket_size
        self.bucket_policy = bucket_policy
        self.rehash_every = rehash_every
        self.rehash_growth = rehash_growth
        self.rebuild_every = rebuild_every
        self.norm = norm
        self.tfidf = tfidf
        self.lr = lr
        self.beta1 = beta1
        self.beta2 = beta2
        self.eps = eps
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.epochs = epochs
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.n_iter_no_change = n_iter_no_change
        self.refit = refit
        self.threads = threads
        self.seed = seed
        self.warm_start = warm_start

    # -- settings --------------------------------------------------------------------------------
    def _config(self) -> SlideConfig:
        return SlideConfig(**self.get_params())

    def _current_config(self) -> SlideConfig:
        """The constructor's settings, validated; a fitted model checks that none of the
        settings fixed after fitting has changed since."""
        config = self._config()
        if self._is_fitted():
            changed = [k for k in FIXED_AFTER_FIT if getattr(config, k) != getattr(self.config_, k)]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} changed since the model was fitted "
                    f"({', '.join(f'{k}={getattr(self.config_, k)!r}' for k in changed)}); "
                    f"these fix the model's shapes: fit a new model (warm_start=False)")
        return config

    def validation_metric(self) -> str:
        """The early-stopping score: the full softmax's loss where the output layer is trained
        whole, nDCG@5 where it is sampled (:class:`slide.loop.EarlyStopping`)."""
        return "nDCG@5" if self.resolved_["sampled"] else "loss"

    @property
    def batch_size_(self) -> int:
        return self.resolved_["batch_size"]

    def _resolve(self, config, n_shards: int | None = None):
        """The rule's settings for this model's data, of its label shard where it is one; with
        ``n_shards``, of the largest of that many shards instead."""
        resolved = self.rule_settings(config)
        shards = self.shards()
        if n_shards is None and shards is None:
            return resolved
        n = shards.size if n_shards is None else n_shards
        return shard_settings(config, resolved, n, self._shard_rows(n_shards))

    def _shard_rows(self, n_shards: int | None = None) -> int:
        """Output rows of this model's label shard, or with ``n_shards`` the most any of that
        many shards holds."""
        if n_shards is None:
            lo, hi = shard_bounds(self.n_outputs_fitted_, self.shards().size, self.shards().rank)
            return hi - lo
        return -(-self.n_outputs_fitted_ // n_shards)

    def _refresh_config(self):
        """Settings that may change between calls on a fitted model (lr, threads, epochs...)."""
        config = self._current_config()
        lr_changed = config.lr != self.config_.lr
        self.config_ = config
        self.resolved_ = self._resolve(config)
        self.state_.config, self.state_.resolved = config, self.resolved_
        if lr_changed:
            self.state_.learning_rate = self.resolved_["lr"]

    # -- training --------------------------------------------------------------------------------
    def fit(self, X, Y, validation=None, progress: bool = False, on_epoch=None, distributed=None,
            runner=None):
        """Train from scratch (or, with ``warm_start``, continue) on ``X`` [n, n_features]
        (CSR-convertible) and ``Y`` (CSR indicator [n, n_labels] or label-id lists).

        With ``early_stopping`` a slice of the training rows is held out unless ``validation``
        ``(X_val, Y_val)`` is given (:func:`slide.fitting.fit_model`). ``progress`` shows a
        tqdm bar per epoch; ``on_epoch(model, record)`` runs after each epoch.
        ``distributed``: a :class:`slide.distributed.DataParallel`; every rank calls ``fit``
        with its own shard of the rows and ends with the same model. ``runner``: what runs
        the epochs over the training state (default: the engine's threads; the heterogeneous
        trainer, :class:`gpu_ref.hetero.HeteroTrainer`).
        """
        return self.train(X, Y, validation=validation, progress=progress, on_epoch=on_epoch,
                          distributed=distributed, runner=runner)

    def train(self, X, Y, *, continue_training=None, distributed=None, **kw):
        """:meth:`fit` with the whole of :func:`slide.fitting.fit_model`'s control
        (``until_epoch``, ``save_every``, ``on_save``...; ``slide train`` uses it).
        ``continue_training`` defaults to ``warm_start`` on a fitted model."""
        with self._training(distributed):
            warm = self.warm_start and self._is_fitted() if continue_training is None \
                else continue_training
            if warm:
                self._refresh_config()
            try:
                self.record_ = fit_model(self, X, Y, continue_training=warm,
                                         distributed=distributed, **kw)
            finally:
                if self._is_fitted():
                    self.state_.distributed = None
        return self

    def partial_fit(self, X, Y, distributed=None, runner=None):
        """One pass over (X, Y) in the given row order (for streams); initialises an unfitted
        model from this first batch's shapes (no validation slice is held out). A call does not
        start with a rehash: the tables follow their schedule across calls. ``distributed``:
        see :meth:`fit`; every rank calls with its own rows (a shard shorter than the others
        repeats its first rows to take as many steps). Returns the model, or with ``runner``
        what its ``train_rows`` returns."""
        with self._training(distributed):
            if self._is_fitted():
                self._refresh_config()
                X, Y = self.check_data(X, Y, where="partial_fit", grow=distributed is None)
            else:
                X, Y = self.check_data(X, Y, where="partial_fit", fitted=False)
                if distributed is not None:
                    X, Y = distributed.agree_shapes(X, Y)
                self.initialize(X, Y, distributed=distributed, stream=True)
            Y = self.targets(X, Y, grow=distributed is None)
            order = np.arange(X.shape[0])
            if distributed is not None:
                if distributed.started is not self.state_:
                    self.join(distributed)
                order = distributed.epoch_order(order, self.batch_size_)
            if self.state_.samples_seen == 0:  # fill the tables from the (rank 0's) weights
                self.state_.refresh_tables()
            self.state_.distributed = distributed
            try:
                out = (runner or self.state_).train_rows(self.preprocess(X), Y, order)
                if distributed is not None:
                    distributed.finish(self.state_)
            finally:
                self.state_.distributed = None
        return self if runner is None else out

    def initialize(self, X, Y, distributed=None, choice: dict | None = None,
                   stream: bool = False, slow_rows: bool | None = None) -> None:
        """Fresh preprocessing (fitted on X), training state, server and record. With
        ``distributed``, X is this rank's shard (counts and feature statistics are the whole
        data's). ``choice``: settings chosen on a held-out slice (:mod:`slide.selection`).
        ``stream``: X, Y are a stream's first batch (a row for every label of Y). ``slow_rows``:
        the decision of rows updated in few steps, where it stands instead of the rule's (a
        refit's, that of the run it repeats)."""
        self.config_ = self._config()
        self.choice_ = choice
        self.slow_rows_kept_ = slow_rows
        self.fit_data(X, Y, distributed, stream=stream)
        self.resolved_ = self._resolve(self.config_)
        threads = self.config_.threads or (distributed.threads if distributed is not None
                                           else numba.config.NUMBA_NUM_THREADS)
        shards = self.shards()

        def need(n_shards):  # one rank's bytes with the output rows over n_shards label shards
            return model_memory_bytes(self._resolve(self.config_, n_shards), self.n_features_in_,
                                      self._shard_rows(n_shards), threads,
                                      features_per_row=self.features_per_row_,
                                      best_weights=self.config_.early_stopping)

        check_fits(need(1 if shards is None else shards.size),
                   f"a model of {self.n_features_in_} features, hidden {self.resolved_['hidden']} "
                   f"and {self.n_outputs_} labels with training positives"
                   + ("" if shards is None else f" (one of {shards.size} label shards)"),
                   per_shard=need)
        # a previous fit's arrays go before the new ones are made
        self.__dict__.pop("state_", None), self.__dict__.pop("server_", None)
        first_row = 0 if shards is None else shards.bounds(self.n_outputs_fitted_)[0]
        self.state_ = TrainingState.fresh(self.config_, self.resolved_, self.n_features_in_,
                                          self.n_outputs_, self.preprocessor_.seen_features(),
                                          first_row)
        self.state_.bias_shift = self.prior_shift()
        self.server_ = Server(self.state_)

    def add_output_rows(self, W_new, b_new) -> None:
        """Append output rows (:meth:`add_labels`): the training state grows, and serving
        starts again over it with the same settings."""
        if self.state_.distributed is not None:
            raise ValueError("labels cannot be added while training with data parallelism: "
                             "every rank must hold the same rows (give every label a positive "
                             "in the data fit starts from)")
        self.state_.add_outputs(W_new, b_new)
        self.state_.bias_shift = self.prior_shift()
        self.server_ = self.server_.restarted()

    def host_params(self) -> dict:
        """The parameters (host arrays)."""
        return self.params_

    def join(self, distributed) -> None:
        """Train with ``distributed`` from here on, this replica made rank 0's (parameters,
        moments, counters and epoch)."""
        distributed.start(self.state_, self.record_)
        self.state_.distributed = distributed

    def train_epoch(self, Xp, Y, order, progress=None, learning_rate=None) -> dict:
        """One epoch of the training state (the loop's default runner); with data
        parallelism, the replicas end it equal."""
        out = self.state_.train_epoch(Xp, Y, order, progress, learning_rate)
        if self.state_.distributed is not None:
            self.state_.distributed.finish(self.state_)  # one model before it is scored or saved
        return out

    def snapshot(self, out=None) -> dict:
        return self.state_.snapshot(out)

    def restore(self, params) -> None:
        self.state_.restore(params)

    def row_blocks(self) -> dict:
        """The row blocks ``W`` and ``W0`` train in (:mod:`slide.rowblocks`)."""
        self._require_fitted()
        return self.state_.row_blocks()

    def __getstate__(self):
        # a copy (pickle, deepcopy) is not being trained, whichever thread trains this model
        state = super().__getstate__()
        state.pop("_trainer", None)
        return state

    @contextlib.contextmanager
    def _training(self, distributed=None):
        """Mark the model as training on the calling thread for the block. Another thread that
        starts training it meanwhile gets an error instead of racing the first through its
        parameters and scratch; nested calls on the same thread (``partial_fit`` from an
        ``on_epoch`` callback) go through. With ``distributed`` the block is inside its
        :meth:`~slide.distributed.DataParallel.guard`: an error on one rank ends the job."""
        with distributed.guard() if distributed is not None else contextlib.nullcontext():
            me = threading.get_ident()
            with _TRAINER_LOCK:
                owner = self.__dict__.get("_trainer")
                if owner is not None and owner != me:
                    raise RuntimeError(
                        f"this {type(self).__name__} is already training on another thread: a "
                        "model trains on one thread at a time (its kernels already use `threads` "
                        "cores); train a clone on each thread instead")
                self._trainer = me
            try:
                yield
            finally:
                if owner is None:
                    self._trainer = None

    # -- serving ---------------------------------------------------------------------------------
    def embed(self, X) -> np.ndarray:
        """Last hidden layer activations, float32 [n, hidden[-1]]."""
        self._require_current()
        return np.ascontiguousarray(self._last_hidden(self.check_data(X, where="embed")))

    def _last_hidden(self, X) -> np.ndarray:
        """The last hidden layer of the (checked, raw) CSR rows ``X``: preprocessed as the
        first layer reads them, which spares a query a weighed copy of its rows."""
        return self.state_.last(self.state_.forward(X, self.preprocessor_.weighing()))

    def _hidden_blocks(self, X, block: int | None = None):
        """Yields ``(lo, hi, h)``: the last hidden layer of rows lo..hi of the (checked, raw)
        CSR ``X``, block by block (about 64 MB of scores a block by default), on the threads
        that ``_require_current`` set."""
        block = block or max(1, min(4096, (1 << 24) // self.n_outputs_))
        n = X.shape[0]
        for lo in range(0, n, block):
            hi = min(lo + block, n)
            # a single block takes its rows whole: scipy's slice is a new matrix
            yield lo, hi, self._last_hidden(X if hi - lo == n else X[lo:hi])

    def score_blocks(self, X, block: int | None = None):
        """Exact scores of every output row, block by block: yields ``(lo, hi, S)`` with ``S``
        float32 [hi - lo, n_outputs] (column r: label ``labels_.ids[r]``) for rows lo..hi of
        the (checked, raw) CSR ``X``."""
        self._require_current()
        W, b = self.params_["W"], self.server_.bias()
        for lo, hi, h in self._hidden_blocks(X, block):
            s = h @ W.T
            s += b
            yield lo, hi, s

    def block_topk(self, S, k: int):
        """Top-k ``(ids int64 [n, k], scores float32 [n, k])`` of score rows ``S``."""
        return topk(S, k)

    def predict_topk(self, X, k: int = 5, mode: str = "exact", block: int | None = None):
        """Top-k labels per row: ``(ids int64 [n, k], scores float32 [n, k])``, best first.

        ``mode="exact"`` finds the exact top-k without forming the score matrix, ``block``
        rows per call (default 1024): through an int8 screen whose candidates are rescored in
        float32 at 32,768 labels or more on CPUs with AVX-512 VNNI
        (:func:`slide.screen.screened_topk`), else :func:`slide.metrics.topk_product`.
        ``mode="lsh"`` scores only each row's candidates from the serving tables
        (:meth:`set_serving`; rows with fewer than k candidates are padded with id -1).
        ``mode="ann"`` asks an approximate index of the label vectors (:meth:`set_ann`).
        """
        threads = self._require_current()
        X = self.check_data(X, where="predict")
        k = check_k(k)
        if mode not in ("exact", "lsh", "ann"):
            raise ValueError(f"mode must be 'exact', 'lsh' or 'ann', got {mode!r}")
        held_out = None if self.held_out_ is None else \
            (lambda: self._last_hidden(self.held_out_))
        rows, scores = self.server_.topk(lambda b: self._hidden_blocks(X, b), X.shape[0], k,
                                         mode, block, threads, held_out)
        if self.shards() is not None:  # every shard's best, the same on every rank
            return self.shards().merge_topk(self.labels_.to_labels(rows), scores, k)
        return self.labels_.to_labels(rows), scores

    def decision_function(self, X) -> np.ndarray:
        """The scores predictions rank by, float32 [n, n_labels] (dense: mind the memory on wide
        layers): the output logits, less the prior correction where the output layer is
        computed whole (:meth:`prior_shift`); -inf for a label without an output row."""
        self._require_current()
        self._whole_layer("decision_function")
        S = (self._last_hidden(self.check_data(X, where="decision_function")) @ self.params_["W"].T
             + self.server_.bias())
        return self.labels_.scatter(S, -np.inf)
