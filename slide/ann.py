"""Approximate top-k through a nearest-neighbour library: an inner-product graph index (HNSW)
over the label vectors ``[w, b]``, queried with ``[h, 1]``, whose inner product is the model's
score (:mod:`slide.export`).

hnswlib is the backend where it is installed, FAISS's ``IndexHNSWFlat`` otherwise (the ``ann``
extra: ``pip install -e ".[ann]"``); docs/serving.md has the measurements beside the engine's own
LSH serving and the exact mode.
"""
from __future__ import annotations

import importlib.util

import numpy as np

__all__ = ["LabelIndex", "BACKENDS", "available_backend", "label_vectors", "query_vectors",
           "DEFAULT_EF", "DEFAULT_M", "EF_CONSTRUCTION"]

BACKENDS = ("hnswlib", "faiss")
#: graph degree and build-time beam width: hnswlib's recommended starting point for high recall
DEFAULT_M, EF_CONSTRUCTION = 16, 200
#: the query beam width, at least the k asked for (docs/serving.md: recall@10 against ef)
DEFAULT_EF = 64


def available_backend(backend: str | None = None) -> str:
    """The backend to use: ``backend`` if installed, else the first of :data:`BACKENDS` that
    is; an error that names the extra where none is."""
    names = BACKENDS if backend is None else (backend,)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    for name in names:
        if importlib.util.find_spec(name) is not None:
            return name
    raise ImportError(f"mode='ann' needs {' or '.join(names)}: pip install hnswlib faiss-cpu "
                      f"(the ann extra); mode='lsh' is the engine's own sub-linear serving")


def label_vectors(W, b) -> np.ndarray:
    """float32 [n, H + 1]: the rows of ``W`` [n, H] with their biases ``b`` [n] appended."""
    return np.ascontiguousarray(np.hstack((np.asarray(W, np.float32),
                                           np.asarray(b, np.float32)[:, None])))


def query_vectors(H) -> np.ndarray:
    """float32 [n, H + 1]: hidden vectors ``H`` with a 1 appended (their inner product with
    :func:`label_vectors` is the score)."""
    H = np.asarray(H, np.float32)
    return np.ascontiguousarray(np.hstack((H, np.ones((H.shape[0], 1), np.float32))))


class LabelIndex:
    """An HNSW inner-product index of a layer's label vectors.

    ``backend``: ``"hnswlib"`` or ``"faiss"`` (default: :func:`available_backend`); ``M`` and
    ``ef_construction``: the graph's degree and build beam; ``ef``: the query beam (raised to
    k where k is larger). Ids are the layer's rows."""

    def __init__(self, backend: str | None = None, M: int = DEFAULT_M,
                 ef_construction: int = EF_CONSTRUCTION, ef: int = DEFAULT_EF, seed: int = 0):
        for name, v in (("M", M), ("ef_construction", ef_construction), ("ef", ef)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.backend = available_backend(backend)
        self.M, self.ef_construction, self.ef, self.seed = int(M), int(ef_construction), int(ef), seed
        self.index, self.n, self.dim = None, 0, 0

    def build(self, W, b, threads: int = -1) -> "LabelIndex":
        """Index the rows of ``W`` [n, H] with biases ``b`` [n] (a new graph)."""
        V = label_vectors(W, b)
        self.n, self.dim = V.shape
        if self.backend == "hnswlib":
            import hnswlib
            index = hnswlib.Index(space="ip", dim=self.dim)
            index.init_index(max_elements=self.n, ef_construction=self.ef_construction, M=self.M,
                             random_seed=self.seed)
            index.add_items(V, np.arange(self.n), num_threads=threads)
        else:
            import faiss
            index = faiss.IndexHNSWFlat(self.dim, self.M, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = self.ef_construction
            index.add(V)
        self.index = index
        return self

    def save(self, path: str) -> None:
        """Write the graph in its library's own format (``hnswlib.Index.load_index`` /
        ``faiss.read_index``)."""
        if self.backend == "hnswlib":
            self.index.save_index(path)
        else:
            import faiss
            faiss.write_index(self.index, path)

    @property
    def nbytes(self) -> int:
        """About what the index holds: the vectors and the base layer's links."""
        return self.n * (4 * self.dim + 8 * self.M + 16)

    def query(self, H, k: int, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Top-k ``(rows int64 [n, k], scores float32 [n, k])`` of hidden vectors ``H`` [n,
        H]; scores are inner products with ``[h, 1]``, best first."""
        k_found = min(k, self.n)
        Q = query_vectors(H)
        ef = max(self.ef, k_found)
        if self.backend == "hnswlib":
            self.index.set_ef(ef)
            rows, dist = self.index.knn_query(Q, k=k_found, num_threads=threads)
            rows, scores = rows.astype(np.int64), (1.0 - dist).astype(np.float32)
        else:
            import faiss
            params = faiss.SearchParametersHNSW(efSearch=ef)
            scores, rows = self.index.search(Q, k_found, params=params)
        if k_found < k:  # fewer labels than k: padded as LSH serving pads
            pad = ((0, 0), (0, k - k_found))
            rows = np.pad(rows, pad, constant_values=-1)
            scores = np.pad(scores, pad, constant_values=-np.inf)
        return rows, scores
