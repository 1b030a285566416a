"""Hash tables that store every id, for serving from vectors that stay fixed between builds.

:class:`HashTables` keeps buckets of a bounded size, so that training can rehash in place into
memory fixed in advance; a full bucket keeps a sample of the ids offered to it. Trained output
layers fill buckets very unevenly (the largest bucket of a table can be offered thousands of
ids; docs/serving.md), and an id left out of a
bucket can never be found there. :class:`CompactTables` stores table t's buckets one after the
other in one flat array, each exactly as long as it needs to be (compressed sparse rows):

* ``starts`` int64 [L, 2**range_pow + 1]: bucket c of table t holds
  ``ids[t, starts[t, c]:starts[t, c + 1]]``;
* ``ids``    int32 [L, n_ids]: every id once in each table, by bucket, in increasing id order
  within a bucket.

A build is a counting sort of each table's bucket ids (parallel over tables); a query counts the
tables each id of its buckets was found in and keeps at most ``max_out`` ids, those found in the
most tables (ties in the order found).

For maximum inner product search the rows may be hashed less their mean row μ (``center``):
``h·(w - μ)`` ranks the rows as ``h·w`` does, while a large mean shared by every row otherwise
decides most hash codes alike for all of them.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from slide.runtime import borrowed, prefetch, thread_chunks, thread_count
from lsh.families import make_family
from lsh.tables import TableConfig, select_candidates

__all__ = ["CompactTables"]

#: a bucket's first ids asked for ahead of a query's pass (a crowded bucket's rest streams in)
_PREFETCH_IDS = 64


@njit(cache=True, nogil=True, parallel=True)
def _counting_sort(codes, starts, ids):
    """Sort ids 0..n-1 by bucket, table by table: ``codes`` int32 [L, n] (id i's bucket in table
    t), into ``starts`` int64 [L, R + 1] and ``ids`` int32 [L, n] (module docstring)."""
    L, n = codes.shape
    R = starts.shape[1] - 1
    for t in prange(L):
        s = starts[t]
        s[:] = 0
        for i in range(n):
            s[codes[t, i] + 1] += 1
        for c in range(R):
            s[c + 1] += s[c]
        cursor = s[:R].copy()
        out = ids[t]
        for i in range(n):
            c = codes[t, i]
            out[cursor[c]] = i
            cursor[c] += 1


@njit(cache=True, nogil=True)
def _query_one(starts, ids, codes, count, cand, hits, hist, max_out, out):
    """The ids of buckets ``codes`` [L], at most ``max_out`` of them, into ``out``: those found in
    the most tables. ``count`` uint8 [n_ids] is all zeros on entry and on return (a count
    stops at 255); ``cand``, ``hits`` int32 [room for the largest union] and ``hist`` int32
    [L + 2] are scratch. Returns how many were written."""
    L = codes.size
    for t in range(L):  # every bucket asked for at once: their misses overlap
        lo = starts[t, codes[t]]
        hi = min(starts[t, codes[t] + 1], lo + _PREFETCH_IDS)
        prefetch(ids[t, lo:hi])
    n = 0
    for t in range(L):
        for q in range(starts[t, codes[t]], starts[t, codes[t] + 1]):
            i = ids[t, q]
            c = count[i]
            if c == 0:
                cand[n] = i
                n += 1
            if c < 255:
                count[i] = c + 1
    for j in range(n):  # the hit counts, and the marks cleared for the next query
        hits[j] = count[cand[j]]
        count[cand[j]] = 0
    return select_candidates(cand, hits, n, hist, max_out, True, out)


@njit(cache=True, nogil=True, parallel=True)
def _query_batch(starts, ids, codes, count, cand, hits, hist, max_out, bounds, out, lengths):
    for c in prange(bounds.size - 1):
        for r in range(bounds[c], bounds[c + 1]):
            lengths[r] = _query_one(starts, ids, codes[r], count[c], cand[c], hits[c], hist[c],
                                    max_out, out[r])


class CompactTables:
    """L hash tables over ``n_ids`` vectors of dimension ``dim``, every id stored in each.

    Parameters
    ----------
    dim : int
        Vector dimension.
    n_ids : int
        Number of ids; ids are 0..n_ids-1 (row i of the built matrix).
    config : TableConfig
        The family and its K, L and range_pow (``bucket_size`` and ``policy`` do not apply).
    seed : int
        Seeds the hash functions.
    center : bool
        Hash each row less the mean row of the matrix built from (queries as they are).

    Memory: ``4 · L · n_ids`` bytes of ids and ``8 · L · 2**range_pow`` of bucket starts, plus
    query scratch of at most ``9 · n_ids`` bytes a thread (the counts, one byte an id).
    """

    def __init__(self, dim: int, n_ids: int, config: TableConfig = TableConfig(), seed: int = 0,
                 center: bool = False):
        self.dim, self.n_ids, self.config, self.seed = int(dim), int(n_ids), config, int(seed)
        self.center = bool(center)
        if self.n_ids < 1:
            raise ValueError(f"n_ids must be positive, got {n_ids}")
        self.family = make_family(config.family, self.dim, seed=self.seed, **config.family_kwargs())
        self.starts = np.zeros((config.L, (1 << config.range_pow) + 1), np.int64)
        self.ids = np.zeros((config.L, self.n_ids), np.int32)
        self.offset = np.zeros(self.dim, np.float32)
        self.largest_union = 0
        self._free_scratch = []  # query scratch not lent out (slide.runtime.borrowed)

    def build(self, W, chunk: int = 1 << 16) -> None:
        """Store every row of ``W`` float32 [n_ids, dim] (id = row), less their mean row where
        the tables ``center``; a build replaces the last one."""
        W = np.asarray(W, dtype=np.float32)
        if W.shape != (self.n_ids, self.dim):
            raise ValueError(f"W must be [{self.n_ids}, {self.dim}], got {W.shape}")
        self.offset = W.mean(axis=0, dtype=np.float64).astype(np.float32) if self.center \
            else np.zeros(self.dim, np.float32)
        codes = np.empty((self.config.L, self.n_ids), np.int32)
        for lo in range(0, self.n_ids, chunk):  # a centred copy of one chunk at a time
            hi = min(lo + chunk, self.n_ids)
            codes[:, lo:hi] = self.family.hash_dense(W[lo:hi] - self.offset if self.center
                                                     else W[lo:hi]).T
        _counting_sort(codes, self.starts, self.ids)
        # the largest union a query can meet: every table's largest bucket
        self.largest_union = int(min(self.n_ids, np.diff(self.starts, axis=1).max(axis=1).sum()))

    rehash = build

    def _new_scratch(self, threads: int, size: int):
        """Per-thread query scratch: (count uint8 [threads, n_ids], cand and hits int32
        [threads, size]: room for the largest union, hist int32 [threads, L + 2])."""
        return (np.zeros((threads, self.n_ids), np.uint8), np.zeros((threads, size), np.int32),
                np.zeros((threads, size), np.int32),
                np.zeros((threads, self.config.L + 2), np.int32))

    def query_codes(self, codes, max_out: int):
        """Candidates for rows of bucket ids ``codes`` int32 [n, L]: ``ids`` int32 [n, max_out]
        (padded with -1), the ``max_out`` found in the most tables (all of them where fewer) in
        the order found, and ``lengths`` int64 [n]. Queries from several Python threads at
        once each borrow their own scratch (:func:`slide.runtime.borrowed`)."""
        codes = np.ascontiguousarray(codes, np.int32)
        if codes.ndim != 2 or codes.shape[1] != self.config.L:
            raise ValueError(f"codes must be [n, {self.config.L}], got {codes.shape}")
        if codes.size and (codes.min() < 0 or codes.max() >= self.starts.shape[1] - 1):
            raise ValueError(f"bucket ids must be in [0, {self.starts.shape[1] - 1})")
        max_out = int(max_out)
        if max_out < 1:
            raise ValueError(f"max_out must be positive, got {max_out}")
        out = np.full((codes.shape[0], max_out), -1, np.int32)
        lengths = np.zeros(codes.shape[0], np.int64)
        t = thread_count()
        size = max(1, self.largest_union)
        with borrowed(self._free_scratch, lambda s: s[1].shape == (t, size),
                      lambda: self._new_scratch(t, size)) as (count, cand, hits, hist):
            _query_batch(self.starts, self.ids, codes, count, cand, hits, hist, max_out,
                         thread_chunks(codes.shape[0]), out, lengths)
        return out, lengths

    def query(self, V, max_out: int):
        """Candidates for dense rows ``V`` [n, dim]: ``(ids [n, max_out], lengths [n])``."""
        return self.query_codes(self.family.hash_dense(V), max_out)

    @property
    def nbytes(self) -> int:
        """Bytes of the tables (ids and bucket starts; the query scratch apart)."""
        return self.starts.nbytes + self.ids.nbytes

    def bucket(self, t: int, c: int) -> np.ndarray:
        """The ids in bucket ``c`` of table ``t`` (a view)."""
        return self.ids[t, self.starts[t, c]:self.starts[t, c + 1]]
