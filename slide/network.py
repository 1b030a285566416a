"""The SLIDE model: sparse input → dense hidden layers → LSH-sampled output layer.

:class:`SlideClassifier` holds the arrays and follows scikit-learn's conventions (``fit``,
``partial_fit``, ``predict``, ``predict_topk``, ``score``, ``get_params``/``set_params``), so it
drops into a Pipeline after a vectorizer. Its settings are validated into a
:class:`slide.config.SlideConfig` when it is fitted. The Python layer validates at the boundary
and orchestrates one batch at a time; all per-sample work happens in :mod:`slide.kernels`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
import time

import numba
import numpy as np
import scipy.sparse as sp
from sklearn.base import BaseEstimator
from sklearn.exceptions import NotFittedError

from lsh import (CompactTables, HashTables, TableConfig, aligned_empty, aligned_zeros,
                 engine_threads, set_num_threads, thread_chunks)
from lsh.tables import QueryScratch
from slide import kernels
from slide.checkpoint import read_checkpoint, write_checkpoint
from slide.config import (ARCHITECTURE_FIELDS, SlideConfig, checked_setting, hidden_block,
                          hidden_blocks, init_parameters, parameter_shapes, resolve)
from slide.data import check_xy
from slide.metrics import check_k, topk, topk_product
from slide.resources import check_fits, model_memory_bytes
from slide.sampling import draw_key, shared_negatives
from slide.screen import (SCREEN_MIN_LABELS, has_int8_dot, quantize_labels, quantize_rows,
                          screened_candidates, screened_topk)
from slide.train import EarlyStopping, TrainableMixin, fit_loop

#: rows per block of exact top-k (its kernel holds a tile of scores, not a block's matrix)
EXACT_BLOCK_ROWS = 1024
#: LSH serving's default candidates a row, per slot of training's bounded tables (tables ×
#: bucket size): screened in int8, four times as many candidates cost what that many cost in
#: float32 (batches of 128 at 670K labels: 16.6 against 20.5 ms) and found 0.252 of the exact
#: top-5 against 0.135. A budget that does not grow with the serving tables: more tables find
#: better candidates within it (0.380 with 64, 0.496 with 128, batches still faster than the
#: exact mode's), where 4 × their own slots made 64 tables' batches slower (bench/README.md)
CANDIDATES_PER_SLOT = 4

__all__ = ["SlideClassifier"]


#: guards the check-and-set of a model's training thread (:meth:`SlideClassifier._training`)
_TRAINER_LOCK = threading.Lock()
#: guards what serving builds on first use (the tables rehashed after training, the serving
#: tables, the int8 copies), so that queries from several threads build it once: two rehashes of
#: the same tables at once would corrupt them
_SERVING_LOCK = threading.RLock()


class SlideClassifier(TrainableMixin, BaseEstimator):
    """Extreme multi-label classifier trained sparsely on CPU threads.

    Parameters are those of :class:`slide.config.SlideConfig` (``None``: derived from the
    training data by :func:`slide.config.resolve`).

    Fitted attributes: ``config_`` (the validated settings), ``resolved_`` (the concrete
    ones), ``n_features_in_``, ``n_labels_``, ``preprocessor_``, ``params_`` and ``moments_``
    (dicts of float32 arrays; once the model trains, ``W``, ``W0`` and their moments are views
    of :meth:`row_blocks`), ``learning_rate_`` (lowered on plateaus), ``step_``, ``epoch_``,
    ``history_`` (per-epoch records), ``stopping_`` (the epoch kept and why training stopped;
    ``stopping_["choice"]`` where settings were chosen on the validation set), ``choice_`` (the
    settings chosen, ``{}`` for the rule's own; None where there was no choice),
    ``timings_`` (seconds per phase).
    """

    def __init__(self, hidden=None, hidden_sparsity=None, activation=None, sparsity=None,
                 hard_negatives=None, hash_family="dwta", K=None, L=None, range_pow=None,
                 bucket_size=None, bucket_policy="reservoir", rehash_every=None, rehash_growth=1.25,
                 rebuild_every=None, norm="l2", tfidf=None, lr=None, beta1=0.9, beta2=0.999,
                 eps=1e-8, weight_decay=None, batch_size=None,
                 epochs=None, early_stopping=True, validation_fraction=0.1, n_iter_no_change=5,
                 refit=None, threads=None, seed=0, warm_start=False):
        self.hidden = hidden
        self.hidden_sparsity = hidden_sparsity
        self.activation = activation
        self.sparsity = sparsity
        self.hard_negatives = hard_negatives
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
    def _is_fitted(self) -> bool:
        return hasattr(self, "params_")

    def __sklearn_is_fitted__(self) -> bool:
        return self._is_fitted()

    def _current_config(self) -> SlideConfig:
        """The constructor's settings, validated; a fitted model checks that none of the
        settings that fix its shapes has changed since it was fitted."""
        config = SlideConfig(**self.get_params())
        if self._is_fitted():
            changed = [k for k in ARCHITECTURE_FIELDS
                       if getattr(config, k) != getattr(self.config_, k)]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} changed since the model was fitted "
                    f"({', '.join(f'{k}={getattr(self.config_, k)!r}' for k in changed)}); "
                    f"these fix the model's shapes: fit a new model (warm_start=False)")
        return config

    def fit_settings(self) -> dict:
        """Early stopping and seed for :func:`slide.train.fit_loop` (current settings)."""
        c = SlideConfig(**self.get_params())
        return {"early_stopping": c.early_stopping,
                "validation_fraction": c.validation_fraction,
                "n_iter_no_change": c.n_iter_no_change, "refit": c.refit, "seed": c.seed}

    def validation_metric(self) -> str:
        """The early-stopping score: the full softmax's loss where the output layer is trained
        whole, nDCG@5 where it is sampled (:class:`slide.train.EarlyStopping`)."""
        return "nDCG@5" if self.resolved_["sampled"] else "loss"

    def _refresh_config(self):
        """Settings that may change between calls on a fitted model (lr, threads, epochs...)."""
        config = self._current_config()
        if config.lr != self.config_.lr:
            self.learning_rate_ = self._resolve(config)["lr"]
        self.config_ = config
        self.resolved_ = self._resolve(config)
        self.batch_size_ = self.resolved_["batch_size"]

    def _resolve(self, config):
        return resolve(config, self.n_features_in_, self.n_labels_, self.n_train_, self.rare_share_,
                       self.choice_, self.labels_per_row_)

    # -- fitting ---------------------------------------------------------------------------------
    def check_data(self, X, Y=None, where="input", fitted=True):
        """Validated float32 CSR ``X`` (and CSR indicator ``Y``), against the fitted shapes
        when ``fitted`` and the model is fitted."""
        if not (fitted and self._is_fitted()):
            return check_xy(X, Y, where=where, require_labels=Y is not None)
        return check_xy(X, Y, n_features=self.n_features_in_,
                        n_labels=self.n_labels_ if Y is not None else None, where=where,
                        owner=type(self).__name__)

    def fit(self, X, Y, validation=None, progress: bool = False, on_epoch=None, distributed=None):
        """Train from scratch (or, with ``warm_start``, continue) on ``X`` [n, n_features]
        (CSR-convertible) and ``Y`` (CSR indicator [n, n_labels] or label-id lists).

        With ``early_stopping`` a slice of the training rows is held out unless ``validation``
        ``(X_val, Y_val)`` is given; see :func:`slide.train.fit_loop`. ``progress`` shows a
        tqdm bar per epoch; ``on_epoch(model, record)`` runs after each epoch.
        ``distributed``: a :class:`slide.distributed.DataParallel`; every rank calls ``fit``
        with its own shard of the rows and ends with the same model.
        """
        with self._training(distributed):
            return self._fit(X, Y, validation, progress, on_epoch, distributed)

    def _fit(self, X, Y, validation, progress, on_epoch, distributed):
        warm = self.warm_start and self._is_fitted()
        if warm:
            self._refresh_config()
        fit_loop(self, X, Y, validation=validation, progress=progress, on_epoch=on_epoch,
                 continue_training=warm, distributed=distributed)
        if self._tables_stale:  # serving-ready: predictions then leave the model as it is
            self._refresh_tables()
        return self

    def partial_fit(self, X, Y, distributed=None):
        """One pass over (X, Y) in the given row order (for streams); initialises an unfitted
        model from this first batch's shapes (no validation slice is held out). Unlike an
        epoch, a call does not start with a rehash: the tables follow their schedule across
        calls, so a stream of small calls costs what one epoch over the same rows does.
        ``distributed``: see :meth:`fit`; every rank calls with its own rows (a shard shorter
        than the others repeats its first rows to take as many steps)."""
        with self._training(distributed):
            return self._partial_fit(X, Y, distributed)

    def __getstate__(self):
        # a copy (pickle, deepcopy) is not being trained, whichever thread trains this model
        state = super().__getstate__()
        state.pop("_trainer", None)
        # the copy's weights and moments are arrays of their own, no longer views of a block:
        # it makes blocks of its own when it trains (a copied block and copied views would
        # pass _live_block's identity check, and the copy would train one, predict from another)
        state["_row_blocks"] = {}
        return state

    @contextlib.contextmanager
    def _training(self, distributed=None):
        """Mark the model as training on the calling thread for the block. Another thread that
        starts training it meanwhile gets an error instead of racing the first through the
        model's parameters and step buffers (where both would train garbage); nested calls on
        the same thread (``partial_fit`` from an ``on_epoch`` callback) go through. With
        ``distributed``, the whole block (that check too) is inside its
        :meth:`~slide.distributed.DataParallel.guard`: an error on one rank ends the job
        instead of leaving the other ranks waiting for it."""
        with distributed.guard() if distributed is not None else contextlib.nullcontext():
            with self._marked_training():
                yield

    @contextlib.contextmanager
    def _marked_training(self):
        me = threading.get_ident()
        with _TRAINER_LOCK:
            owner = self.__dict__.get("_trainer")
            if owner is not None and owner != me:
                raise RuntimeError(
                    f"this {type(self).__name__} is already training on another thread: a model "
                    "trains on one thread at a time (its kernels already use `threads` cores); "
                    "train a clone on each thread instead")
            self._trainer = me
        try:
            yield
        finally:
            if owner is None:
                self._trainer = None

    def _partial_fit(self, X, Y, distributed):
        if self._is_fitted():
            self._refresh_config()
            X, Y = self.check_data(X, Y, where="partial_fit")
        else:
            X, Y = self.check_data(X, Y, where="partial_fit", fitted=False)
            if distributed is not None:
                X, Y = distributed.agree_shapes(X, Y)
            self.initialize(X, Y, distributed=distributed)
        order = np.arange(X.shape[0])
        if distributed is not None:
            distributed.ensure_started(self)
            order = distributed.epoch_order(order, self.batch_size_)
        if self.samples_seen_ == 0:  # a fresh model: fill the tables from the initial weights
            self._refresh_tables()
        self.distributed_ = distributed
        try:
            self.train_rows(self.preprocess(X), Y, order)
            if distributed is not None:
                distributed.finish(self)
        finally:
            self.distributed_ = None
        return self

    def initialize(self, X, Y, distributed=None, choice: dict | None = None) -> None:
        """Fresh preprocessing (fitted on X), parameters, moments, tables and counters. With
        ``distributed``, X is this rank's shard: row counts and feature statistics are the
        whole data's, and :meth:`DataParallel.start` then gives every rank rank 0's parameters.
        ``choice``: settings chosen on a held-out slice, one of ``resolved_["choices"]`` (see
        :func:`slide.train.fit_loop`); None before a choice is made."""
        self.config_ = SlideConfig(**self.get_params())
        self.choice_ = choice
        self.fit_data(X, Y, distributed)
        self.resolved_ = self._resolve(self.config_)
        check_fits(model_memory_bytes(self.resolved_, self.n_features_in_, self.n_labels_,
                                      self.config_.threads or numba.config.NUMBA_NUM_THREADS),
                   f"a model of {self.n_features_in_} features, hidden {self.resolved_['hidden']} "
                   f"and {self.n_labels_} labels")
        self._row_blocks = {}  # a previous fit's blocks go before the new arrays are made
        self.params_ = init_parameters(self.resolved_["hidden"], self.n_features_in_, self.n_labels_,
                                       self.config_.seed, self.preprocessor_.seen_features(),
                                       self.resolved_["input_init"])
        # np.zeros maps zero pages lazily: the moments take no memory before row_blocks copies
        # them (np.zeros_like writes every page)
        self.moments_ = {f"{k}.{s}": np.zeros(v.shape, v.dtype) for k, v in self.params_.items()
                         for s in "mv"}
        self.learning_rate_ = self.resolved_["lr"]
        self.step_, self.epoch_, self.samples_seen_ = 0, 0, 0
        self.epoch_position_ = 0
        self.history_, self.timings_ = [], {}
        self.early_stopping_, self.best_params_, self.stopping_ = None, None, None
        self.hash_seed_ = self.config_.seed
        self._setup()
        self._next_rehash = self.resolved_["rehash_every"]
        self._rehash_interval = float(self.resolved_["rehash_every"])
        self._next_rebuild = self.resolved_["rebuild_every"]
        # a model initialised here trains: its weights go into their row blocks now, so that
        # the tables are first hashed from them (a rehash in a timed step then compiles nothing)
        self.row_blocks()
        self._refresh_tables()

    def _setup(self):
        """Derived state: offsets, gradients, tables, scratch (never saved)."""
        r = self.resolved_
        self.batch_size_ = r["batch_size"]
        sizes = np.array(r["hidden"], np.int64)
        self._sizes = sizes
        self._n_acts = int(sizes.sum())  # every hidden layer's activations side by side
        self._blocks = hidden_blocks(r["hidden"])
        # the kernels take the offsets as arrays (at least one entry, even with no stack)
        self._h_off = np.array([b[0] for b in self._blocks] or [0], np.int64)
        self._b_off = np.array([b[1] for b in self._blocks] or [0], np.int64)
        # the small dense parameters' gradients; those of W, b and W0 are compact, a row for each
        # row a step adds gradients to (_scratch)
        self.grads_ = {k: np.zeros(self.params_[k].shape, np.float32) for k in ("b0", "Wh", "bh")}
        self.tables_, self.serving_tables_, self.serving_candidates_ = None, None, None
        if r["sampled"]:
            self.tables_ = HashTables(int(sizes[-1]), self.n_labels_, TableConfig(**r["tables"]),
                                      seed=self.hash_seed_)
        self.hidden_tables_ = [None] * sizes.size
        for l, layer in enumerate(r["hidden_layers"]):
            if layer is not None:
                self.hidden_tables_[l] = HashTables(int(sizes[l - 1]), int(sizes[l]),
                                                    TableConfig(**layer["tables"]),
                                                    seed=self._layer_seed(l))
        # kernels.mark_rows' marks of the output rows and mark_ids' of the input rows, all
        # UNTOUCHED between steps, and the rows' slots in a step's compact gradients
        self._owners = np.zeros(self.n_labels_, np.uint8)
        self._owners_in = np.zeros(self.params_["W0"].shape[0], np.uint8)
        self._slots = np.zeros(self.n_labels_, np.int32)
        self._slots_in = np.zeros(self.params_["W0"].shape[0], np.int32)
        # a label's place in the step's pool, and its membership bit: -1 and 0 between steps
        self._pool_pos = np.full(self.n_labels_, -1, np.int32)
        self._pool_bits = np.zeros((self.n_labels_ + 7) // 8, np.uint8)
        self._scratch_key = None
        self._pool_buf = None
        self._in_lists = np.empty((3, 0), np.int32)
        self._pairs = (np.zeros(1, np.int64), np.empty(0, np.int32), np.empty(0, np.float32))
        self._numbers = np.arange(0, dtype=np.int32)
        self.distributed_ = None  # a DataParallel while fit/partial_fit trains across ranks
        self._tables_stale = False
        # int8 copies of W and b for serving, built when first needed: exact top-k's, by label
        # tiles (slide.screen.Int8Rows), and LSH serving's, by label (Int8Labels)
        self._int8_rows = None
        self._int8_labels = None

    def row_blocks(self) -> dict:
        """The row blocks that ``W`` and ``W0`` train in (:mod:`slide.kernels`): float32
        [n_labels, 3·H] and [n_features, 3·H0], row i the weights of row i, then its Adam first
        and second moments; ``params_`` and ``moments_`` hold views of them. Made when the model
        is initialised for training, filled from the file when a checkpoint with moments is
        loaded, and made again (a copy) at the next step if those arrays were replaced. A model
        loaded from an inference-only checkpoint keeps its plain arrays until it trains: its
        moments are zeros that take no memory until written, and a block would write them
        all."""
        if not self._is_fitted():
            raise NotFittedError("this SlideClassifier is not fitted yet: it has no weights")
        for name in ("W", "W0"):
            if self._live_block(name) is None:
                self._make_block(name, self.params_[name].shape,
                                 lambda part, d, key: np.copyto(part, d[key]))
        return {name: B for name, (B, _) in self._row_blocks.items()}

    def _make_block(self, name: str, shape: tuple, fill) -> None:
        """Make ``name``'s row block float32 [n, 3·H] for its [n, H] ``shape``:
        ``fill(part, d, key)`` writes each of its three column blocks (the weights, the first
        moment, the second), which then replaces ``d[key]`` (``params_`` or ``moments_``)."""
        n, H = shape
        # on a cache line, so that a row of weights (512 bytes at H = 128) spans 8 lines, not 9
        B = aligned_empty((n, 3 * H), np.float32)
        parts = []
        for j, (d, key) in enumerate(self._block_parts(name)):
            part = B[:, j * H:(j + 1) * H]
            fill(part, d, key)
            d[key] = part
            parts.append(part)
        self._row_blocks[name] = (B, tuple(parts))

    def _block_parts(self, name: str) -> tuple:
        """(dict, key) of the weights and the two moments a row block of ``name`` holds."""
        return ((self.params_, name), (self.moments_, name + ".m"), (self.moments_, name + ".v"))

    def _live_block(self, name: str):
        """``name``'s row block if the weights and both moments are still the views of it that
        :meth:`_make_block` made, else None (not made yet, or an array was replaced since). The
        views are kept to be checked by identity: a single row's query asks twice, and asking
        numpy where each view's memory starts took 20 µs."""
        B, parts = self._row_blocks.get(name, (None, ()))
        if B is None or any(d[key] is not part
                            for (d, key), part in zip(self._block_parts(name), parts)):
            return None
        return B

    def _weight_rows(self, name: str) -> np.ndarray:
        """C-contiguous rows led by the weights of ``W`` or ``W0``, for kernels that only read
        them: the row block where the model trains, the plain matrix otherwise."""
        B = self._live_block(name)
        return self.params_[name] if B is None else B

    def _scratch(self, n_rows: int, max_labels: int, nnz: int):
        """Per-thread and per-batch buffers, grown when a batch needs more (``nnz``: the batch's
        non-zero features).

        Among them the step's compact gradients ``grads_["W"]`` [S, H], ``grads_["b"]`` [S]
        and ``grads_["W0"]`` [S0, H0]: row k for the k-th row a step adds gradients to (its
        slot, :func:`slide.kernels.mark_rows`), zero between steps (Adam zeroes the rows it
        reads). A full-size accumulator would hold a row for every label (343 MB at 670K x
        128), and its pages, written at random rows, all come back within an epoch."""
        t = numba.get_num_threads()
        width = self.resolved_["lsh_cap"] + max_labels
        n_features, H0 = self.params_["W0"].shape
        need = min(nnz, n_features)  # the batch's distinct features, at most
        if "W0" not in self.grads_ or self.grads_["W0"].shape[0] < need:
            # a quarter more room, so that a slightly fuller batch does not allocate again
            self.grads_["W0"] = aligned_zeros((min(need + need // 4, n_features), H0), np.float32)
        if self._in_lists.shape[1] < nnz:
            room = nnz + nnz // 4
            self._in_lists = np.empty((3, room), np.int32)  # kernels.mark_ids' lists of input rows
            # kernels.backward_hidden's entries of the shared input rows, grouped by row
            self._pairs = (np.empty(room + 1, np.int64), np.empty(room, np.int32),
                           np.empty(room, np.float32))
        old = self._scratch_key
        if old is None or old[0] != t or old[1] < width or old[2] < n_rows:
            width = max(width, old[1] if old else 0)
            n_rows = max(n_rows, old[2] if old else 0)
            tc = self.tables_.config if self.tables_ is not None else None
            self._qs = QueryScratch(t, tc.L if tc else 1, tc.bucket_size if tc else 1, width,
                                    self.n_labels_)
            self._active = np.zeros((n_rows, width), np.int32)
            self._n_active = np.zeros(n_rows, np.int64)
            self._logits = np.zeros((t, width), np.float32)
            self._dbuf = np.zeros((t, 2 * int(self._sizes.max())), np.float32)
            self._dH = np.empty((n_rows, int(self._sizes[-1])), np.float32)
            self._d_first = np.empty((n_rows, int(self._sizes[0])), np.float32)
            self._losses = np.empty(n_rows, np.float32)
            self._touched = np.zeros(n_rows * width + self.resolved_["pool"], np.int32)
            self._shared = np.zeros_like(self._touched)
            self._in_place = np.zeros_like(self._touched)
            rows = min(self._touched.size, self.n_labels_)  # the step's distinct rows, at most
            self.grads_["W"] = aligned_zeros((rows, self.params_["W"].shape[1]), np.float32)
            self.grads_["b"] = np.zeros(rows, np.float32)
            self._scratch_key = (t, width, n_rows)

    def _pool_blocks(self, n_rows: int, n_pool: int, width: int, threads: int):
        """Contiguous float32 blocks for the shared pool's step, cut from one buffer kept across
        batches (fresh megabyte arrays page-fault on every batch): its weight rows [P, H], its
        logits (then logit gradients) [n, P], its weight gradients [P, H], a vector over it [P]
        (biases, then column sums) and the threads' shares of the hidden gradient [T, n, H]."""
        shapes = ((n_pool, width), (n_rows, n_pool), (n_pool, width), (n_pool,),
                  (threads, n_rows, width))
        # plain integers: numpy's prod and cumsum on these tuples took 40 us a step
        ends = list(itertools.accumulate((math.prod(shape) for shape in shapes), initial=0))
        if self._pool_buf is None or self._pool_buf.size < ends[-1]:
            self._pool_buf = aligned_empty(ends[-1], np.float32)  # the gathered rows on lines
        return tuple(self._pool_buf[lo:hi].reshape(shape)
                     for lo, hi, shape in zip(ends[:-1], ends[1:], shapes))

    # -- forward ---------------------------------------------------------------------------------
    def _layer_seed(self, l: int) -> int:
        """Hash seed of hidden layer l's tables (the output layer's is ``hash_seed_``)."""
        return self.hash_seed_ + 7919 * l

    def _block(self, l: int):
        """Weights [H_l, H_{l-1}] and bias [H_l] of hidden layer l >= 1 (views into Wh, bh)."""
        return hidden_block(self.params_, self._blocks[l - 1])

    def _forward(self, X: sp.csr_matrix) -> np.ndarray:
        """Activations of every hidden layer, float32 [n, Σ hidden], for preprocessed rows."""
        p, sizes = self.params_, self._sizes
        acts = np.empty((X.shape[0], self._n_acts), np.float32)
        relu = self.resolved_["activation"] == "relu"
        kernels.forward_input(X.indptr.astype(np.int64), X.indices, X.data, self._weight_rows("W0"),
                              p["b0"], relu, acts)
        lo = 0
        for l in range(1, sizes.size):
            W, b = self._block(l)
            tables = self.hidden_tables_[l]
            if tables is None:
                active, n_active = np.zeros((X.shape[0], 0), np.int32), np.zeros(X.shape[0], np.int64)
            else:
                codes = tables.family.hash_dense(acts[:, lo:lo + int(sizes[l - 1])])
                active, n_active = tables.query_codes(
                    codes, self.resolved_["hidden_layers"][l]["target"], rank=True)
            kernels.forward_layer(acts, lo, lo + int(sizes[l - 1]), W, b, active, n_active, relu)
            lo += int(sizes[l - 1])
        return acts

    def _last(self, acts):
        return acts[:, acts.shape[1] - int(self._sizes[-1]):]

    # -- training --------------------------------------------------------------------------------
    def _tick(self, name, t0):
        self.timings_[name] = self.timings_.get(name, 0.0) + time.perf_counter() - t0
        return time.perf_counter()

    def begin_epoch(self) -> None:
        """Rehash the tables with the current weights. Every epoch starts with it, so a run
        resumed from a checkpoint (whose tables are rebuilt on load) continues exactly."""
        self._refresh_tables()

    def train_epoch(self, Xp, Y, order, progress=None) -> dict:
        """One epoch: a rehash (:meth:`begin_epoch`), then :meth:`train_rows`."""
        self.begin_epoch()
        return self.train_rows(Xp, Y, order, progress)

    def train_rows(self, Xp, Y, order, progress=None) -> dict:
        """One pass in ``order`` over preprocessed rows, in batches of ``batch_size_``, on the
        model's threads; the tables rehash on their schedule only."""
        threads = self.config_.threads
        if threads is None and self.distributed_ is not None:
            threads = self.distributed_.threads  # ranks on one host share its cores
        with engine_threads(threads):
            return super().train_epoch(Xp, Y, order, progress)

    def train_step(self, Xb: sp.csr_matrix, Yb: sp.csr_matrix) -> float:
        """One optimizer step on a batch of preprocessed rows ``Xb`` (float32 CSR, sorted
        indices) with labels ``Yb`` (CSR indicator); returns the batch's mean loss. Call it
        inside :func:`lsh.engine_threads` for the model's thread count."""
        p, g = self.params_, self.grads_
        blocks = self.row_blocks()
        n = Xb.shape[0]
        self._scratch(n, kernels.longest_row(Yb.indptr), Xb.indices.size)
        n_threads = numba.get_num_threads()  # the per-sample kernels' loops, one per thread
        y_indptr = Yb.indptr.astype(np.int64)
        t0 = time.perf_counter()
        acts = self._forward(Xb)
        h = self._last(acts)
        t0 = self._tick("forward_hidden", t0)
        if self.tables_ is not None:
            codes = self.tables_.family.hash_dense(h)
            buckets, seen = self.tables_.buckets, self.tables_.seen
            pool = shared_negatives(draw_key(self.config_.seed, 1, self.step_), self.n_labels_,
                                    self.resolved_["pool"], Yb.indices)
        else:  # every neuron active: the pool is all of them
            codes = np.zeros((n, 1), np.int32)
            buckets, seen = np.zeros((0, 1, 1), np.int32), np.zeros((0, 1), np.int32)
            pool = np.arange(self.n_labels_, dtype=np.int32)
        t0 = self._tick("hash", t0)
        # the shared pool is a dense block: its logits and gradients are matrix products
        pool_bounds = thread_chunks(pool.size)  # each thread's block of the pool
        W_pool, z_pool, g_pool, pool_vec, dH_parts = self._pool_blocks(n, pool.size, h.shape[1],
                                                                       pool_bounds.size - 1)
        h_pool = np.ascontiguousarray(h)  # a view into acts' columns when there are 2+ layers
        kernels.pool_logits(h_pool, blocks["W"], p["b"], pool, W_pool, z_pool, pool_vec,
                            pool_bounds, kernels.POOL_CHUNK)
        t0 = self._tick("pool_matmul", t0)
        qs = self._qs
        kernels.select_active(y_indptr, Yb.indices, codes, buckets, seen, qs.slots, qs.where,
                              qs.cand, qs.hits, qs.hist, self.resolved_["lsh_cap"], pool,
                              self._pool_pos, self._pool_bits, z_pool, self._active,
                              self._n_active, n_threads)
        dp = self.distributed_
        # a row whose whole gradient one kernel computes gets its Adam step there; not where
        # ranks sum their gradients before the update
        in_place = self._updates_in_place()
        n_touched, n_shared = kernels.mark_rows(pool, self._active[:n], self._n_active[:n],
                                                self._owners, in_place, self._touched, self._slots,
                                                self._shared)
        hyper = (*self._adam_hyper(self.step_ + 1), self.resolved_["weight_decay"])
        dH, losses = self._dH[:n], self._losses[:n]
        m = self.moments_
        loss = kernels.output_step(y_indptr, acts, blocks["W"], p["b"], g["W"], g["b"], m["b.m"],
                                   m["b.v"], self._owners, self._slots, z_pool, self._active,
                                   self._n_active, n_threads, self._logits, dH, losses, *hyper)
        t0 = self._tick("select+output", t0)
        kernels.pool_gradients(h_pool, W_pool, z_pool, pool, dH, blocks["W"], p["b"], g["W"], g["b"],
                               m["b.m"], m["b.v"], self._owners, self._slots, g_pool, pool_vec,
                               dH_parts, pool_bounds, kernels.POOL_CHUNK, *hyper)
        t0 = self._tick("pool_matmul", t0)
        # the batch's input rows: a feature in one sample's row only (most of them) gets its
        # Adam step in that sample's backward pass
        in_touched, in_rows, in_alone = self._in_lists[:, :Xb.indices.size]
        n_in, n_in_shared = kernels.mark_ids(Xb.indices, self._owners_in, in_place, in_touched,
                                             self._slots_in, in_rows)
        kernels.backward_hidden(Xb.indptr.astype(np.int64), Xb.indices, Xb.data, acts, dH,
                                blocks["W0"], self._owners_in, self._slots_in, n_in_shared,
                                p["Wh"], self._h_off, self._sizes, g["W0"], g["b0"], g["Wh"],
                                g["bh"], self._b_off, n_threads, self._dbuf, self._d_first[:n],
                                *self._pairs, self.resolved_["activation"] == "relu", *hyper)
        t0 = self._tick("backward_hidden", t0)
        # the rows updated in place are listed only for data parallelism's averages
        listed = dp is not None
        n_in_place = kernels.clear_marks(self._owners, self._touched[:n_touched],
                                         self._in_place if listed else self._in_place[:0])
        n_in_alone = kernels.clear_marks(self._owners_in, in_touched[:n_in],
                                         in_alone if listed else in_alone[:0])
        out_rows, in_rows = self._shared[:n_shared], in_rows[:n_in_shared]
        in_alone = in_alone[:n_in_alone]
        # the rows' gradients, row t for out_rows[t] / in_rows[t] (their slots)
        grads = {"W": g["W"][:n_shared], "b": g["b"][:n_shared], "W0": g["W0"][:n_in_shared],
                 "b0": g["b0"], "Wh": g["Wh"], "bh": g["bh"]}
        if dp is not None:  # sync: the ranks' gradients averaged over the rows any rank touched
            out_rows, in_rows, grads = dp.before_update(self, out_rows, in_rows, grads)
            t0 = self._tick("exchange", t0)
        self._adam_update(out_rows, in_rows, grads)
        t0 = self._tick("adam", t0)
        self.samples_seen_ += n
        if dp is not None:  # local/delayed: parameter averages on their schedule
            dp.after_update(self, np.concatenate((out_rows, self._in_place[:n_in_place])),
                            np.concatenate((in_rows, in_alone)))
            t0 = self._tick("exchange", t0)
        self._maybe_rehash()
        self._tick("rehash", t0)
        return loss

    def _updates_in_place(self) -> bool:
        """Whether rows with one source of gradient get their Adam step in the kernel that
        computes it: not where ranks sum their gradients before the update."""
        return self.distributed_ is None or not self.distributed_.sums_gradients

    def _adam_hyper(self, step: int) -> tuple:
        """Adam's (lr, beta1, beta2, eps, step) for the kernels."""
        c = self.config_
        return self.learning_rate_, c.beta1, c.beta2, c.eps, step

    def _adam_update(self, out_rows, in_rows, grads):
        """One Adam step on output rows ``out_rows`` (and their biases), input rows ``in_rows``
        and the small dense parameters, from compact gradients (:meth:`apply_gradients`' form);
        the gradients are zeroed on return. Weight decay applies to weights, not biases."""
        p, m = self.params_, self.moments_
        blocks = self.row_blocks()
        self.step_ += 1
        hp = self._adam_hyper(self.step_)
        wd = self.resolved_["weight_decay"]
        g_out, g_in = self._first_numbers(out_rows.size), self._first_numbers(in_rows.size)
        kernels.adam_rows(out_rows, g_out, blocks["W"], grads["W"], *hp, wd)
        kernels.adam_entries(out_rows, g_out, p["b"], m["b.m"], m["b.v"], grads["b"], *hp, 0.0)
        kernels.adam_rows(in_rows, g_in, blocks["W0"], grads["W0"], *hp, wd)
        for k, decay in (("b0", 0.0), ("Wh", wd), ("bh", 0.0)):
            if p[k].size:
                kernels.adam_dense(p[k], m[k + ".m"], m[k + ".v"], grads[k], *hp, decay)
        self._params_changed()

    def _first_numbers(self, n: int) -> np.ndarray:
        """0, 1, ..., n - 1 (int32; the rows of a compact gradient, one for each row listed),
        cut from one array kept across steps: numpy's ``arange`` between the step's kernels,
        which leave the caches cold, took about 40 us."""
        if self._numbers.size < n:
            self._numbers = np.arange(n + n // 4, dtype=np.int32)
        return self._numbers[:n]

    def apply_gradients(self, out_rows, in_rows, grads) -> None:
        """One Adam step from gradients computed elsewhere (the heterogeneous trainer's GPU
        worker): ``grads["W"]`` [len(out_rows), H] and ``grads["b"]`` [len(out_rows)] for output
        rows ``out_rows``, ``grads["W0"]`` [len(in_rows), H0] for input rows ``in_rows``, and full
        ``b0``, ``Wh``, ``bh``. All float32 host arrays; they are zeroed on return."""
        self._adam_update(np.asarray(out_rows, np.int32), np.asarray(in_rows, np.int32), grads)

    def _tables(self):
        """(tables, weights, seed) of every sampled layer: hidden ones, then the output."""
        out = [(t, self._block(l)[0], self._layer_seed(l)) for l, t in enumerate(self.hidden_tables_)
               if t is not None]
        if self.tables_ is not None:
            out.append((self.tables_, self.params_["W"], self.hash_seed_))
        return out

    def _maybe_rehash(self):
        if self.samples_seen_ >= self._next_rebuild:
            self.hash_seed_ += 1
            for tables, W, seed in self._tables():
                tables.rebuild(W, seed=seed)
            self._tables_stale = False
            self._next_rebuild = self.samples_seen_ + self.resolved_["rebuild_every"]
            self._next_rehash = self.samples_seen_ + int(self._rehash_interval)
        elif self.samples_seen_ >= self._next_rehash:
            for tables, W, _ in self._tables():
                tables.rehash(W)
            self._tables_stale = False
            self._rehash_interval *= self.config_.rehash_growth
            self._next_rehash = self.samples_seen_ + int(self._rehash_interval)

    def _refresh_tables(self):
        """Rehash with the current weights (epochs start with it; LSH serving does it first
        when training has moved the weights since the last rehash)."""
        for tables, W, _ in self._tables():
            tables.rehash(W)
        if self.serving_tables_ is not None:
            self.serving_tables_.rehash(self.params_["W"])
        self._tables_stale = False

    def set_serving(self, tables: int | None = None, candidates: int | None = None,
                    center: bool = True):
        """The hash tables of ``predict_topk(mode="lsh")``, apart from training's.

        ``tables``: how many tables to query (default: as many as training's), with training's
        hash family, K and buckets. They store every label (:class:`lsh.compact.CompactTables`),
        where training's bounded buckets keep a sample of a crowded bucket's labels. More
        tables find more of the exact top-k (recall) at a higher cost per query, and take
        ``tables × n_labels × 4`` bytes. ``candidates``: the most labels scored a row, those
        found in the most tables (default: four times the most that training's bounded tables
        could return, its tables × bucket size, whatever the serving tables; at most every
        label). ``center``: hash the output rows less their mean row, which ranks the labels as
        the rows do (``h·(w − μ) = h·w − h·μ``) while the large mean that trained rows share no
        longer gives most of them the same codes. At Amazon-670K shape, on a model with the
        identity hidden layer, recall@5 rose from 0.009 with training's 24 tables to 0.252 with
        24 of these and the default candidates, 0.380 with 64 and 0.496 with 128
        (bench/README.md).

        The first LSH query builds the default tables where none were set. Not saved with the
        model; kept up to date with the weights. Queries may come from several threads at once;
        calling this while they run is safe, though a query then running may finish on the
        tables it started with. ``bench/serving.py`` measures recall@k and
        latency along these settings.
        """
        self._require_fitted()
        if self.tables_ is None:
            raise ValueError("every output is computed for this model: there are no tables to serve from")
        for name, value in (("tables", tables), ("candidates", candidates)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                      or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        tables = int(tables or self.tables_.config.L)
        cfg = dataclasses.replace(self.tables_.config, L=tables)
        serving = CompactTables(self.tables_.dim, self.n_labels_, cfg,
                                seed=self.hash_seed_ + 0x5EED, center=center)
        serving.build(self.params_["W"])
        # the tables last, once built: a query on another thread takes them as they are set
        slots = self.tables_.config.L * self.tables_.config.bucket_size
        budget = min(self.n_labels_, CANDIDATES_PER_SLOT * slots)
        self.serving_candidates_ = int(candidates or budget)
        self.serving_tables_ = serving
        return self

    def _params_changed(self):
        self._tables_stale = True
        self._int8_rows = None
        self._int8_labels = None

    def _built_once(self, name: str, build):
        """Attribute ``name``, set to ``build()`` where it is None: once, however many query
        threads ask for it at the same moment (``_SERVING_LOCK``), on the query's threads."""
        if getattr(self, name) is None:
            with _SERVING_LOCK:
                if getattr(self, name) is None:
                    self._query_threads()
                    setattr(self, name, build())
        return getattr(self, name)

    def _exact_screen(self):
        """The int8 copy of the output layer for exact top-k (:mod:`slide.screen`), or None
        where the float32 kernel is as fast (fewer than ``SCREEN_MIN_LABELS`` labels) or the
        CPU has no int8 dot product. Built on the first exact query after the weights last
        moved (0.3 s and 0.25 bytes per weight at 670K x 128), dropped at the next update."""
        if self.n_labels_ < SCREEN_MIN_LABELS or not has_int8_dot():
            return None
        return self._built_once("_int8_rows",
                                lambda: quantize_rows(self.params_["W"], self.params_["b"]))

    def _candidate_screen(self):
        """The int8 copy of the output layer by label that LSH serving scores its candidates
        from (:func:`slide.screen.screened_candidates`). Built on the first LSH query after the
        weights last moved (0.1 s and 0.25 bytes per weight plus 16 bytes per label at 670K x
        128), dropped at the next update."""
        return self._built_once("_int8_labels",
                                lambda: quantize_labels(self.params_["W"], self.params_["b"]))

    # -- inference -------------------------------------------------------------------------------
    def _query_threads(self) -> int:
        """Set numba's threads for a query from the ``threads`` parameter as it is now, and
        return the count: ``set_params(threads=N)`` on a fitted or loaded model takes effect at
        its next query, as ``n_jobs`` does in scikit-learn (``config_`` follows the parameters
        only when training resumes, and a query that read it ran on every core)."""
        return set_num_threads(checked_setting("threads", self.threads))

    def _require_fitted(self):
        """Serving starts here: the model must exist, and its tables reflect its weights."""
        if not self._is_fitted():
            raise NotFittedError("this SlideClassifier is not fitted yet; call fit first")
        if self._tables_stale:
            with _SERVING_LOCK:
                if self._tables_stale:
                    self._refresh_tables()

    def embed(self, X) -> np.ndarray:
        """Last hidden layer activations, float32 [n, hidden[-1]]."""
        self._require_fitted()
        X = self.preprocess(self.check_data(X, where="embed"))
        self._query_threads()
        return np.ascontiguousarray(self._last(self._forward(X)))

    def _block_rows(self, block):
        # about 64 MB of float32 scores per block: the loss's temporaries (shifted scores, their
        # exponentials) are as large again, and at 670K labels a larger block set the peak
        # memory of a whole training run
        return block or max(1, min(4096, (1 << 24) // self.n_labels_))

    def _last_hidden_blocks(self, X, block: int | None = None):
        """Yields ``(lo, hi, h)``: the last hidden layer float32 [hi - lo, H] of rows lo..hi of
        the (checked, raw) CSR ``X``, block by block."""
        Xp = self.preprocess(X)
        block = self._block_rows(block)
        # the model's threads, a single row's query too: each of its kernels splits the work
        # (exact scoring a row's labels), and one thread answered single rows later on 2 cores
        # at 10K and 670K labels, exact and LSH (bench/README.md, "Serving")
        self._query_threads()
        n = Xp.shape[0]
        for lo in range(0, n, block):
            hi = min(lo + block, n)
            # a query of one block (a single row's) takes its rows whole: scipy's slice, a new
            # matrix, was a tenth of a single row's LSH query
            yield lo, hi, self._last(self._forward(Xp if hi - lo == n else Xp[lo:hi]))

    def score_blocks(self, X, block: int | None = None):
        """Exact scores of every label, block by block: yields ``(lo, hi, S)`` with ``S``
        float32 [hi - lo, n_labels] for rows lo..hi of the (checked, raw) CSR ``X``."""
        self._require_fitted()
        W, b = self.params_["W"], self.params_["b"]
        for lo, hi, h in self._last_hidden_blocks(X, block):
            s = h @ W.T
            s += b
            yield lo, hi, s

    def block_topk(self, S, k: int):
        """Top-k ``(ids int64 [n, k], scores float32 [n, k])`` of score rows ``S``."""
        return topk(S, k)

    def predict_topk(self, X, k: int = 5, mode: str = "exact", block: int | None = None):
        """Top-k labels per row: ``(ids int64 [n, k], scores float32 [n, k])``, best first.

        ``mode="exact"`` finds the exact top-k without forming the score matrix, ``block``
        rows per call (default 1024): at 32,768 labels or more on CPUs with AVX-512 VNNI through
        an int8 screen whose candidates are rescored in float32
        (:func:`slide.screen.screened_topk`), otherwise :func:`slide.metrics.topk_product`;
        ``mode="lsh"`` scores only each row's candidates from the serving tables (sub-linear
        serving; :meth:`set_serving`, built with its defaults at the first such query where it
        was not called; rows with fewer than k candidates are padded with id -1), ``block``
        rows per call (default: about 64 MB of candidates, 2,048 rows at 4,096 a row).
        """
        self._require_fitted()
        X = self.check_data(X, where="predict")
        k = check_k(k)
        if mode not in ("exact", "lsh"):
            raise ValueError(f"mode must be 'exact' or 'lsh', got {mode!r}")
        ids = np.empty((X.shape[0], k), np.int64)
        scores = np.empty((X.shape[0], k), np.float32)
        W, b = self.params_["W"], self.params_["b"]
        if mode == "exact" or self.tables_ is None:
            # the fused kernels never form a block's score matrix, so blocks can be larger
            screen = self._exact_screen()
            for lo, hi, h in self._last_hidden_blocks(X, block or EXACT_BLOCK_ROWS):
                ids[lo:hi], scores[lo:hi] = topk_product(h, W, b, k) if screen is None \
                    else screened_topk(h, W, b, k, screen)
            return ids, scores
        tables = self._built_once("serving_tables_", lambda: self.set_serving().serving_tables_)
        n_cand = self.serving_candidates_
        screen = self._candidate_screen()
        # a block's candidates take 8 bytes each (their ids, their int8 bounds): about 64 MB a
        # block. Blocks of the score matrix's size (25 rows at 670K labels) made a batch of 128
        # rows 1.15-1.21x as long as one block (bench/README.md)
        block = block or max(1, min(4096, (1 << 23) // n_cand))
        for lo, hi, h in self._last_hidden_blocks(X, block):
            cand, n_c = tables.query(h, n_cand)
            # fewer rows than threads: each row's candidates split among them
            parts = max(1, numba.get_num_threads() // h.shape[0])
            screened_candidates(h, self._weight_rows("W"), b, screen, cand, n_c, parts,
                                ids[lo:hi], scores[lo:hi])
        return ids, scores

    def decision_function(self, X) -> np.ndarray:
        """All output logits, float32 [n, n_labels] (dense: mind the memory on wide layers)."""
        self._require_fitted()
        X = self.preprocess(self.check_data(X, where="decision_function"))
        return self._last(self._forward(X)) @ self.params_["W"].T + self.params_["b"]

    # -- persistence -----------------------------------------------------------------------------
    def save(self, path, inference_only: bool = False) -> None:
        """Write the model to directory ``path`` (npz + JSON, atomic; see :mod:`slide.checkpoint`).

        ``inference_only`` leaves out what only training needs (the Adam moments and the best
        epoch's copy): about a third of the size; such a model predicts, but cannot resume.
        """
        self._require_fitted()
        pre_arrays, pre_meta = self.preprocessor_.get_state()
        arrays = {**self.params_, **{f"pre.{k}": v for k, v in pre_arrays.items()}}
        if not inference_only:
            arrays.update({f"adam.{k}": v for k, v in self.moments_.items()})
            if self.best_params_ is not None:
                arrays.update({f"best.{k}": v for k, v in self.best_params_.items()})
        meta = {
            "engine": "slide", "config": self.config_.to_json(), "preprocessing": pre_meta,
            "n_features": self.n_features_in_, "n_labels": self.n_labels_, "n_train": self.n_train_,
            "rare_share": self.rare_share_, "choice": self.choice_,
            "labels_per_row": self.labels_per_row_,
            "step": self.step_, "epoch": self.epoch_, "samples_seen": self.samples_seen_,
            "epoch_position": self.epoch_position_,
            "learning_rate": self.learning_rate_, "hash_seed": self.hash_seed_,
            "next_rehash": self._next_rehash, "rehash_interval": self._rehash_interval,
            "next_rebuild": self._next_rebuild, "history": self.history_,
            "early_stopping": self.early_stopping_.to_json() if self.early_stopping_ else None,
            "stopping": self.stopping_, "inference_only": bool(inference_only),
            "single_label": bool(getattr(self, "single_label_", False)),
        }
        write_checkpoint(path, arrays, meta, self.step_)

    @classmethod
    def load(cls, path) -> "SlideClassifier":
        """Load a model saved by :meth:`save`, or by the dense reference (same format)."""
        ck = read_checkpoint(path)
        model = cls(**ck.config_params(cls))
        model._restore_state(ck)
        return model

    def _restore_state(self, ck) -> None:
        """Fitted state from a :class:`slide.checkpoint.Checkpoint` (validated shapes)."""
        self.config_ = SlideConfig(**self.get_params())
        self.n_features_in_, self.n_labels_, self.n_train_ = ck.n_features, ck.n_labels, ck.n_train
        self.rare_share_, self.choice_ = ck.rare_share, ck.choice
        self.labels_per_row_ = ck.labels_per_row
        self.resolved_ = self._resolve(self.config_)
        shapes = parameter_shapes(self.resolved_["hidden"], self.n_features_in_, self.n_labels_)
        # a checkpoint with moments was saved to train on: its layers W and W0 are read straight
        # into the row blocks they train in. Read whole and then copied, they would be held
        # beside their blocks (1 GB more at 670K labels, above the peak of training itself)
        blocked = [k for k in ("W", "W0") if f"adam.{k}.m" in ck and f"adam.{k}.v" in ck]
        rest = {k: v for k, v in shapes.items() if k not in blocked}
        self.params_ = ck.arrays_like(rest)
        self.moments_ = ck.arrays_like(rest, prefix="adam.", suffixes=(".m", ".v"), zeros=True)
        self._row_blocks = {}
        for name in blocked:
            self._make_block(name, shapes[name], lambda part, d, key, name=name: ck.read_into(
                key if key == name else f"adam.{key}", part))
        self.params_ = {k: self.params_[k] for k in shapes}  # the order saved and exchanged
        self.moments_ = {f"{k}.{s}": self.moments_[f"{k}.{s}"] for k in shapes for s in "mv"}
        self.inference_only_ = bool(ck.meta.get("inference_only", False))
        best = ck.arrays_like(shapes, prefix="best.", missing_ok=True)
        self.best_params_ = best or None
        self.preprocessor_ = ck.preprocessor(self.n_features_in_)
        self.step_, self.epoch_ = ck.step, ck.epoch
        self.epoch_position_ = ck.int("epoch_position", 0, minimum=0, maximum=self.n_train_)
        self.samples_seen_ = ck.int("samples_seen", 0, minimum=0)
        self.learning_rate_ = ck.float("learning_rate", self.resolved_["lr"], positive=True)
        self.hash_seed_ = ck.int("hash_seed", self.config_.seed, minimum=0, maximum=2 ** 32 - 1)
        self.history_ = ck.records("history")
        self.early_stopping_ = ck.parsed("early_stopping", EarlyStopping.from_json)
        self.stopping_ = ck.object("stopping")
        self.single_label_ = bool(ck.meta.get("single_label", False))
        self.timings_ = {}
        self._setup()
        r = self.resolved_
        self._next_rehash = ck.int("next_rehash", r["rehash_every"], minimum=0)
        self._rehash_interval = ck.float("rehash_interval", r["rehash_every"], positive=True)
        self._next_rebuild = ck.int("next_rebuild", r["rebuild_every"], minimum=0)
        self._refresh_tables()
