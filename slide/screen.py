"""Exact top-k over a wide output layer through an int8 screen.

The exact top-k of ``H @ W.T + b`` is bound by the product's arithmetic: 171 MFLOP per row at
670K labels and hidden 128, which float32 on one core does at ~70 GFLOP/s at best. Most of
those scores only need to be known to be too small. Here every score is first computed from
int8 copies of ``H`` and ``W`` with the CPU's int8 dot-product instruction (AVX-512 VNNI's
``vpdpbusd``: 64 multiply-adds per instruction, four times float32's FMA), together with a
rigorous bound on the quantisation error; only the labels whose upper bound reaches the k-th
best lower bound of their row are then scored in float32. The result is the exact top-k (the
candidates always contain every label that can be in it), at a quarter of the arithmetic.

Bound, per row ``h`` and label ``w`` (``ĥ``, ``ŵ``: the dequantised copies)::

    |h·w - ĥ·ŵ| = |(h - ĥ)·w + ĥ·(w - ŵ)| <= |h - ĥ| |w| + |ĥ| |w - ŵ|

(Cauchy-Schwarz on both terms), plus a float32 rounding allowance. ``vpdpbusd`` multiplies
unsigned by signed bytes: each row is quantised to 0..255 over its own range, which for a row
with negative entries (an identity layer's) starts below 0 at a zero point z, ĥ = t (q - z);
z times the label's sum of its int8 weights is taken off its int32 dot product (exactly).
Machines without VNNI take :func:`slide.metrics.topk_product`.

The same screen serves labels scattered through the layer, each row's own (LSH serving's
candidates, :func:`screened_candidates`): there the query stays float32 (ĥ = h, so the bound is
``|h| |w - ŵ|`` and the rounding allowance), and the int8 copy is laid out by label
(:class:`Int8Labels`), since a candidate costs the scattered lines its row spans rather than
its arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from slide.runtime import (aligned_empty, as_rows, configure_threading, prefetch, prefetch_l2,
                           thread_count)
from slide.kernels import AHEAD, FAR
from slide.vecmath import REASSOC, dot
from slide.metrics import heap_push, heap_sorted, heaps_merge, check_k, topk_product

__all__ = ["Int8Rows", "quantize_rows", "screened_topk", "has_int8_dot", "target_has",
           "SCREEN_MIN_LABELS", "Int8Labels", "quantize_labels", "screened_candidates", "dot_int8",
           "query_range"]

#: label rows per micro-tile (4 vectors of 16 int32 lanes) and batch rows per micro-tile
TILE_LABELS, TILE_ROWS = 64, 4
#: below this many labels the float32 kernel is as fast (the screen's fixed costs dominate)
SCREEN_MIN_LABELS = 1 << 15
#: batch rows screened per pass over the labels: their int8 rows (128 bytes each at hidden
#: 128) stay in a core's L1 cache while every label tile meets them
ROW_BLOCK = 128


def rounding_allowance(d: int) -> np.float32:
    """Relative allowance for float32 rounding in the screened and the rescored scores: a
    d-term float32 dot product is within d * 2^-24 of its exact value relative to |h||w|
    (twice that, and at least 1e-4)."""
    return np.float32(max(1e-4, 2 * d * 2.0 ** -24))


def target_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with ``feature`` (LLVM's name: ``"avx2"``,
    ``"avx512vnni"``): the host's, unless ``NUMBA_CPU_NAME`` names another target, which then
    has only what ``NUMBA_CPU_FEATURES`` turns on (so that ``NUMBA_CPU_NAME=haswell`` with
    AVX-512 off runs as an AVX2 machine would)."""
    from numba import config
    if config.CPU_NAME and config.CPU_NAME != "host":
        return f"+{feature}" in (config.CPU_FEATURES or "").split(",")
    from llvmlite import binding
    return bool(binding.get_host_cpu_features().get(feature, False))


@lru_cache(maxsize=None)
def has_int8_dot() -> bool:
    """Whether numba compiles for a CPU with AVX-512 VNNI, the screen's instruction
    (:func:`target_has`). Asked once per process (LLVM's answer costs a quarter of a
    millisecond, a single-row query's budget)."""
    return target_has("avx512vnni")


@intrinsic
def _dot_tile(typingctx, hq, r0, wq, acc):
    """``acc[r0 + a, 16 g:16 g + 16] = sum_d dpbusd(hq[r0 + a, d], wq[d, 64 g:64 g + 64])`` for
    a < TILE_ROWS, g < TILE_LABELS / 16: int32 dot products of 4 uint8 rows ``hq`` (int32
    [rows, D4], four bytes each) with one tile of 64 int8 label rows ``wq`` (int8 [D4, 256]:
    the 4 bytes of the tile's label j at depth d sit at ``wq[d, 4 j:4 j + 4]``). The 16
    accumulators stay in registers over the depth loop; only AVX-512 VNNI machines may compile
    it."""
    sig = types.void(hq, r0, wq, acc)

    def codegen(context, builder, signature, args):
        H = context.make_array(signature.args[0])(context, builder, args[0])
        Wq = context.make_array(signature.args[2])(context, builder, args[2])
        A = context.make_array(signature.args[3])(context, builder, args[3])
        i64, i32 = ir.IntType(64), ir.IntType(32)
        v16 = ir.VectorType(i32, 16)
        groups = TILE_LABELS // 16
        dpbusd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16, [v16, v16, v16]), "llvm.x86.avx512.vpdpbusd.512")
        depth = cgutils.unpack_tuple(builder, H.shape, 2)[1]
        h_stride = cgutils.unpack_tuple(builder, H.strides, 2)[0]
        w_stride = cgutils.unpack_tuple(builder, Wq.strides, 2)[0]
        a_stride = cgutils.unpack_tuple(builder, A.strides, 2)[0]
        four = ir.Constant(i64, 4)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v16, None))
                for _ in range(TILE_ROWS * groups)]  # promoted to registers by LLVM
        h_base = builder.add(builder.ptrtoint(H.data, i64), builder.mul(args[1], h_stride))
        w_base = builder.ptrtoint(Wq.data, i64)
        splat = ir.Constant(v16, [0] * 16)
        with cgutils.for_range(builder, depth) as loop:
            hv = []
            for a in range(TILE_ROWS):
                p = builder.add(h_base, builder.add(builder.mul(ir.Constant(i64, a), h_stride),
                                                    builder.mul(loop.index, four)))
                x = builder.load(builder.inttoptr(p, i32.as_pointer()), align=4)
                x = builder.insert_element(ir.Constant(v16, ir.Undefined), x, ir.Constant(i32, 0))
                hv.append(builder.shuffle_vector(x, ir.Constant(v16, ir.Undefined), splat))
            row = builder.add(w_base, builder.mul(loop.index, w_stride))
            for g in range(groups):
                p = builder.add(row, ir.Constant(i64, 64 * g))
                wv = builder.load(builder.inttoptr(p, v16.as_pointer()), align=1)
                for a in range(TILE_ROWS):
                    slot = accs[a * groups + g]
                    builder.store(builder.call(dpbusd, [builder.load(slot), hv[a], wv]), slot)
        a_base = builder.add(builder.ptrtoint(A.data, i64), builder.mul(args[1], a_stride))
        for a in range(TILE_ROWS):
            for g in range(groups):
                p = builder.add(a_base, builder.add(builder.mul(ir.Constant(i64, a), a_stride),
                                                    ir.Constant(i64, 64 * g)))
                builder.store(builder.load(accs[a * groups + g]),
                              builder.inttoptr(p, v16.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@dataclass(frozen=True)
class Int8Rows:
    """Int8 copy of a layer's weights W [L, d], with its biases, for :func:`screened_topk`.

    packed : int8 [L' / 64, ceil(d / 4), 256] (L' = L rounded up to 64; padding rows are zero):
        tile-major, so that scoring a tile of 64 labels reads 8 KB in one piece (at hidden 128)
        rather than 32 pieces a row of the whole matrix apart, each on a page of its own (a
        single query would be bound by TLB misses); within a tile the layout ``_dot_tile``
        reads.
    scale : float32 [L']: w_j ~ scale_j * q_j (symmetric, per label: max |w_j| / 127).
    norm, error : float32 [L']: |w_j| and |w_j - scale_j q_j|, rounded up.
    sums : int32 [L']: sum_i q_ji (times a query's zero point, see the module docstring).
    bias : float32 [L']: the layer's biases b_j, and for the padding labels one that no bound
        lifts to a candidate; built here once, not for every query.
    n_rows, dim : L and d.
    """
    packed: np.ndarray
    scale: np.ndarray
    norm: np.ndarray
    error: np.ndarray
    sums: np.ndarray
    bias: np.ndarray
    n_rows: int
    dim: int

    @property
    def nbytes(self) -> int:
        return (self.packed.nbytes + self.scale.nbytes + self.norm.nbytes + self.error.nbytes
                + self.sums.nbytes + self.bias.nbytes)


@njit(cache=True, nogil=True, inline="always")
def _quantize_row(w, q):
    """``q[i] = round(w[i] / s)`` (int8, |q| <= 127) for the row's symmetric scale
    ``s = max |w| / 127``; returns s, the sum of q, |w| and |w - s q|, the last two one float32
    step up: the bounds must not round below their float64 values."""
    m = 0.0
    for i in range(w.size):
        m = max(m, abs(w[i]))
    s = m / 127.0
    nw = 0.0
    ne = 0.0
    total = 0
    for i in range(w.size):
        v = 0 if s == 0.0 else min(127, max(-127, round(w[i] / s)))
        q[i] = v
        total += v
        x = np.float64(w[i])
        nw += x * x
        ne += (x - v * np.float64(np.float32(s))) ** 2
    up = np.float32(np.inf)
    return (s, total, np.nextafter(np.float32(np.sqrt(nw)), up),
            np.nextafter(np.float32(np.sqrt(ne)), up))


@njit(cache=True, nogil=True, parallel=True)
def _quantize_rows(W, packed, scale, norm, error, sums):
    L, d = W.shape
    for g in prange(packed.shape[0]):  # a tile of labels at a time, with one scratch row
        q = np.empty(d, np.int8)
        for j in range(g * TILE_LABELS, min(L, (g + 1) * TILE_LABELS)):
            scale[j], sums[j], norm[j], error[j] = _quantize_row(W[j], q)
            for i in range(d):
                packed[g, i // 4, 4 * (j % TILE_LABELS) + i % 4] = q[i]


def quantize_rows(W, b) -> Int8Rows:
    """:class:`Int8Rows` of the layer ``W`` float32 [L, d] (rows contiguous), ``b`` float32
    [L]; 0.25 bytes per weight extra."""
    configure_threading()
    W = as_rows(W)
    L, d = W.shape
    if np.shape(b) != (L,):
        raise ValueError(f"b must hold one bias per row of W ({L}), got shape {np.shape(b)}")
    Lp = -(-L // TILE_LABELS) * TILE_LABELS
    packed = np.zeros((Lp // TILE_LABELS, -(-d // 4), 4 * TILE_LABELS), np.int8)
    scale, norm, error = (np.zeros(Lp, np.float32) for _ in range(3))
    sums = np.zeros(Lp, np.int32)
    _quantize_rows(W, packed, scale, norm, error, sums)
    bias = np.full(Lp, -np.finfo(np.float32).max, np.float32)
    bias[:L] = b
    return Int8Rows(packed, scale, norm, error, sums, bias, L, d)


@njit(cache=True, nogil=True, inline="always")
def query_range(H, r, levels):
    """Scale ``s`` and zero point ``z`` of row ``r`` of ``H`` over its range [min(0, min h),
    max(0, max h)] in ``levels`` steps, h ~ s (q - z) with q in [0, levels]; ``s`` is 0 for a
    row of zeros (every q is then ``z`` = 0)."""
    lo = 0.0
    hi = 0.0
    for i in range(H.shape[1]):
        lo = min(lo, H[r, i])
        hi = max(hi, H[r, i])
    s = (hi - lo) / levels
    return s, 0 if s == 0.0 else min(levels, round(-lo / s))


@njit(cache=True, nogil=True, parallel=True)
def _quantize_queries(H, rounding, hq_bytes, t, off, slack, nh):
    """uint8 rows of ``H`` [n, d] into ``hq_bytes`` [n', 4 D4], each over its own range
    [min(0, min h), max(0, max h)] in 255 steps: h ~ t (q - off) with the scale ``t`` and the
    zero point ``off`` (0 for a row with no negative entry); per row also ``slack`` =
    |h - ĥ| + ``rounding`` |h| (multiplies |w_j|) and ``nh`` = |ĥ| (multiplies |w_j - ŵ_j|),
    ĥ = t (q - off)."""
    n, d = H.shape
    for r in prange(n):
        s, z = query_range(H, r, 255)
        s32 = np.float64(np.float32(s))
        e = 0.0
        nq = 0.0
        nx = 0.0
        for i in range(d):
            x = np.float64(H[r, i])
            q = z if s == 0.0 else min(255, max(0, round(x / s) + z))
            hq_bytes[r, i] = q
            v = (q - z) * s32
            e += (x - v) ** 2
            nq += v * v
            nx += x * x
        t[r] = s
        off[r] = z
        slack[r] = np.nextafter(np.float32(np.sqrt(e) + rounding * np.sqrt(nx)), np.float32(np.inf))
        nh[r] = np.nextafter(np.float32(np.sqrt(nq)), np.float32(np.inf))


@njit(cache=True, nogil=True, inline="always")
def _bounds(acc, a, j, jj, t, off, slack, nh, rounding, scale, norm, error, sums, bias):
    """Lower and upper bound of the score of label ``j`` (tile column ``jj``) for tile row ``a``
    of the int32 dots ``acc`` (the row's scale ``t``, zero point ``off``, ``slack`` and ``nh``)."""
    # the exact dot in int32 (|q - z| <= 255, |w| <= 127: far from overflow), so that the
    # vectorised loop runs in 32-bit lanes; numba would widen the product to int64
    v = np.float32(np.int32(acc[a, jj] - off * sums[j])) * (t * scale[j]) + bias[j]
    e = slack * norm[j] + nh * error[j] + rounding * abs(bias[j])
    return v - e, v + e


@njit(cache=True, nogil=True, inline="always")
def _tile_bounds(acc, a, g, t, off, slack, nh, rounding, floor, scale, norm, error, sums, bias,
                 ups):
    """The upper bounds of labels g..g+63 for tile row ``a`` into ``ups`` [64], and how many of
    them reach ``floor``.

    A vectorised loop: unsigned indices, so numba emits no negative-index wraparound, which
    would turn every load into a gather (10x slower), and a count rather than a float max,
    whose NaN-aware form LLVM does not vectorise. The bounds are kept so that a tile with a
    hit computes again only those of the labels that reach the floor, not all 64."""
    hits = np.int32(0)
    g = np.uint64(g)
    a = np.uint64(a)
    for jj in range(np.uint64(TILE_LABELS)):
        up = _bounds(acc, a, g + jj, jj, t, off, slack, nh, rounding, scale, norm, error, sums,
                     bias)[1]
        ups[jj] = up
        hits = np.int32(hits + np.int32(up >= floor))  # int32 lanes: numba widens a sum
    return hits


@njit(cache=True, nogil=True, parallel=True, fastmath={"nsz", "contract", "arcp"})
def _screen(hq, n, t, off, slack, nh, rounding, packed, scale, norm, error, sums, bias, L,
            bounds, heap_ids, heap_lows, sizes, cand_ids, cand_ups, n_cand, overflow):
    """For each chunk c of labels ``bounds[c]..bounds[c + 1]`` (in parallel): every row's k
    best lower bounds (``heap_*`` [C, n, k]) and the labels whose upper bound reached the
    running k-th best lower bound (``cand_*`` [C, n, cap], in label order).

    The bounds' fastmath flags are set here: numba inlines ``_bounds`` and ``_tile_bounds``
    into this function before LLVM sees them, so flags of their own would not hold (set there
    only, the bounds took no fused multiply-adds)."""
    C = bounds.size - 1
    rows = hq.shape[0]
    k = heap_ids.shape[2]
    cap = cand_ids.shape[2]
    for c in prange(C):
        acc = np.empty((rows, TILE_LABELS), np.int32)
        ups = np.empty(TILE_LABELS, np.float32)
        for g in range(bounds[c], bounds[c + 1], TILE_LABELS):
            tile = packed[g // TILE_LABELS]
            # every row's dots first, then their bounds: reading a tile right after the
            # instruction's 64-byte stores would stall on store forwarding
            for r0 in range(0, rows, TILE_ROWS):
                _dot_tile(hq, r0, tile, acc)
            for r in range(n):
                full = sizes[c, r] >= k
                # float32, as the bounds are: a float64 floor made the vectorised test
                # convert every bound and count in 64-bit lanes
                floor = heap_lows[c, r, 0] if full else np.float32(-np.inf)
                if _tile_bounds(acc, r, g, t[r], off[r], slack[r], nh[r], rounding, floor,
                                scale, norm, error, sums, bias, ups) == 0:
                    continue  # the common case: no label of the tile can enter
                for jj in range(min(TILE_LABELS, L - g)):
                    up = ups[jj]
                    if up < floor and full:
                        continue
                    j = g + jj
                    low = _bounds(acc, r, j, jj, t[r], off[r], slack[r], nh[r], rounding, scale,
                                  norm, error, sums, bias)[0]
                    if not full or low > floor:
                        sizes[c, r] = heap_push(low, j, k, sizes[c, r], heap_ids[c, r],
                                                 heap_lows[c, r])
                        full = sizes[c, r] >= k
                        if full:
                            floor = heap_lows[c, r, 0]
                    m = n_cand[c, r]
                    if m == cap:  # drop what the risen floor has ruled out since
                        m = 0
                        for i in range(cap):
                            if cand_ups[c, r, i] >= floor or not full:
                                cand_ids[c, r, m] = cand_ids[c, r, i]
                                cand_ups[c, r, m] = cand_ups[c, r, i]
                                m += 1
                        if m == cap:
                            overflow[r] = True  # this row goes to the float32 kernel
                            m = 0
                    cand_ids[c, r, m] = j
                    cand_ups[c, r, m] = up
                    n_cand[c, r] = m + 1


@njit(cache=True, nogil=True, parallel=True)
def _rescore(H, W, b, heap_ids, heap_lows, sizes, cand_ids, cand_ups, n_cand, overflow,
             out_ids, out_scores):
    """Per row: the k-th best lower bound over all chunks, then the float32 scores of the
    candidates whose upper bound reaches it, into a k-heap (label order: ties to the lower id)."""
    C, n, k = heap_ids.shape
    d = H.shape[1]
    for r in prange(n):
        if overflow[r]:
            continue
        lows = np.full(k, -np.inf, np.float32)
        ids = np.full(k, -1, np.int64)
        m = 0
        for c in range(C):
            for a in range(sizes[c, r]):
                m = heap_push(heap_lows[c, r, a], heap_ids[c, r, a], k, m, ids, lows)
        theta = lows[0] if m >= k else -np.inf
        m = 0
        for c in range(C):
            for i in range(n_cand[c, r]):
                if cand_ups[c, r, i] >= theta:
                    j = cand_ids[c, r, i]
                    s = np.float32(0.0)
                    for x in range(d):
                        s += H[r, x] * W[j, x]
                    m = heap_push(s + b[j], j, k, m, out_ids[r], out_scores[r])
        heap_sorted(m, k, out_ids[r], out_scores[r])


def screened_topk(H, W, b, k: int, rows: Int8Rows, chunks: int | None = None,
                  capacity: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise top-k of ``H @ W.T + b``, exactly, through the int8 screen of ``rows``
    (``quantize_rows(W, b)``; rebuild it whenever W or b changes).

    H float32 [n, d] (a CPU without the int8 dot product sends it to
    :func:`slide.metrics.topk_product`), W float32 [L, d], b float32 [L].
    ``chunks``: label ranges scored in parallel (default 4 per numba thread); ``capacity``:
    candidates kept per row and chunk before a row falls back to the float32 kernel. Returns
    ids int64 [n, k] and scores float32 [n, k], best first, ties to the lower id, -1 / -inf
    padding when L < k; scores are float32 dot products (the same values as
    :func:`slide.metrics.topk_product`'s up to float32 rounding).
    """
    configure_threading()
    k = check_k(k)
    H = np.ascontiguousarray(H, dtype=np.float32)
    W, b = as_rows(W), np.ascontiguousarray(b, dtype=np.float32)
    n, d = H.shape
    if rows.n_rows != W.shape[0] or rows.dim != d or W.shape[1] != d:
        raise ValueError(f"the int8 rows are of a [{rows.n_rows}, {rows.dim}] matrix; "
                         f"W is {list(W.shape)} and H has {d} columns: quantize W again")
    if n == 0 or not has_int8_dot():
        return topk_product(H, W, b, k)
    # the label chunks scored in parallel
    Lp = rows.scale.size
    groups = Lp // TILE_LABELS
    C = max(1, min(groups, int(chunks or 4 * thread_count())))
    bounds = (np.arange(C + 1) * groups // C * TILE_LABELS).astype(np.int64)
    rounding = rounding_allowance(d)
    ids = np.full((n, k), -1, np.int64)
    scores = np.full((n, k), -np.inf, np.float32)
    for lo in range(0, n, ROW_BLOCK):
        hi = min(n, lo + ROW_BLOCK)
        _screened_block(H[lo:hi], W, b, rows, bounds, rounding, capacity, ids[lo:hi],
                        scores[lo:hi])
    return ids, scores


def _screened_block(H, W, b, rows, bounds, rounding, capacity, ids, scores):
    """Top-k of one block of rows into ``ids``/``scores`` [n, k] (filled with -1 / -inf)."""
    n, k = ids.shape
    C = bounds.size - 1
    n_pad = -(-n // TILE_ROWS) * TILE_ROWS
    hq_bytes = np.zeros((n_pad, 4 * rows.packed.shape[1]), np.uint8)
    t, slack, nh = (np.zeros(n_pad, np.float32) for _ in range(3))
    off = np.zeros(n_pad, np.int32)
    _quantize_queries(H, rounding, hq_bytes, t, off, slack, nh)
    heap_ids = np.full((C, n, k), -1, np.int64)
    heap_lows = np.full((C, n, k), -np.inf, np.float32)
    sizes = np.zeros((C, n), np.int64)
    cand_ids = np.empty((C, n, capacity), np.int64)
    cand_ups = np.empty((C, n, capacity), np.float32)
    n_cand = np.zeros((C, n), np.int64)
    overflow = np.zeros(n, np.bool_)
    _screen(hq_bytes.view(np.int32), n, t, off, slack, nh, rounding, rows.packed, rows.scale,
            rows.norm, rows.error, rows.sums, rows.bias, W.shape[0], bounds, heap_ids, heap_lows,
            sizes, cand_ids, cand_ups, n_cand, overflow)
    _rescore(H, W, b, heap_ids, heap_lows, sizes, cand_ids, cand_ups, n_cand, overflow, ids, scores)
    if overflow.any():
        ids[overflow], scores[overflow] = topk_product(H[overflow], W, b, k)


# --------------------------------------------------------------------------------------------
# Scattered labels: the candidates of LSH serving
# --------------------------------------------------------------------------------------------
#: columns of :attr:`Int8Labels.meta`
SCALE, NORM, ERROR, BIAS = range(4)


@dataclass(frozen=True)
class Int8Labels:
    """Int8 copy of a layer's weights W [L, d] by label, with its biases, for scoring labels
    scattered through the layer (:func:`screened_candidates`: LSH serving's candidates).

    q : int8 [L, d]: w_j ~ scale_j * q_j (symmetric, per label: max |w_j| / 127), a label's
        row in one piece (128 bytes at hidden 128, a quarter of its float32 row).
    meta : float32 [L, 4]: per label scale_j, |w_j| and |w_j - scale_j q_j| (rounded up) and
        b_j (columns ``SCALE``, ``NORM``, ``ERROR``, ``BIAS``), one 16-byte piece read with the
        row: as four arrays they were four more scattered lines a label.
    """
    q: np.ndarray
    meta: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.meta.nbytes


@njit(cache=True, nogil=True, parallel=True)
def _quantize_labels(W, b, q, meta):
    for j in prange(W.shape[0]):
        meta[j, SCALE], _, meta[j, NORM], meta[j, ERROR] = _quantize_row(W[j], q[j])
        meta[j, BIAS] = b[j]


def quantize_labels(W, b) -> Int8Labels:
    """:class:`Int8Labels` of the layer ``W`` float32 [L, d] (each row contiguous: the weights'
    view in a training model's row block goes as it is), ``b`` float32 [L]; 0.25 bytes per
    weight and 16 bytes per label extra."""
    configure_threading()
    W = as_rows(W)
    L, d = W.shape
    if np.shape(b) != (L,):
        raise ValueError(f"b must hold one bias per row of W ({L}), got shape {np.shape(b)}")
    q = aligned_empty((L, d), np.int8)  # a label's 128 bytes (d = 128) on 2 lines, not 3
    meta = aligned_empty((L, 4), np.float32)
    _quantize_labels(W, np.ascontiguousarray(b, dtype=np.float32), q, meta)
    return Int8Labels(q, meta)


@njit(cache=True, nogil=True, fastmath=REASSOC)
def dot_int8(q, h):
    """``q · h`` in float32 for an int8 row ``q`` [d] and a float32 ``h`` [d] (its own
    function, so that LLVM keeps the reassociation that vectorises it where it inlines it)."""
    acc = np.float32(0.0)
    for i in range(h.size):
        acc += np.float32(q[i]) * h[i]
    return acc


@njit(cache=True, nogil=True, parallel=True)
def _screen_candidates(H, W, b, q, meta, rounding, cand, lengths, parts, approx, ids, scores):
    d = H.shape[1]
    k = ids.shape[1]
    n_rows = H.shape[0]
    part_pos = np.empty((parts, n_rows, k), np.int64)
    part_top = np.empty((parts, n_rows, k), np.float32)
    sizes = np.empty((parts, n_rows), np.int64)
    for task in prange(n_rows * parts):
        r, p = task // parts, task % parts
        h = H[r]
        row = cand[min(np.int64(r), cand.shape[0] - 1)]  # one row shared by all, or each its own
        nh = 0.0
        for i in range(d):
            nh += np.float64(h[i]) * h[i]
        nh = np.nextafter(np.float32(np.sqrt(nh)), np.float32(np.inf))  # |h|, rounded up
        slack = rounding * nh
        lo, hi = lengths[r] * p // parts, lengths[r] * (p + 1) // parts
        ups = approx[r]
        # the run's k best lower bounds
        low_pos = np.empty(k, np.int64)
        lows = np.empty(k, np.float32)
        m = 0
        for a in range(lo, hi):
            # the rows are scattered through the layer: each asked for a few ahead, a miss
            # a row; its 16 bytes of scale, bounds and bias are one line beside it. Asked of
            # L2 FAR ahead too, more of them are on their way at once (docs/serving.md)
            if a + AHEAD < hi:
                ahead = row[a + AHEAD]
                prefetch(q[ahead])
                prefetch(meta[ahead])
            if a + FAR < hi:
                far = row[a + FAR]
                prefetch_l2(q[far])
                prefetch_l2(meta[far])
            i = row[a]
            v = meta[i, SCALE] * dot_int8(q[i], h) + meta[i, BIAS]
            # |h·w - h·ŵ| <= |h| |w - ŵ|, and float32 rounding in this score and the rescored
            # one (see the module docstring)
            e = slack * meta[i, NORM] + nh * meta[i, ERROR] + rounding * abs(meta[i, BIAS])
            ups[a] = v + e
            low = v - e
            if low == low:  # NaN (an infinite bias) never rules a label out
                m = heap_push(low, a, k, m, low_pos, lows)
        floor = lows[0] if m >= k else np.float32(-np.inf)
        # float32 scores of the labels whose upper bound reaches the run's k-th best lower
        # bound (at most the row's), in candidate order: the run's top-k, exactly
        pos, top = part_pos[p, r], part_top[p, r]
        n = 0
        for a in range(lo, hi):
            if not ups[a] < floor:
                i = row[a]
                n = heap_push(b[i] + dot(W[i, :d], h), a, k, n, pos, top)
        sizes[p, r] = n
    # the runs in candidate order, so that ties still go to the earlier candidate
    heaps_merge(part_pos, part_top, sizes, ids, scores)
    for r in prange(n_rows):
        pos, top = ids[r], scores[r]  # candidate positions, as label ids from here
        row = cand[min(np.int64(r), cand.shape[0] - 1)]
        for j in range(k):
            pos[j] = row[pos[j]] if pos[j] >= 0 and np.isfinite(top[j]) else -1


def screened_candidates(H, W, b, labels: Int8Labels, cand, lengths, parts: int, ids, scores):
    """Each row's exact top-k of its first ``lengths[r]`` candidates ``cand[r]`` by score
    ``W[i] · h_r + b[i]``, screened through the int8 copy ``labels`` (:func:`quantize_labels`
    of the same W and b; build it again whenever they change).

    ``H`` float32 [n, d]; ``W`` float32 [L, d], or a row block whose rows lead with the weights
    (the output layer's); ``b`` float32 [L]; ``cand`` int32 [n, w], whose first ``lengths[r]``
    entries (int64 [n], at most w) are label ids in [0, L), as the serving tables give them, or
    [1, w]: one row of candidates for every row (one compiled kernel either way, where a
    broadcast view would be another).
    Writes ``ids`` int64 [n, k] (label ids, best first, ties to the earlier candidate) and
    ``scores`` float32 [n, k]; -1 / -inf where a row has fewer than k candidates, -1 where a
    score is not finite.

    Every candidate is scored from its int8 row with a bound on the error; only those whose
    upper bound reaches the k-th best lower bound are scored again in float32. A candidate's
    int8 row and its 16 bytes of scale, bounds and bias are 3 of the 9 lines that its float32
    row and bias span, and a scattered row costs its misses (docs/serving.md). Each row's
    candidates are cut into ``parts`` runs, each a task for a thread with a heap of its own,
    merged after: more parts than 1 a row where there are fewer rows than threads (one row's
    thousands of candidates on every thread).
    """
    configure_threading()
    H = np.ascontiguousarray(H, dtype=np.float32)
    n, d = H.shape
    if labels.q.shape != (W.shape[0], d) or W.shape[1] < d:
        raise ValueError(f"the int8 labels are of a {list(labels.q.shape)} matrix; W is "
                         f"{list(W.shape)} and H has {d} columns: quantize W again")
    if cand.shape[0] not in (1, n) or np.shape(lengths) != (n,) or ids.shape != scores.shape \
            or ids.shape[0] != n:
        raise ValueError(f"one row of candidates (or one for all), lengths, ids and scores for "
                         f"each of the {n} rows of H, got {cand.shape[0]}, {np.shape(lengths)}, "
                         f"{ids.shape} and {scores.shape}")
    if np.shape(b) != (W.shape[0],) or (n and (lengths.min() < 0 or lengths.max() > cand.shape[1])):
        raise ValueError(f"b must hold one bias per row of W ({W.shape[0]}) and each length must "
                         f"be within the {cand.shape[1]} candidates a row, got {np.shape(b)} and "
                         f"lengths {lengths.min()}..{lengths.max()}")
    approx = np.empty((n, cand.shape[1]), np.float32)
    _screen_candidates(H, W, b, labels.q, labels.meta, rounding_allowance(d), cand, lengths,
                       max(1, int(parts)), approx, ids, scores)
