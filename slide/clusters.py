"""The engine's own index for ``mode="ann"``: the label vectors ``[w, b]`` cut into k-means
clusters (an inverted file), each label in its nearest cluster and in a second chosen by SOAR's
rule, the layer copied to int8 in cluster order. A query estimates every cluster's centroid
score with ``[h, 1]`` from the centroids' own 4-bit copy, takes the entries of the best
clusters until they hold its budget, estimates their scores from the layer's int8 copy (AVX2's
int8 products, eight labels to a register, or a loop with the same sums) and rescores the best
estimates in float32.

Where LSH's tables find a label only when a random projection agrees, the centroids are the
layer's own summary: on git_openstack, a fiftieth of the entries taken this way holds 0.95 of
the exact top-10, a twentieth 0.99. A batch's candidates are scored cluster by cluster while
each cluster's rows are in cache, so batches gain as much as single rows (docs/serving.md).
"""
from __future__ import annotations

import math
import numbers
from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from slide.blas import gemm
from slide.metrics import heap_push, heap_sorted
from slide.runtime import aligned_empty, blas_threads, configure_threading, prefetch, thread_count
from slide.screen import BIAS, SCALE, quantize_labels, query_range, target_has
from slide.vecmath import REASSOC, dot

__all__ = ["LabelClusters", "cluster_count", "DEFAULT_PROBE", "CLUSTERS_PER_ROOT"]

#: clusters per square root of the labels (a power of two near it): small clusters rank
#: candidates finely, and their centroids still cost a few percent of the labels
CLUSTERS_PER_ROOT = 8
#: the share of the entries (two a label) scored a query by default: 0.98 of the exact top-10
#: on git_openstack
DEFAULT_PROBE = 0.05
#: candidates rescored in float32 a row, per label asked for: the int8 estimates rank them
#: (at k = 10, 12 found what 15 and 1,000 did on git_openstack and the Amazon preset)
KEEP_PER_K = 1.2
#: SOAR's λ for a label's second cluster (:func:`_nearest`): 0.5 found more of the top-10 than
#: the second-nearest (0) and than λ = 1 at git_openstack and the Amazon preset alike
#: (docs/serving.md)
ORTHOGONAL = 0.5
#: Lloyd's iterations, over a sample of this many label vectors per cluster; from the last
#: index's centroids, fewer
ITERATIONS, WARM_ITERATIONS, SAMPLE_PER_CLUSTER = 10, 3, 32
#: a thread's block of the assignment's scores (4 MB; 1 MB made BLAS's products too thin)
_BLOCK_BYTES = 1 << 22


def cluster_count(n: int) -> int:
    """Clusters for ``n`` labels: the power of two nearest ``CLUSTERS_PER_ROOT √n``, 1..n."""
    if n <= 1:
        return 1
    return int(min(n, 2 ** round(math.log2(CLUSTERS_PER_ROOT * math.sqrt(n)))))


@njit(cache=True, nogil=True, parallel=True, fastmath=REASSOC)
def _nearest(V, C, half_norms, orthogonal, tasks, block, out):
    """Each row's nearest centroid of ``C`` into ``out[:, 0]`` (argmax of v·c - |c|²/2), and
    where ``out`` has two columns, its second into ``out[:, 1]``: the nearest of the others
    once ``orthogonal`` λ times the square of r·(v - c) / |r| is added to the distance, r = v -
    c₁ the first one's residual (SOAR's rule: a label that its first centroid underrates along
    r is then held where it is not). A block of rows at a time on each of ``tasks`` threads (a
    single-threaded BLAS product a block, its scores still in cache for the argmax)."""
    n, d = V.shape
    n_blocks = (n + block - 1) // block
    second = out.shape[1] > 1
    for task in prange(tasks):
        P = np.empty((block, C.shape[0]), np.float32)
        R = np.empty((block if second else 0, d), np.float32)
        Q = np.empty((block if second else 0, C.shape[0]), np.float32)
        for blk in range(task, n_blocks, tasks):
            lo, hi = blk * block, min(n, (blk + 1) * block)
            gemm(V[lo:hi], False, C, True, P[:hi - lo], 0.0)
            for i in range(hi - lo):
                out[lo + i, 0] = _best(P[i], half_norms)
            if not second:
                continue
            for i in range(hi - lo):
                R[i] = V[lo + i] - C[out[lo + i, 0]]
            gemm(R[:hi - lo], False, C, True, Q[:hi - lo], 0.0)  # r·c
            for i in range(hi - lo):
                first = out[lo + i, 0]
                rv, rr = np.float32(0.0), np.float32(0.0)
                for j in range(d):
                    rv += R[i, j] * V[lo + i, j]
                    rr += R[i, j] * R[i, j]
                weight = np.float32(orthogonal / (2.0 * rr)) if rr > 0 else np.float32(0.0)
                for c in range(C.shape[0]):  # r·(v - c)
                    P[i, c] -= weight * (rv - Q[i, c]) ** 2
                P[i, first] = -np.inf
                out[lo + i, 1] = _best(P[i], half_norms)


@njit(cache=True, nogil=True, inline="always", fastmath=REASSOC)
def _best(scores, half_norms):
    """argmax of ``scores - half_norms``: the max first (a reduction that vectorises, where a
    running argmax does not), then where it is."""
    best = -np.inf
    for c in range(scores.size):
        best = max(best, scores[c] - half_norms[c])
    for c in range(scores.size):
        if scores[c] - half_norms[c] == best:
            return c
    return 0


@njit(cache=True, nogil=True)
def _means(V, assign, C):
    """Each cluster's mean of the rows of ``V`` assigned to it (``assign`` [n, m]: a row's m
    clusters) into ``C``; an empty cluster keeps its centroid."""
    sums = np.zeros(C.shape, np.float64)
    counts = np.zeros(C.shape[0], np.int64)
    for i in range(V.shape[0]):
        for e in range(assign.shape[1]):
            c = assign[i, e]
            counts[c] += 1
            for j in range(V.shape[1]):
                sums[c, j] += V[i, j]
    for c in range(C.shape[0]):
        if counts[c]:
            for j in range(C.shape[1]):
                C[c, j] = sums[c, j] / counts[c]


def _assign(V, C, threads: int, nearest: int = 1) -> np.ndarray:
    """The nearest centroid of each row of ``V``, and with ``nearest=2`` a second by SOAR's
    rule (:func:`_nearest`), int64 [n, nearest]."""
    out = np.zeros((V.shape[0], min(nearest, C.shape[0])), np.int64)
    half = 0.5 * np.einsum("ij,ij->i", C, C)
    block = max(1, _BLOCK_BYTES // (4 * C.shape[0]))
    # BLAS's own threads would spin after each product and take the cores from numba's
    with blas_threads(1):
        _nearest(V, C, half, ORTHOGONAL, max(1, min(threads, thread_count())), block,
                 out)
    return out


def kmeans(V, n_clusters: int, seed: int = 0, threads: int = 1, start=None, nearest: int = 1):
    """Lloyd's k-means of the rows of ``V`` float32 [n, d]: ``(centroids [n_clusters, d],
    assignment int64 [n, nearest])``, each row's nearest centroid, and with ``nearest=2`` a
    second (:func:`_assign`); ``ITERATIONS`` steps over a sample of ``SAMPLE_PER_CLUSTER`` rows
    per cluster from ``n_clusters`` distinct rows of it, or ``WARM_ITERATIONS`` from the
    centroids ``start`` (the last index's, the weights having moved since). With two clusters
    a row, one more step over every row: each centroid the mean of the entries its cluster
    holds, which it stands for when a query chooses clusters (docs/serving.md)."""
    rng = np.random.default_rng(seed)
    n = V.shape[0]
    sample = V if n <= SAMPLE_PER_CLUSTER * n_clusters else \
        V[np.sort(rng.choice(n, SAMPLE_PER_CLUSTER * n_clusters, replace=False))]
    if start is not None and np.shape(start) == (n_clusters, V.shape[1]):
        C, steps = np.array(start, np.float32), WARM_ITERATIONS
    else:
        C = np.array(sample[rng.choice(sample.shape[0], n_clusters, replace=False)], np.float32)
        steps = ITERATIONS
    for _ in range(steps):
        _means(sample, _assign(sample, C, threads), C)
    assign = _assign(V, C, threads, nearest)
    if assign.shape[1] > 1:
        _means(V, assign, C)
        assign = _assign(V, C, threads, nearest)
    return C, assign


#: bins of a row's centroid scores for choosing its clusters
_BINS = 256


@njit(cache=True, nogil=True, inline="always")
def _choose(row, sizes, budget, chosen):
    """One row's best clusters by its centroid scores ``row``, whole, until they hold ``budget``
    entries (``sizes``: each cluster's), into ``chosen``; returns how many. Those of the score
    bins above the one where the budget runs out, then that bin's in cluster order: two passes
    over the scores, where sorting them took longer than scoring the candidates."""
    n_clusters = row.size
    lo, hi = np.inf, -np.inf
    for c in range(n_clusters):
        lo, hi = min(lo, row[c]), max(hi, row[c])
    scale = (_BINS - 1) / (hi - lo) if hi > lo else 0.0
    bins = np.empty(n_clusters, np.int64)
    labels = np.zeros(_BINS, np.int64)  # the entries of the clusters in each bin
    for c in range(n_clusters):
        bins[c] = int((hi - row[c]) * scale)
        labels[bins[c]] += sizes[c]
    last, held = 0, labels[0]  # the bin where the budget runs out
    while held < budget and last + 1 < _BINS:
        last += 1
        held += labels[last]
    m, held = 0, 0
    for whole in (True, False):
        for c in range(n_clusters):
            if (bins[c] < last) if whole else (bins[c] == last and held < budget):
                chosen[m] = c
                m += 1
                held += sizes[c]
    return m


@njit(cache=True, nogil=True)
def _by_cluster(chosen, n_chosen, starts, tasks):
    """The rows that chose each cluster (CSR ``ptr`` [C + 1], ``rows``), and ``tasks`` + 1
    bounds that split the clusters into runs of about equal work (labels times rows)."""
    n_clusters = starts.size - 1
    ptr = np.zeros(n_clusters + 1, np.int64)
    for r in range(chosen.shape[0]):
        for j in range(n_chosen[r]):
            ptr[chosen[r, j] + 1] += 1
    work = np.zeros(n_clusters + 1, np.int64)
    for c in range(n_clusters):
        work[c + 1] = work[c] + ptr[c + 1] * (starts[c + 1] - starts[c])
        ptr[c + 1] += ptr[c]
    rows = np.empty(ptr[-1], np.int32)
    fill = ptr[:-1].copy()
    for r in range(chosen.shape[0]):
        for j in range(n_chosen[r]):
            c = chosen[r, j]
            rows[fill[c]] = r
            fill[c] += 1
    bounds = np.searchsorted(work, np.arange(tasks + 1) * (work[-1] / tasks))
    bounds[0], bounds[-1] = 0, n_clusters
    return ptr, rows, bounds


#: labels a step of the scan: one AVX2 register of their int32 sums; a cluster's int8 rows
#: are stored in groups of this many, each group by 4-byte pieces of depth
GROUP = 8
#: the query's uint8 levels: AVX2's pairwise sums are int16 and saturate above 2 · 127 · 127,
#: so the query takes 7 bits
LEVELS = 127
#: a centroid's 4-bit levels, -NIBBLE..NIBBLE, stored as w + OFFSET (0..15): they choose the
#: clusters that int8 ones choose, in half the bytes a row reads (docs/serving.md)
NIBBLE, OFFSET = 7, 8
#: groups asked for ahead of the scan
_AHEAD = 2


@lru_cache(maxsize=None)
def int8_kind() -> str | None:
    """The int8 dot product the scan uses on the target CPU (:func:`slide.screen.target_has`):
    ``"avx2"`` (``vpmaddubsw`` then ``vpmaddwd``; CPUs with AVX-512 have it too), or None
    (a loop that LLVM vectorises as it can, with the same sums)."""
    return "avx2" if target_has("avx2") else None


def _grouped_sums(nibbles: bool):
    """The codegen of :func:`_dot8_avx2` (``nibbles`` false) or :func:`_dot4_avx2`: a group's
    eight sums in the eight int32 lanes of one register, so that no sum is reduced across
    lanes, over two accumulators, each every other 32-byte piece of the rows. On a target
    without AVX2 it compiles the loop instead, which such a target's kernels run."""
    def codegen(context, builder, signature, args):
        if not target_has("avx2"):
            loop = _dot4_loop if nibbles else _dot8_loop
            return context.compile_internal(builder, loop.py_func, signature, args)
        h = context.make_array(signature.args[0])(context, builder, args[0])
        w = context.make_array(signature.args[1])(context, builder, args[1])
        o = context.make_array(signature.args[3])(context, builder, args[3])
        i64, i32, i16, i8 = (ir.IntType(b) for b in (64, 32, 16, 8))
        acc_t, load_t, pairs_t = ir.VectorType(i32, 8), ir.VectorType(i8, 32), ir.VectorType(i16, 16)

        def x86(name, ret, *operands):
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, operands),
                                                  f"llvm.x86.avx2.{name}")
        maddubs = x86("pmadd.ub.sw", pairs_t, load_t, load_t)
        maddwd = x86("pmadd.wd", acc_t, pairs_t, pairs_t)
        ones = ir.Constant(pairs_t, [1] * 16)
        low, four = ir.Constant(load_t, [15] * 32), ir.Constant(pairs_t, [4] * 16)
        stride = cgutils.unpack_tuple(builder, w.strides, 2)[0]
        hp = builder.ptrtoint(h.data, i64)
        wp = builder.add(builder.ptrtoint(w.data, i64),
                         builder.mul(context.cast(builder, args[2], signature.args[2], types.int64),
                                     stride))
        accs = [cgutils.alloca_once_value(builder, ir.Constant(acc_t, None)) for _ in range(2)]
        zeros = ir.Constant(acc_t, None)

        def spread(depth):
            # the query's four bytes from this depth, in every lane
            at = builder.add(hp, depth)
            word = builder.load(builder.inttoptr(at, i32.as_pointer()), align=1)
            return builder.bitcast(builder.shuffle_vector(
                builder.insert_element(zeros, word, ir.Constant(i32, 0)), zeros,
                ir.Constant(acc_t, [0] * 8)), load_t)

        def step(piece, acc):
            at = builder.add(wp, builder.mul(piece, ir.Constant(i64, 32)))
            wv = builder.load(builder.inttoptr(at, load_t.as_pointer()), align=1)
            if nibbles:  # the low halves hold depths 8 i..8 i + 3, the high ones the next four
                lo = builder.and_(wv, low)
                hi = builder.and_(builder.bitcast(
                    builder.lshr(builder.bitcast(wv, pairs_t), four), load_t), low)
                depth = builder.mul(piece, ir.Constant(i64, 8))
                pairs = builder.add(  # at most 2 · 2 · 127 · 15 a pair: no int16 overflow
                    builder.call(maddubs, [spread(depth), lo]),
                    builder.call(maddubs, [spread(builder.add(depth, ir.Constant(i64, 4))), hi]))
            else:
                pairs = builder.call(maddubs, [spread(builder.mul(piece, ir.Constant(i64, 4))), wv])
            builder.store(builder.add(builder.load(acc), builder.call(maddwd, [pairs, ones])), acc)

        # the depth is the rows' (the query may be longer: zeros beyond)
        pieces = builder.sdiv(cgutils.unpack_tuple(builder, w.shape, 2)[1],
                              ir.Constant(i64, 4 * GROUP))
        with cgutils.for_range(builder, builder.sdiv(pieces, ir.Constant(i64, 2))) as loop:
            first = builder.mul(loop.index, ir.Constant(i64, 2))
            step(first, accs[0])
            step(builder.add(first, ir.Constant(i64, 1)), accs[1])
        with cgutils.if_unlikely(builder, builder.icmp_signed(
                "!=", builder.srem(pieces, ir.Constant(i64, 2)), ir.Constant(i64, 0))):
            step(builder.sub(pieces, ir.Constant(i64, 1)), accs[0])
        total = builder.add(builder.load(accs[0]), builder.load(accs[1]))
        builder.store(total, builder.bitcast(o.data, acc_t.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


@intrinsic
def _dot8_avx2(typingctx, hq, q, g, out):
    """``out[u] = sum_i hq[i] * w_u[i]`` in int32 for a uint8 row ``hq`` [>= D] (at most 127 a
    byte) and the ``GROUP`` int8 rows ``w_u`` of group ``g`` of ``q`` [G, GROUP D] (D a
    multiple of 4, C-contiguous; bytes 4 i..4 i + 3 of ``w_u`` at ``q[g, GROUP 4 i + 4 u:...+ 4]``),
    on AVX2: one ``vpmaddubsw`` (the query's four bytes broadcast) and one ``vpmaddwd`` a
    piece (on a target without AVX2, the loop's code: kernels branch to it, never here)."""
    return types.void(hq, q, g, out), _grouped_sums(nibbles=False)


@intrinsic
def _dot4_avx2(typingctx, hq, q, g, out):
    """``out[u] = sum_i hq[i] * v_u[i]`` in int32 for a uint8 row ``hq`` [>= D] (at most 127
    a byte) and the ``GROUP`` rows ``v_u`` of 4-bit values (0..15) of group ``g`` of ``q``
    [G, GROUP D / 2] (D a multiple of 8, C-contiguous; 32 bytes a piece of 8 depths, 4 a row:
    byte j of row u's holds depth 8 i + j in its low half, 8 i + 4 + j in its high half), on
    AVX2: each half-byte set widened by a mask, then :func:`_dot8_avx2`'s two products, one
    ``vpmaddwd`` for both halves (the loop's code on a target without AVX2)."""
    return types.void(hq, q, g, out), _grouped_sums(nibbles=True)


def _sums_loop(nibbles: bool):
    @njit(cache=True, nogil=True, inline="always")
    def sums(hq, q, g, out):
        # the sums of _grouped_sums's kernels, for CPUs without AVX2
        for u in range(GROUP):
            out[u] = 0
        for i in range(q.shape[1] // (4 * GROUP)):
            for u in range(GROUP):
                s = out[u]
                for j in range(4):
                    v = np.int32(q[g, GROUP * 4 * i + 4 * u + j])
                    if nibbles:
                        s += np.int32(hq[8 * i + j]) * (v & 15) + \
                            np.int32(hq[8 * i + 4 + j]) * (v >> 4)
                    else:
                        s += np.int32(hq[4 * i + j]) * v
                out[u] = s
    return sums


_dot8_loop, _dot4_loop = _sums_loop(nibbles=False), _sums_loop(nibbles=True)


@njit(cache=True, nogil=True, parallel=True)
def _quantize_queries(H, hq, t, z, shift):
    """uint8 rows of ``H`` [n, d] into ``hq`` [n, >= d] (zero beyond d), each over its own
    range [min(0, min h), max(0, max h)] in ``LEVELS`` steps: h ~ t (q - z); ``shift``: what
    a row's sums with 4-bit rows stored as w + 8 count beyond its sums with w, 8 sum(q)."""
    for r in prange(H.shape[0]):
        _quantize_row(H, r, hq, t, z, shift)


@njit(cache=True, nogil=True, inline="always")
def _quantize_row(H, r, hq, t, z, shift):
    s, zr = query_range(H, r, LEVELS)  # the exact screen's range rule
    total = 0
    for i in range(H.shape[1]):
        hq[r, i] = zr if s == 0.0 else min(LEVELS, max(0, round(H[r, i] / s) + zr))
        total += hq[r, i]
    t[r], z[r], shift[r] = s, zr, OFFSET * total


@njit(cache=True, nogil=True, inline="always")
def _push_new(v, j, k, n, ids, scores):
    """:func:`heap_push`, unless the heap holds ``j`` already: a label in two clusters is
    offered twice, with the same estimate."""
    for e in range(n):
        if ids[e] == j:
            return n
    return heap_push(v, j, k, n, ids, scores)


@intrinsic
def _estimates8(typingctx, dots, scale, bias, sums, p, tr, zr, sr, est):
    """``est[u] = scale[p + u] tr (dots[u] - sr - zr sums[p + u]) + bias[p + u]`` for the
    ``GROUP`` lanes u at once, in the order the scalar sum would take (int32 integers, then
    float32; the integers are exact in int32 for depths below 2^31 / 127² ≈ 133,000): LLVM
    would not vectorise the loop, not knowing that ``est`` overlaps none of the arrays it
    reads."""
    sig = types.void(dots, scale, bias, sums, p, tr, zr, sr, est)

    def codegen(context, builder, signature, args):
        i32, f32 = ir.IntType(32), ir.FloatType()
        vi, vf = ir.VectorType(i32, GROUP), ir.VectorType(f32, GROUP)
        arrays = [context.make_array(signature.args[j])(context, builder, args[j])
                  for j in (0, 1, 2, 3, 8)]
        at = context.cast(builder, args[4], signature.args[4], types.intp)

        def load(array, ty, offset):
            ptr = builder.gep(array.data, [offset]) if offset is not None else array.data
            return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=4)

        def splat(value, ty, from_ty, to_ty):
            x = context.cast(builder, value, from_ty, to_ty)
            x = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(i32, 0))
            return builder.shuffle_vector(x, ir.Constant(ty, ir.Undefined),
                                          ir.Constant(vi, [0] * GROUP))
        d, s, b, u = (load(arrays[0], vi, None), load(arrays[1], vf, at), load(arrays[2], vf, at),
                      load(arrays[3], vi, at))
        n = builder.sub(builder.sub(d, splat(args[7], vi, signature.args[7], types.int32)),
                        builder.mul(splat(args[6], vi, signature.args[6], types.int32), u))
        x = builder.sitofp(n, vf)
        e = builder.fadd(builder.fmul(builder.fmul(
            s, splat(args[5], vf, signature.args[5], types.float32)), x), b)
        builder.store(e, builder.bitcast(arrays[4].data, vf.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def _estimates(r, g, hq, t, z, shift, q, scale, bias, sums, dots, est, avx2, nibbles):
    """Row ``r``'s estimated scores of the ``GROUP`` rows of group ``g`` of ``q`` (with each
    row's ``scale``, ``bias`` and integer ``sums``) into ``est``; ``dots`` [GROUP] their int32
    scratch; ``avx2``: AVX2's sums, else the loop's (:func:`int8_kind`); ``nibbles``: 4-bit
    rows stored as w + ``OFFSET`` (``shift``), else int8 rows. The kind is an argument, not a
    kernel of its own per kind: numba's cache keys a closure by its cells, and a kernel's cell
    is another on every start, so closures over kernels compiled again in every process."""
    if nibbles:
        if avx2:
            _dot4_avx2(hq[r], q, g, dots)
        else:
            _dot4_loop(hq[r], q, g, dots)
    elif avx2:
        _dot8_avx2(hq[r], q, g, dots)
    else:
        _dot8_loop(hq[r], q, g, dots)
    _estimates8(dots, scale, bias, sums, g * GROUP, t[r], z[r], shift[r] if nibbles else 0,
                est)


@njit(cache=True, nogil=True, inline="always")
def _offer(r, lo, hi, hq, t, z, shift, q, scale, bias, sums, members, m, ids, best, dots, est,
           ahead, avx2):
    """Row ``r``'s estimates of the int8 rows ``lo..hi`` (multiples of ``GROUP``), a group at
    a time (``dots``, ``est`` [GROUP] their scratch), offered as their labels (``members``) to
    its heap (``ids``, ``best``, ``m`` of ``ids.size`` entries) where they beat its least;
    returns the heap's size. A group's estimates are tested against the least before any is
    offered: offered one at a time, each waited on the heap's branches. ``ahead``: groups
    asked for ahead (0: none, the rows being in cache)."""
    keep = ids.size
    least = best[0] if m == keep else -np.inf
    end = hi // GROUP
    for g in range(lo // GROUP, end):
        if ahead and g + ahead < end:
            prefetch(q[g + ahead])
        _estimates(r, g, hq, t, z, shift, q, scale, bias, sums, dots, est, avx2, False)
        p = g * GROUP
        top = -np.inf  # a NaN estimate is never offered
        for u in range(GROUP):
            top = est[u] if est[u] > top else top
        if top > least:
            for u in range(GROUP):
                if est[u] > least:
                    m = _push_new(est[u], members[p + u], keep, m, ids, best)
                    least = best[0] if m == keep else -np.inf
    return m


@njit(cache=True, nogil=True, parallel=True)
def _scan(hq, t, z, shift, q, scale, bias, sums, members, starts, ptr, rows, bounds, pos, best,
          held, avx2):
    """Cluster by cluster, each task its run of them: every label's int8 estimate for each
    row that chose its cluster, offered to the task's heap of ``keep`` for that row (a
    cluster's int8 rows stay in cache while its rows are scored)."""
    n, keep = hq.shape[0], pos.shape[2]
    for task in prange(bounds.size - 1):
        # the task's own heaps: views of the shared arrays would count references to them
        # from both threads at every row of every cluster
        my_pos = np.empty((n, keep), np.int64)
        my_best = np.empty((n, keep), np.float32)
        my_held = np.zeros(n, np.int64)
        dots = np.empty(GROUP, np.int32)
        est = np.empty(GROUP, np.float32)
        for c in range(bounds[task], bounds[task + 1]):
            for j in range(ptr[c], ptr[c + 1]):
                r = rows[j]
                my_held[r] = _offer(r, starts[c], starts[c + 1], hq, t, z, shift, q, scale, bias,
                                    sums, members, my_held[r], my_pos[r], my_best[r], dots, est,
                                    0, avx2)
        pos[task] = my_pos
        best[task] = my_best
        held[task] = my_held


@njit(cache=True, nogil=True, inline="always")
def _centroid_scores(r, lo, hi, hq, t, z, shift, cq, cscale, cbias, csums, dots, est, out, avx2):
    """Row ``r``'s estimated scores of the centroids in groups ``lo..hi`` of the 4-bit copy
    ``cq`` into ``out`` [C] (the groups' padding left out; ``est`` [GROUP] scratch)."""
    for g in range(lo, hi):
        _estimates(r, g, hq, t, z, shift, cq, cscale, cbias, csums, dots, est, avx2, True)
        for u in range(min(GROUP, out.size - g * GROUP)):
            out[g * GROUP + u] = est[u]


@njit(cache=True, nogil=True, parallel=True)
def _choose_clusters(hq, t, z, shift, cq, cscale, cbias, csums, sizes, budget, chosen, n_chosen,
                     avx2):
    """Each row's clusters (:func:`_choose`) by its centroids' 4-bit estimates."""
    for r in prange(hq.shape[0]):
        coarse = np.empty(sizes.size, np.float32)
        dots = np.empty(GROUP, np.int32)
        est = np.empty(GROUP, np.float32)
        _centroid_scores(r, 0, cq.shape[0], hq, t, z, shift, cq, cscale, cbias, csums, dots, est,
                         coarse, avx2)
        n_chosen[r] = _choose(coarse, sizes, budget, chosen[r])


@njit(cache=True, nogil=True, parallel=True)
def _rescore(H, W, b, pos, best, held, ids, scores):
    """Each row's top-k (``ids``: W's rows), in float32, of the ``keep`` best labels its
    tasks' heaps hold."""
    tasks, _, keep = pos.shape
    for r in prange(H.shape[0]):
        top = np.empty(keep, np.int64)
        top_est = np.empty(keep, np.float32)
        m = 0
        for task in range(tasks):
            for j in range(held[task, r]):
                m = _push_new(best[task, r, j], pos[task, r, j], keep, m, top, top_est)
        _rescore_row(H, r, W, b, top, m, ids[r], scores[r])


@njit(cache=True, nogil=True, inline="always")
def _exact_scores(H, r, W, b, top, lo, m, step, out):
    """``out[j]``: row ``r``'s float32 score of label ``top[j]``, for j = lo, lo + step, ...
    below ``m``."""
    d = H.shape[1]
    for j in range(lo, m, step):  # the rows are scattered through the layer: asked for ahead
        prefetch(W[top[j]])
    for j in range(lo, m, step):
        out[j] = b[top[j]] + dot(W[top[j], :d], H[r])


@njit(cache=True, nogil=True, inline="always")
def _best_of(exact, top, m, ids, scores):
    """The top-k into ``ids``, ``scores`` [k] of the labels ``top[:m]`` scored ``exact``."""
    k = ids.size
    n = 0
    for j in range(m):
        n = heap_push(exact[j], top[j], k, n, ids, scores)
    heap_sorted(n, k, ids, scores)


@njit(cache=True, nogil=True, inline="always")
def _rescore_row(H, r, W, b, top, m, ids, scores):
    """Row ``r``'s top-k into ``ids``, ``scores`` [k], in float32, of the labels ``top[:m]``."""
    exact = np.empty(m, np.float32)
    _exact_scores(H, r, W, b, top, 0, m, 1, exact)
    _best_of(exact, top, m, ids, scores)


@njit(cache=True, nogil=True, parallel=True)
def _query_row(H, depth, cq, cscale, cbias, csums, starts, sizes, budget, q, scale, bias, sums,
               members, W, b, keep, T, ids, scores, avx2):
    """The whole query of one row ``H`` [1, d] in one call, into ``ids``, ``scores`` [1,
    k]: the query quantized, its centroids' estimates (``cq``, ...: their 4-bit copy, each
    of ``T`` threads over its block of groups), its clusters (:func:`_choose`), their
    labels' estimates, each thread over every T-th cluster, and the ``keep`` best
    rescored."""
    hq = np.zeros((1, depth), np.uint8)
    scale_q = np.zeros(1, np.float32)
    zero = np.zeros(1, np.int32)
    shift = np.zeros(1, np.int32)
    _quantize_row(H, 0, hq, scale_q, zero, shift)
    coarse = np.empty(sizes.size, np.float32)
    for t in prange(T):
        dots = np.empty(GROUP, np.int32)
        est = np.empty(GROUP, np.float32)
        _centroid_scores(0, t * cq.shape[0] // T, (t + 1) * cq.shape[0] // T, hq, scale_q,
                         zero, shift, cq, cscale, cbias, csums, dots, est, coarse, avx2)
    chosen = np.empty(sizes.size, np.int32)
    m = _choose(coarse, sizes, budget, chosen)
    pos = np.empty((T, keep), np.int64)
    best = np.empty((T, keep), np.float32)
    held = np.zeros(T, np.int64)
    for task in prange(T):
        my_pos = np.empty(keep, np.int64)
        my_best = np.empty(keep, np.float32)
        dots = np.empty(GROUP, np.int32)
        est = np.empty(GROUP, np.float32)
        n = 0
        for j in range(task, m, T):
            c = chosen[j]
            if j + T < m:  # the next cluster's first groups, asked for ahead
                lo, hi = starts[chosen[j + T]], starts[chosen[j + T] + 1]
                for g in range(lo // GROUP, min(hi, lo + _AHEAD * GROUP) // GROUP):
                    prefetch(q[g])
            n = _offer(0, starts[c], starts[c + 1], hq, scale_q, zero, shift, q, scale, bias,
                       sums, members, n, my_pos, my_best, dots, est, _AHEAD, avx2)
        pos[task], best[task], held[task] = my_pos, my_best, n
    top = np.empty(keep, np.int64)
    top_est = np.empty(keep, np.float32)
    n = 0
    for task in range(T):
        for j in range(held[task]):
            n = _push_new(best[task, j], pos[task, j], keep, n, top, top_est)
    # the rows rescored, each thread over its share: a row's misses wait on one core's
    # outstanding loads, so two cores fetch the scattered float32 rows in about half the time
    exact = np.empty(n, np.float32)
    for task in prange(T):
        _exact_scores(H, 0, W, b, top, task, n, T, exact)
    _best_of(exact, top, n, ids[0], scores[0])




def _int8_copy(V, order, sizes, starts):
    """The int8 copy of the rows ``order`` of ``V`` [n, d + 1] (weights, bias last) laid out
    by :func:`_grouped`, with each place's scale, bias and int8 sum (padding: 0, -inf, 0),
    and where each of ``order`` went: ``(q, scale, bias, sums, place)``."""
    d = V.shape[1] - 1
    depth = -(-d // 4) * 4
    W = np.zeros((V.shape[0], depth), np.float32)
    W[:, :d] = V[:, :d]
    rows = quantize_labels(W, np.ascontiguousarray(V[:, d]))
    q, place = _grouped(rows.q, order, sizes, starts)
    return (q, *_placed(place, starts[-1], rows.meta[order, SCALE], rows.meta[order, BIAS],
                        rows.q[order].sum(axis=1, dtype=np.int32)), place)


def _placed(place, entries, scale, bias, sums):
    """Each copied row's ``scale``, ``bias`` and integer ``sums`` at its ``place`` of
    ``entries``, the padding's 0, -inf and 0: ``(scale, bias, sums)``."""
    out = (np.zeros(entries, np.float32), np.full(entries, -np.inf, np.float32),
           np.zeros(entries, np.int32))
    for a, values in zip(out, (scale, bias, sums)):
        a[place] = values
    return out


def _int4_copy(V, order, sizes, starts):
    """The 4-bit copy of the rows ``order`` of ``V`` [n, d + 1] (weights, bias last) laid out
    for :func:`_dot4_avx2`, with each place's scale, bias and sum of its levels (padding: 0,
    -inf, 0), and where each of ``order`` went: ``(q, scale, bias, sums, place)``."""
    d = V.shape[1] - 1
    depth = -(-d // 8) * 8
    W = V[:, :d]
    top = np.abs(W).max(axis=1) if d else np.zeros(V.shape[0], np.float32)
    step = (top / NIBBLE).astype(np.float32)
    levels = np.zeros((V.shape[0], depth), np.int8)
    nonzero = step > 0
    levels[nonzero, :d] = np.clip(np.rint(W[nonzero] / step[nonzero, None]), -NIBBLE, NIBBLE)
    flat, place = _grouped((levels + OFFSET).astype(np.int8), order, sizes, starts, pieces=8)
    # [group, piece of 8 depths, row, 8] -> the low half-bytes the piece's first four depths
    nibbles = flat.reshape(flat.shape[0], depth // 8, GROUP, 2, 4).astype(np.uint8)
    q = aligned_empty((flat.shape[0], GROUP * depth // 2), np.uint8)
    q.reshape(flat.shape[0], depth // 8, GROUP, 4)[...] = (nibbles[:, :, :, 0] |
                                                          (nibbles[:, :, :, 1] << 4))
    return (q, *_placed(place, starts[-1], step[order], V[order, d],
                        levels[order].sum(axis=1, dtype=np.int32)), place)


def _grouped(q, order, sizes, starts, pieces: int = 4):
    """``q`` int8 [n, D]'s rows ``order`` (cluster by cluster, ``sizes`` of them in each) laid
    out for :func:`_dot8_avx2`: each cluster from ``starts`` (its rows padded with zeros to a
    multiple of ``GROUP``), groups of ``GROUP`` rows by pieces of ``pieces`` bytes of depth,
    int8 [P / GROUP, GROUP D]; and the place of each of ``order`` in it."""
    D = q.shape[1]
    cluster_of = np.repeat(np.arange(sizes.size), sizes)
    first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    place = starts[cluster_of] + np.arange(order.size) - first[cluster_of]
    flat = np.zeros((starts[-1], D), np.int8)
    flat[place] = q[order]
    out = aligned_empty((starts[-1] // GROUP, GROUP * D), np.int8)
    by_piece = flat.reshape(-1, GROUP, D // pieces, pieces).transpose(0, 2, 1, 3)
    out.reshape(-1, D // pieces, GROUP, pieces)[...] = by_piece  # [group, piece, row, bytes]
    return out, place


class LabelClusters:
    """An inverted file of a layer's label vectors (see the module docstring).

    ``clusters``: how many (default :func:`cluster_count` of the layer's rows); ``probe``: the
    share of the entries a query scores (default ``DEFAULT_PROBE``; more finds more of the exact
    top-k, slower); ``spill``: each label in a second cluster too (:func:`_nearest`), not one
    (twice the int8 copy, and as much of it scored, for recall that one cluster a label needs
    more to reach, docs/serving.md). Ids are the layer's rows.
    """

    backend = "clusters"

    def __init__(self, clusters: int | None = None, probe: float = DEFAULT_PROBE, seed: int = 0,
                 spill: bool = True):
        if clusters is not None and (isinstance(clusters, bool) or
                                     not isinstance(clusters, (int, np.integer)) or clusters < 1):
            raise ValueError(f"clusters must be a positive integer, got {clusters!r}")
        if isinstance(probe, bool) or not isinstance(probe, numbers.Real) or not 0 < probe <= 1:
            raise ValueError(f"probe must be a share of the labels in (0, 1], got {probe!r}")
        self.clusters, self.probe, self.seed, self.spill = clusters, float(probe), seed, spill
        self.centroids = self.starts = self.sizes = self.members = None
        self.n = self.entries = 0

    def build(self, W, b, threads: int = 1, start: "LabelClusters | None" = None) -> "LabelClusters":
        """Cluster the rows of ``W`` [n, H] with biases ``b`` [n]; from the centroids of
        ``start`` (an index of an earlier state of the same layer) where it has as many."""
        configure_threading()
        W = np.asarray(W, np.float32)
        V = np.ascontiguousarray(np.hstack((W, np.asarray(b, np.float32)[:, None])))
        self.n = V.shape[0]
        n_clusters = min(self.n, self.clusters or cluster_count(self.n))
        C, assign = kmeans(V, n_clusters, self.seed, threads, getattr(start, "centroids", None),
                           nearest=2 if self.spill else 1)
        self.centroids = C
        # entry e: label e // copies in cluster assign.flat[e]; the entries by cluster
        cluster = assign.ravel()
        order = np.argsort(cluster, kind="stable") // assign.shape[1]
        self.sizes = np.bincount(cluster, minlength=n_clusters).astype(np.int64)
        self.entries = cluster.size
        # each cluster's int8 rows in one piece, padded to whole groups (rows that are never
        # offered: scale 0, bias -inf, member -1), their depth to whole 4-byte pieces
        self.starts = np.concatenate(([0], np.cumsum(-(-self.sizes // GROUP) * GROUP)))
        self.q, self.scale, self.label_bias, self.sums, place = _int8_copy(V, order, self.sizes,
                                                                           self.starts)
        self.members = np.full(self.starts[-1], -1, np.int32)
        self.members[place] = order
        # the centroids' own 4-bit copy, in one run of groups: a row's pass over them reads an
        # eighth of their float32 bytes, and a row alone chooses as in a batch
        self.coarse = _int4_copy(C, np.arange(n_clusters), np.array([n_clusters]),
                                 np.array([0, -(-n_clusters // GROUP) * GROUP]))[:4]
        # the biases as given: a view of V would hold its whole copy of the layer
        self.W, self.b = W, np.ascontiguousarray(b, np.float32)
        # a single row's kernel arguments, gathered once: between kernels that leave the caches
        # cold, each attribute a query reads costs it about a microsecond
        self._row_head = (self.depth, *self.coarse, self.starts, self.sizes)
        self._row_tail = (self.q, self.scale, self.label_bias, self.sums, self.members, self.W,
                          self.b)
        return self

    @property
    def weights(self) -> np.ndarray:
        """The centroids' weights, float32 [C, H] (a view of ``centroids``)."""
        return self.centroids[:, :-1]

    @property
    def bias(self) -> np.ndarray:
        """The centroids' biases, float32 [C] (a view of ``centroids``)."""
        return self.centroids[:, -1]

    @property
    def depth(self) -> int:
        """A query's quantized depth: both copies' (the labels' whole 4-byte pieces, the
        centroids' 8-depth ones), zeros beyond the layer's."""
        return max(self.q.shape[1] // GROUP, 2 * self.coarse[0].shape[1] // GROUP)

    @property
    def budget(self) -> int:
        """Entries a query scores (a label in two clusters counts twice)."""
        return max(1, min(self.entries, int(round(self.probe * self.entries))))

    @property
    def nbytes(self) -> int:
        """What the index holds beside the layer: centroids and their 4-bit copy, members,
        cluster bounds and the int8 copy of the layer in cluster order with each row's scale,
        bias and sum."""
        return sum(a.nbytes for a in (self.centroids, self.members, self.starts, self.sizes,
                                      self.q, self.scale, self.label_bias, self.sums,
                                      *self.coarse))

    def chosen(self, H) -> tuple[np.ndarray, np.ndarray]:
        """``(clusters int32 [n, C], counts int64 [n])``: the clusters each row of ``H`` [n,
        hidden] scores, the first ``counts[r]`` of its row."""
        return self._chosen(*self._quantized(H))

    def _quantized(self, H):
        H = np.ascontiguousarray(H, np.float32)
        n = H.shape[0]
        hq = np.zeros((n, self.depth), np.uint8)
        t = np.empty(n, np.float32)
        z = np.empty(n, np.int32)
        shift = np.empty(n, np.int32)
        _quantize_queries(H, hq, t, z, shift)
        return hq, t, z, shift

    def _chosen(self, hq, t, z, shift):
        n, n_clusters = hq.shape[0], self.sizes.size
        chosen = np.empty((n, n_clusters), np.int32)
        counts = np.empty(n, np.int64)
        _choose_clusters(hq, t, z, shift, *self.coarse, self.sizes, self.budget, chosen, counts,
                         int8_kind() == "avx2")
        return chosen, counts

    def query(self, H, k: int, threads: int = 1, keep: int | None = None):
        """Top-k ``(rows int64 [n, k], scores float32 [n, k])`` of hidden vectors ``H`` [n,
        hidden], best first: the labels of each row's clusters (:meth:`chosen`) scored from
        the int8 copy, the ``keep`` best (default ``KEEP_PER_K`` k) again in float32."""
        H = np.ascontiguousarray(H, np.float32)
        n = H.shape[0]
        keep = max(k, min(self.n, keep or math.ceil(KEEP_PER_K * k)))
        avx2 = int8_kind() == "avx2"
        ids = np.empty((n, k), np.int64)
        scores = np.empty((n, k), np.float32)
        if n == 1:  # one kernel: a batch's five cost more to start (docs/serving.md)
            _query_row(H, *self._row_head, self.budget, *self._row_tail, keep, threads, ids,
                       scores, avx2)
            return ids, scores
        hq, t, z, shift = self._quantized(H)
        chosen, counts = self._chosen(hq, t, z, shift)
        ptr, rows, bounds = _by_cluster(chosen, counts, self.starts, threads)
        pos = np.empty((threads, n, keep), np.int64)
        best = np.empty((threads, n, keep), np.float32)
        held = np.empty((threads, n), np.int64)
        _scan(hq, t, z, shift, self.q, self.scale, self.label_bias, self.sums, self.members,
              self.starts, ptr, rows, bounds, pos, best, held, avx2)
        _rescore(H, self.W, self.b, pos, best, held, ids, scores)
        return ids, scores
