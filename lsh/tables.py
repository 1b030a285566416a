"""LSH hash tables over flat int32 arrays, built and queried by parallel numba kernels.

Storage for L tables of 2**range_pow buckets holding up to ``bucket_size`` ids each:

* ``buckets`` int32 [L, 2**range_pow, bucket_size]: the ids (slots past the fill are stale);
* ``seen``    int32 [L, 2**range_pow]: how many ids were ever offered to the bucket since it was
  cleared. The fill is ``min(seen, bucket_size)``.

A full bucket either overwrites its oldest id (``fifo``, a ring buffer) or keeps a uniform sample
of everything offered (``reservoir``, Vitter's algorithm R). Inserts are table-parallel, so no two
threads ever write the same bucket, and each table has its own RNG stream, so the result does not
depend on the thread count.

Queries take a vector's L bucket ids and return the deduplicated union of the hit buckets; a
per-thread ``marks`` array replaces a set: one int32 per id holding the number of the query
that last met it (high bits) and how many of that query's tables held it (low
:data:`HIT_BITS`), so that meeting an id touches one word (with the two in separate arrays, a
query at 670K ids took 40% longer). Optionally the union is cut to its ``max_out`` most
frequent ids (hit count across tables).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numba
import numpy as np
from numba import njit, prange

from lsh._threading import thread_chunks
from lsh.families import make_family

__all__ = ["TableConfig", "HashTables", "autotune", "query_one", "query_union",
           "select_candidates", "claim", "QueryScratch", "HIT_BITS", "MAX_TABLES"]

FIFO, RESERVOIR = 0, 1
_POLICIES = {"fifo": FIFO, "reservoir": RESERVOIR}

#: low bits of a query mark holding the id's hit count, so at most 2**HIT_BITS - 1 tables
HIT_BITS = 8
MAX_TABLES = (1 << HIT_BITS) - 1
_HITS = np.int32(MAX_TABLES)
#: query numbers run below this, so that number << HIT_BITS fits an int32
_MAX_QUERIES = 1 << (31 - HIT_BITS)


@dataclass(frozen=True)
class TableConfig:
    """Hash-table hyperparameters (see :func:`autotune` for defaults derived from sparsity)."""
    family: str = "dwta"
    K: int = 6
    L: int = 50
    range_pow: int = 18
    bucket_size: int = 16
    policy: str = "reservoir"
    bin_size: int = 8           # WTA / DWTA
    density: float = 1 / 3      # SimHash

    def __post_init__(self):
        if self.policy not in _POLICIES:
            raise ValueError(f"policy must be one of {', '.join(_POLICIES)}, got {self.policy!r}")
        if self.K < 1 or self.L < 1 or self.bucket_size < 1:
            raise ValueError("K, L and bucket_size must be positive")
        if self.L > MAX_TABLES:
            raise ValueError(f"L must be at most {MAX_TABLES} (queries count hits in "
                             f"{HIT_BITS} bits), got {self.L}")
        if not 1 <= self.range_pow <= 30:
            raise ValueError(f"range_pow must be in 1..30, got {self.range_pow}")

    def family_kwargs(self) -> dict:
        kw = {"K": self.K, "L": self.L, "range_pow": self.range_pow}
        if self.family == "simhash":
            kw["density"] = self.density
        else:
            kw["bin_size"] = self.bin_size
        return kw

    def memory_bytes(self) -> int:
        return 4 * self.L * (1 << self.range_pow) * (self.bucket_size + 1)


def autotune(n_neurons: int, sparsity: float, family: str = "dwta", policy: str = "reservoir",
             max_memory_bytes: int = 1 << 30, max_tables: int = 128, max_bucket_size: int = 256,
             **overrides) -> TableConfig:
    """Hash-table sizes for a layer of ``n_neurons`` of which a fraction ``sparsity`` is active.

    BOLT's rule: range_pow = log2(128 / sparsity), K = round(range_pow / 3) in 2..8,
    L = round(sparsity · 2**range_pow), bucket_size = 4 · n_neurons / 2**range_pow. We also keep
    range_pow no larger than needed to spread the neurons (≥ 1 neuron per bucket on average)
    and cap L at ``max_tables``, bucket_size at ``max_bucket_size``, and both so the tables fit
    in ``max_memory_bytes``. Any field given in ``overrides`` wins.
    """
    if not 0 < sparsity <= 1:
        raise ValueError(f"sparsity must be in (0, 1], got {sparsity}")
    n_neurons = int(n_neurons)
    range_pow = int(math.floor(math.log2(128.0 / sparsity)))
    range_pow = max(4, min(range_pow, max(4, int(math.ceil(math.log2(max(n_neurons, 2)))))))
    K = max(2, min(8, int(round(range_pow / 3))))
    L = max(4, min(max_tables, MAX_TABLES, int(round(sparsity * (1 << range_pow)))))
    bucket_size = max(4, min(max_bucket_size, int(math.ceil(4 * n_neurons / (1 << range_pow)))))
    cfg = dict(family=family, K=K, L=L, range_pow=range_pow, bucket_size=bucket_size, policy=policy)
    cfg.update(overrides)
    while TableConfig(**cfg).memory_bytes() > max_memory_bytes and "L" not in overrides and cfg["L"] > 8:
        cfg["L"] = max(8, cfg["L"] * 3 // 4)
    while TableConfig(**cfg).memory_bytes() > max_memory_bytes and "bucket_size" not in overrides \
            and cfg["bucket_size"] > 4:
        cfg["bucket_size"] = max(4, cfg["bucket_size"] * 3 // 4)
    return TableConfig(**cfg)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _xorshift(state):
    x = state[0]
    x ^= x >> np.uint64(12)
    x ^= x << np.uint64(25)
    x ^= x >> np.uint64(27)
    state[0] = x
    return x * np.uint64(0x2545F4914F6CDD1D)


@njit(cache=True, nogil=True, parallel=True)
def insert_kernel(buckets, seen, rng_state, ids, codes, policy):
    """Offer ``ids[i]`` to bucket ``codes[i, l]`` of every table l (parallel over tables)."""
    cap = buckets.shape[2]
    for t in prange(buckets.shape[0]):
        state = rng_state[t:t + 1]
        for i in range(ids.size):
            b = codes[i, t]
            c = seen[t, b]
            if c < cap:
                slot = c
            elif policy == FIFO:
                slot = c % cap
            else:
                r = _xorshift(state) % np.uint64(c + 1)
                slot = np.int64(r) if r < np.uint64(cap) else -1
            if slot >= 0:
                buckets[t, b, slot] = ids[i]
            if c < 2_000_000_000:
                seen[t, b] = c + 1


@njit(cache=True, nogil=True)
def claim(marks, i, gen):
    """Mark id ``i`` as met by query ``gen`` (with no hits) in ``marks``; True if that query had
    not met it yet. A query's ids claimed before :func:`query_union` (a sample's labels) are
    left out of its union."""
    key = np.int32(gen) << HIT_BITS
    if marks[i] < key:
        marks[i] = key
        return True
    return False


@njit(cache=True, nogil=True)
def query_union(buckets, seen, codes, marks, gen, cand):
    """The deduplicated union of the ids in the L buckets ``codes`` [L], written to ``cand``
    (int32 [L * bucket_size]) in discovery order; returns its size. Each id met is marked in
    ``marks`` with the query number ``gen`` (1 <= gen < 2**23, increasing from query to query)
    and its hit count (the tables it was found in)."""
    key = np.int32(gen) << HIT_BITS
    cap = buckets.shape[2]
    n = 0
    for t in range(codes.size):
        b = codes[t]
        fill = min(seen[t, b], cap)
        for s in range(fill):
            i = buckets[t, b, s]
            v = marks[i]
            if v < key:  # an earlier query's mark
                marks[i] = key + 1
                cand[n] = i
                n += 1
            else:
                marks[i] = v + 1
    return n


@njit(cache=True, nogil=True)
def select_candidates(cand, n, marks, hist, max_out, rank, out):
    """At most ``max_out`` of the union ``cand[:n]`` (from :func:`query_union`, whose hit counts
    ``marks`` holds) into ``out``: with ``rank`` the most frequently hit ids, otherwise the
    first found. Returns the count."""
    if n <= max_out:
        out[:n] = cand[:n]
        return n
    if not rank:
        out[:max_out] = cand[:max_out]
        return max_out
    # counting selection by hit count: keep every id above the threshold count, then fill
    # with ids at the threshold in discovery order
    hist[:] = 0
    for j in range(n):
        hist[marks[cand[j]] & _HITS] += 1
    above = 0
    thr = hist.size - 1
    while thr > 0 and above + hist[thr] < max_out:
        above += hist[thr]
        thr -= 1
    room = max_out - above
    m = 0
    for j in range(n):
        h = marks[cand[j]] & _HITS
        if h > thr or (h == thr and room > 0):
            if h == thr:
                room -= 1
            out[m] = cand[j]
            m += 1
    return m


@njit(cache=True, nogil=True)
def query_one(buckets, seen, codes, marks, gen, cand, hist, max_out, rank, out):
    """Union of the ids in the L buckets ``codes`` [L], deduplicated, written to ``out``.

    Per-thread scratch: ``marks`` int32 [n_ids], ``cand`` int32 [L * bucket_size], ``hist``
    int32 [L + 2]; ``gen`` is this query's number (see :func:`query_union`). Returns the
    number of ids written (at most ``max_out``); with ``rank`` the most frequently hit ids
    are kept when the union is larger, otherwise the first ones found.
    """
    n = query_union(buckets, seen, codes, marks, gen, cand)
    return select_candidates(cand, n, marks, hist, max_out, rank, out)


@njit(cache=True, nogil=True, parallel=True)
def _query_batch(buckets, seen, codes, marks, gens, cand, hist, max_out, rank, bounds, out,
                 lengths):
    for c in prange(bounds.size - 1):
        for r in range(bounds[c], bounds[c + 1]):
            gens[c] += 1
            lengths[r] = query_one(buckets, seen, codes[r], marks[c], gens[c], cand[c], hist[c],
                                   max_out, rank, out[r])


class QueryScratch:
    """Per-thread query scratch, allocated once and reused across queries and batches:
    ``marks`` int32 [threads, n_ids], ``gens`` int32 [threads] (each thread's last query
    number), ``cand`` and ``hist`` (see :func:`query_one`)."""

    def __init__(self, n_threads: int, n_ids: int, L: int, bucket_size: int):
        self.marks = np.zeros((n_threads, n_ids), np.int32)
        self.gens = np.zeros(n_threads, np.int32)
        self.cand = np.zeros((n_threads, L * bucket_size), np.int32)
        self.hist = np.zeros((n_threads, L + 2), np.int32)

    def fits(self, n_threads, n_ids, L, bucket_size) -> bool:
        return self.marks.shape == (n_threads, n_ids) and self.cand.shape[1] == L * bucket_size \
            and self.hist.shape[1] == L + 2

    def renew_if_old(self, queries: int) -> None:
        """Start the query numbers again, marks cleared, if ``queries`` more on one thread
        could reach :data:`_MAX_QUERIES` (about 8 million)."""
        if queries >= _MAX_QUERIES:
            raise ValueError(f"at most {_MAX_QUERIES - 1} queries at a time, got {queries}")
        if int(self.gens.max()) + queries >= _MAX_QUERIES:
            self.marks[:] = 0
            self.gens[:] = 0


# --------------------------------------------------------------------------------------------
# Python API
# --------------------------------------------------------------------------------------------
class HashTables:
    """L hash tables over ``n_ids`` vectors of dimension ``dim``.

    Parameters
    ----------
    dim : int
        Vector dimension (a layer's fan-in).
    n_ids : int
        Number of ids (neurons) that can be stored; ids are 0..n_ids-1.
    config : TableConfig
    seed : int
        Seeds the hash functions and the reservoir RNG streams.
    """

    def __init__(self, dim: int, n_ids: int, config: TableConfig = TableConfig(), seed: int = 0):
        self.dim, self.n_ids, self.config, self.seed = int(dim), int(n_ids), config, int(seed)
        self.family = make_family(config.family, self.dim, seed=self.seed, **config.family_kwargs())
        R = 1 << config.range_pow
        self.buckets = np.zeros((config.L, R, config.bucket_size), np.int32)
        self.seen = np.zeros((config.L, R), np.int32)
        self._policy = _POLICIES[config.policy]
        self._reset_rng()
        self._scratch = None
        self.builds = 0  # times the tables were (re)built from weights: rehash cost counters

    def _reset_rng(self):
        ss = np.random.SeedSequence([self.seed, self.family.seed])
        self.rng_state = ss.generate_state(self.config.L, np.uint64) | np.uint64(1)

    # -- building ---------------------------------------------------------------------------
    def clear(self) -> None:
        self.seen[:] = 0
        self._reset_rng()

    def insert(self, ids, codes) -> None:
        """Offer ``ids`` [n] with their bucket ids ``codes`` int32 [n, L] to every table."""
        ids = np.ascontiguousarray(ids, np.int32)
        codes = np.ascontiguousarray(codes, np.int32)
        if codes.shape != (ids.size, self.config.L):
            raise ValueError(f"codes must be [{ids.size}, {self.config.L}], got {codes.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_ids):
            raise ValueError(f"ids must be in [0, {self.n_ids})")
        insert_kernel(self.buckets, self.seen, self.rng_state, ids, codes, self._policy)

    def build(self, W, chunk: int = 1 << 16) -> None:
        """Clear the tables and insert every row of ``W`` float32 [n_ids, dim] (id = row)."""
        W = np.asarray(W, dtype=np.float32)
        if W.shape != (self.n_ids, self.dim):
            raise ValueError(f"W must be [{self.n_ids}, {self.dim}], got {W.shape}")
        self.clear()
        self.builds += 1
        for lo in range(0, self.n_ids, chunk):
            hi = min(lo + chunk, self.n_ids)
            self.insert(np.arange(lo, hi, dtype=np.int32), self.family.hash_dense(W[lo:hi]))

    rehash = build  # same hash functions, current weights

    def rebuild(self, W, seed: int | None = None) -> None:
        """Draw new hash functions (seed defaults to the next one), then build from ``W``."""
        self.family = self.family.reseeded(self.family.seed + 1 if seed is None else int(seed))
        self.build(W)

    # -- querying ---------------------------------------------------------------------------
    def scratch(self, queries: int) -> QueryScratch:
        """This thread count's query scratch, ready for ``queries`` more queries per thread."""
        t = numba.get_num_threads()
        cfg = self.config
        if self._scratch is None or not self._scratch.fits(t, self.n_ids, cfg.L, cfg.bucket_size):
            self._scratch = QueryScratch(t, self.n_ids, cfg.L, cfg.bucket_size)
        self._scratch.renew_if_old(queries)
        return self._scratch

    def query_codes(self, codes, max_out: int | None = None, rank: bool = False):
        """Candidates for rows of bucket ids ``codes`` int32 [n, L].

        Returns ``ids`` int32 [n, max_out] (padded with -1) and ``lengths`` int64 [n].
        ``max_out`` defaults to L × bucket_size (the whole union).
        """
        codes = np.ascontiguousarray(codes, np.int32)
        cap = self.config.L * self.config.bucket_size
        max_out = cap if max_out is None else int(max_out)
        out = np.full((codes.shape[0], max_out), -1, np.int32)
        lengths = np.zeros(codes.shape[0], np.int64)
        step = _MAX_QUERIES // 2  # a thread's queries in one call stay below the marks' limit
        for lo in range(0, codes.shape[0], step):
            hi = min(lo + step, codes.shape[0])
            s = self.scratch(hi - lo)
            _query_batch(self.buckets, self.seen, codes[lo:hi], s.marks, s.gens, s.cand, s.hist,
                         max_out, rank, thread_chunks(hi - lo), out[lo:hi], lengths[lo:hi])
        return out, lengths

    def query(self, V, max_out: int | None = None, rank: bool = False):
        """Candidates for dense rows ``V`` [n, dim]: ``(ids [n, max_out], lengths [n])``."""
        return self.query_codes(self.family.hash_dense(V), max_out, rank)

    def query_one(self, v, max_out: int | None = None, rank: bool = False) -> np.ndarray:
        """Candidate ids (int32, each once) for one dense vector [dim]."""
        ids, n = self.query(np.asarray(v, np.float32).reshape(1, -1), max_out, rank)
        return ids[0, : n[0]]

    # -- introspection ----------------------------------------------------------------------
    def fill(self) -> np.ndarray:
        """Ids stored per bucket, int32 [L, 2**range_pow]."""
        return np.minimum(self.seen, self.config.bucket_size)

    def stats(self) -> dict:
        fill = self.fill()
        return {**asdict(self.config), "memory_mb": self.buckets.nbytes / 2**20,
                "mean_fill": float(fill.mean()), "full_buckets": float((fill == self.config.bucket_size).mean()),
                "empty_buckets": float((fill == 0).mean())}
