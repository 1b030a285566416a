"""Feature preprocessing fitted on the training rows and applied by every engine.

Bag-of-words rows arrive as raw counts or weights whose scale varies with the document's length.
The network's first layer sums one weight row per non-zero, so an unnormalised long row drives
the hidden layer far harder than a short one. :class:`Preprocessor` gives every row unit L2
norm (optionally after tf-idf weighting with an idf fitted on the training rows) and remembers
which features the training rows contain, so that features never seen in training contribute
nothing (their first-layer rows start at zero and are never updated). It is part of the model:
fit, predict, evaluate and embed see the same features, and checkpoints carry it.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from numba import njit

__all__ = ["Preprocessor", "row_divisor", "weighed", "NO_IDF", "UNWEIGHED"]

NORMS = ("l2", None)
#: the ``idf`` of a weighing without tf-idf, and the ``(idf, l2)`` of rows weighed already
NO_IDF = np.zeros(0, np.float32)
UNWEIGHED = (NO_IDF, False)


class Preprocessor:
    """Row scaling: optional tf-idf weighting, then L2 normalisation.

    Parameters
    ----------
    norm : "l2" or None
        Scale each row to unit Euclidean norm (rows without non-zeros stay empty).
    tfidf : bool
        Multiply each feature by its smoothed inverse document frequency
        ``idf_j = ln((1 + n) / (1 + df_j)) + 1`` (scikit-learn's ``smooth_idf``) before the norm.

    Fitted attributes: ``document_frequency_`` int64 [n_features] (training rows holding each
    feature), ``n_documents_`` and, with ``tfidf``, ``idf_`` float32 [n_features].
    """

    def __init__(self, norm: str | None = "l2", tfidf: bool = False):
        if norm not in NORMS:
            raise ValueError(f"norm must be 'l2' or None, got {norm!r}")
        self.norm, self.tfidf = norm, bool(tfidf)

    def fit(self, X: sp.csr_matrix) -> "Preprocessor":
        """Document frequencies (and idf) of CSR ``X`` [n, n_features]."""
        return self.fit_counts(np.bincount(X.indices, minlength=X.shape[1]), X.shape[0])

    def fit_counts(self, document_frequency, n_documents: int) -> "Preprocessor":
        """Fit from counts: ``document_frequency`` [n_features] rows holding each feature among
        ``n_documents`` rows (data-parallel training sums them over the shards)."""
        self.n_documents_ = int(n_documents)
        self.document_frequency_ = np.asarray(document_frequency).astype(np.int64)
        self._set_idf()
        return self

    def _set_idf(self):
        self.idf_ = None
        if self.tfidf:
            n, df = self.n_documents_, self.document_frequency_
            self.idf_ = (np.log((1.0 + n) / (1.0 + df)) + 1.0).astype(np.float32)

    def seen_features(self) -> np.ndarray:
        """bool [n_features]: features present in at least one training row."""
        return self.document_frequency_ > 0

    def weighing(self) -> tuple[np.ndarray, bool]:
        """``(idf, l2)``: what :meth:`transform` applies, for kernels that weigh raw rows as
        they read them (:func:`row_divisor`); ``idf`` is empty without tf-idf."""
        return (self.idf_ if self.idf_ is not None else NO_IDF), self.norm == "l2"

    def transform(self, X: sp.csr_matrix) -> sp.csr_matrix:
        """A new float32 CSR matrix with the fitted weighting and row norm applied."""
        X = sp.csr_matrix(X, dtype=np.float32, copy=True)
        if X.nnz:
            _weigh_rows(X.indptr, X.indices, X.data, *self.weighing())
        return X

    # -- checkpoints -------------------------------------------------------------------------
    def get_state(self) -> tuple[dict, dict]:
        """``(arrays, meta)``: what a checkpoint stores (npz arrays + JSON values)."""
        return ({"document_frequency": self.document_frequency_},
                {"norm": self.norm, "tfidf": self.tfidf, "n_documents": self.n_documents_})

    @classmethod
    def from_state(cls, arrays: dict, meta: dict, n_features: int) -> "Preprocessor":
        """Inverse of :meth:`get_state`; checks the array against the model's feature count."""
        pre = cls(meta.get("norm", "l2"), bool(meta.get("tfidf", False)))
        df = np.asarray(arrays["document_frequency"])
        if df.shape != (n_features,) or df.dtype.kind not in "iu" or (df.size and df.min() < 0):
            raise ValueError(f"document_frequency must be {n_features} non-negative integers, "
                             f"got {df.dtype} {df.shape}")
        pre.document_frequency_ = df.astype(np.int64)
        pre.n_documents_ = int(meta["n_documents"])
        pre._set_idf()
        return pre

    def __repr__(self):
        return f"Preprocessor(norm={self.norm!r}, tfidf={self.tfidf})"


@njit(cache=True, nogil=True, inline="always")
def row_divisor(lo, hi, indices, data, idf, l2):
    """What the values ``data[lo:hi]`` of one row are divided by after each is multiplied by
    its feature's ``idf`` (unless ``idf`` is empty): with ``l2``, the weighted row's Euclidean
    norm (summed in float64), else 1, and 1 for a row of norm 0, which stays as it is. A value
    weighed as ``weighed(p, ...) / divisor`` is then exactly :meth:`Preprocessor.
    transform`'s."""
    if not l2:
        return np.float32(1.0)
    s = 0.0
    for p in range(lo, hi):
        v = weighed(p, indices, data, idf)
        s += np.float64(v) * np.float64(v)
    return np.float32(np.sqrt(s)) if s > 0.0 else np.float32(1.0)


@njit(cache=True, nogil=True, inline="always")
def weighed(p, indices, data, idf):
    """Value ``p`` times its feature's ``idf`` (as it is where ``idf`` is empty), before the
    division by its row's :func:`row_divisor`."""
    return data[p] * idf[indices[p]] if idf.size else data[p]


@njit(cache=True, nogil=True)
def _weigh_rows(indptr, indices, data, idf, l2):
    """In place, row by row, each value weighed as :func:`row_divisor` says. Done with
    whole-matrix numpy expressions instead, the temporaries (a row id, a float64 square and a
    norm per non-zero) would set the peak memory of a whole training run. One thread: a single
    query's row wakes no thread pool."""
    for r in range(indptr.size - 1):
        lo, hi = indptr[r], indptr[r + 1]
        divisor = row_divisor(lo, hi, indices, data, idf, l2)
        for p in range(lo, hi):
            data[p] = weighed(p, indices, data, idf) / divisor
