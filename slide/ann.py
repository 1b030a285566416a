"""Approximate top-k for ``mode="ann"``: an index over the label vectors ``[w, b]``, queried
with ``[h, 1]``, whose inner product is the model's score (:mod:`slide.export`).

The engine's own index is the default: k-means clusters of the label vectors scored through
an int8 copy (:class:`slide.clusters.LabelClusters`). An inner-product graph (HNSW) from hnswlib
or FAISS's ``IndexHNSWFlat`` is the other choice where the ``ann`` extra is installed (``pip
install -e ".[ann]"``); docs/ann.md has the measurements of each beside the engine's LSH
serving and the exact mode.
"""
from __future__ import annotations

import importlib.util
import numbers

import numpy as np

from slide.clusters import DEFAULT_PROBE, LabelClusters
from slide.metrics import recall_against, topk_product

__all__ = ["LabelIndex", "BACKENDS", "LIBRARIES", "available_backend", "make_index",
           "label_vectors", "query_vectors", "calibrate", "checked_recall", "DEFAULT_EF",
           "DEFAULT_M", "EF_CONSTRUCTION", "DEFAULT_PROBE", "DEFAULT_RECALL", "CALIBRATION_ROWS",
           "CALIBRATION_K", "PROBES", "EFS"]

#: the engine's own index first, then the libraries'
BACKENDS = ("clusters", "hnswlib", "faiss")
LIBRARIES = BACKENDS[1:]
#: graph degree and build-time beam width: hnswlib's recommended starting point for high recall
DEFAULT_M, EF_CONSTRUCTION = 16, 200
#: the query beam width, at least the k asked for (docs/ann.md: recall@10 against ef), where
#: no held-out rows choose it
DEFAULT_EF = 64
#: the share of the exact top-k an index's probe or beam is chosen to find, on rows held out of
#: training: how much to probe depends on how clustered the layer is (docs/ann.md)
DEFAULT_RECALL = 0.95
#: held-out rows kept for that (their mean recall within about 0.005 of the test rows')
CALIBRATION_ROWS = 512
#: the k whose recall is measured
CALIBRATION_K = 10
#: the probes and beams tried, each about 1.1 times the last (1.2: up to a fifth more scored)
PROBES = tuple(round(0.005 * 1.1 ** j, 5) for j in range(60) if 0.005 * 1.1 ** j < 1) + (1.0,)
EFS = (10, 11, 12, 14, 16, 18, 20, 22, 24, 27, 30, 33, 36, 40, 44, 48, 53, 58, 64, 70, 77, 85,
       94, 103, 113, 124, 136, 150, 165, 182, 200, 220, 242, 266, 293, 322, 354, 390, 429, 472,
       519, 571, 628, 691, 760, 836, 920, 1012)


def available_backend(backend: str | None = None, libraries=BACKENDS) -> str:
    """The backend to use: ``backend`` if installed, else the first of ``libraries`` that is
    (the engine's own ``"clusters"`` always is); an error that names the extra where none
    is."""
    if backend is not None and backend not in libraries:
        raise ValueError(f"backend must be one of {', '.join(libraries)}, got {backend!r}")
    names = libraries if backend is None else (backend,)
    for name in names:
        if name == "clusters" or importlib.util.find_spec(name) is not None:
            return name
    raise ImportError(f"this index needs {' or '.join(names)}: pip install hnswlib faiss-cpu "
                      f"(the ann extra); backend='clusters' is the engine's own")


def make_index(backend: str | None = None, ef: int | None = None, M: int = DEFAULT_M,
               ef_construction: int = EF_CONSTRUCTION, probe: float | None = None,
               clusters: int | None = None, seed: int = 0):
    """``mode="ann"``'s index, unbuilt: :class:`slide.clusters.LabelClusters` (``probe``,
    ``clusters``) for ``"clusters"`` (the default), else a :class:`LabelIndex` graph (``ef``,
    ``M``, ``ef_construction``); a probe or beam of None starts at its default
    (:func:`calibrate` may choose it). Both ``build(W, b, threads)`` and ``query(H, k,
    threads)``."""
    if available_backend(backend) == "clusters":
        return LabelClusters(clusters=clusters, probe=DEFAULT_PROBE if probe is None else probe,
                             seed=seed)
    return LabelIndex(backend=backend, M=M, ef_construction=ef_construction,
                      ef=DEFAULT_EF if ef is None else ef, seed=seed)


def checked_recall(recall) -> float:
    """``recall`` as a float, or an error that says what it must be."""
    if isinstance(recall, bool) or not isinstance(recall, numbers.Real) or not 0 < recall <= 1:
        raise ValueError(f"recall must be a share of the exact top-k in (0, 1], got {recall!r}")
    return float(recall)


def calibrate(index, W, b, H, recall: float, threads: int = 1) -> dict:
    """Set an index built over ``W`` [n, hidden], ``b`` [n]'s probe (clusters) or query beam
    (graphs) to the least of :data:`PROBES` or :data:`EFS` whose top-``CALIBRATION_K`` of
    hidden vectors ``H`` [m, hidden] holds ``recall`` of their exact top-k on average, or the
    largest where none does; returns ``{"probe" or "ef": value, "recall": found, "target":
    recall, "rows": m}``.

    Recall rises with either knob (more clusters or a wider beam; a rare near-tie can cost a
    label), so a binary search over the grid asks about six queries of ``H``."""
    recall = checked_recall(recall)
    H = np.ascontiguousarray(H, np.float32)
    k = min(CALIBRATION_K, W.shape[0])
    exact = topk_product(H, W, b, k)[0]
    knob = index.knob
    grid = PROBES if knob == "probe" else EFS
    found = {}

    def share(j):  # the mean share of each row's exact top-k the index finds at grid[j]
        if j not in found:
            setattr(index, knob, grid[j])
            found[j] = recall_against(index.query(H, k, threads)[0], exact)
        return found[j]

    lo, hi = 0, len(grid) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if share(mid) >= recall:
            hi = mid
        else:
            lo = mid + 1
    setattr(index, knob, grid[lo])
    return {knob: grid[lo], "recall": share(lo), "target": float(recall), "rows": H.shape[0]}


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
    """An HNSW inner-product index of a layer's label vectors from a library.

    ``backend``: ``"hnswlib"`` or ``"faiss"`` (default: the first installed); ``M`` and
    ``ef_construction``: the graph's degree and build beam; ``ef``: the query beam (raised to
    k where k is larger). Ids are the layer's rows."""

    #: what trades recall for time (:func:`calibrate` chooses it)
    knob = "ef"

    def __init__(self, backend: str | None = None, M: int = DEFAULT_M,
                 ef_construction: int = EF_CONSTRUCTION, ef: int = DEFAULT_EF, seed: int = 0):
        for name, v in (("M", M), ("ef_construction", ef_construction), ("ef", ef)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.backend = available_backend(backend, LIBRARIES)
        self.M, self.ef_construction, self.ef, self.seed = int(M), int(ef_construction), int(ef), seed
        self.calibration = None  # what calibrate chose and found, where it ran
        self.index, self.n, self.dim = None, 0, 0

    def build(self, W, b, threads: int = -1, start=None) -> "LabelIndex":
        """Index the rows of ``W`` [n, H] with biases ``b`` [n] (a new graph; ``start``, an
        earlier index, is not used)."""
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
