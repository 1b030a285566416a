"""LSH hash tables over flat int32 arrays, built and queried by parallel numba kernels.

Storage for L tables of 2**range_pow buckets holding up to ``bucket_size`` ids each:

* ``buckets`` int32 [L, 2**range_pow, bucket_size]: the ids (slots past the fill are stale);
* ``seen``    int32 [L, 2**range_pow]: how many ids were ever offered to the bucket since it was
  cleared. The fill is ``min(seen, bucket_size)``.

A full bucket either overwrites its oldest id (``fifo``, a ring buffer) or keeps a uniform sample
of everything offered (``reservoir``, Vitter's algorithm R). Inserts are table-parallel, so no two
threads ever write the same bucket, and each table has its own RNG stream, so the result does not
depend on the thread count.

Queries take a vector's L bucket ids and return the deduplicated union of the hit buckets,
optionally cut to its ``max_out`` most frequent ids (hit count across tables). The union is
deduplicated in a per-thread open-addressed set sized for the largest union (L ×
bucket_size ids, at most half full): small enough to stay in L1 and L2, where an array of one
mark per id is evicted by the training step between queries (docs/tables.md).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from numba import njit, prange

from slide.runtime import aligned_zeros, borrowed, copy_into, prefetch, thread_chunks, thread_count
from lsh.families import make_family

__all__ = ["TableConfig", "HashTables", "autotune", "bucket_size_for", "query_one", "query_union",
           "select_candidates", "claim", "QueryScratch"]

FIFO, RESERVOIR = 0, 1
_POLICIES = {"fifo": FIFO, "reservoir": RESERVOIR}

#: the query set's hash multiplier (Fibonacci hashing: the product's high bits spread the ids)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


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


def bucket_size_for(n_neurons: int, range_pow: int, max_bucket_size: int = 256) -> int:
    """:func:`autotune`'s bucket size for ``n_neurons`` over ``2**range_pow`` buckets: room for
    4 neurons a bucket on average, from 4 to ``max_bucket_size``."""
    return max(4, min(max_bucket_size, int(math.ceil(4 * int(n_neurons) / (1 << range_pow)))))


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
    L = max(4, min(max_tables, int(round(sparsity * (1 << range_pow)))))
    bucket_size = bucket_size_for(n_neurons, range_pow, max_bucket_size)
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


@njit(cache=True, nogil=True, inline="always")
def _probe(slots, i):
    """The slot of id ``i`` in the query set ``slots`` (int32 [2**b], -1 where empty): the one
    holding it, or the empty one where it goes (linear probing)."""
    mask = slots.size - 1
    s = np.int64((np.uint64(i) * _GOLDEN) >> np.uint64(32)) & mask
    while slots[s] != -1 and slots[s] != i:
        s = (s + 1) & mask
    return s


@njit(cache=True, nogil=True)
def claim(slots, where, i):
    """Put id ``i`` in the query set (``slots``, ``where``: :class:`QueryScratch`) as met but no
    candidate; True if it was not there yet. Ids claimed before :func:`query_union` (a
    sample's labels) are left out of its union."""
    s = _probe(slots, i)
    if slots[s] == i:
        return False
    slots[s] = i
    where[s] = -1
    return True


@njit(cache=True, nogil=True)
def query_union(buckets, seen, codes, slots, where, cand, hits):
    """The deduplicated union of the ids in the L buckets ``codes`` [L], written to ``cand``
    (int32, room for the largest union: :class:`QueryScratch`) in discovery order, with each
    one's hit count (the tables it was found in) at the same position of ``hits``; returns its
    size. Ids go through the
    query set ``slots`` (int32 [S], -1 where empty; ``where`` int32 [S] holds each id's
    position in ``cand``, -1 for a claimed one); the caller empties it (``slots[:] = -1``)
    after the query."""
    cap = buckets.shape[2]
    for t in range(codes.size):  # every bucket asked for at once: their misses overlap
        b = codes[t]
        prefetch(buckets[t, b, :min(seen[t, b], cap)])
    n = 0
    for t in range(codes.size):
        b = codes[t]
        bucket = buckets[t, b]
        for q in range(min(seen[t, b], cap)):
            i = bucket[q]
            s = _probe(slots, i)
            if slots[s] == i:
                w = where[s]
                if w >= 0:
                    hits[w] += 1
            else:
                slots[s] = i
                where[s] = n
                cand[n] = i
                hits[n] = 1
                n += 1
    return n


@njit(cache=True, nogil=True)
def select_candidates(cand, hits, n, hist, max_out, rank, out):
    """At most ``max_out`` of the union ``cand[:n]`` (from :func:`query_union`, with hit counts
    ``hits[:n]``) into ``out``: with ``rank`` the most frequently hit ids, otherwise the first
    found. ``hist`` int32 [L + 2] is scratch. Returns the count."""
    if n <= max_out or not rank:  # all of them, or the first found
        m = min(n, max_out)
        copy_into(out[:m], cand[:m])
        return m
    # counting selection by hit count: keep every id above the threshold count, then fill
    # with ids at the threshold in discovery order
    hist[:] = 0
    for j in range(n):
        hist[hits[j]] += 1
    above = 0
    thr = hist.size - 1
    while thr > 0 and above + hist[thr] < max_out:
        above += hist[thr]
        thr -= 1
    room = max_out - above
    m = 0
    for j in range(n):
        h = hits[j]
        if h > thr or (h == thr and room > 0):
            if h == thr:
                room -= 1
            out[m] = cand[j]
            m += 1
    return m


@njit(cache=True, nogil=True)
def query_one(buckets, seen, codes, slots, where, cand, hits, hist, max_out, rank, out):
    """Union of the ids in the L buckets ``codes`` [L], deduplicated, written to ``out``.

    Per-thread scratch as in :class:`QueryScratch` (``slots`` all -1 on entry and on return).
    Returns the number of ids written (at most ``max_out``); with ``rank`` the most frequently
    hit ids are kept when the union is larger, otherwise the first ones found.
    """
    n = query_union(buckets, seen, codes, slots, where, cand, hits)
    slots[:] = -1
    return select_candidates(cand, hits, n, hist, max_out, rank, out)


@njit(cache=True, nogil=True, parallel=True)
def _query_batch(buckets, seen, codes, slots, where, cand, hits, hist, max_out, rank, bounds, out,
                 lengths):
    for c in prange(bounds.size - 1):
        for r in range(bounds[c], bounds[c + 1]):
            lengths[r] = query_one(buckets, seen, codes[r], slots[c], where[c], cand[c], hits[c],
                                   hist[c], max_out, rank, out[r])


class QueryScratch:
    """Per-thread query scratch, allocated once and reused across queries and batches: the query
    set ``slots`` int32 [threads, S] (all -1 between queries) with ``where`` int32
    [threads, S], and ``cand``, ``hits`` int32 [threads, U], ``hist`` int32 [threads, L + 2]
    (see :func:`query_union`). U is the largest union, L × bucket_size ids or the ``n_ids``
    there are if fewer; S is the power of two past twice U plus ``extra`` claimed ids (a
    sample's labels), so the set is at most half full."""

    def __init__(self, n_threads: int, L: int, bucket_size: int, extra: int = 0,
                 n_ids: int | None = None):
        size = _largest_union(L, bucket_size, n_ids)
        n_slots = 1 << (2 * (size + extra)).bit_length()
        self.slots = np.full((n_threads, n_slots), -1, np.int32)
        self.where = np.zeros((n_threads, n_slots), np.int32)
        self.cand = np.zeros((n_threads, size), np.int32)
        self.hits = np.zeros((n_threads, size), np.int32)
        self.hist = np.zeros((n_threads, L + 2), np.int32)

    def fits(self, n_threads: int, L: int, bucket_size: int, extra: int = 0,
             n_ids: int | None = None) -> bool:
        size = _largest_union(L, bucket_size, n_ids)
        return self.cand.shape == (n_threads, size) and self.hist.shape[1] == L + 2 \
            and self.slots.shape[1] > 2 * (size + extra)


def _largest_union(L: int, bucket_size: int, n_ids: int | None) -> int:
    return L * bucket_size if n_ids is None else max(1, min(L * bucket_size, n_ids))


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
        # on a cache line: a bucket of 64 ids spans 4 lines, not 5
        self.buckets = aligned_zeros((config.L, R, config.bucket_size), np.int32)
        self.seen = np.zeros((config.L, R), np.int32)
        self._policy = _POLICIES[config.policy]
        self._reset_rng()
        self._free_scratch = []  # query scratch not lent out (slide.runtime.borrowed)
        self.builds = 0  # times the tables were (re)built from weights: rehash cost counters

    def _reset_rng(self):
        ss = np.random.SeedSequence([self.seed, self.family.seed])
        self.rng_state = ss.generate_state(self.config.L, np.uint64) | np.uint64(1)

    # -- building ---------------------------------------------------------------------------
    def clear(self) -> None:
        self.seen[:] = 0
        self._reset_rng()

    def insert(self, ids, codes) -> None:
        """Offer ``ids`` [n] with their bucket ids ``codes`` int32 [n, L] to every table. Each
        table reads its column of ``codes``: the transpose of a table-major [L, n] array reads
        them in order (taken as it is, not copied)."""
        ids = np.ascontiguousarray(ids, np.int32)
        codes = np.asarray(codes, np.int32)
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
        # codes table-major, so that each table's inserts read their column in order: row-major,
        # a table's pass would read every line of the chunk's codes and push the buckets being
        # filled out of L2. A chunk's codes are a C-contiguous [L, m] at the start of one
        # buffer, which the hashing writes in place.
        L = self.config.L
        buf = np.empty(L * min(chunk, self.n_ids), np.int32)
        for lo in range(0, self.n_ids, chunk):
            hi = min(lo + chunk, self.n_ids)
            codes = self.family.hash_dense(W[lo:hi], out=buf[:L * (hi - lo)].reshape(L, -1).T)
            self.insert(np.arange(lo, hi, dtype=np.int32), codes)

    rehash = build  # same hash functions, current weights

    def rebuild(self, W, seed: int | None = None) -> None:
        """Draw new hash functions (seed defaults to the next one), then build from ``W``."""
        self.family = self.family.reseeded(self.family.seed + 1 if seed is None else int(seed))
        self.build(W)

    # -- querying ---------------------------------------------------------------------------
    def lookup(self, V):
        """``(codes, buckets, seen)``: dense rows ``V``'s bucket ids [n, L] and the arrays a
        query of them reads, for a caller that runs its own query kernel."""
        return self.family.hash_dense(V), self.buckets, self.seen

    @property
    def query_shape(self) -> tuple:
        """(tables, bucket size) of what :meth:`lookup` returns: a query's scratch sizes."""
        return self.config.L, self.config.bucket_size

    @property
    def nbytes(self) -> int:
        """The tables' memory: their buckets and fill counts."""
        return self.buckets.nbytes + self.seen.nbytes

    def query_codes(self, codes, max_out: int | None = None, rank: bool = False):
        """Candidates for rows of bucket ids ``codes`` int32 [n, L].

        Returns ``ids`` int32 [n, max_out] (padded with -1) and ``lengths`` int64 [n].
        ``max_out`` defaults to L × bucket_size (the whole union). Queries from several Python
        threads at once each borrow their own scratch (:func:`slide.runtime.borrowed`).
        """
        codes = np.ascontiguousarray(codes, np.int32)
        cfg = self.config
        max_out = cfg.L * cfg.bucket_size if max_out is None else int(max_out)
        out = np.full((codes.shape[0], max_out), -1, np.int32)
        lengths = np.zeros(codes.shape[0], np.int64)
        t = thread_count()
        with borrowed(self._free_scratch,
                      lambda s: s.fits(t, cfg.L, cfg.bucket_size, n_ids=self.n_ids),
                      lambda: QueryScratch(t, cfg.L, cfg.bucket_size, n_ids=self.n_ids)) as s:
            _query_batch(self.buckets, self.seen, codes, s.slots, s.where, s.cand, s.hits,
                         s.hist, max_out, rank, thread_chunks(codes.shape[0]), out, lengths)
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
