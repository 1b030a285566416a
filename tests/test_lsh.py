import re

import numba
import numpy as np
import pytest
import scipy.sparse as sp
from scipy import stats

import lsh
from lsh import DWTA, WTA, HashTables, SimHash, TableConfig, autotune
from slide.runtime import as_rows, set_num_threads
from lsh.families import _densify


def _pairs_at_angle(rng, n, d, theta):
    u = rng.standard_normal((n, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    w = rng.standard_normal((n, d))
    w -= (w * u).sum(1, keepdims=True) * u
    w /= np.linalg.norm(w, axis=1, keepdims=True)
    return u.astype(np.float32), (np.cos(theta) * u + np.sin(theta) * w).astype(np.float32)


@pytest.mark.parametrize("theta", [0.3, 0.8, 1.5, 2.4])
def test_simhash_bit_collision_rate_matches_theory(rng, theta):
    # one bit per table (K=1) so bucket equality is bit equality; 64 tables × 400 pairs
    fam = SimHash(64, K=1, L=64, seed=3, density=1.0)
    u, v = _pairs_at_angle(rng, 400, 64, theta)
    rate = (fam.hash_dense(u) == fam.hash_dense(v)).mean()
    assert abs(rate - (1 - theta / np.pi)) < 0.03, rate


def test_sparse_simhash_is_close_to_theory(rng):
    fam = SimHash(128, K=1, L=128, seed=1)  # density 1/3
    u, v = _pairs_at_angle(rng, 400, 128, 1.0)
    assert abs((fam.hash_dense(u) == fam.hash_dense(v)).mean() - (1 - 1 / np.pi)) < 0.05


@pytest.mark.parametrize("cls", [WTA, DWTA, SimHash])
def test_identical_vectors_collide_and_rate_falls_with_distance(rng, cls):
    fam = cls(64, K=2, L=100, seed=0)
    u = rng.standard_normal((200, 64)).astype(np.float32)
    assert (fam.hash_dense(u) == fam.hash_dense(u.copy())).all()
    rates = []
    for noise in (0.1, 0.5, 1.0, 3.0):
        v = u + noise * rng.standard_normal(u.shape).astype(np.float32)
        rates.append((fam.hash_dense(u) == fam.hash_dense(v)).mean())
    assert all(a > b for a, b in zip(rates, rates[1:])), rates


def _zeros_as_neg_inf(v):
    """A dense row as DWTA sees it: zeros as -inf, so that no bin's argmax lands on one."""
    return np.where(v == 0, np.float32(-np.inf), v).astype(np.float32)


def test_dwta_densification_leaves_no_empty_code(rng):
    fam = DWTA(256, K=4, L=20, seed=2)
    codes = np.empty(fam.K * fam.L, np.int64)
    from lsh.families import _wta_dense_codes
    for nnz in (1, 2, 5, 30):
        for _ in range(20):
            v = np.zeros(256, np.float32)
            v[rng.choice(256, nnz, replace=False)] = rng.random(nnz).astype(np.float32) + 0.1
            _wta_dense_codes(fam.bins, _zeros_as_neg_inf(v), codes)
            assert (codes == -1).any() or nnz == 30
            _densify(codes, fam.seed)
            assert (codes >= 0).all() and (codes < fam.bin_size).all()


@pytest.mark.parametrize("family", [WTA, DWTA])
@pytest.mark.parametrize("bin_size", [2, 4, 8, 16])
@pytest.mark.parametrize("dim", [48, 37])
@pytest.mark.parametrize("K", [3, 9])
def test_blocked_dense_hashing_equals_one_row_at_a_time(rng, family, bin_size, dim, K):
    """Rows hashed in transposed blocks (several blocks, a partial one, blocks narrowed to a
    few rows, ties and zeros among them; bins compared two or four positions a pass, and bins
    of 8 in one; a dim of whole 16 x 16 tiles and one with columns left over; a table's codes
    concatenated in uint32 keys, and at K = 9 with bins of 16 in uint64 ones) get the codes of
    the one-row reference loop."""
    from lsh.families import _wta_dense_codes, combine_codes
    fam = family(dim, K=K, L=7, range_pow=6, seed=5, bin_size=bin_size)
    V = rng.integers(-2, 3, (150, dim)).astype(np.float32)  # small integers: ties and zeros
    V[7] = 0.0  # DWTA: every bin empty
    codes = np.empty(fam.K * fam.L, np.int64)
    expect = np.empty((V.shape[0], fam.L), np.int32)
    for r, v in enumerate(V):
        if family is DWTA:
            _wta_dense_codes(fam.bins, _zeros_as_neg_inf(v), codes)
            _densify(codes, fam.seed)
        else:
            _wta_dense_codes(fam.bins, v, codes)
        combine_codes(codes, fam.K, fam.L, fam.bits, fam.range_pow, expect[r])
    np.testing.assert_array_equal(fam.hash_dense(V), expect)
    # fewer rows than a block (a single query's): blocks as narrow as whole vectors allow
    for lo, hi in ((0, 1), (3, 8), (7, 40)):
        np.testing.assert_array_equal(fam.hash_dense(V[lo:hi]), expect[lo:hi])
    # rows inside a wider array (a row block's weights) hash in place, to the same codes
    wide = np.concatenate([V, -V, V], axis=1)
    assert np.shares_memory(as_rows(wide[:, :dim]), wide)
    assert as_rows(V.T).strides[1] == 4  # columns of a matrix: copied into rows
    np.testing.assert_array_equal(fam.hash_dense(wide[:, :dim]), expect)


@pytest.mark.parametrize("family", [SimHash, WTA, DWTA])
def test_codes_written_table_major_equal_row_major_and_build_the_same_tables(rng, family):
    """``hash_dense(V, out=...)`` into the transpose of a table-major array gives the codes it
    returns row-major; tables offered either layout (a build writes table-major, in chunks
    smaller than the rows) hold the same ids; a wrong ``out`` is refused."""
    W = rng.standard_normal((300, 40)).astype(np.float32)
    fam = family(40, K=2, L=6, range_pow=5, seed=3)
    rows = fam.hash_dense(W)
    by_table = np.full((6, 300), -1, np.int32)
    assert fam.hash_dense(W, out=by_table.T) is not None
    np.testing.assert_array_equal(by_table.T, rows)
    cfg = TableConfig(family=family.name, K=2, L=6, range_pow=5, bucket_size=4)
    built, offered = HashTables(40, 300, cfg, seed=3), HashTables(40, 300, cfg, seed=3)
    built.build(W, chunk=128)
    offered.clear()
    offered.insert(np.arange(300, dtype=np.int32), offered.family.hash_dense(W))
    np.testing.assert_array_equal(built.seen, offered.seen)
    np.testing.assert_array_equal(built.buckets, offered.buckets)
    # codes come back table-major; any other out is filled from them
    assert rows.T.flags.c_contiguous
    row_major = np.full((300, 6), -1, np.int32)
    assert fam.hash_dense(W, out=row_major) is row_major
    np.testing.assert_array_equal(row_major, rows)
    for bad in (np.empty((300, 5), np.int32), np.empty((300, 6), np.int64)):
        with pytest.raises(ValueError, match="out must be"):
            fam.hash_dense(W, out=bad)


def test_leading_rows_widen_a_row_blocks_weights_and_nothing_else(rng):
    """The weights of a row block (its first H columns, any run of its rows; a plain block or
    one on a cache line, itself a view of a byte buffer) go to the kernels as C-contiguous rows
    that start where they do, so that they compile once with a plain matrix's layout; a view
    whose rows are not contiguous, or whose last row widened would run past its memory, goes
    as it is."""
    from slide.runtime import aligned_empty, leading_rows
    plain = rng.standard_normal((50, 12)).astype(np.float32)
    lined = aligned_empty((50, 12), np.float32)
    lined[:] = plain
    for B in (plain, lined):
        W = B[:, :4]
        for view, first in ((W, 0), (W[7:19], 7), (W[48:], 48), (B[3:9, 1:4], 3)):
            rows = leading_rows(view)
            assert rows.flags.c_contiguous and rows.shape == (view.shape[0], 12)
            assert rows.ctypes.data == view.ctypes.data
            np.testing.assert_array_equal(rows[:, :view.shape[1]], view)
            assert numba.typeof(rows) == numba.typeof(np.empty((2, 2), np.float32))
        C = np.ascontiguousarray(W)
        for other in (B[:, ::2], B.T, C, B[0], np.asfortranarray(B)[:, :4]):
            assert leading_rows(other) is other
    # widened, the last row would end 4 bytes past the matrix's memory
    tail = plain[48:, 1:4]
    assert leading_rows(tail) is tail


def test_aligned_arrays_start_on_a_cache_line():
    """Arrays whose rows kernels read at random start on a cache line (numpy's large arrays
    start 16 bytes into one), zeroed or not, at any shape and dtype."""
    from slide.runtime import CACHE_LINE, aligned_empty, aligned_zeros
    for shape, dtype in (((1000, 384), np.float32), ((3, 5, 64), np.int32), (7, np.int64)):
        for make in (aligned_empty, aligned_zeros):
            a = make(shape, dtype)
            assert a.ctypes.data % CACHE_LINE == 0 and a.flags.c_contiguous
            assert a.shape == (shape if isinstance(shape, tuple) else (shape,)) and a.dtype == dtype
        assert not aligned_zeros(shape, dtype).any()
    # the tables' buckets: a bucket of 16 ids on one line
    t = HashTables(8, 100, TableConfig(family="simhash", K=2, L=3, range_pow=4, bucket_size=16))
    assert t.buckets.ctypes.data % CACHE_LINE == 0


@pytest.mark.parametrize("zeros_to_neg_inf", [False, True])
def test_transpose_tile_moves_one_tile_and_nothing_else(rng, zeros_to_neg_inf):
    """A 16 x 16 tile of a strided view lands transposed at its place in the destination (zeros
    as -inf where asked), every other element of the destination untouched."""
    from numba import njit
    from slide.runtime import transpose_tile

    @njit
    def move(src, r, d, dst, i, z):
        transpose_tile(src, r, d, dst, i, z)

    big = rng.integers(-2, 3, (40, 90)).astype(np.float32)  # zeros among them
    src = big[:, 3:73]  # rows strided, not a whole number of vectors apart
    dst = np.full((70, 33), 9.0, np.float32)
    move(src, 5, 37, dst, 11, zeros_to_neg_inf)
    expect = np.full_like(dst, 9.0)
    expect[37:53, 11:27] = src[5:21, 37:53].T
    if zeros_to_neg_inf:
        expect[37:53, 11:27][expect[37:53, 11:27] == 0] = -np.inf
    np.testing.assert_array_equal(dst, expect)


def test_dwta_sparse_and_dense_hashing_agree(rng):
    fam = DWTA(300, K=3, L=30, seed=4)
    X = sp.random(50, 300, density=0.05, format="csr", random_state=1, dtype=np.float32)
    np.testing.assert_array_equal(fam.hash_csr(X), fam.hash_dense(X.toarray()))
    wta = WTA(300, K=3, L=30, seed=4)
    np.testing.assert_array_equal(wta.hash_csr(X), wta.hash_dense(X.toarray()))
    sim = SimHash(300, K=6, L=10, seed=4)
    np.testing.assert_array_equal(sim.hash_csr(X), sim.hash_dense(X.toarray()))


def test_bucket_ids_in_range_and_fold(rng):
    fam = DWTA(64, K=6, L=8, range_pow=10, seed=0)  # 18 code bits folded into 10
    ids = fam.hash_dense(rng.standard_normal((500, 64)))
    assert ids.min() >= 0 and ids.max() < 1024
    assert np.unique(ids).size > 500  # folding spreads the codes


def _tables(policy, cap=4, L=3, range_pow=2, n_ids=1000):
    return HashTables(8, n_ids, TableConfig(family="simhash", K=2, L=L, range_pow=range_pow,
                                            bucket_size=cap, policy=policy), seed=1)


@pytest.mark.parametrize("policy", ["fifo", "reservoir"])
def test_buckets_never_exceed_capacity(policy):
    t = _tables(policy)
    ids = np.arange(1000, dtype=np.int32)
    t.insert(ids, np.zeros((1000, 3), np.int32))
    assert (t.fill() <= 4).all() and t.fill()[:, 0].tolist() == [4, 4, 4]


def test_fifo_keeps_newest():
    t = _tables("fifo")
    t.insert(np.arange(10, dtype=np.int32), np.zeros((10, 3), np.int32))
    assert sorted(t.buckets[0, 0, :4].tolist()) == [6, 7, 8, 9]


def test_reservoir_keeps_uniform_sample():
    n, cap, reps = 40, 4, 200
    counts = np.zeros(n)
    cfg = TableConfig(family="simhash", K=1, L=reps, range_pow=1, bucket_size=cap, policy="reservoir")
    for seed in (0, 1):  # 400 reservoirs, each table with a stream of its own
        t = HashTables(4, n, cfg, seed=seed)
        t.insert(np.arange(n, dtype=np.int32), np.zeros((n, reps), np.int32))
        for l in range(reps):
            counts += np.bincount(t.buckets[l, 0], minlength=n)
    _, p = stats.chisquare(counts)  # expected reps * cap / n each
    assert p > 0.001, p
    fifo_like = counts[-cap:].sum() / counts.sum()
    assert fifo_like < 0.3


def test_query_returns_each_id_once_and_only_hits(rng):
    W = rng.standard_normal((3000, 32)).astype(np.float32)
    t = HashTables(32, 3000, TableConfig(family="dwta", K=2, L=16, range_pow=6, bucket_size=32), seed=0)
    t.build(W)
    ids, n = t.query(W[:20])
    codes = t.family.hash_dense(W[:20])
    for r in range(20):
        got = ids[r, : n[r]]
        assert np.unique(got).size == got.size
        assert r in got  # a stored vector finds itself unless evicted
        expect = set()
        for l in range(16):
            b = codes[r, l]
            expect.update(t.buckets[l, b, : min(t.seen[l, b], 32)].tolist())
        assert set(got.tolist()) == expect


def test_ranked_query_keeps_most_frequent(rng):
    W = rng.standard_normal((2000, 32)).astype(np.float32)
    t = HashTables(32, 2000, TableConfig(family="dwta", K=2, L=24, range_pow=5, bucket_size=64), seed=0)
    t.build(W)
    full, nf = t.query(W[:5])
    top, nt = t.query(W[:5], max_out=10, rank=True)
    codes = t.family.hash_dense(W[:5])
    for r in range(5):
        hits = np.zeros(2000, int)
        for l in range(24):
            b = codes[r, l]
            hits[t.buckets[l, b, : min(t.seen[l, b], 64)]] += 1
        kept = top[r, : nt[r]]
        assert nt[r] == 10 and np.unique(kept).size == 10
        assert hits[kept].min() >= np.sort(hits[full[r, : nf[r]]])[::-1][9]


def test_same_seed_identical_and_parallel_equals_serial(rng):
    W = rng.standard_normal((5000, 32)).astype(np.float32)
    cfg = TableConfig(family="dwta", K=3, L=8, range_pow=8, bucket_size=8)
    a, b = HashTables(32, 5000, cfg, seed=9), HashTables(32, 5000, cfg, seed=9)
    old = numba.get_num_threads()
    try:
        set_num_threads(1)
        a.build(W)
        set_num_threads(numba.config.NUMBA_NUM_THREADS)
        b.build(W)
    finally:
        numba.set_num_threads(old)
    np.testing.assert_array_equal(a.seen, b.seen)
    np.testing.assert_array_equal(np.where(a.fill()[..., None] > np.arange(8), a.buckets, -1),
                                  np.where(b.fill()[..., None] > np.arange(8), b.buckets, -1))
    c = HashTables(32, 5000, cfg, seed=9)
    c.rebuild(W)
    assert not np.array_equal(a.seen, c.seen)


def test_autotune_follows_bolt_rule_and_memory_cap():
    cfg = autotune(670_091, 0.005)
    assert cfg.range_pow == 14 and cfg.K == 5
    assert cfg.memory_bytes() <= 1 << 30
    small = autotune(1000, 0.1, L=7)
    assert small.L == 7
    with pytest.raises(ValueError):
        autotune(100, 0)
    with pytest.raises(ValueError):
        TableConfig(policy="lru")


def test_tables_count_their_builds(rng):
    W = rng.standard_normal((50, 16)).astype(np.float32)
    t = HashTables(16, 50, TableConfig(K=2, L=3, range_pow=4, bucket_size=8), seed=0)
    assert t.builds == 0
    t.build(W)
    t.rehash(W)
    t.rebuild(W)
    t.insert(np.arange(5, dtype=np.int32), t.family.hash_dense(W[:5]))  # an insert is no build
    assert t.builds == 3


def test_prefetch_hints_leave_results_unchanged():
    """Prefetching rows, single entries and the last row of an array (the hint may reach past
    its end) changes nothing a kernel computes; anything but a 1-D array is refused."""
    from numba import njit
    from numba.core.errors import TypingError
    from slide.runtime import prefetch, prefetch_l2, prefetch_w

    @njit
    def sum_rows(W, b, rows):
        s = 0.0
        for t in range(rows.size):
            i = rows[t]
            prefetch(W[rows[min(t + 2, rows.size - 1)]])
            prefetch_l2(W[rows[min(t + 8, rows.size - 1)]])
            prefetch_w(b[i:i + 1])
            s += W[i].sum() + b[i]
        return s

    rng = np.random.default_rng(0)
    W = rng.standard_normal((50, 37)).astype(np.float32)  # rows not a whole number of lines
    b = rng.standard_normal(50)
    rows = np.append(rng.integers(0, 50, 30), 49).astype(np.int32)
    assert np.isclose(sum_rows(W, b, rows), W[rows].sum(dtype=np.float64) + b[rows].sum(), rtol=1e-6)
    # each asks for its own kind of prefetch: (read 0 / write 1, locality 3 every level / 2 L2)
    ir = next(iter(sum_rows.inspect_llvm().values()))
    kinds = set(re.findall(r"@llvm\.prefetch\.p0\(ptr [^,]+, i32 (\d), i32 (\d), i32 1\)", ir))
    assert kinds == {("0", "3"), ("0", "2"), ("1", "3")}

    @njit
    def whole(W):
        prefetch(W)

    with pytest.raises(TypingError):
        whole(W)


@pytest.mark.parametrize("n", [0, 1, 7, 670_091])
def test_thread_chunks_split_rows_into_one_even_run_per_thread(n):
    """The boundaries start at 0, end at n, never fall, and give each thread n // t or
    n // t + 1 rows (t: the thread count, at most n)."""
    from slide.runtime import engine_threads, thread_chunks
    for threads in (1, 2, 3):
        with engine_threads(threads) as t:
            bounds = thread_chunks(n)
        assert bounds.dtype == np.int64
        assert bounds[0] == 0 and bounds[-1] == n
        assert bounds.size == max(1, min(t, n)) + 1
        sizes = np.diff(bounds)
        assert sizes.min() >= 0 and sizes.max() - sizes.min() <= 1


def test_thread_count_is_numbas_own_on_every_thread():
    """``thread_count`` reads numba's count for the calling thread (set by numba's own setter
    too, not only by ``set_num_threads``), and ``set_num_threads`` sets it for that thread
    only, as numba's setter does."""
    import threading
    from slide.runtime import thread_count
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread")
    previous = numba.get_num_threads()
    seen = {}

    def other():
        seen["start"] = thread_count(), numba.get_num_threads()
        seen["set"] = set_num_threads(1), thread_count(), numba.get_num_threads()

    try:
        numba.set_num_threads(2)
        assert thread_count() == 2
        numba.set_num_threads(1)
        assert thread_count() == 1
        assert set_num_threads(None) == numba.config.NUMBA_NUM_THREADS == thread_count() \
            == numba.get_num_threads()
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert seen["start"][0] == seen["start"][1] and seen["set"] == (1, 1, 1)
        assert thread_count() == numba.config.NUMBA_NUM_THREADS  # this thread's is as it was
    finally:
        numba.set_num_threads(previous)


def test_fetch_add_hands_each_item_to_one_thread():
    """Threads that claim items from one counter at once each get distinct items and together
    all of them (a plain read-add-write would lose claims when two threads race); anything but
    an int64 array is refused."""
    from numba import njit, prange
    from numba.core.errors import TypingError
    from slide.runtime import engine_threads
    from slide.runtime import fetch_add

    @njit(parallel=True)
    def claim_all(n_items, n_threads, owner, counter):
        for c in prange(n_threads):
            i = fetch_add(counter, 1)
            while i < n_items:
                owner[i] += c + 1
                i = fetch_add(counter, 1)

    n = 200_000
    with engine_threads(2):
        owner, counter = np.zeros(n, np.int64), np.zeros(1, np.int64)
        claim_all(n, 2, owner, counter)
    assert counter[0] == n + 2  # every item claimed once, then one failed claim a thread
    assert np.isin(owner, (1, 2)).all()  # each item went to exactly one thread

    @njit
    def wrong(c):
        return fetch_add(c, 1)

    with pytest.raises(TypingError):
        wrong(np.zeros(1, np.int32))


def test_query_set_at_its_fullest_counts_hits_and_empties_again():
    """A union as large as the scratch allows (every slot of every bucket a distinct id, plus
    claimed labels), and hit counts past 255: the set dedups, counts, leaves the claimed ids
    out, and is empty again after each query."""
    from lsh.tables import QueryScratch, claim, query_one, query_union
    L, cap, n_ids = 300, 8, 5000
    buckets = np.zeros((L, 2, cap), np.int32)
    seen = np.full((L, 2), cap, np.int32)
    buckets[:, 0] = np.arange(L * cap, dtype=np.int32).reshape(L, cap) * 7 % n_ids  # distinct
    buckets[:, 1] = np.arange(cap, dtype=np.int32)  # ids 0..7 in every table's bucket 1
    buckets[:, 1, 0] = 4321
    labels = np.array([3, 4999], np.int32)
    s = QueryScratch(1, L, cap, extra=labels.size)
    cand, hits = s.cand[0], s.hits[0]
    for codes in (np.zeros(L, np.int32), np.ones(L, np.int32)):
        for lab in labels:
            assert claim(s.slots[0], s.where[0], lab)
        assert not claim(s.slots[0], s.where[0], labels[0])  # claimed once
        n = query_union(buckets, seen, codes, s.slots[0], s.where[0], cand, hits)
        s.slots[0] = -1
        met = np.concatenate([buckets[t, codes[t]] for t in range(L)])
        expect, counts = np.unique(met[~np.isin(met, labels)], return_counts=True)
        order = np.argsort(cand[:n])
        np.testing.assert_array_equal(cand[:n][order], expect)
        np.testing.assert_array_equal(hits[:n][order], counts)
    assert hits[:n].max() == L  # 300 hits: no narrow counter
    out = np.zeros(3, np.int32)
    assert query_one(buckets, seen, np.ones(L, np.int32), s.slots[0], s.where[0], cand, hits,
                     s.hist[0], 3, True, out) == 3
    assert set(out.tolist()) <= set(range(8)) | {4321} and (s.slots == -1).all()
    # a union can hold no more ids than there are: the scratch is sized by the smaller
    small = QueryScratch(2, L, cap, extra=2, n_ids=40)
    assert small.cand.shape == (2, 40) and small.slots.shape[1] == 128
    assert small.fits(2, L, cap, extra=2, n_ids=40) and not small.fits(2, L, cap, extra=2)


def _compact(rng, n=3000, dim=32, L=12, center=False, shift=0.0):
    W = (rng.standard_normal((n, dim)) + shift * rng.standard_normal(dim)).astype(np.float32)
    t = lsh.CompactTables(dim, n, TableConfig(family="dwta", K=2, L=L, range_pow=6), seed=3,
                          center=center)
    t.build(W)
    return W, t


def test_compact_tables_store_every_id_once_in_its_bucket_in_id_order(rng):
    W, t = _compact(rng)
    codes = t.family.hash_dense(W)
    for l in range(t.config.L):
        assert np.array_equal(np.sort(t.ids[l]), np.arange(W.shape[0]))
        assert t.starts[l, 0] == 0 and t.starts[l, -1] == W.shape[0]
        for b in range(1 << t.config.range_pow):
            assert np.array_equal(t.bucket(l, b), np.flatnonzero(codes[:, l] == b))
    assert t.largest_union == min(3000, np.diff(t.starts, axis=1).max(axis=1).sum())


def test_compact_query_keeps_the_ids_found_in_the_most_tables(rng):
    W, t = _compact(rng)
    V = rng.standard_normal((6, 32)).astype(np.float32)
    codes = t.family.hash_dense(V)
    full, nf = t.query(V, max_out=3000)
    top, nt = t.query(V, max_out=25)
    for r in range(6):
        hits = np.zeros(3000, int)
        for l in range(t.config.L):
            hits[t.bucket(l, codes[r, l])] += 1
        got = full[r, :nf[r]]
        assert set(got.tolist()) == set(np.flatnonzero(hits).tolist()) and np.unique(got).size == got.size
        assert np.all(full[r, nf[r]:] == -1)
        kept = top[r, :nt[r]]
        assert nt[r] == 25 and np.unique(kept).size == 25
        assert hits[kept].min() >= np.sort(hits)[::-1][24]  # no id left out was found more often
    again, _ = t.query(V, max_out=25)  # the per-thread marks were cleared
    assert np.array_equal(again, top)


def test_centred_compact_tables_hash_the_rows_less_their_mean(rng):
    W, t = _compact(rng, center=True, shift=3.0)
    np.testing.assert_allclose(t.offset, W.mean(0), rtol=1e-5, atol=1e-5)
    plain = lsh.CompactTables(32, 3000, t.config, seed=3)
    plain.build(W - W.mean(0))
    assert np.array_equal(t.ids, plain.ids) and np.array_equal(t.starts, plain.starts)
    # a mean that every row shares puts them in few buckets unless it is taken off
    crowded = lsh.CompactTables(32, 3000, t.config, seed=3)
    crowded.build(W)
    assert np.diff(crowded.starts, axis=1).max() > 2 * np.diff(t.starts, axis=1).max()


def test_compact_tables_reject_bad_shapes(rng):
    W, t = _compact(rng)
    with pytest.raises(ValueError, match=r"W must be \[3000, 32\]"):
        t.build(W[:, :31])
    with pytest.raises(ValueError, match="codes must be"):
        t.query_codes(np.zeros((2, 5), np.int32), 10)
    with pytest.raises(ValueError, match=r"bucket ids must be in \[0, 64\)"):
        t.query_codes(np.full((2, t.config.L), 64, np.int32), 10)
    with pytest.raises(ValueError, match="max_out must be positive"):
        t.query(W[:2], 0)


def test_compact_query_counts_past_255_tables_without_wrapping(rng):
    """Counts are one byte an id: an id found in all 300 tables stops at 255, found once."""
    W = rng.standard_normal((50, 16)).astype(np.float32)
    t = lsh.CompactTables(16, 50, TableConfig(family="dwta", K=1, L=300, range_pow=3), seed=1)
    t.build(W)
    ids, n = t.query(W[:3], max_out=50)
    for r in range(3):
        got = ids[r, :n[r]]
        assert np.unique(got).size == got.size and r in got


@pytest.mark.parametrize("kind", ["compact", "bounded"])
def test_queries_from_several_threads_match_one_at_a_time(rng, kind, run_threads):
    """Python threads querying one table set at once (a recommender's pool of threads: the
    kernels release the GIL) get the answers that one query at a time gets, and leave the tables
    answering as before: each query borrows scratch of its own. Sharing it, they read each
    other's marks and leave some set (wrong candidates then and in every later query)."""
    from lsh.compact import CompactTables

    n, dim = 60_000, 16
    cfg = TableConfig(family="dwta", K=2, L=48, range_pow=6, bucket_size=512)
    tables = CompactTables(dim, n, cfg, seed=1) if kind == "compact" \
        else HashTables(dim, n, cfg, seed=1)
    tables.build(rng.standard_normal((n, dim)).astype(np.float32))
    Q = rng.standard_normal((96, dim)).astype(np.float32)
    codes = tables.family.hash_dense(Q)

    def ask(rows):
        ids, lengths = tables.query_codes(codes[rows], 2000) if kind == "compact" \
            else tables.query_codes(codes[rows], 2000, rank=True)
        return [ids[r, :lengths[r]].copy() for r in range(len(ids))]

    want = ask(slice(None))
    assert np.mean([w.size for w in want]) > 1000  # long queries, which overlap
    wrong = []

    def work(first):
        for rep in range(3):
            wrong.extend(r for r in range(first, 96, 4) if not np.array_equal(ask([r])[0], want[r]))

    errors = run_threads(work, range(4))
    assert not errors and not wrong, f"{errors[:3]}; {len(wrong)} answers differ from one at a time"
    assert all(np.array_equal(a, b) for a, b in zip(ask(slice(None)), want))
