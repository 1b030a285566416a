"""What every estimator of the project shares: the engine's and the dense reference's
scikit-learn face over their own training states.

:class:`TrainableMixin` supplies data checks, preprocessing, the labels a model trains
(:mod:`slide.labels`), the fitted record's attributes, evaluation and the probability outputs.
A subclass provides ``_config()`` (its settings as a :class:`slide.config.SlideConfig`),
``initialize``, ``train_epoch``, ``snapshot`` / ``restore``, ``score_blocks``, ``block_topk``,
``predict_topk`` and ``add_output_rows``.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from sklearn.exceptions import NotFittedError
from sklearn.utils import ClassifierTags

from slide.config import idf_weighted, rare_share, resolve
from slide.data import check_xy
from slide.labels import LabelMap
from slide.loop import FitRecord
from slide.preprocess import Preprocessor

__all__ = ["TrainableMixin", "new_rows", "log_prior", "PRIOR_CORRECTION", "softmax_loss", "softmax_parts",
           "array_module"]


def _from_record(field: str, doc: str):
    """A fitted attribute read from the model's :class:`slide.loop.FitRecord`."""
    def get(self):
        if "record_" not in vars(self):
            raise AttributeError(f"{type(self).__name__} is not fitted: it has no {field}_")
        return getattr(self.record_, field)
    return property(get, doc=doc)


class TrainableMixin:
    """The engine-independent half of the estimator interface (see the module docstring)."""

    epoch_ = _from_record("epoch", "Epochs trained.")
    epoch_position_ = _from_record("epoch_position", "Samples of the next epoch trained.")
    history_ = _from_record("history", "One record per epoch.")
    stopping_ = _from_record("stopping", "The epoch kept and why training stopped.")
    early_stopping_ = _from_record("early_stopping", "Validation bookkeeping.")
    best_params_ = _from_record("best_params", "The best epoch's weights while a run goes on.")
    single_label_ = _from_record("single_label", "Fitted on a 1-D y (label ids).")
    plan_ = _from_record("plan", "The plan the run followed, the others' predictions and why "
                                 "(:class:`slide.planner.Planner`); None without planning.")

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True  # CSR is the native input
        tags.target_tags.required = True
        tags.target_tags.multi_output = True  # Y: a label-indicator matrix or label lists
        tags.classifier_tags = ClassifierTags(multi_class=True, multi_label=True)
        return tags

    #: up to ``slide.ann.CALIBRATION_ROWS`` rows (CSR, as given) that ``fit`` held out and
    #: did not train on: ``mode="ann"`` chooses its probe by them; None without such rows
    held_out_ = None

    #: the attribute that fitting sets first: the model is fitted when it has it
    _fitted_attribute = "params_"

    def _is_fitted(self) -> bool:
        return self._fitted_attribute in vars(self)

    def __sklearn_is_fitted__(self) -> bool:
        return self._is_fitted()

    def _require_fitted(self):
        if not self._is_fitted():
            raise NotFittedError(f"this {type(self).__name__} is not fitted yet; call fit first")

    def fit_settings(self) -> dict:
        """Early stopping, validation fraction, patience, refit and seed (current settings,
        valid before the model is fitted)."""
        c = self._config()
        return {"early_stopping": c.early_stopping, "validation_fraction": c.validation_fraction,
                "n_iter_no_change": c.n_iter_no_change, "refit": c.refit, "seed": c.seed}

    def check_data(self, X, Y=None, where="input", fitted=True, grow=False):
        """Validated float32 CSR ``X`` (and CSR indicator ``Y``), against the fitted shapes
        when ``fitted`` and the model is fitted; with ``grow``, ``Y`` may have more labels than
        the model (training adds them: :meth:`targets`)."""
        if not (fitted and self._is_fitted()):
            return check_xy(X, Y, where=where, require_labels=Y is not None)
        if grow and Y is not None:
            X, Y = check_xy(X, Y, n_features=self.n_features_in_, where=where,
                            owner=type(self).__name__)
            if Y.shape[1] < self.n_labels_:
                Y = sp.csr_matrix((Y.data, Y.indices, Y.indptr), shape=(Y.shape[0], self.n_labels_))
            return X, Y
        return check_xy(X, Y, n_features=self.n_features_in_,
                        n_labels=self.n_labels_ if Y is not None else None, where=where,
                        owner=type(self).__name__)

    def fit_data(self, X, Y, distributed=None, stream: bool = False) -> None:
        """Learn what the defaults rule reads from the training rows (``initialize``'s first
        step, after ``config_`` and ``choice_`` are set): ``n_features_in_``, ``n_labels_``,
        ``n_train_``, ``labels_`` (a :class:`slide.labels.LabelMap` of the labels with a
        positive in ``Y``: the output rows; with ``stream``, ``X``, ``Y`` are a stream's first
        batch, which cannot know the labels to come, and every label of ``Y`` gets a row),
        ``n_outputs_fitted_`` (their count, which the defaults rule reads), ``log_prior_``
        (their training priors), the preprocessing ``preprocessor_`` (``config_.norm``, and idf
        weighting as :func:`slide.config.idf_weighted` says) fitted on ``X``, ``rare_share_``
        (:func:`slide.config.rare_share`), ``labels_per_row_`` and ``features_per_row_``. With
        ``distributed``, ``X``, ``Y`` are this rank's shard and the counts, labels and feature
        statistics are the whole data's. Starts a fresh ``record_``."""
        n_train = X.shape[0] if distributed is None else distributed.total(X.shape[0])
        n_positives = Y.nnz if distributed is None else distributed.total(Y.nnz)
        # each label's training positives: the output rows, and their priors
        counts = np.bincount(Y.indices[Y.data != 0], minlength=Y.shape[1])
        if distributed is not None:
            counts = distributed.total(counts.astype(np.int64))
        self.n_features_in_, self.n_labels_, self.n_train_ = X.shape[1], Y.shape[1], n_train
        self.labels_ = LabelMap.of(np.ones(Y.shape[1], bool) if stream else counts > 0)
        self.n_outputs_fitted_ = self.labels_.size
        self.features_per_row_ = X.nnz / max(X.shape[0], 1)
        self.preprocessor_ = Preprocessor(self.config_.norm,
                                          idf_weighted(self.config_, self.choice_)).fit(X)
        if distributed is not None:
            distributed.merge_preprocessor(self.preprocessor_)
        self.rare_share_ = rare_share(self.preprocessor_.document_frequency_)
        self.labels_per_row_ = n_positives / max(n_train, 1)
        # the prior correction's priors (a stream's first batch tells too little of them: none)
        self.log_prior_ = None if stream else \
            log_prior(counts[self.labels_.ids], n_positives, self.labels_.size)
        #: the label shards this rank's output rows are one of (slide.shards), or None
        self.label_shards_ = None
        if distributed is not None and distributed.mode == "labels":
            self.label_shards_ = distributed
            self.labels_, self.log_prior_ = distributed.shard_labels(self.labels_, self.log_prior_)
        self.record_ = FitRecord()

    def read_fitted(self, ck, shards=None) -> None:
        """What :meth:`fit_data` learns, and the settings resolved from it, from a
        :class:`slide.checkpoint.Checkpoint` (a model's ``load``); ``shards``: the label shards
        its output rows are one of, or None."""
        self.config_ = self._config()
        self.n_features_in_, self.n_labels_, self.n_train_ = ck.n_features, ck.n_labels, ck.n_train
        self.rare_share_, self.choice_ = ck.rare_share, ck.choice
        self.labels_per_row_ = ck.labels_per_row
        self.slow_rows_kept_ = ck.slow_rows
        self.labels_, self.n_outputs_fitted_ = ck.labels, ck.n_outputs_fitted
        self.features_per_row_ = ck.features_per_row
        self.log_prior_ = ck.log_prior
        self.label_shards_ = shards
        self.preprocessor_ = ck.preprocessor(ck.n_features)
        self.resolved_ = self._resolve(self.config_)

    def rule_settings(self, config) -> dict:
        """The rule's settings (:func:`slide.config.resolve`) for ``config`` over this model's
        data: its output rows, training rows, rare share, choice, labels a row, the kept
        decision on rows updated in few steps, and the features its training rows hold."""
        # the features the rows hold, not the header's count: a hashed or shared feature space
        # declares columns no row uses, and the rule reads the data's shape
        seen = int(self.preprocessor_.seen_features().sum())
        return resolve(config, seen, self.n_outputs_fitted_, self.n_train_, self.rare_share_,
                       self.choice_, self.labels_per_row_, self.slow_rows_kept_)

    def prior_shift(self):
        """What prediction adds to each output row's logit: ``-PRIOR_CORRECTION · log prior``
        where the output layer is computed whole (docs/prior-correction.md), else None."""
        if self.log_prior_ is None or self.resolved_["sampled"]:
            return None
        return (-PRIOR_CORRECTION * self.log_prior_).astype(np.float32)

    def serving_bias(self) -> np.ndarray:
        """The biases predictions rank by (host float32 [n_outputs]): the trained ones plus
        :meth:`prior_shift` where there is one."""
        b = np.asarray(self.host_params()["b"], np.float32)
        shift = self.prior_shift()
        return b if shift is None else b + shift

    @property
    def n_outputs_(self) -> int:
        """Output rows: the labels with a row (``labels_.ids``)."""
        return self.labels_.size

    def targets(self, X, Y, grow: bool = True):
        """``Y`` (checked CSR over the label space, its rows those of ``X``) over the output
        rows, for training: labels of ``Y`` without a row get one first (:meth:`add_labels`).
        Without ``grow`` (data parallelism: every rank must hold the same rows) such labels
        are an error."""
        if self.shards() is not None:
            return self.shards().targets(self.labels_, Y)
        missing = self.labels_.missing(Y) if Y.shape[1] <= self.n_labels_ else None
        if not grow and (missing is None or missing.size):
            raise ValueError(
                "these rows have labels without a training positive when the model was "
                "initialised; with data parallelism every rank must hold the same output rows: "
                "initialise the model from rows that hold every label")
        if missing is None:
            self.add_labels(Y.shape[1] - self.n_labels_)
            missing = self.labels_.missing(Y)
        if missing.size:
            self._give_rows(missing, X, Y)
        return self.labels_.to_rows(Y)

    def shards(self):
        """The :class:`slide.shards.LabelShards` this model's output rows are a shard of, or
        None (the whole layer)."""
        return vars(self).get("label_shards_")

    def add_labels(self, n: int = 0, X=None, Y=None):
        """Grow the label space by ``n`` labels (ids ``n_labels_`` onwards) and give a row to
        every label with a positive in ``Y`` that has none, initialised from the hidden
        representations of its rows of ``X`` (:func:`new_rows`). A label without a positive
        gets its row with its first one (:meth:`targets`: ``partial_fit``, a warm-started
        ``fit``). The other rows, the optimizer state and the record are kept; the training
        tables and serving follow. Returns the model."""
        self._require_fitted()
        if self.shards() is not None:
            raise ValueError("a label-sharded model keeps the labels it was initialised with")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be a non-negative integer, got {n!r}")
        if n:
            self.labels_ = LabelMap(self.labels_.ids, self.n_labels_ + int(n))
            self.n_labels_ += int(n)
        if Y is not None:
            X, Y = self.check_data(X, Y, where="add_labels")
            missing = self.labels_.missing(Y)
            if missing.size:
                self._give_rows(missing, X, Y)
        return self

    def _give_rows(self, ids, X, Y) -> None:
        """Rows for labels ``ids`` (sorted, without rows), from their rows of ``X`` / ``Y``."""
        host = self.host_params()
        W, b = host["W"], host["b"]
        positives = Y[:, ids].T.tocsr()  # [len(ids), n]: each new label's rows
        H = self.embed(X) if positives.nnz else np.zeros((X.shape[0], W.shape[1]), np.float32)
        W_new, b_new = new_rows(W, b, positives, H, seed=self.labels_.size)
        if self.log_prior_ is not None:
            self.log_prior_ = np.concatenate((self.log_prior_, log_prior(
                np.diff(positives.indptr), self.labels_per_row_ * self.n_train_, self.n_outputs_)))
        self.add_output_rows(W_new, b_new)
        best = self.record_.best_params
        if best is not None:  # the best epoch's weights gain the rows as they are now
            xp = array_module(best["W"])
            best["W"] = xp.concatenate((best["W"], xp.asarray(W_new)))
            best["b"] = xp.concatenate((best["b"], xp.asarray(b_new)))
        self.labels_ = self.labels_.extend(ids)

    def _whole_layer(self, what: str) -> None:
        """Refuse ``what`` on a label shard: it needs every label's score in one process."""
        if self.shards() is not None and self.shards().size > 1:
            raise ValueError(f"{what} needs the whole output layer; this model is one of "
                             f"{self.shards().size} label shards (predict_topk, predict and "
                             "evaluate merge the shards; or load the sharded checkpoint into "
                             "one process)")

    def preprocess(self, X):
        """The model's fitted preprocessing of CSR ``X`` (float32 CSR, same shape)."""
        return self.preprocessor_.transform(X)

    def fitted_state(self) -> dict:
        """The fitted model's attributes, for :meth:`restore_fitted` after another run. A
        shallow copy suffices: ``initialize`` binds every fitted attribute to new objects."""
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
        if self.shards() is not None and not predict_kw:
            return self.shards().evaluate(self, X, Y, k, loss)
        X, Y = self.check_data(X, Y, where="evaluate", fitted=True)
        if predict_kw or not loss:
            return evaluate_topk(Y, self.predict_topk(X, k, **predict_kw)[0], k)
        top = np.empty((X.shape[0], k), np.int64)
        total, rows = 0.0, 0
        Yr = self.labels_.to_rows(Y)  # labels without a row have no score to take a loss of
        shift = self.prior_shift()
        for lo, hi, S in self.score_blocks(X):
            top[lo:hi] = self.labels_.to_labels(self.block_topk(S, k)[0])
            if shift is not None:  # the loss is training's: of the logits as trained
                S -= array_module(S).asarray(shift)
            s, n = softmax_loss(S, Yr[lo:hi])
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
        if self._is_fitted() and self.single_label_ and k == 1:
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
        self._require_fitted()
        self._whole_layer("predict_proba")
        X = self.check_data(X, where="predict_proba", fitted=True)
        out = np.empty((X.shape[0], self.n_labels_), np.float32)
        for lo, hi, S in self.score_blocks(X):
            xp = array_module(S)
            P = self.labels_.scatter(xp.exp(S - _logsumexp_rows(S)[:, None]), 0.0)
            out[lo:hi] = P if xp is np else P.get()
        return out

    def predict_topk_proba(self, X, k: int = 5):
        """Exact top-k labels and their softmax probabilities (normalised over every label):
        ``(ids int64 [n, k], probabilities float32 [n, k])``, best first."""
        self._whole_layer("predict_topk_proba")
        X = self.check_data(X, where="predict", fitted=True)
        ids = np.empty((X.shape[0], k), np.int64)
        probs = np.empty((X.shape[0], k), np.float32)
        for lo, hi, S in self.score_blocks(X):
            lse = _logsumexp_rows(S)
            rows, top = self.block_topk(S, k)
            ids[lo:hi] = self.labels_.to_labels(rows)
            lse = lse if isinstance(lse, np.ndarray) else lse.get()
            probs[lo:hi] = np.exp(top - lse[:, None])
        return ids, probs


#: where the output layer is computed whole, prediction ranks by the logits less this share of
#: each label's log training prior (docs/prior-correction.md)
PRIOR_CORRECTION = 0.2


def log_prior(counts, positives: float, n_labels: int) -> np.ndarray:
    """float32 log of the labels' training priors, ``(count + 1) / (positives + n_labels)``
    (``n_labels``: the labels with an output row)."""
    return np.log((np.asarray(counts, np.float64) + 1.0) / (positives + n_labels)).astype(np.float32)


def new_rows(W, b, positives, H, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Output rows for new labels: ``(W_new, b_new)`` float32 host arrays.

    ``W``, ``b``: the output layer's rows and biases now; ``positives`` CSR [m, n]: each new
    label's rows among ``n`` rows whose last hidden layer is ``H`` [n, hidden]. A label with
    positives starts at the mean of their hidden vectors, scaled to the median norm of the
    trained rows, with the median bias: its rows then score it as a typical label scores its
    own (docs/labels.md). One without starts as a fresh row does, with the median bias.
    """
    W, b = np.asarray(W), np.asarray(b)
    m, width = positives.shape[0], W.shape[1]
    rng = np.random.default_rng(seed)
    W_new = rng.standard_normal((m, width), np.float32) * np.float32(1.0 / np.sqrt(width))
    counts = np.diff(positives.indptr)
    if counts.any():
        mean = (positives @ H) / np.maximum(counts, 1)[:, None]
        norms = np.linalg.norm(mean, axis=1, keepdims=True)
        scale = np.float32(np.median(np.linalg.norm(W, axis=1))) if W.size else np.float32(1)
        take = (counts > 0) & (norms[:, 0] > 0)
        W_new[take] = (mean[take] / norms[take] * scale).astype(np.float32)
    b_new = np.full(m, np.median(b) if b.size else 0.0, np.float32)
    return np.ascontiguousarray(W_new, np.float32), b_new


def softmax_parts(S, Y):
    """The parts of a softmax cross-entropy of score rows ``S`` [n, L] (numpy or cupy) against
    the labels of CSR ``Y`` [n, L], per row: the largest score, the sum of exp(score -
    largest), and the sum of the labels' scores (float64). Parts of several blocks of columns
    (label shards) combine into the whole row's."""
    xp = array_module(S)
    rows = np.repeat(np.arange(S.shape[0]), np.diff(Y.indptr))
    m = S.max(axis=1, keepdims=True)
    sums = xp.exp(S - m).sum(axis=1)
    picked = xp.bincount(xp.asarray(rows), weights=S[xp.asarray(rows), xp.asarray(Y.indices)]
                         .astype(xp.float64), minlength=S.shape[0])
    return m[:, 0], sums, picked


def softmax_loss(S, Y) -> tuple[float, int]:
    """Summed cross-entropy of score rows ``S`` [n, L] (numpy or cupy) against uniform targets
    over the labels of CSR ``Y`` [n, L], and the number of rows with labels."""
    xp = array_module(S)
    counts = np.diff(Y.indptr)
    m, sums, picked = softmax_parts(S, Y)
    lse = m + xp.log(sums)
    per_row = picked / xp.asarray(np.maximum(counts, 1))
    has = xp.asarray(counts > 0)
    return float((lse.astype(xp.float64) - per_row)[has].sum()), int((counts > 0).sum())


def _logsumexp_rows(S):
    """log Σ exp over each row of score rows ``S`` [n, L] (numpy or cupy), float32 [n]."""
    xp = array_module(S)
    m = S.max(axis=1)
    return m + xp.log(xp.exp(S - m[:, None]).sum(axis=1))


def array_module(a):
    """numpy, or cupy for a device array (cupy is imported only when one is passed)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy.get_array_module(a)
