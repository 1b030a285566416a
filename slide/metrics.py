"""Extreme-classification metrics: P@k, nDCG@k, PSP@k, and a parallel top-k.

Arguments come in scikit-learn's and napkinXC's order, ``(y_true, y_pred)``. ``y_true``: a
0/1 indicator matrix [n, L] (CSR or dense) or a list of label-id lists. ``y_pred``: a top-k
index matrix [n, k] (int, best first; -1 pads rows with fewer than k predictions), a score
matrix [n, L] (float), or a list of ranked label-id lists. Every metric returns its mean over
samples for k = 1..k as a float64 array, so ``precision_at_k(Y, top, 5)[0]`` is P@1.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import scipy.sparse as sp
from numba import njit, prange

from slide.runtime import as_rows, blas_threads, configure_threading, thread_count

__all__ = ["topk", "topk_product", "precision_at_k", "ndcg_at_k", "psp_at_k", "propensities", "evaluate",
           "recall_against", "PROPENSITY_AB"]

# Jain et al. (2016) propensity parameters per dataset family.
PROPENSITY_AB = {"default": (0.55, 1.5), "amazon": (0.6, 2.6), "wikipedia": (0.5, 0.4)}


@njit(cache=True, nogil=True, inline="always")
def heap_push(v, j, k, n, out_ids, out_scores):
    """Offer score ``v`` of id ``j`` to the k-sized min-heap holding n entries; returns the new
    size. Ties go to the lower id (ids arrive in increasing order)."""
    if n < k:
        # sift up
        i = n
        n += 1
        while i > 0:
            p = (i - 1) // 2
            if out_scores[p] > v or (out_scores[p] == v and out_ids[p] < j):
                out_scores[i] = out_scores[p]
                out_ids[i] = out_ids[p]
                i = p
            else:
                break
        out_scores[i] = v
        out_ids[i] = j
    elif v > out_scores[0]:
        # replace the root and sift down
        i = 0
        while True:
            c = 2 * i + 1
            if c >= k:
                break
            if c + 1 < k and (out_scores[c + 1] < out_scores[c] or
                              (out_scores[c + 1] == out_scores[c] and out_ids[c + 1] > out_ids[c])):
                c += 1
            if out_scores[c] < v:
                out_scores[i] = out_scores[c]
                out_ids[i] = out_ids[c]
                i = c
            else:
                break
        out_scores[i] = v
        out_ids[i] = j
    return n


@njit(cache=True, nogil=True)
def heap_sorted(n, k, out_ids, out_scores):
    """A heap of n entries -> descending order (k is small: insertion sort); pads to k."""
    for a in range(1, n):
        s, d = out_scores[a], out_ids[a]
        b = a - 1
        while b >= 0 and (out_scores[b] < s or (out_scores[b] == s and out_ids[b] > d)):
            out_scores[b + 1] = out_scores[b]
            out_ids[b + 1] = out_ids[b]
            b -= 1
        out_scores[b + 1] = s
        out_ids[b + 1] = d
    for a in range(n, k):
        out_ids[a] = -1
        out_scores[a] = -np.inf


@njit(cache=True, nogil=True, inline="always")
def _offer_row(row, bias, offset, n, out_ids, out_scores):
    """Offer ``row[j]`` (plus ``bias[j]`` unless ``bias`` is empty) as id ``offset + j`` to a
    k-sized min-heap holding n entries, ids in increasing order; returns the new size. The
    heap's root is kept in a register: almost every score fails this one comparison."""
    k = out_ids.size
    floor = out_scores[0] if n >= k else -np.inf
    biased = bias.size > 0
    for j in range(row.size):
        v = row[j] + bias[j] if biased else row[j]
        if v > floor or n < k:
            n = heap_push(v, offset + j, k, n, out_ids, out_scores)
            if n >= k:
                floor = out_scores[0]
    return n


@njit(cache=True, nogil=True)
def _heaps_offer(S, bias, offset, heap_ids, heap_scores, sizes):
    """Offer ``S[r, j] + bias[j]`` (label ``offset + j``) to row r's k-heap, for a tile of
    labels (one thread's; the caller runs several on their own heaps)."""
    for r in range(S.shape[0]):
        sizes[r] = _offer_row(S[r], bias, offset, sizes[r], heap_ids[r], heap_scores[r])


@njit(cache=True, nogil=True, parallel=True)
def heaps_merge(heap_ids, heap_scores, sizes, out_ids, out_scores):
    """Per row, the top-k of the threads' heaps [T, n, k], merged in label order (thread c
    covered lower labels than c + 1), so ties still go to the lower id."""
    T, n, k = heap_ids.shape
    for r in prange(n):
        m = 0
        for c in range(T):
            heap_sorted(sizes[c, r], k, heap_ids[c, r], heap_scores[c, r])
            for a in range(k):  # sorted: among equal scores the lower id comes first
                if heap_ids[c, r, a] >= 0:
                    m = heap_push(heap_scores[c, r, a], heap_ids[c, r, a], k, m, out_ids[r], out_scores[r])
        heap_sorted(m, k, out_ids[r], out_scores[r])


def topk_product(H, W, b, k: int, tile: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise top-k of ``H @ W.T + b`` without the [n, L] score matrix.

    ``H`` float32 [n, d], ``W`` float32 [L, d] (C-contiguous), ``b`` float32 [L]. The labels go
    through in tiles of ``tile`` rows of W (default: about 1 MB of scores per tile, so a tile's
    scores stay in a core's cache). Each of numba's threads (as many as it is set to) takes a
    contiguous range of tiles: one single-threaded BLAS product per tile, whose scores go into
    the thread's per-row k-heaps while hot; both release the GIL, so plain Python threads run
    them side by side. Memory traffic is W once instead of a score matrix written and read back
    (343 MB for 128 rows at 670K labels). Returns what :func:`topk` returns on the full matrix:
    ids int64 [n, k] and scores float32 [n, k], best first, ties to the lower id, -1 / -inf
    padding when L < k.
    """
    configure_threading()
    k = check_k(k)
    n, L = H.shape[0], W.shape[0]
    H = np.ascontiguousarray(H, dtype=np.float32)
    W, b = as_rows(W), np.ascontiguousarray(b, dtype=np.float32)
    tile = max(1, int(tile or max(64, min(L, (1 << 18) // max(n, 1)))))
    n_tiles = -(-L // tile)
    T = max(1, min(thread_count(), n_tiles))
    heap_ids = np.full((T, n, k), -1, np.int64)
    heap_scores = np.full((T, n, k), -np.inf, np.float32)
    sizes = np.zeros((T, n), np.int64)

    def scan(c):
        for t in range(c * n_tiles // T, (c + 1) * n_tiles // T):
            lo, hi = t * tile, min((t + 1) * tile, L)
            _heaps_offer(H @ W[lo:hi].T, b[lo:hi], lo, heap_ids[c], heap_scores[c], sizes[c])

    with blas_threads(1):  # the threads below share the cores
        if T == 1:
            scan(0)
        else:
            with ThreadPoolExecutor(T) as pool:
                list(pool.map(scan, range(T)))
    ids = np.empty((n, k), np.int64)
    vals = np.empty((n, k), np.float32)
    heaps_merge(heap_ids, heap_scores, sizes, ids, vals)
    return ids, vals


@njit(cache=True, nogil=True, parallel=True)
def topk_kernel(scores, k, out_ids, out_scores):
    """Row-wise top-k of ``scores`` [n, L] into ``out_ids`` [n, k] int64 / ``out_scores`` [n, k]
    (ties go to the lower index)."""
    no_bias = np.empty(0, scores.dtype)
    for r in prange(scores.shape[0]):
        n = _offer_row(scores[r], no_bias, 0, 0, out_ids[r], out_scores[r])
        heap_sorted(n, k, out_ids[r], out_scores[r])


def check_k(k) -> int:
    """``k`` as an int, refusing what is not a positive whole number (2.7, 0, True, "5")."""
    if type(k) is int and k >= 1:  # the common case, without the ABCs' checks
        return k
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer, float, np.floating)) \
            or k != int(k) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return int(k)


def topk(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k indices [n, k] (int64, best first) and their scores [n, k] (float32) of each row."""
    configure_threading()
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    if scores.ndim != 2:
        raise ValueError(f"scores must be 2-D, got shape {scores.shape}")
    k = check_k(k)
    ids = np.empty((scores.shape[0], k), np.int64)
    vals = np.empty((scores.shape[0], k), np.float32)
    topk_kernel(scores, k, ids, vals)
    return ids, vals


@njit(cache=True, nogil=True, parallel=True)
def _gains(top, indptr, indices, weights, out):
    """out[r, j] = weight of label top[r, j] if it is a true label of row r, else 0."""
    for r in prange(top.shape[0]):
        lo, hi = indptr[r], indptr[r + 1]
        for j in range(top.shape[1]):
            t = top[r, j]
            if t < 0:
                continue
            # indices are sorted: binary search
            a, b = lo, hi
            while a < b:
                m = (a + b) // 2
                if indices[m] < t:
                    a = m + 1
                else:
                    b = m
            if a < hi and indices[a] == t:
                out[r, j] = weights[t]


def _as_top(pred, k: int) -> np.ndarray:
    k = check_k(k)
    if isinstance(pred, (list, tuple)):  # ranked label lists, padded with -1
        top = np.full((len(pred), k), -1, np.int64)
        for r, ids in enumerate(pred):
            ids = list(ids)[:k]
            top[r, :len(ids)] = ids
        return top
    pred = np.asarray(pred)
    if pred.ndim != 2:
        raise ValueError(f"y_pred must be 2-D, got shape {pred.shape}")
    if np.issubdtype(pred.dtype, np.floating):  # a score matrix
        return topk(pred, k)[0]
    if pred.shape[1] < k:
        raise ValueError(f"y_pred's top-k matrix has {pred.shape[1]} columns, fewer than k={k}")
    return np.ascontiguousarray(pred[:, :k], dtype=np.int64)


def _hits(y_true, y_pred, k, weights=None):
    configure_threading()
    from slide.data import DataFormatError, labels_to_csr
    try:
        Y = labels_to_csr(y_true, where="y_true")
    except DataFormatError as e:
        raise ValueError(f"{e} (the metrics take (y_true, y_pred): true labels first)") from None
    Y.sort_indices()
    top = _as_top(y_pred, k)
    if top.shape[0] != Y.shape[0]:
        raise ValueError(f"y_pred has {top.shape[0]} rows, y_true {Y.shape[0]}")
    if top.size and top.max() >= Y.shape[1] and isinstance(y_true, sp.spmatrix | sp.sparray | np.ndarray):
        raise ValueError(f"y_pred holds label id {int(top.max())}, y_true has {Y.shape[1]} labels")
    w = np.ones(max(Y.shape[1], int(top.max(initial=-1)) + 1), np.float64) if weights is None \
        else np.asarray(weights, np.float64)
    gains = np.zeros(top.shape, np.float64)
    _gains(top, Y.indptr.astype(np.int64), Y.indices.astype(np.int64), w, gains)
    return top, Y, gains


def precision_at_k(y_true, y_pred, k: int = 5) -> np.ndarray:
    """P@1..P@k: |top-j ∩ labels| / j averaged over samples. Returns float64 [k]."""
    k = check_k(k)
    _, _, gains = _hits(y_true, y_pred, k)
    return np.cumsum(gains, axis=1).mean(axis=0) / np.arange(1, k + 1)


def ndcg_at_k(y_true, y_pred, k: int = 5) -> np.ndarray:
    """nDCG@1..nDCG@k with 1/log2(rank+1) discounts, normalised by the ideal ranking.

    Samples without labels score 0 (as in pyxclib).
    """
    k = check_k(k)
    _, Y, gains = _hits(y_true, y_pred, k)
    disc = 1.0 / np.log2(np.arange(2, k + 2))
    dcg = np.cumsum(gains * disc, axis=1)
    n_true = np.diff(Y.indptr)
    ideal = np.cumsum(disc)[np.clip(np.minimum.outer(n_true, np.arange(1, k + 1)) - 1, 0, None)]
    ideal = np.where(np.minimum.outer(n_true, np.arange(1, k + 1)) > 0, ideal, np.inf)
    return (dcg / ideal).mean(axis=0)


def propensities(Y_train, A: float = 0.55, B: float = 1.5) -> np.ndarray:
    """Jain et al. propensities p_l = 1 / (1 + C (N_l + B)^-A), C = (ln N - 1)(B + 1)^A.

    ``Y_train`` [N, L] CSR gives the label frequencies N_l. Returns float64 [L].
    """
    Y_train = sp.csr_matrix(Y_train)
    n = Y_train.shape[0]
    freq = np.bincount(Y_train.indices, minlength=Y_train.shape[1]).astype(np.float64)
    c = (np.log(n) - 1.0) * (B + 1.0) ** A
    return 1.0 / (1.0 + c * np.exp(-A * np.log(freq + B)))


def psp_at_k(y_true, y_pred, propensities, k: int = 5) -> np.ndarray:
    """Propensity-scored precision PSP@1..k, normalised by the best achievable ranking.

    ``propensities``: the propensity of every label, float [L] in (0, 1], as
    :func:`slide.metrics.propensities` returns (each hit weighs 1 / propensity).
    """
    k = check_k(k)
    p = np.asarray(propensities, np.float64)
    if p.ndim != 1 or not np.all((p > 0) & (p <= 1)):
        raise ValueError("propensities must be a 1-D array of values in (0, 1] (not their inverses)")
    w = 1.0 / p
    _, Y, gains = _hits(y_true, y_pred, k, w)
    num = np.cumsum(gains, axis=1).sum(axis=0)
    # the best ranking puts each row's highest inverse propensities first
    Yw = sp.csr_matrix((w[Y.indices], Y.indices, Y.indptr), shape=Y.shape)
    best = np.zeros((Y.shape[0], k))
    _best_gains(Yw.indptr.astype(np.int64), Yw.data, best)
    den = np.cumsum(best, axis=1).sum(axis=0)
    return num / np.where(den > 0, den, np.inf)


@njit(cache=True, nogil=True, parallel=True)
def _best_gains(indptr, data, out):
    k = out.shape[1]
    for r in prange(out.shape[0]):
        row = np.sort(data[indptr[r]:indptr[r + 1]])[::-1]
        for j in range(min(k, row.size)):
            out[r, j] = row[j]


def recall_against(found, exact) -> float:
    """The mean share of each row's ``exact`` top-k ids [n, k] that ``found`` [n, k'] holds
    (an approximate top-k against the exact one; ``found``'s padding, -1, is left out)."""
    found, exact = np.asarray(found), np.asarray(exact)
    return float(np.mean([np.intersect1d(a[a >= 0], e).size for a, e in zip(found, exact)])
                 / exact.shape[1])


def evaluate(y_true, y_pred, k: int = 5, propensities=None) -> dict:
    """A dict of the usual report at j = 1, 3, 5 (those up to k) and at k itself: P@j, nDCG@j
    (and PSP@j given the labels' propensities)."""
    configure_threading()
    k = check_k(k)
    top = _as_top(y_pred, k)
    at = sorted({j for j in (1, 3, 5) if j <= k} | {k})
    p = precision_at_k(y_true, top, k)
    n = ndcg_at_k(y_true, top, k)
    out = {f"P@{j}": float(p[j - 1]) for j in at}
    out.update({f"nDCG@{j}": float(n[j - 1]) for j in at})
    if propensities is not None:
        s = psp_at_k(y_true, top, propensities, k)
        out.update({f"PSP@{j}": float(s[j - 1]) for j in at})
    return out
