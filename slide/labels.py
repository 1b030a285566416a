"""The labels a model trains: one output row for each label that has a training positive.

A data set's header declares its label space; recommender catalogues declare far more labels
than their rows use (items without interactions yet). A row for a label without a positive
would only ever learn to score low, so the model keeps rows for the labels that occur and a
:class:`LabelMap` between the two id spaces: the output row ``r`` is label ``ids[r]``. Every
public input and output (``Y``, predictions, scores, checkpoints' ``n_labels``) stays in the
header's id space; only the training state sees row numbers. A label's first positive (a later
``partial_fit``, a warm-started ``fit``, :meth:`slide.estimator.SlideClassifier.add_labels`)
gives it a row.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

__all__ = ["LabelMap", "labels_present"]


def labels_present(Y: sp.csr_matrix) -> np.ndarray:
    """bool [n_labels]: the labels of CSR indicator ``Y`` with at least one positive."""
    present = np.zeros(Y.shape[1], bool)
    present[Y.indices[Y.data != 0]] = True
    return present


class LabelMap:
    """Output rows ↔ label ids: ``ids`` (int64, sorted ascending) are the labels with a row, in
    row order, of a label space of ``n_labels``. Rows added later (:meth:`extend`) go after the
    others, so ``ids`` is then no longer sorted; the lookups do not assume it."""

    def __init__(self, ids, n_labels: int):
        ids = np.asarray(ids, np.int64)
        self.n_labels = int(n_labels)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("a label map needs at least one label")
        if ids.min() < 0 or ids.max() >= self.n_labels:
            raise ValueError(f"label ids must be in 0..{self.n_labels - 1}")
        self.ids = ids
        self._row = None  # label id -> row (-1: none), made on first use
        self._ids_or_none = None  # row -> label id, with row -1 -> -1: made on first use
        # checked once: queries ask on every call
        self.is_identity = ids.size == self.n_labels and bool(np.all(ids == np.arange(ids.size)))

    @classmethod
    def of(cls, present: np.ndarray) -> "LabelMap":
        """The map of the labels marked in bool ``present`` (every label where none is)."""
        ids = np.flatnonzero(present)
        return cls(ids if ids.size else np.arange(present.size), present.size)

    @classmethod
    def identity(cls, n_labels: int) -> "LabelMap":
        return cls(np.arange(n_labels), n_labels)

    @property
    def size(self) -> int:
        """Output rows."""
        return int(self.ids.size)

    def rows(self) -> np.ndarray:
        """[n_labels] (int32 below 2**31 labels): each label's row, -1 for a label without one."""
        if self._row is None:
            row = np.full(self.n_labels, -1, np.int32 if self.n_labels < 2**31 else np.int64)
            row[self.ids] = np.arange(self.size)
            self._row = row
        return self._row

    def missing(self, Y: sp.csr_matrix) -> np.ndarray:
        """Sorted label ids with a positive in ``Y`` and no row."""
        present = labels_present(Y)
        present[self.ids] = False
        return np.flatnonzero(present)

    def extend(self, new_ids) -> "LabelMap":
        """The map with rows for ``new_ids`` (labels without one) after the existing rows."""
        out = LabelMap(np.concatenate((self.ids, np.asarray(new_ids, np.int64))), self.n_labels)
        if np.unique(out.ids).size != out.size:
            raise ValueError("a label given a row already has one")
        return out

    def to_rows(self, Y: sp.csr_matrix) -> sp.csr_matrix:
        """``Y`` [n, n_labels] as an indicator over the rows [n, size]: labels without a row
        are left out (they have no score to train or rank)."""
        if self.is_identity:
            return Y
        Y = sp.csr_matrix(Y)
        r = self.rows()[Y.indices]
        keep = r >= 0
        indptr = np.concatenate(([0], np.cumsum(keep)))[Y.indptr].astype(Y.indptr.dtype)
        out = sp.csr_matrix((Y.data[keep], r[keep].astype(Y.indices.dtype), indptr),
                            shape=(Y.shape[0], self.size))
        out.has_sorted_indices = False
        out.sort_indices()
        return out

    def to_labels(self, rows: np.ndarray) -> np.ndarray:
        """Row numbers (int, any shape; -1 kept as -1) as label ids."""
        if self.is_identity:
            return rows
        if self._ids_or_none is None:  # row -1 reads the -1 appended at the end
            self._ids_or_none = np.append(self.ids, -1)
        return self._ids_or_none[rows]

    def scatter(self, S, fill: float):
        """Scores over the rows [n, size] (numpy or cupy) as scores over every label [n,
        n_labels], ``fill`` where a label has no row."""
        if self.is_identity:
            return S
        if isinstance(S, np.ndarray):
            xp = np
        else:  # a device array: cupy is imported only when one is passed
            import cupy
            xp = cupy.get_array_module(S)
        out = xp.full((S.shape[0], self.n_labels), fill, S.dtype)
        out[:, xp.asarray(self.ids)] = S
        return out
