"""Hash families: SimHash (sparse random projections), WTA and DWTA.

A family holds K × L hash functions drawn from a seed. Hashing a vector gives K·L raw codes
(``bits`` bits each); the K codes of table l are concatenated into that table's bucket id in
``[0, 2**range_pow)``. When the concatenation is wider than ``range_pow`` bits it is folded with
Fibonacci hashing rather than truncated, so no code bit is simply dropped.

Every family exposes the same three entry points, all returning bucket ids as int32 [n, L]:

* ``hash_one(v)``: one dense float32 vector [dim] → [L];
* ``hash_dense(V, out=None)``: a batch of dense rows [n, dim], parallel over rows. The kernels
  write table-major, into an [L, n] array whose transpose is returned; ``out``, where given,
  receives the ids: written in place where it is the transpose of a C-contiguous [L, n]
  array (a table build's buffer), filled from a new one otherwise;
* ``hash_csr(X)``: a batch of sparse CSR rows [n, dim], parallel over rows.

The kernels are module-level numba functions over the family's arrays so that other kernels
(table builds, the training engine) call them without Python in between.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from numba import njit, prange

from slide.runtime import TILE, as_rows, leading_rows, prefetch, thread_chunks, transpose_tile

__all__ = ["SimHash", "WTA", "DWTA", "make_family", "combine_codes"]

_FIB = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, nogil=True)
def combine_codes(codes, K, L, bits, range_pow, out):
    """Concatenate K ``bits``-bit codes per table into L bucket ids < 2**range_pow."""
    total = K * bits
    for t in range(L):
        key = np.uint64(0)
        for k in range(K):
            key = (key << np.uint64(bits)) | np.uint64(codes[t * K + k])
        if total > range_pow:
            key = (key * _FIB) >> np.uint64(64 - range_pow)
        out[t] = np.int32(key)


# --------------------------------------------------------------------------------------------
# SimHash: bit = sign(r . v) for sparse r with entries in {+1, -1}
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _simhash_dense_codes(proj_idx, proj_sign, v, codes):
    for h in range(proj_idx.shape[0]):
        s = np.float32(0.0)
        for j in range(proj_idx.shape[1]):
            s += proj_sign[h, j] * v[proj_idx[h, j]]
        codes[h] = 1 if s > 0 else 0


@njit(cache=True, nogil=True, parallel=True)
def _simhash_dense(proj_idx, proj_sign, V, K, L, range_pow, bounds, by_table):
    """SimHash bucket ids of the rows of ``V`` (float32 [n, >= dim]: the projections read
    coordinates below dim only) into table-major ``by_table`` int32 [L, n]; thread c hashes
    rows ``bounds[c]:bounds[c + 1]``."""
    for c in prange(bounds.size - 1):
        codes = np.empty(K * L, np.int64)
        for r in range(bounds[c], bounds[c + 1]):
            _simhash_dense_codes(proj_idx, proj_sign, V[r], codes)
            combine_codes(codes, K, L, 1, range_pow, by_table[:, r])


# --------------------------------------------------------------------------------------------
# WTA / DWTA: bins of m coordinates cut from concatenated random permutations
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _wta_dense_codes(bins, v, codes):
    """codes[h] = position of the largest coordinate of v in bin h (the first on ties), or -1
    if every coordinate of the bin is -inf (DWTA's dense rows pass their zeros as -inf, see
    :func:`_wta_dense`, so that no bin's argmax lands on a zero).

    One pass with a strict ``>``: compiled to selects, about twice as fast here as a max pass
    followed by a search for its position, or as testing for zeros inside the loop.
    """
    neg = np.float32(-np.inf)
    m = bins.shape[1]
    for h in range(bins.shape[0]):
        row = bins[h]
        best = neg
        arg = -1
        for j in range(m):
            x = v[row[j]]
            if x > best:
                best = x
                arg = j
        codes[h] = arg


@njit(cache=True, nogil=True)
def _dwta_sparse_codes(inv_bin, inv_pos, idx, val, codes, best):
    """DWTA codes of a sparse vector from its non-zeros only: O(nnz × permutations)."""
    codes[:] = -1
    best[:] = -np.inf
    n_hashes = codes.size
    for p in range(inv_bin.shape[0]):
        for t in range(idx.size):
            x = val[t]
            if x == 0:
                continue
            b = inv_bin[p, idx[t]]
            if b < n_hashes and x > best[b]:
                best[b] = x
                codes[b] = inv_pos[p, idx[t]]


@njit(cache=True, nogil=True)
def _densify(codes, seed):
    """Fill empty codes (-1) by borrowing from a bin chosen by a universal hash of
    (bin, attempt); a vector with at least one non-empty bin ends with none empty."""
    n = codes.size
    filled = 0
    for h in range(n):
        if codes[h] >= 0:
            filled += 1
    if filled == 0:
        codes[:] = 0
        return
    if filled == n:
        return
    src = codes.copy()
    for h in range(n):
        if src[h] >= 0:
            continue
        attempt = 1
        while True:
            key = (np.uint64(h) * np.uint64(0x9E3779B1) + np.uint64(attempt) * np.uint64(0x85EBCA77)
                   + np.uint64(seed)) * _FIB
            b = int((key >> np.uint64(32)) % np.uint64(n))
            if src[b] >= 0:
                codes[h] = src[b]
                break
            attempt += 1
            if attempt > 64:  # vanishingly rare: take the next non-empty bin
                b = (h + 1) % n
                while src[b] < 0:
                    b = (b + 1) % n
                codes[h] = src[b]
                break


#: rows hashed together by :func:`_wta_dense`: each comparison then runs across them in SIMD
#: lanes. 64 lanes of a transposed block (32 KB at 128 dimensions) stay in L1 and are enough
#: iterations for LLVM's vectorised loop (16 lanes, unrolled 4 times) to run at all.
_BLOCK_ROWS = 64
#: a block narrower than :data:`_BLOCK_ROWS` (a thread with fewer rows: a single query) is as
#: wide as its rows in whole 16-lane vectors: 64 lanes for one row hashed 63 columns of -inf
_LANES = 16


@njit(cache=True, nogil=True)
def _transpose_block(V, r0, R, densify, Vt):
    """``Vt[:, :R] = V[r0:r0 + R, :dim].T`` for float32 ``V`` [n, >= dim] and ``Vt`` [dim, B],
    R <= B, with DWTA's zeros (``densify``) as -inf so that no bin's argmax lands on one; the
    columns past R are -inf. Whole 16 x 16 tiles go through :func:`slide.runtime.transpose_tile`, the
    rest (the last rows of a thread's range, the last columns of an odd dim) one by one."""
    neg = np.float32(-np.inf)
    dim = Vt.shape[0]
    rows, cols = R - R % TILE, dim - dim % TILE
    for i0 in range(0, rows, TILE):
        # the next tile row's rows (past the block's end, the next block's first): where they
        # lie apart in a wider array (a row block's weights) the hardware does not fetch them
        # ahead on its own. Asking for them in eighths between eighths of the hashing instead,
        # to overlap the arithmetic, was no faster.
        for m in range(TILE):
            if r0 + i0 + TILE + m < V.shape[0]:
                prefetch(V[r0 + i0 + TILE + m, :dim])
        for d0 in range(0, cols, TILE):
            transpose_tile(V, r0 + i0, d0, Vt, i0, densify)
        for i in range(i0, i0 + TILE):
            for d in range(cols, dim):
                Vt[d, i] = neg if densify and V[r0 + i, d] == 0 else V[r0 + i, d]
    for i in range(rows, R):
        v = V[r0 + i]
        for d in range(dim):
            Vt[d, i] = neg if densify and v[d] == 0 else v[d]
    for i in range(R, Vt.shape[1]):
        Vt[:, i] = neg


@njit(cache=True, nogil=True)
def _wta_block_codes(bins, Vt, codes, best):
    """:func:`_wta_dense_codes` for the columns of ``Vt`` float32 [dim, R] at once, hash-major:
    ``codes[h, i]`` int32 [n_hashes, R] for column i, the same result (strict ``>``: the first
    position on ties, -1 for a bin of -inf only). ``best`` float32 [R] is scratch. Every load
    and store runs along the columns, so the whole loop is SIMD (codes stored row-major per
    column spend much of the hashing time in scattered stores); a pass takes four positions of
    a bin (two where the bin has two), so the running maximum and its position are loaded and
    stored once per four comparisons."""
    neg = np.float32(-np.inf)
    R = Vt.shape[1]
    width = bins.shape[1]
    step = 4 if width % 4 == 0 else 2  # bin sizes are powers of two >= 2
    for h in range(bins.shape[0]):
        row = bins[h]
        code = codes[h]
        for i in range(R):
            best[i] = neg
            code[i] = -1
        for j in range(0, width, step):
            x0, x1 = Vt[row[j]], Vt[row[j + 1]]
            if step == 4:
                x2, x3 = Vt[row[j + 2]], Vt[row[j + 3]]
                for i in range(R):  # written as selects: the loop vectorises across the columns
                    b, c = _keep_max(x0, i, j, best[i], code[i])
                    b, c = _keep_max(x1, i, j + 1, b, c)
                    b, c = _keep_max(x2, i, j + 2, b, c)
                    best[i], code[i] = _keep_max(x3, i, j + 3, b, c)
            else:
                for i in range(R):
                    b, c = _keep_max(x0, i, j, best[i], code[i])
                    best[i], code[i] = _keep_max(x1, i, j + 1, b, c)


@njit(cache=True, nogil=True)
def _wta_block_codes_8(bins, Vt, codes):
    """:func:`_wta_block_codes` for bins of 8 positions (the default): each bin in one pass that
    starts from -inf and keeps its running maximum in registers, never stored or loaded. A
    function of its own: as a branch of the general
    kernel, or with a running-maximum array in the loop, LLVM left the loops scalar."""
    neg = np.float32(-np.inf)
    for h in range(bins.shape[0]):
        row = bins[h]
        code = codes[h]
        x0, x1, x2, x3 = Vt[row[0]], Vt[row[1]], Vt[row[2]], Vt[row[3]]
        x4, x5, x6, x7 = Vt[row[4]], Vt[row[5]], Vt[row[6]], Vt[row[7]]
        for i in range(code.size):  # written as selects: the loop vectorises across the columns
            b, c = _keep_max(x0, i, 0, neg, -1)
            b, c = _keep_max(x1, i, 1, b, c)
            b, c = _keep_max(x2, i, 2, b, c)
            b, c = _keep_max(x3, i, 3, b, c)
            b, c = _keep_max(x4, i, 4, b, c)
            b, c = _keep_max(x5, i, 5, b, c)
            b, c = _keep_max(x6, i, 6, b, c)
            code[i] = _keep_max(x7, i, 7, b, c)[1]


@njit(cache=True, nogil=True, inline="always")
def _keep_max(x, i, j, b, c):
    """(x[i], j) where x[i] beats the running maximum b (strictly: the first position keeps
    a tie), (b, c) otherwise; a select, so the caller's loop vectorises."""
    return (x[i], j) if x[i] > b else (b, c)


@njit(cache=True, nogil=True)
def _combine_block(codes, K, L, bits, range_pow, keys, by_table, r0, m):
    """:func:`combine_codes` for the columns of hash-major ``codes`` int32 [K·L, R] at once:
    the bucket ids of the first m <= R columns into columns ``r0:r0 + m`` of table-major
    ``by_table`` int32 [L, n]. ``keys`` [R] is scratch for the concatenated codes: uint32 where
    their K·bits fit (the same ids, with the loops in twice the lanes), uint64 otherwise."""
    total = K * bits
    R = keys.size
    for t in range(L):
        keys[:] = 0
        for k in range(K):
            code = codes[t * K + k]
            for i in range(R):
                keys[i] = (keys[i] << np.uint32(bits)) | np.uint32(code[i])  # in keys' width
        ids = by_table[t, r0:r0 + m]  # contiguous, unlike a row of the block by_table[:, r0:]
        if total > range_pow:
            for i in range(m):
                ids[i] = np.int32((np.uint64(keys[i]) * _FIB) >> np.uint64(64 - range_pow))
        else:
            for i in range(m):
                ids[i] = np.int32(keys[i])


@njit(cache=True, nogil=True, parallel=True)
def _wta_dense(bins, V, dim, densify, seed, K, L, bits, range_pow, key_dtype, bounds, by_table):
    """WTA (or with ``densify`` DWTA) bucket ids of the rows ``V[:, :dim]`` (float32
    [n, >= dim], see :func:`slide.runtime.leading_rows`) into table-major ``by_table`` int32
    [L, n]; ``key_dtype``: the dtype of :func:`_combine_block`'s keys;
    thread c hashes rows ``bounds[c]:bounds[c + 1]``, in transposed blocks of
    :data:`_BLOCK_ROWS`, or of as few lanes as fewer rows need (a row-at-a-time loop gathers 8
    scattered coordinates per bin and does not vectorise). A row with an empty bin (DWTA) is
    densified on its own."""
    n_hashes = K * L
    for c in prange(bounds.size - 1):
        width = min(_BLOCK_ROWS, max(1, -(-(bounds[c + 1] - bounds[c]) // _LANES)) * _LANES)
        Vt = np.empty((dim, width), np.float32)
        codes = np.empty((n_hashes, width), np.int32)
        best = np.empty(width, np.float32)
        keys = np.empty(width, key_dtype)
        empty = np.empty(width, np.bool_)
        row_codes = np.empty(n_hashes, np.int64)
        for r0 in range(bounds[c], bounds[c + 1], width):
            R = min(width, bounds[c + 1] - r0)
            _transpose_block(V, r0, R, densify, Vt)
            if bins.shape[1] == 8:
                _wta_block_codes_8(bins, Vt, codes)
            else:
                _wta_block_codes(bins, Vt, codes, best)
            if densify:
                empty[:] = False
                for h in range(n_hashes):
                    code = codes[h]
                    for i in range(width):
                        empty[i] |= code[i] < 0
                for i in range(R):
                    if empty[i]:
                        row_codes[:] = codes[:, i]
                        _densify(row_codes, seed)
                        codes[:, i] = row_codes
            _combine_block(codes, K, L, bits, range_pow, keys, by_table, r0, R)


@njit(cache=True, nogil=True, parallel=True)
def _dwta_csr(inv_bin, inv_pos, indptr, indices, data, seed, K, L, bits, range_pow, bounds, out):
    for c in prange(bounds.size - 1):
        codes = np.empty(K * L, np.int64)
        best = np.empty(K * L, np.float32)
        for r in range(bounds[c], bounds[c + 1]):
            lo, hi = indptr[r], indptr[r + 1]
            _dwta_sparse_codes(inv_bin, inv_pos, indices[lo:hi], data[lo:hi], codes, best)
            _densify(codes, seed)
            combine_codes(codes, K, L, bits, range_pow, out[r])


@njit(cache=True, nogil=True, parallel=True)
def _scatter_csr(simhash, proj_idx, proj_sign, bins, dim, indptr, indices, data, K, L, bits,
                 range_pow, bounds, out):
    """SimHash (``simhash``) or WTA bucket ids of CSR rows: each row is scattered into a
    per-thread dense buffer, hashed, and only its non-zeros cleared again."""
    for c in prange(bounds.size - 1):
        codes = np.empty(K * L, np.int64)
        dense = np.zeros(dim, np.float32)
        for r in range(bounds[c], bounds[c + 1]):
            for p in range(indptr[r], indptr[r + 1]):
                dense[indices[p]] = data[p]
            if simhash:
                _simhash_dense_codes(proj_idx, proj_sign, dense, codes)
            else:
                _wta_dense_codes(bins, dense, codes)
            combine_codes(codes, K, L, bits, range_pow, out[r])
            for p in range(indptr[r], indptr[r + 1]):
                dense[indices[p]] = 0.0


# --------------------------------------------------------------------------------------------
# Parameter objects
# --------------------------------------------------------------------------------------------
class _Family:
    """Shared plumbing: K, L, range_pow, input checks and output allocation."""
    name = ""
    bits = 1

    def __init__(self, dim: int, K: int, L: int, range_pow: int, seed: int):
        if dim <= 0 or K <= 0 or L <= 0:
            raise ValueError(f"dim, K and L must be positive, got {dim}, {K}, {L}")
        if not 1 <= range_pow <= 30:
            raise ValueError(f"range_pow must be in 1..30, got {range_pow}")
        self.dim, self.K, self.L, self.range_pow, self.seed = int(dim), int(K), int(L), int(range_pow), int(seed)

    @property
    def n_buckets(self) -> int:
        return 1 << self.range_pow

    def _dense_input(self, V, out=None):
        """(the rows of ``V`` [n, dim] as the kernels take them, :func:`slide.runtime.leading_rows`,
        of which they read the first ``dim`` entries; the table-major int32 [L, n] array they
        write: the transpose of ``out`` where that is C-contiguous, a new one otherwise; the
        threads' row bounds). The kernels see one layout of each, so each compiles once: the
        weights of a rehash (rows of a row block, written table-major) and a batch's hidden
        rows would otherwise compile the WTA kernel twice, seconds of a first run."""
        V = as_rows(V)
        if V.ndim != 2 or V.shape[1] != self.dim:
            raise ValueError(f"expected rows of dimension {self.dim}, got shape {V.shape}")
        n = V.shape[0]
        if out is not None and not (isinstance(out, np.ndarray) and out.dtype == np.int32
                                    and out.shape == (n, self.L)):
            raise ValueError(f"out must be an int32 array of shape {(n, self.L)}")
        in_place = out is not None and out.T.flags.c_contiguous
        by_table = out.T if in_place else np.empty((self.L, n), np.int32)
        return leading_rows(V), by_table, thread_chunks(n)

    @staticmethod
    def _dense_output(by_table, out):
        """The bucket ids [n, L] the kernels wrote into ``by_table`` [L, n]: ``out`` (filled
        from it, where it was not written in place), otherwise the transpose of ``by_table``."""
        if out is None:
            return by_table.T
        if not np.may_share_memory(by_table, out):
            out[...] = by_table.T
        return out

    def _csr_input(self, X):
        X = sp.csr_matrix(X, dtype=np.float32)
        if X.shape[1] != self.dim:
            raise ValueError(f"expected rows of dimension {self.dim}, got shape {X.shape}")
        return X, np.empty((X.shape[0], self.L), np.int32), thread_chunks(X.shape[0])

    def hash_one(self, v) -> np.ndarray:
        """Bucket ids int32 [L] of one dense vector [dim]."""
        return self.hash_dense(np.asarray(v, np.float32).reshape(1, -1))[0]

    def params(self) -> dict:
        return {"family": self.name, "dim": self.dim, "K": self.K, "L": self.L,
                "range_pow": self.range_pow, "seed": self.seed, **self._extra_params()}

    def _extra_params(self) -> dict:
        return {}

    def reseeded(self, seed: int):
        """The same family with new hash functions (a table *rebuild*)."""
        params = self.params()
        del params["family"]
        params["seed"] = seed
        return type(self)(**params)


class SimHash(_Family):
    """Signed random projections: each of the K·L bits is sign(r·v) for a sparse ±1 vector r.

    Two vectors at angle θ agree on a bit with probability 1 − θ/π.
    ``density`` is the fraction of non-zero entries in each r (default 1/3).
    """
    name = "simhash"
    bits = 1

    def __init__(self, dim, K=8, L=16, range_pow=None, seed=0, density=1 / 3):
        super().__init__(dim, K, L, K if range_pow is None else range_pow, seed)
        self.density = float(density)
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        rng = np.random.default_rng(seed)
        nnz = max(1, int(round(self.dim * self.density)))
        n = self.K * self.L
        # distinct coordinates per projection: argsort of random keys, then keep the first nnz
        keys = rng.random((n, self.dim), dtype=np.float32)
        self.proj_idx = np.ascontiguousarray(np.argsort(keys, axis=1)[:, :nnz].astype(np.int32))
        self.proj_sign = rng.choice(np.array([-1.0, 1.0], np.float32), size=(n, nnz))

    def _extra_params(self):
        return {"density": self.density}

    def hash_dense(self, V, out=None) -> np.ndarray:
        """Bucket ids int32 [n, L] of the rows of ``V`` [n, dim] (the transpose of a
        table-major array), into ``out`` where given (see the module docstring)."""
        V, by_table, bounds = self._dense_input(V, out)
        _simhash_dense(self.proj_idx, self.proj_sign, V, self.K, self.L, self.range_pow, bounds,
                       by_table)
        return self._dense_output(by_table, out)

    def hash_csr(self, X) -> np.ndarray:
        X, out, bounds = self._csr_input(X)
        _scatter_csr(True, self.proj_idx, self.proj_sign, np.zeros((0, 1), np.int32), self.dim,
                     X.indptr.astype(np.int64), X.indices, X.data, self.K, self.L, 1, self.range_pow,
                     bounds, out)
        return out


class WTA(_Family):
    """Winner-take-all: each hash is the position of the largest of m permuted coordinates.

    Bins of m distinct coordinates are cut from concatenated random permutations of the
    coordinates; codes have log2(m) bits. Sensitive to rank correlation.
    """
    name = "wta"
    _densify = False

    def __init__(self, dim, K=6, L=50, range_pow=None, seed=0, bin_size=8):
        if bin_size < 2 or bin_size & (bin_size - 1):
            raise ValueError(f"bin_size must be a power of two >= 2, got {bin_size}")
        self.bin_size = int(bin_size)
        self.bits = int(np.log2(bin_size))  # log2, not ln: codes need all their bits
        super().__init__(dim, K, L, K * self.bits if range_pow is None else range_pow, seed)
        if self.bin_size > self.dim:
            raise ValueError(f"bin_size {bin_size} exceeds dim {dim}")
        rng = np.random.default_rng(seed)
        n_hashes = self.K * self.L
        n_perm = -(-n_hashes * self.bin_size // self.dim)
        perms = np.stack([rng.permutation(self.dim) for _ in range(n_perm)]).astype(np.int32)
        seq = perms.ravel()
        self.bins = np.ascontiguousarray(seq[: n_hashes * self.bin_size].reshape(n_hashes, self.bin_size))
        # inverse map for sparse inputs: coordinate c of permutation p lands in (bin, pos)
        slot = np.arange(n_perm * self.dim, dtype=np.int64).reshape(n_perm, self.dim)
        self.inv_bin = np.empty((n_perm, self.dim), np.int32)
        self.inv_pos = np.empty((n_perm, self.dim), np.int32)
        rows = np.arange(n_perm)[:, None]
        self.inv_bin[rows, perms] = (slot // self.bin_size).astype(np.int32)
        self.inv_pos[rows, perms] = (slot % self.bin_size).astype(np.int32)

    def _extra_params(self):
        return {"bin_size": self.bin_size}

    @property
    def _key_dtype(self) -> np.dtype:
        """The dtype in which a table's K codes are concatenated (:func:`_combine_block`)."""
        return np.dtype(np.uint32 if self.K * self.bits <= 32 else np.uint64)

    def hash_dense(self, V, out=None) -> np.ndarray:
        """Bucket ids int32 [n, L] of the rows of ``V`` [n, dim] (the transpose of a
        table-major array), into ``out`` where given (see the module docstring)."""
        V, by_table, bounds = self._dense_input(V, out)
        _wta_dense(self.bins, V, self.dim, self._densify, self.seed, self.K, self.L, self.bits,
                   self.range_pow, self._key_dtype, bounds, by_table)
        return self._dense_output(by_table, out)

    def hash_csr(self, X) -> np.ndarray:
        X, out, bounds = self._csr_input(X)
        _scatter_csr(False, np.zeros((0, 1), np.int32), np.zeros((0, 1), np.float32), self.bins,
                     self.dim, X.indptr.astype(np.int64), X.indices, X.data, self.K, self.L, self.bits,
                     self.range_pow, bounds, out)
        return out


class DWTA(WTA):
    """Densified WTA for sparse or mostly-zero vectors.

    A bin's code is the argmax among its *non-zero* coordinates; an empty bin borrows the code
    of another bin chosen by a universal hash of (bin, attempt). Sparse inputs are hashed from
    their non-zeros only, at O(nnz × permutations) cost.
    """
    name = "dwta"
    _densify = True

    def hash_csr(self, X) -> np.ndarray:
        X, out, bounds = self._csr_input(X)
        _dwta_csr(self.inv_bin, self.inv_pos, X.indptr.astype(np.int64), X.indices, X.data,
                  self.seed, self.K, self.L, self.bits, self.range_pow, bounds, out)
        return out


_FAMILIES = {cls.name: cls for cls in (SimHash, WTA, DWTA)}


def make_family(name: str, dim: int, **kwargs):
    """A hash family by name: ``"simhash"``, ``"wta"`` or ``"dwta"``."""
    try:
        cls = _FAMILIES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hash family {name!r}; choose from {', '.join(_FAMILIES)}") from None
    return cls(dim, **kwargs)
