"""Inputs and outputs of the peer workers (``xr_linear_worker.py``, ``parabel_worker.py``).

The peers (libpecos, omikuji) live in their own virtual environment, whose numpy and scipy
may be older than this project's, so the workers run as subprocesses and this module, like
them, imports nothing from the project. The runner (:mod:`bench.peers`) writes the training
and test rows with :func:`save_problem`; a worker reads them with :func:`load_problem` and
writes its top-k with :func:`save_topk`.
"""
import numpy as np
import scipy.sparse as sp

__all__ = ["save_problem", "load_problem", "save_topk"]


def save_problem(path, **mats) -> None:
    """Write CSR matrices (``X_train``, ``Y_train``, ``X_test``) to ``path`` (.npz) as float32
    parts that any numpy reads back."""
    arrays = {}
    for key, M in mats.items():
        M = sp.csr_matrix(M, dtype=np.float32)
        arrays.update({f"{key}_data": M.data, f"{key}_indices": M.indices,
                       f"{key}_indptr": M.indptr, f"{key}_shape": np.array(M.shape)})
    np.savez(path, **arrays)


def _csr(z, name):
    return sp.csr_matrix((z[f"{name}_data"], z[f"{name}_indices"], z[f"{name}_indptr"]),
                         shape=tuple(z[f"{name}_shape"]))


def load_problem(path):
    """``(X_train, Y_train, X_test)`` from :func:`save_problem`'s file: float32 CSR with sorted
    indices (PECOS refuses unsorted rows)."""
    z = np.load(path)
    mats = tuple(_csr(z, name).astype(np.float32).tocsr() for name in ("X_train", "Y_train", "X_test"))
    for M in mats:
        M.sort_indices()
    return mats


def save_topk(path, ids, scores, train_seconds: float, predict_seconds: float) -> None:
    """A worker's answer: label ids int64 [n, k] (-1 padded), their scores float32 [n, k], and
    its training and prediction seconds."""
    np.savez(path, ids=np.asarray(ids, np.int64), scores=np.asarray(scores, np.float32),
             train_seconds=train_seconds, predict_seconds=predict_seconds)

