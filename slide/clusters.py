"""The engine's own index for ``mode="ann"``: the label vectors ``[w, b]`` cut into k-means
clusters (an inverted file), each label in its nearest cluster and in a second chosen by SOAR's
rule, the layer copied to int8 in cluster order. A query estimates every cluster's centroid
score with ``[h, 1]`` from the centroids' own 4-bit copy, takes the entries of the best
clusters until they hold its budget, estimates their scores from the layer's int8 copy (the
kernels of :mod:`slide.grouped`, eight labels to a register) and rescores the best estimates
in float32.

Where LSH's tables find a label only when a random projection agrees, the centroids are the
layer's own summary: on git_openstack, a fiftieth of the entries taken this way holds 0.95 of
the exact top-10, a twentieth 0.99. A batch's candidates are scored cluster by cluster, the
rows that chose a cluster in tiles that share each load of its bytes (docs/ann-kernels.md).
"""
from __future__ import annotations

import math
import numbers

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from slide.blas import gemm
from slide.amx import (AMX_ROWS, amx_begin, amx_end, amx_group_sums, amx_ready, gather_rows,
                       tile_config)
from slide.grouped import (AMX, AVX2, GROUP, LOOP, PAIR, TILE_GROUPS, TILE_ROWS, VNNI, above8,
                           estimates4, estimates8, int4_groups, int8_groups, int8_kind,
                           pair_above, pair_sums, quantize_queries, quantize_query_row, splat,
                           spread_words, tile4_estimates, tile_estimates)
from slide.metrics import heap_push, heap_sorted
from slide.runtime import as_rows, blas_threads, configure_threading, prefetch, thread_count
from slide.toplanes import new_tops, top_held, top_offer, trailing_zeros
from slide.vecmath import REASSOC, dot

__all__ = ["LabelClusters", "cluster_count", "DEFAULT_PROBE", "CLUSTERS_PER_ROOT"]

#: clusters per square root of the labels (a power of two near it): small clusters rank
#: candidates finely, and their centroids still cost a few percent of the labels
CLUSTERS_PER_ROOT = 8
#: the share of the entries (two a label) scored a query where no held-out rows choose it
#: (:func:`slide.ann.calibrate`): 0.97 of the exact top-10 on git_openstack, 0.87 at the
#: Amazon preset
DEFAULT_PROBE = 0.05
#: candidates rescored in float32 a row, per label asked for: the int8 estimates rank them
#: (at k = 10, 12 found what 15 and 1,000 did on git_openstack and the Amazon preset)
KEEP_PER_K = 1.2
#: SOAR's λ for a label's second cluster (:func:`_nearest`): 0.5 found more of the top-10 than
#: the second-nearest (0) and than λ = 1 at git_openstack and the Amazon preset alike
#: (docs/ann.md)
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
def _nearest(W, b, C, half_norms, orthogonal, tasks, block, out):
    """Each label vector ``v = [w, b]``'s nearest centroid of ``C`` [k, d + 1] into ``out[:, 0]``
    (argmax of v·c - |c|²/2), and where ``out`` has two columns, its second into ``out[:, 1]``:
    the nearest of the others once ``orthogonal`` λ times the square of r·(v - c) / |r| is
    added to the distance, r = v - c₁ the first one's residual (SOAR's rule: a label that its
    first centroid underrates along r is then held where it is not). A block of rows at a time
    on each of ``tasks`` threads (a single-threaded BLAS product a block, its scores still in
    cache for the argmax); the bias enters as a rank-one term, so ``v`` is never copied."""
    n, d = W.shape
    Cw, cb = C[:, :d], C[:, d]
    n_blocks = (n + block - 1) // block
    second = out.shape[1] > 1
    for task in prange(tasks):
        P = np.empty((block, C.shape[0]), np.float32)
        R = np.empty((block if second else 0, d), np.float32)
        rb = np.empty(block if second else 0, np.float32)
        Q = np.empty((block if second else 0, C.shape[0]), np.float32)
        for blk in range(task, n_blocks, tasks):
            lo, hi = blk * block, min(n, (blk + 1) * block)
            gemm(W[lo:hi], False, Cw, True, P[:hi - lo], 0.0)
            for i in range(hi - lo):
                bi = b[lo + i]
                for c in range(C.shape[0]):
                    P[i, c] += bi * cb[c]
                out[lo + i, 0] = _best(P[i], half_norms)
            if not second:
                continue
            for i in range(hi - lo):
                first = out[lo + i, 0]
                R[i] = W[lo + i] - Cw[first]
                rb[i] = b[lo + i] - cb[first]
            gemm(R[:hi - lo], False, Cw, True, Q[:hi - lo], 0.0)  # r·c, the bias's term below
            for i in range(hi - lo):
                first = out[lo + i, 0]
                rv, rr = rb[i] * b[lo + i], rb[i] * rb[i]
                for j in range(d):
                    rv += R[i, j] * W[lo + i, j]
                    rr += R[i, j] * R[i, j]
                weight = np.float32(orthogonal / (2.0 * rr)) if rr > 0 else np.float32(0.0)
                for c in range(C.shape[0]):  # r·(v - c)
                    P[i, c] -= weight * (rv - Q[i, c] - rb[i] * cb[c]) ** 2
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
def _means(W, b, assign, C):
    """Each cluster's mean of the label vectors ``[w, b]`` (rows of ``W``, ``b``) assigned to
    it (``assign`` [n, m]: a label's m clusters) into ``C``; an empty cluster keeps its
    centroid."""
    d = W.shape[1]
    sums = np.zeros(C.shape, np.float64)
    counts = np.zeros(C.shape[0], np.int64)
    for i in range(W.shape[0]):
        for e in range(assign.shape[1]):
            c = assign[i, e]
            counts[c] += 1
            for j in range(d):
                sums[c, j] += W[i, j]
            sums[c, d] += b[i]
    for c in range(C.shape[0]):
        if counts[c]:
            for j in range(C.shape[1]):
                C[c, j] = sums[c, j] / counts[c]


def _assign(W, b, C, threads: int, nearest: int = 1) -> np.ndarray:
    """The nearest centroid of each label vector ``[w, b]``, and with ``nearest=2`` a second
    by SOAR's rule (:func:`_nearest`), int64 [n, nearest]."""
    out = np.zeros((W.shape[0], min(nearest, C.shape[0])), np.int64)
    half = 0.5 * np.einsum("ij,ij->i", C, C)
    block = max(1, _BLOCK_BYTES // (4 * C.shape[0]))
    # BLAS's own threads would spin after each product and take the cores from numba's
    with blas_threads(1):
        _nearest(W, b, C, half, ORTHOGONAL, max(1, min(threads, thread_count())), block, out)
    return out


def kmeans(W, b, n_clusters: int, seed: int = 0, threads: int = 1, start=None,
           nearest: int = 1):
    """Lloyd's k-means of the label vectors ``[w, b]`` (rows of ``W`` float32 [n, d], ``b``
    [n]): ``(centroids [n_clusters, d + 1], assignment int64 [n, nearest])``, each label's
    nearest centroid, and with ``nearest=2`` a second (:func:`_assign`); ``ITERATIONS`` steps
    over a sample of ``SAMPLE_PER_CLUSTER`` labels per cluster from ``n_clusters`` distinct
    ones of it, or ``WARM_ITERATIONS`` from the centroids ``start`` (the last index's, the
    weights having moved since). With two clusters a label, one more step over every label:
    each centroid the mean of the entries its cluster holds, which it stands for when a query
    chooses clusters (docs/ann.md)."""
    W, b = _label_rows(W, b)
    rng = np.random.default_rng(seed)
    n = W.shape[0]
    if n <= SAMPLE_PER_CLUSTER * n_clusters:
        sW, sb = W, b
    else:
        rows = np.sort(rng.choice(n, SAMPLE_PER_CLUSTER * n_clusters, replace=False))
        sW, sb = W[rows], b[rows]
    if start is not None and np.shape(start) == (n_clusters, W.shape[1] + 1):
        C, steps = np.array(start, np.float32), WARM_ITERATIONS
    else:
        first = rng.choice(sW.shape[0], n_clusters, replace=False)
        C = np.ascontiguousarray(np.hstack((sW[first], sb[first, None])), np.float32)
        steps = ITERATIONS
    for _ in range(steps):
        _means(sW, sb, _assign(sW, sb, C, threads), C)
    assign = _assign(W, b, C, threads, nearest)
    if assign.shape[1] > 1:
        _means(W, b, assign, C)
        assign = _assign(W, b, C, threads, nearest)
    return C, assign


def _label_rows(W, b):
    """The layer's rows ``W`` as float32 rows each contiguous (a view where they are already,
    a training model's weights inside its row block too) and ``b`` float32 contiguous: the
    label vectors ``[w, b]`` are read from the two, never copied into one array (a copy of the
    layer each time the clusters follow the weights)."""
    return as_rows(W), np.ascontiguousarray(b, np.float32)


#: bins of a row's centroid scores for choosing its clusters
_BINS = 256
#: lanes of the choice's vector passes (one AVX-512 register of float32 or int32)
_LANES = 16


@intrinsic
def _extremes(typingctx, row):
    """``(least, greatest)`` of the float32 ``row`` (1-D, contiguous), _LANES at a time (a
    scalar loop's min and max wait on each other in turn); NaNs are never taken, an empty row
    gives (inf, -inf)."""
    ret = types.UniTuple(types.float32, 2)

    def codegen(context, builder, signature, args):
        f32, i64, i32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
        vf = ir.VectorType(f32, _LANES)
        a = context.make_array(signature.args[0])(context, builder, args[0])
        n = cgutils.unpack_tuple(builder, a.shape, 1)[0]
        ends = (float("inf"), float("-inf"))
        lanes = [cgutils.alloca_once_value(builder, ir.Constant(vf, [e] * _LANES)) for e in ends]
        ones = [cgutils.alloca_once_value(builder, ir.Constant(f32, e)) for e in ends]

        def take(slot, x, op):  # x where it is beyond what the slot holds
            held = builder.load(slot)
            builder.store(builder.select(builder.fcmp_ordered(op, x, held), x, held), slot)
        whole = builder.sdiv(n, ir.Constant(i64, _LANES))
        with cgutils.for_range(builder, whole) as loop:
            at = builder.gep(a.data, [builder.mul(loop.index, ir.Constant(i64, _LANES))])
            v = builder.load(builder.bitcast(at, vf.as_pointer()), align=4)
            for slot, op in zip(lanes, "<>"):
                take(slot, v, op)
        for slot, one, op in zip(lanes, ones, "<>"):
            v = builder.load(slot)
            for u in range(_LANES):
                take(one, builder.extract_element(v, ir.Constant(i32, u)), op)
        start = builder.mul(whole, ir.Constant(i64, _LANES))
        with cgutils.for_range_slice(builder, start, n, ir.Constant(i64, 1)) as (j, _):
            x = builder.load(builder.gep(a.data, [j]))
            for one, op in zip(ones, "<>"):
                take(one, x, op)
        return context.make_tuple(builder, ret, [builder.load(one) for one in ones])
    return ret(row), codegen


def _bins_where(op: str):
    """The codegen of :func:`_bins_below` (``op`` "<") and :func:`_bins_at` ("==")."""
    def codegen(context, builder, signature, args):
        i64, i32 = ir.IntType(64), ir.IntType(32)
        vi, mask_t = ir.VectorType(i32, _LANES), ir.VectorType(ir.IntType(1), _LANES)
        bins, out = (context.make_array(signature.args[i])(context, builder, args[i])
                     for i in (0, 2))
        last = context.cast(builder, args[1], signature.args[1], types.int32)
        m = cgutils.alloca_once_value(builder, context.cast(builder, args[3], signature.args[3],
                                                            types.int64))
        compress = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [vi, i32.as_pointer(), mask_t]), "llvm.masked.compressstore.v16i32")
        count = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.IntType(_LANES), [ir.IntType(_LANES)]), f"llvm.ctpop.i{_LANES}")
        bound = splat(builder, last, _LANES)
        n = cgutils.unpack_tuple(builder, bins.shape, 1)[0]
        with cgutils.for_range(builder, builder.sdiv(n, ir.Constant(i64, _LANES))) as loop:
            first = builder.mul(loop.index, ir.Constant(i64, _LANES))
            v = builder.load(builder.bitcast(builder.gep(bins.data, [first]), vi.as_pointer()),
                             align=4)
            mask = builder.icmp_signed(op, v, bound)
            c = builder.trunc(first, i32)
            ids = builder.add(splat(builder, c, _LANES), ir.Constant(vi, list(range(_LANES))))
            at = builder.load(m)
            builder.call(compress, [ids, builder.gep(out.data, [at]), mask])
            taken = builder.call(count, [builder.bitcast(mask, ir.IntType(_LANES))])
            builder.store(builder.add(at, builder.zext(taken, i64)), m)
        return builder.load(m)
    return codegen


@intrinsic
def _bins_below(typingctx, bins, last, out, m):
    """Appends to ``out`` from ``out[m]`` the clusters c whose ``bins[c] < last``, in order
    (int32 ``bins``, its length a multiple of _LANES), by vector compress-stores; returns the
    new count."""
    return types.int64(bins, last, out, m), _bins_where("<")


@intrinsic
def _bins_at(typingctx, bins, last, out, m):
    """:func:`_bins_below` of the clusters whose ``bins[c] == last``."""
    return types.int64(bins, last, out, m), _bins_where("==")


@njit(cache=True, nogil=True, inline="always")
def _choose(row, sizes, budget, chosen):
    """One row's best clusters by its centroid scores ``row``, whole, until they hold ``budget``
    entries (``sizes``: each cluster's), into ``chosen``; returns how many. Those of the score
    bins above the one where the budget runs out, then that bin's in cluster order: passes
    over the scores in vector steps, where sorting them took longer than scoring the
    candidates."""
    n_clusters = row.size
    lo, hi = _extremes(row)
    lo, hi = float(lo), float(hi)
    scale = (_BINS - 1) / (hi - lo) if hi > lo else 0.0
    bins = np.empty(-(-n_clusters // _LANES) * _LANES, np.int32)
    bins[n_clusters:] = _BINS  # the padding: in no bin
    for c in range(n_clusters):
        bins[c] = int((hi - row[c]) * scale)
    labels = np.zeros(_BINS, np.int64)  # the entries of the clusters in each bin
    for c in range(n_clusters):
        labels[bins[c]] += sizes[c]
    last, held = 0, labels[0]  # the bin where the budget runs out
    while held < budget and last + 1 < _BINS:
        last += 1
        held += labels[last]
    held -= labels[last]
    m = _bins_below(bins, last, chosen, 0)
    end = _bins_at(bins, last, chosen, m)  # the last bin's, taken in order while they fit
    for j in range(m, end):
        if held >= budget:
            break
        chosen[m] = chosen[j]
        held += sizes[chosen[j]]
        m += 1
    return m


@njit(cache=True, nogil=True)
def _by_cluster(chosen, n_chosen, starts, tasks):
    """The rows that chose each cluster (CSR ``ptr`` [C + 1], ``rows``, each cluster's in
    order), and ``tasks`` + 1 bounds that split the clusters into runs of about equal work
    (labels times rows). The rows are first set as bits of their clusters, then read out
    cluster by cluster: placed one by one, each went to another cluster's run, and the stores
    missed the caches (docs/ann-kernels.md)."""
    n, n_clusters = chosen.shape[0], starts.size - 1
    words = -(-n // 64)
    bits = np.zeros((n_clusters, words), np.int64)
    for r in range(n):
        w, bit = r >> 6, np.int64(1) << (r & 63)
        for j in range(n_chosen[r]):
            bits[chosen[r, j], w] |= bit
    ptr = np.zeros(n_clusters + 1, np.int64)
    work = np.zeros(n_clusters + 1, np.int64)
    rows = np.empty(n_chosen.sum(), np.int32)
    at = 0
    for c in range(n_clusters):
        for w in range(words):
            left = bits[c, w]
            while left != 0:
                rows[at] = 64 * w + trailing_zeros(left)
                left &= left - 1
                at += 1
        ptr[c + 1] = at
        work[c + 1] = work[c] + (at - ptr[c]) * (starts[c + 1] - starts[c])
    bounds = np.searchsorted(work, np.arange(tasks + 1) * (work[-1] / tasks))
    bounds[0], bounds[-1] = 0, n_clusters
    return ptr, rows, bounds


#: pairs of groups a single row's scan asks for ahead
_AHEAD = 1
#: the fewest of a batch's rows in a cluster that AMX's tiles take: fewer fill too little of
#: a tile of AMX_ROWS to beat VNNI's tiles (batches of 8 and 32 at git_openstack)
AMX_FROM = 8


def _kind() -> int:
    """:func:`int8_kind` as the kernels' integer: VNNI, AVX2 or LOOP; AMX where the process
    may use it (:func:`amx_ready`) and the CPU is the host's VNNI one."""
    kind = {"avx512vnni": VNNI, "avx2": AVX2}.get(int8_kind(), LOOP)
    return AMX if kind == VNNI and amx_ready() else kind


@njit(cache=True, nogil=True, inline="always")
def _offer_bits(est, o, bits, p, members, least, scores, ids, keep):
    """The estimates ``est[o + u]`` of the lanes u that ``bits`` name (1 << u) and that beat
    ``least``, offered as their labels ``members[p + u]`` to a row's lanes (``scores``,
    ``ids``: :mod:`slide.toplanes`, ``keep`` entries); returns the least an estimate must
    beat then."""
    while bits:
        u = trailing_zeros(bits)
        bits &= bits - 1
        if est[o + u] > least:
            top_offer(scores, ids, est[o + u], members[p + u])
            least = scores[keep - 1]
    return least


@njit(cache=True, nogil=True, inline="always")
def _offer(r, lo, hi, hq, t, z, q, scale, bias, sums, members, scores, ids, keep, dots, est,
           ahead, avx2):
    """Row ``r``'s estimates of the int8 rows ``lo..hi`` (multiples of ``PAIR``), a pair of
    groups at a time (:func:`pair_sums` into ``dots`` [PAIR]; ``est`` [PAIR] scratch),
    offered to its lanes (``scores``, ``ids``, ``keep`` entries; :func:`_offer_sums`).
    ``ahead``: pairs asked for ahead (0: none, the rows being in cache)."""
    end = hi // PAIR
    for p in range(lo // PAIR, end):
        if ahead and p + ahead < end:
            prefetch(q[p + ahead])
        pair_sums(hq[r], q, p, dots, avx2)
        _offer_sums(dots, 2 * p, 2 * p + 2, t[r], z[r], scale, bias, sums, members, scores,
                    ids, keep, est)


@njit(cache=True, nogil=True, inline="always")
def _offer_all(est, lo, hi, members, scores, ids, keep):
    """:func:`_offer` of the groups ``lo..hi`` from a row's estimates of them ``est`` [GROUP
    (hi - lo)]."""
    least = scores[keep - 1]
    for g in range(lo, hi):
        o = GROUP * (g - lo)
        least = _offer_bits(est, o, above8(est, o, least), g * GROUP, members, least, scores,
                            ids, keep)


@njit(cache=True, nogil=True, inline="always")
def _offer_sums(dots, lo, hi, tr, zr, scale, bias, sums, members, scores, ids, keep, est):
    """:func:`_offer_all` of a row's int32 sums ``dots`` [GROUP (hi - lo)] with the groups
    ``lo..hi``: two groups' estimates compared with the least in registers
    (:func:`pair_above`), made (:func:`estimates8`, into ``est`` [2 GROUP]) and offered only
    where one is above."""
    least = scores[keep - 1]
    for g in range(lo, hi, 2):
        o = GROUP * (g - lo)
        if g + 1 < hi:
            bits = pair_above(dots, o, scale, bias, sums, g * GROUP, tr, zr, 0, least)
            if bits == 0:
                continue
            estimates8(dots, o + GROUP, scale, bias, sums, (g + 1) * GROUP, tr, zr, 0,
                       est[GROUP:])
        else:
            bits = (1 << GROUP) - 1
        estimates8(dots, o, scale, bias, sums, g * GROUP, tr, zr, 0, est)
        least = _offer_bits(est, 0, bits, g * GROUP, members, least, scores, ids, keep)


@njit(cache=True, nogil=True, inline="always")
def _held_out(scores, ids, keep, pos, best):
    """The first ``keep`` lanes of a row into ``pos``, ``best`` [keep]; returns how many hold
    an entry."""
    for a in range(keep):
        pos[a], best[a] = ids[a], scores[a]
    return top_held(ids, keep)


@njit(cache=True, nogil=True, parallel=True)
def _scan(hq, t, z, q, scale, bias, sums, members, starts, widest, ptr, rows, bounds, pos, best,
          held, kind, cfg, amx_from):
    """Cluster by cluster, each task its run of them, the cluster's rows in tiles, each row
    offered to the task's lanes of ``keep`` for it. AMX (``kind``; ``cfg``: its tiles'
    configuration), in a cluster that ``amx_from`` rows or more chose: AMX_ROWS rows' sums
    with every group of the cluster, then each row's estimates compared as they are made
    (:func:`_offer_sums`). Else TILE_ROWS rows' estimates of every group
    (:func:`tile_estimates`; ``widest``: the most groups a cluster has), then each row's
    offered (:func:`_offer_all`)."""
    n, keep = pos.shape[1], pos.shape[2]
    for task in prange(bounds.size - 1):
        my_scores, my_ids = new_tops(n, keep)
        tile = np.empty((TILE_ROWS, GROUP * widest), np.float32)
        A = np.zeros((AMX_ROWS if kind == AMX else 0, q.shape[1] // PAIR), np.uint8)
        dots = np.empty((AMX_ROWS if kind == AMX else 0, GROUP * widest), np.int32)
        est = np.empty(2 * GROUP, np.float32)
        if kind == AMX:
            amx_begin(cfg)
        for c in range(bounds[task], bounds[task + 1]):
            lo, hi = starts[c] // GROUP, starts[c + 1] // GROUP
            amx = kind == AMX and ptr[c + 1] - ptr[c] >= amx_from
            block = AMX_ROWS if amx else TILE_ROWS
            for j in range(ptr[c], ptr[c + 1], block):
                nr = min(block, ptr[c + 1] - j)
                if amx:
                    gather_rows(hq, rows, j, nr, A)
                    amx_group_sums(A, q, lo, hi, dots)
                else:
                    for g in range(lo, hi, TILE_GROUPS):
                        tile_estimates(kind, hq, rows, j, nr, q, g,
                                       min(TILE_GROUPS, hi - g), t, z, scale, bias, sums, tile,
                                       GROUP * (g - lo))
                for a in range(nr):
                    r = rows[j + a]
                    if amx:
                        _offer_sums(dots[a], lo, hi, t[r], z[r], scale, bias, sums, members,
                                    my_scores[r], my_ids[r], keep, est)
                    else:
                        _offer_all(tile[a], lo, hi, members, my_scores[r], my_ids[r], keep)
        if kind == AMX:
            amx_end()
        for r in range(n):
            held[task, r] = _held_out(my_scores[r], my_ids[r], keep, pos[task, r], best[task, r])


@njit(cache=True, nogil=True, inline="always")
def _centroid_scores(r, lo, hi, hq, t, z, shift, cq, cscale, cbias, csums, dots, est, out, avx2):
    """Row ``r``'s estimated scores of the centroids in groups ``lo..hi`` of the 4-bit copy
    ``cq`` into ``out`` [C] (the groups' padding left out; ``est`` [GROUP] scratch)."""
    for g in range(lo, hi):
        estimates4(r, g, hq, t, z, shift, cq, cscale, cbias, csums, dots, est, avx2)
        for u in range(min(GROUP, out.size - g * GROUP)):
            out[g * GROUP + u] = est[u]


@njit(cache=True, nogil=True, parallel=True)
def _choose_clusters(hq, spread, t, z, shift, cq, cscale, cbias, csums, sizes, budget, chosen,
                     n_chosen, kind):
    """Each row's clusters (:func:`_choose`) by its centroids' 4-bit estimates, scored in
    tiles of TILE_ROWS rows (:func:`tile4_estimates`)."""
    n, groups = hq.shape[0], cq.shape[0]
    every = np.arange(n, dtype=np.int32)
    for i in prange(-(-n // TILE_ROWS)):
        j = i * TILE_ROWS
        nr = min(TILE_ROWS, n - j)
        coarse = np.empty((TILE_ROWS, GROUP * groups), np.float32)
        for g in range(0, groups, TILE_GROUPS):
            tile4_estimates(kind, hq, spread, every, j, nr, cq, g, min(TILE_GROUPS, groups - g),
                            t, z, shift, cscale, cbias, csums, coarse, GROUP * g)
        for a in range(nr):
            n_chosen[j + a] = _choose(coarse[a, :sizes.size], sizes, budget, chosen[j + a])


@njit(cache=True, nogil=True, parallel=True)
def _rescore(H, W, b, pos, best, held, ids, scores):
    """Each row's top-k (``ids``: W's rows), in float32, of the ``keep`` best labels its
    tasks' lanes hold."""
    tasks, _, keep = pos.shape
    for r in prange(H.shape[0]):
        _, top = _merged(pos[:, r], best[:, r], held[:, r], keep)
        _rescore_row(H, r, W, b, top, top_held(top, keep), ids[r], scores[r])


@njit(cache=True, nogil=True, parallel=True)
def _estimated(pos, best, held, ids, scores):
    """Each row's top-k (``ids`` [n, k]) by the int8 estimates its tasks' lanes hold, best
    first, with those estimates in ``scores``; -1 and -inf past what the lanes hold."""
    k = ids.shape[1]
    for r in prange(ids.shape[0]):
        est, top = _merged(pos[:, r], best[:, r], held[:, r], k)
        m = top_held(top, k)
        for j in range(k):
            ids[r, j] = top[j] if j < m else -1
            scores[r, j] = est[j] if j < m else -np.inf


@njit(cache=True, nogil=True, inline="always")
def _merged(pos, best, held, keep):
    """The lanes (:mod:`slide.toplanes`) of the best ``keep`` of one row's tasks' entries
    ``pos``, ``best`` [tasks, keep] (``held`` [tasks] of each)."""
    top_est, top = new_tops(1, keep)
    for task in range(pos.shape[0]):
        for j in range(held[task]):
            top_offer(top_est[0], top[0], best[task, j], pos[task, j])
    return top_est[0], top[0]


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
    quantize_query_row(H, 0, hq, scale_q, zero, shift)
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
        my_scores, my_ids = new_tops(1, keep)
        dots = np.empty(PAIR, np.int32)
        est = np.empty(PAIR, np.float32)
        for j in range(task, m, T):
            c = chosen[j]
            if j + T < m:  # the next cluster's first groups, asked for ahead
                lo, hi = starts[chosen[j + T]], starts[chosen[j + T] + 1]
                for p in range(lo // PAIR, min(hi, lo + _AHEAD * PAIR) // PAIR):
                    prefetch(q[p])
            _offer(0, starts[c], starts[c + 1], hq, scale_q, zero, q, scale, bias, sums,
                   members, my_scores[0], my_ids[0], keep, dots, est, _AHEAD, avx2)
        held[task] = _held_out(my_scores[0], my_ids[0], keep, pos[task], best[task])
    _, top = _merged(pos, best, held, keep)
    n = top_held(top, keep)
    # the rows rescored, each thread over its share: a row's misses wait on one core's
    # outstanding loads, so two cores fetch the scattered float32 rows in about half the time
    exact = np.empty(n, np.float32)
    for task in prange(T):
        _exact_scores(H, 0, W, b, top, task, n, T, exact)
    _best_of(exact, top, n, ids[0], scores[0])


class LabelClusters:
    """An inverted file of a layer's label vectors (see the module docstring).

    ``clusters``: how many (default :func:`cluster_count` of the layer's rows); ``probe``: the
    share of the entries a query scores (default ``DEFAULT_PROBE``; more finds more of the exact
    top-k, slower); ``spill``: each label in a second cluster too (:func:`_nearest`), not one
    (twice the int8 copy, and as much of it scored, for recall that one cluster a label needs
    more to reach, docs/ann.md). Ids are the layer's rows.
    """

    backend = "clusters"
    #: what trades recall for time (:func:`slide.ann.calibrate` chooses it)
    knob = "probe"

    def __init__(self, clusters: int | None = None, probe: float = DEFAULT_PROBE, seed: int = 0,
                 spill: bool = True):
        if clusters is not None and (isinstance(clusters, bool) or
                                     not isinstance(clusters, (int, np.integer)) or clusters < 1):
            raise ValueError(f"clusters must be a positive integer, got {clusters!r}")
        if isinstance(probe, bool) or not isinstance(probe, numbers.Real) or not 0 < probe <= 1:
            raise ValueError(f"probe must be a share of the labels in (0, 1], got {probe!r}")
        self.clusters, self.probe, self.seed, self.spill = clusters, float(probe), seed, spill
        self.calibration = None  # what slide.ann.calibrate chose and found, where it ran
        self.centroids = self.starts = self.sizes = self.members = self.assign = None
        self.n = self.entries = 0

    def build(self, W, b, threads: int = 1, start: "LabelClusters | None" = None) -> "LabelClusters":
        """Cluster the rows of ``W`` [n, H] with biases ``b`` [n]; from the centroids of
        ``start`` (an index of an earlier state of the same layer) where it has as many."""
        configure_threading()
        W, b = _label_rows(W, b)
        n_clusters = min(W.shape[0], self.clusters or cluster_count(W.shape[0]))
        C, assign = kmeans(W, b, n_clusters, self.seed, threads,
                           getattr(start, "centroids", None), nearest=2 if self.spill else 1)
        self._lay_out(W, b, C, assign)
        return self

    def refresh(self, W, b) -> "LabelClusters":
        """The same clusters over the layer's current rows ``W`` / ``b`` (each label where it
        was, each centroid the mean of its members): no k-means step, so a layer that training
        moves a little between two calls is re-indexed for the cost of copying it once."""
        if self.assign is None:
            raise ValueError("refresh re-indexes a built index: build it first")
        configure_threading()
        W, b = _label_rows(W, b)
        if W.shape[0] != self.n:
            raise ValueError(f"the index holds {self.n} labels; refresh got {W.shape[0]}")
        C = self.centroids.copy()
        _means(W, b, self.assign, C)
        self._lay_out(W, b, C, self.assign)
        return self

    def assigned(self, W, b, centroids, assign) -> "LabelClusters":
        """The rows of ``W`` / ``b`` indexed in given clusters: ``centroids`` [C, H + 1] and
        each label's ``assign`` [n, 1 or 2] (an index's own, as a checkpoint kept them), each
        centroid then the mean of its members as :meth:`refresh` makes it."""
        self.centroids = np.asarray(centroids, np.float32)
        self.assign, self.n = np.asarray(assign, np.int32), len(assign)
        return self.refresh(W, b)

    def _lay_out(self, W, b, C, assign):
        """The index of label vectors ``[w, b]`` in clusters ``C`` by ``assign`` [n, 1 or 2]."""
        self.n, n_clusters = W.shape[0], C.shape[0]
        # each label's clusters, which a refresh keeps
        self.centroids, self.assign = C, assign.astype(np.int32, copy=False)
        # entry e: label e // copies in cluster assign.flat[e]; the entries by cluster
        cluster = assign.ravel()
        order = np.argsort(cluster, kind="stable") // assign.shape[1]
        self.sizes = np.bincount(cluster, minlength=n_clusters).astype(np.int64)
        self.entries = cluster.size
        # each cluster's int8 rows in one piece, padded to whole pairs of groups (rows that are
        # never offered: scale 0, bias -inf, member -1), their depth to whole 4-byte pieces
        self.starts = np.concatenate(([0], np.cumsum(-(-self.sizes // PAIR) * PAIR)))
        self.q, self.scale, self.label_bias, self.sums, place = int8_groups(W, b, order,
                                                                           self.sizes, self.starts)
        self.members = np.full(self.starts[-1], -1, np.int32)
        self.members[place] = order
        self._widest = int(np.diff(self.starts).max()) // GROUP  # a batch tile's scratch
        self._tiles = tile_config(self.q.shape[1] // PAIR)  # AMX's, at the copy's depth
        # the centroids' own 4-bit copy, in one run of groups: a row's pass over them reads an
        # eighth of their float32 bytes, and a row alone chooses as in a batch
        self.coarse = int4_groups(C, np.arange(n_clusters), np.array([n_clusters]),
                                 np.array([0, -(-n_clusters // GROUP) * GROUP]))[:4]
        self.W, self.b = W, b
        # a single row's kernel arguments, gathered once: between kernels that leave the caches
        # cold, each attribute a query reads costs it about a microsecond
        self._row_head = (self.depth, *self.coarse, self.starts, self.sizes)
        self._row_tail = (self.q, self.scale, self.label_bias, self.sums, self.members, self.W,
                          self.b)

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
        return max(self.q.shape[1] // PAIR, 2 * self.coarse[0].shape[1] // GROUP)

    @property
    def budget(self) -> int:
        """Entries a query scores (a label in two clusters counts twice)."""
        return max(1, min(self.entries, int(round(self.probe * self.entries))))

    @property
    def nbytes(self) -> int:
        """What the index holds beside the layer: centroids and their 4-bit copy, each label's
        clusters, members, cluster bounds and the int8 copy of the layer in cluster order with
        each row's scale, bias and sum."""
        return sum(a.nbytes for a in (self.centroids, self.assign, self.members, self.starts,
                                      self.sizes, self.q, self.scale, self.label_bias, self.sums,
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
        quantize_queries(H, hq, t, z, shift)
        return hq, t, z, shift

    def _chosen(self, hq, t, z, shift):
        n, n_clusters = hq.shape[0], self.sizes.size
        chosen = np.empty((n, n_clusters), np.int32)
        counts = np.empty(n, np.int64)
        kind = _kind()
        spread = spread_words(hq, 2 * self.coarse[0].shape[1] // GROUP) \
            if kind >= VNNI else np.empty((n, 0, 4 * GROUP), np.int32)
        _choose_clusters(hq, spread, t, z, shift, *self.coarse, self.sizes, self.budget, chosen,
                         counts, kind)
        return chosen, counts

    def query(self, H, k: int, threads: int = 1, keep: int | None = None,
              rescore: bool = True):
        """Top-k ``(rows int64 [n, k], scores float32 [n, k])`` of hidden vectors ``H`` [n,
        hidden], best first: the labels of each row's clusters (:meth:`chosen`) scored from
        the int8 copy, the ``keep`` best (default ``KEEP_PER_K`` k) again in float32. With
        ``rescore=False`` (a batch of rows), the top-k by the int8 estimates, which are the
        scores: a training step that computes its candidates' scores itself need not fetch
        their rows first (docs/active-set.md)."""
        H = np.ascontiguousarray(H, np.float32)
        n = H.shape[0]
        keep = k if not rescore else max(k, min(self.n, keep or math.ceil(KEEP_PER_K * k)))
        avx2 = int8_kind() is not None
        ids = np.empty((n, k), np.int64)
        scores = np.empty((n, k), np.float32)
        # a row alone: one kernel, as a batch's five cost more to start (docs/ann-kernels.md)
        if n == 1 and rescore:
            _query_row(H, *self._row_head, self.budget, *self._row_tail, keep, threads, ids,
                       scores, avx2)
            return ids, scores
        hq, t, z, shift = self._quantized(H)
        chosen, counts = self._chosen(hq, t, z, shift)
        ptr, rows, bounds = _by_cluster(chosen, counts, self.starts, threads)
        pos = np.empty((threads, n, keep), np.int64)
        best = np.empty((threads, n, keep), np.float32)
        held = np.empty((threads, n), np.int64)
        kind = _kind()
        _scan(hq, t, z, self.q, self.scale, self.label_bias, self.sums, self.members,
              self.starts, self._widest, ptr, rows, bounds, pos, best, held, kind, self._tiles,
              AMX_FROM)
        if rescore:
            _rescore(H, self.W, self.b, pos, best, held, ids, scores)
        else:
            _estimated(pos, best, held, ids, scores)
        return ids, scores
