"""The engine's own index for ``mode="ann"``: the label vectors ``[w, b]`` cut into k-means
clusters (an inverted file), the layer copied to int8 in cluster order. A query scores every
cluster's centroid with ``[h, 1]``, takes the labels of the best clusters until they hold its
budget of candidates, estimates their scores from the int8 copy (the CPU's int8 dot product:
AVX-512 VNNI, else AVX2, else float32) and rescores the best estimates in float32.

Where LSH's tables find a label only when a random projection agrees, the centroids are the
layer's own summary: on git_openstack, a tenth of the labels taken this way holds 0.957 of the
exact top-10. A batch's centroid scores are one product, and its candidates are scored cluster
by cluster while each cluster's rows are in cache, so batches gain as much as single rows
(docs/serving.md).
"""
from __future__ import annotations

import math
import numbers
from functools import lru_cache

import numpy as np
import numba
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from slide.blas import gemm
from slide.metrics import heap_push, heap_sorted
from slide.runtime import blas_threads, configure_threading, prefetch
from slide.screen import (BIAS, SCALE, dot_int8, has_int8_dot, quantize_labels, query_range,
                          target_has)
from slide.vecmath import REASSOC, dot

__all__ = ["LabelClusters", "cluster_count", "DEFAULT_PROBE", "CLUSTERS_PER_ROOT"]

#: clusters per square root of the labels (a power of two near it): small clusters rank
#: candidates finely, and their centroids still cost a few percent of the labels
CLUSTERS_PER_ROOT = 8
#: the share of the labels scored a query by default: 0.95 of the exact top-10 on git_openstack
DEFAULT_PROBE = 0.1
#: candidates rescored in float32 a row, per label asked for: the int8 estimates rank them
#: (on git_openstack, k + 2 found what 3k did)
KEEP_PER_K = 1.5
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
def _nearest(V, C, half_norms, tasks, block, out):
    """The nearest centroid of each row of ``V`` into ``out``: argmax of v·c - |c|²/2, a block of
    rows at a time on each of ``tasks`` threads (one single-threaded BLAS product a block, its
    scores still in cache for the argmax)."""
    n = V.shape[0]
    n_blocks = (n + block - 1) // block
    for task in prange(tasks):
        P = np.empty((block, C.shape[0]), np.float32)
        for blk in range(task, n_blocks, tasks):
            lo, hi = blk * block, min(n, (blk + 1) * block)
            gemm(V[lo:hi], False, C, True, P[:hi - lo], 0.0)
            for i in range(hi - lo):
                # the row's max first (a reduction that vectorises, where a running argmax
                # does not), then where it is
                best = -np.inf
                for c in range(C.shape[0]):
                    best = max(best, P[i, c] - half_norms[c])
                for c in range(C.shape[0]):
                    if P[i, c] - half_norms[c] == best:
                        out[lo + i] = c
                        break


@njit(cache=True, nogil=True)
def _means(V, assign, C):
    """Each cluster's mean of the rows of ``V`` assigned to it into ``C``; an empty cluster
    keeps its centroid."""
    sums = np.zeros(C.shape, np.float64)
    counts = np.zeros(C.shape[0], np.int64)
    for i in range(V.shape[0]):
        c = assign[i]
        counts[c] += 1
        for j in range(V.shape[1]):
            sums[c, j] += V[i, j]
    for c in range(C.shape[0]):
        if counts[c]:
            for j in range(C.shape[1]):
                C[c, j] = sums[c, j] / counts[c]


def _assign(V, C, threads: int) -> np.ndarray:
    """The nearest centroid of each row of ``V``, int64 [n]."""
    out = np.zeros(V.shape[0], np.int64)
    half = 0.5 * np.einsum("ij,ij->i", C, C)
    block = max(1, _BLOCK_BYTES // (4 * C.shape[0]))
    # BLAS's own threads would spin after each product and take the cores from numba's
    with blas_threads(1):
        _nearest(V, C, half, max(1, min(threads, numba.get_num_threads())), block, out)
    return out


def kmeans(V, n_clusters: int, seed: int = 0, threads: int = 1, start=None):
    """Lloyd's k-means of the rows of ``V`` float32 [n, d]: ``(centroids [n_clusters, d],
    assignment int64 [n])``, ``ITERATIONS`` steps over a sample of ``SAMPLE_PER_CLUSTER`` rows
    per cluster from ``n_clusters`` distinct rows of it, or ``WARM_ITERATIONS`` from the
    centroids ``start`` (the last index's, the weights having moved since)."""
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
    return C, _assign(V, C, threads)


@njit(cache=True, nogil=True, parallel=True)
def _coarse(H, C, c, T, out):
    """``out = H @ C.T + c``: a single-threaded BLAS product on each of ``T`` threads, over its
    block of clusters."""
    for t in prange(T):
        lo, hi = t * C.shape[0] // T, (t + 1) * C.shape[0] // T
        gemm(H, False, C[lo:hi], True, out[:, lo:hi], 0.0)
        for r in range(H.shape[0]):
            for j in range(lo, hi):
                out[r, j] += c[j]


#: bins of a row's centroid scores for choosing its clusters
_BINS = 256


@njit(cache=True, nogil=True, inline="always")
def _choose(row, starts, budget, chosen):
    """One row's best clusters by its centroid scores ``row``, whole, until they hold ``budget``
    labels, into ``chosen``; returns how many. Those of the score bins above the one where
    the budget runs out, then that bin's in cluster order: two passes over the scores, where
    sorting them took longer than scoring the candidates."""
    n_clusters = row.size
    lo, hi = np.inf, -np.inf
    for c in range(n_clusters):
        lo, hi = min(lo, row[c]), max(hi, row[c])
    scale = (_BINS - 1) / (hi - lo) if hi > lo else 0.0
    bins = np.empty(n_clusters, np.int64)
    labels = np.zeros(_BINS, np.int64)  # the labels of the clusters in each bin
    for c in range(n_clusters):
        bins[c] = int((hi - row[c]) * scale)
        labels[bins[c]] += starts[c + 1] - starts[c]
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
                held += starts[c + 1] - starts[c]
    return m


@njit(cache=True, nogil=True, parallel=True)
def _gather(coarse, starts, budget, chosen, n_chosen):
    """Each row's clusters (:func:`_choose`) by its ``coarse`` scores."""
    for r in prange(coarse.shape[0]):
        n_chosen[r] = _choose(coarse[r], starts, budget, chosen[r])


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


#: the int8 rows' depth is padded to a multiple of this: one VNNI instruction's bytes
_LANE_BYTES = 64
#: independent accumulators in a row's dot product
_CHAINS = 4


@lru_cache(maxsize=None)
def int8_kind() -> str | None:
    """The int8 dot product the target CPU has (:func:`slide.screen.target_has`): ``"vnni"``
    (AVX-512 VNNI's ``vpdpbusd``, 64 multiply-adds an instruction), ``"avx2"``
    (``vpmaddubsw`` then ``vpmaddwd``, 32 in two), or None."""
    return "vnni" if has_int8_dot() else "avx2" if target_has("avx2") else None


#: the query's uint8 levels for each: AVX2's pairwise sums are int16 and saturate above
#: 2 · 127 · 127, so its query takes 7 bits
LEVELS = {"vnni": 255, "avx2": 127}


@intrinsic
def _dot_u8s8(typingctx, hq, wq):
    """``sum_i hq[i] * wq[i]`` in int32 for a uint8 row ``hq`` (at most 127 a byte where the
    kind is AVX2) and an int8 row ``wq``, both contiguous, of the same length, a multiple of
    64, by the target's int8 dot product (:func:`int8_kind`; only such targets compile it)."""
    kind = int8_kind()
    if kind is None:
        return None
    sig = types.int32(hq, wq)
    width = 16 if kind == "vnni" else 8  # int32 lanes of a register
    step_bytes = 4 * width

    def codegen(context, builder, signature, args):
        h = context.make_array(signature.args[0])(context, builder, args[0])
        w = context.make_array(signature.args[1])(context, builder, args[1])
        i64, i32, i16, i8 = (ir.IntType(b) for b in (64, 32, 16, 8))
        acc_t = ir.VectorType(i32, width)
        total = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i32, [acc_t]), f"llvm.vector.reduce.add.v{width}i32")
        if kind == "vnni":
            dpbusd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(acc_t, [acc_t] * 3), "llvm.x86.avx512.vpdpbusd.512")
            load_t = acc_t
        else:
            load_t = ir.VectorType(i8, 32)
            pairs_t = ir.VectorType(i16, 16)
            maddubs = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(pairs_t, [load_t, load_t]), "llvm.x86.avx2.pmadd.ub.sw")
            maddwd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(acc_t, [pairs_t, pairs_t]), "llvm.x86.avx2.pmadd.wd")
            ones = ir.Constant(pairs_t, [1] * 16)
        n = cgutils.unpack_tuple(builder, h.shape, 1)[0]
        chunks = builder.sdiv(n, ir.Constant(i64, step_bytes))
        # _CHAINS accumulators: one would wait out the instruction's latency at every chunk
        accs = [cgutils.alloca_once_value(builder, ir.Constant(acc_t, None))
                for _ in range(_CHAINS)]
        hp, wp = builder.ptrtoint(h.data, i64), builder.ptrtoint(w.data, i64)

        def step(chunk, acc):
            off = builder.mul(chunk, ir.Constant(i64, step_bytes))
            hv = builder.load(builder.inttoptr(builder.add(hp, off), load_t.as_pointer()), align=1)
            wv = builder.load(builder.inttoptr(builder.add(wp, off), load_t.as_pointer()), align=1)
            if kind == "vnni":
                out = builder.call(dpbusd, [builder.load(acc), hv, wv])
            else:
                out = builder.add(builder.load(acc),
                                  builder.call(maddwd, [builder.call(maddubs, [hv, wv]), ones]))
            builder.store(out, acc)

        rounds = builder.sdiv(chunks, ir.Constant(i64, _CHAINS))
        with cgutils.for_range(builder, rounds) as loop:
            for c in range(_CHAINS):
                step(builder.add(builder.mul(loop.index, ir.Constant(i64, _CHAINS)),
                                 ir.Constant(i64, c)), accs[c])
        done = builder.mul(rounds, ir.Constant(i64, _CHAINS))
        with cgutils.for_range(builder, builder.sub(chunks, done)) as loop:
            step(builder.add(done, loop.index), accs[0])
        acc = builder.load(accs[0])
        for c in range(1, _CHAINS):
            acc = builder.add(acc, builder.load(accs[c]))
        return builder.call(total, [acc])

    return sig, codegen


@intrinsic
def _dot4_u8s8(typingctx, hq, wq, i):
    """``(hq · wq[i], ..., hq · wq[i + 3])`` in int32 for a uint8 row ``hq`` (at most 127 a
    byte) and the int8 rows i..i+3 of ``wq`` [n, len(hq)] (C-contiguous, len(hq) a multiple of
    32), on AVX2 (only such targets compile it): the query's bytes loaded once for the four
    rows, and the four sums reduced together by ``vphaddd``."""
    if int8_kind() != "avx2":
        return None
    sig = types.UniTuple(types.int32, 4)(hq, wq, i)

    def codegen(context, builder, signature, args):
        h = context.make_array(signature.args[0])(context, builder, args[0])
        w = context.make_array(signature.args[1])(context, builder, args[1])
        i64, i32, i16, i8 = (ir.IntType(b) for b in (64, 32, 16, 8))
        acc_t, load_t, pairs_t = ir.VectorType(i32, 8), ir.VectorType(i8, 32), ir.VectorType(i16, 16)

        def x86(name, ret, *operands):
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, operands),
                                                  f"llvm.x86.avx2.{name}")
        maddubs = x86("pmadd.ub.sw", pairs_t, load_t, load_t)
        maddwd = x86("pmadd.wd", acc_t, pairs_t, pairs_t)
        hadd = x86("phadd.d", acc_t, acc_t, acc_t)
        ones = ir.Constant(pairs_t, [1] * 16)
        n = cgutils.unpack_tuple(builder, h.shape, 1)[0]
        stride = cgutils.unpack_tuple(builder, w.strides, 2)[0]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(acc_t, None)) for _ in range(4)]
        hp = builder.ptrtoint(h.data, i64)
        wp = builder.add(builder.ptrtoint(w.data, i64),
                         builder.mul(context.cast(builder, args[2], signature.args[2], types.int64),
                                     stride))
        with cgutils.for_range(builder, builder.sdiv(n, ir.Constant(i64, 32))) as loop:
            off = builder.mul(loop.index, ir.Constant(i64, 32))
            hv = builder.load(builder.inttoptr(builder.add(hp, off), load_t.as_pointer()), align=1)
            for u, acc in enumerate(accs):
                at = builder.add(builder.add(wp, builder.mul(ir.Constant(i64, u), stride)), off)
                wv = builder.load(builder.inttoptr(at, load_t.as_pointer()), align=1)
                pairs = builder.call(maddubs, [hv, wv])
                builder.store(builder.add(builder.load(acc), builder.call(maddwd, [pairs, ones])),
                              acc)
        a = [builder.load(acc) for acc in accs]
        # each 128-bit half: [s0 s1 s2 s3] of its own bytes; the halves added
        both = builder.call(hadd, [builder.call(hadd, [a[0], a[1]]), builder.call(hadd, [a[2], a[3]])])
        half = ir.VectorType(i32, 4)
        total = builder.add(builder.shuffle_vector(both, both, ir.Constant(half, [0, 1, 2, 3])),
                            builder.shuffle_vector(both, both, ir.Constant(half, [4, 5, 6, 7])))
        return context.make_tuple(builder, signature.return_type,
                                  [builder.extract_element(total, ir.Constant(i32, u))
                                   for u in range(4)])

    return sig, codegen


@njit(cache=True, nogil=True, parallel=True)
def _quantize_queries(H, levels, hq, t, z):
    """uint8 rows of ``H`` [n, d] into ``hq`` [n, >= d] (zero beyond d), each over its own
    range [min(0, min h), max(0, max h)] in ``levels`` steps: h ~ t (q - z)."""
    for r in prange(H.shape[0]):
        _quantize_row(H, r, levels, hq, t, z)


@njit(cache=True, nogil=True, inline="always")
def _quantize_row(H, r, levels, hq, t, z):
    s, zr = query_range(H, r, levels)  # the exact screen's range rule
    for i in range(H.shape[1]):
        hq[r, i] = zr if s == 0.0 else min(levels, max(0, round(H[r, i] / s) + zr))
    t[r], z[r] = s, zr


@njit(cache=True, nogil=True, inline="always")
def _estimate_int8(r, i, H, hq, t, z, q, meta, sums):
    return meta[i, SCALE] * t[r] * np.float32(_dot_u8s8(hq[r], q[i]) - z[r] * sums[i]) + meta[i, BIAS]


@njit(cache=True, nogil=True, inline="always")
def _estimate_float(r, i, H, hq, t, z, q, meta, sums):
    # where the CPU has no int8 dot product: the float32 query against the int8 row
    return meta[i, SCALE] * dot_int8(q[i, :H.shape[1]], H[r]) + meta[i, BIAS]


@njit(cache=True, nogil=True, inline="always")
def _estimates4_avx2(r, i, H, hq, t, z, q, meta, sums, out):
    d = _dot4_u8s8(hq[r], q, i)
    for u in range(4):
        out[u] = (meta[i + u, SCALE] * t[r] * np.float32(d[u] - z[r] * sums[i + u]) +
                  meta[i + u, BIAS])


def _four_by_one(estimate):
    @njit(cache=True, nogil=True, inline="always")
    def estimates4(r, i, H, hq, t, z, q, meta, sums, out):
        for u in range(4):
            out[u] = estimate(r, i + u, H, hq, t, z, q, meta, sums)
    return estimates4


def _offer_kernel(estimate, estimates4):
    @njit(cache=True, nogil=True, inline="always")
    def offer(r, lo, hi, H, hq, t, z, q, meta, sums, m, pos, best, est):
        """Row ``r``'s estimates of labels ``lo..hi``, four at a time (``est`` [4] their
        scratch), offered to its heap (``pos``, ``best``, ``m`` of ``pos.size`` entries) where
        they beat its least; returns the heap's size. Offered one at a time, each estimate
        waited on the heap's branches: a batch's scan took 1.6 times as long (docs/serving.md)."""
        keep = pos.size
        least = best[0] if m == keep else -np.inf
        i = lo
        while i < hi:
            n = min(4, hi - i)
            if n == 4:
                estimates4(r, i, H, hq, t, z, q, meta, sums, est)
            else:
                for u in range(n):
                    est[u] = estimate(r, i + u, H, hq, t, z, q, meta, sums)
            top = -np.inf  # a NaN estimate is never offered
            for u in range(n):
                if est[u] > top:
                    top = est[u]
            if top > least:
                for u in range(n):
                    if est[u] > least:
                        m = heap_push(est[u], i + u, keep, m, pos, best)
                        least = best[0] if m == keep else -np.inf
            i += n
        return m
    return offer


def _scan_kernel(offer):
    @njit(cache=True, nogil=True, parallel=True)
    def scan(H, hq, t, z, q, meta, sums, starts, ptr, rows, bounds, pos, best, held):
        """Cluster by cluster, each task its run of them: every label's int8 estimate for
        each row that chose its cluster, offered to the task's heap of ``keep`` for that row
        (a cluster's int8 rows stay in cache while its rows are scored)."""
        n, keep = H.shape[0], pos.shape[2]
        for task in prange(bounds.size - 1):
            # the task's own heaps: views of the shared arrays would count references to
            # them from both threads at every row of every cluster
            my_pos = np.empty((n, keep), np.int64)
            my_best = np.empty((n, keep), np.float32)
            my_held = np.zeros(n, np.int64)
            est = np.empty(4, np.float32)
            for c in range(bounds[task], bounds[task + 1]):
                for j in range(ptr[c], ptr[c + 1]):
                    r = rows[j]
                    my_held[r] = offer(r, starts[c], starts[c + 1], H, hq, t, z, q, meta, sums,
                                       my_held[r], my_pos[r], my_best[r], est)
            pos[task] = my_pos
            best[task] = my_best
            held[task] = my_held
    return scan


#: each int8 kind's (and the float fallback's) way of offering a run of labels to a heap
_OFFERS = {"vnni": _offer_kernel(_estimate_int8, _four_by_one(_estimate_int8)),
           "avx2": _offer_kernel(_estimate_int8, _estimates4_avx2),
           None: _offer_kernel(_estimate_float, _four_by_one(_estimate_float))}
_SCANS = {kind: _scan_kernel(offer) for kind, offer in _OFFERS.items()}


@njit(cache=True, nogil=True, parallel=True)
def _rescore(H, W, b, members, pos, best, held, ids, scores):
    """Each row's top-k (``ids``: W's rows), in float32, of the ``keep`` best estimates its
    tasks' heaps hold."""
    tasks, _, keep = pos.shape
    for r in prange(H.shape[0]):
        top = np.empty(keep, np.int64)
        top_est = np.empty(keep, np.float32)
        m = 0
        for task in range(tasks):
            for j in range(held[task, r]):
                m = heap_push(best[task, r, j], pos[task, r, j], keep, m, top, top_est)
        _rescore_row(H, r, W, b, members, top, m, ids[r], scores[r])


@njit(cache=True, nogil=True, inline="always")
def _rescore_row(H, r, W, b, members, top, m, ids, scores):
    """Row ``r``'s top-k into ``ids``, ``scores`` [k], in float32, of the label positions
    ``top[:m]``."""
    d = H.shape[1]
    k = ids.size
    for j in range(m):  # the rows are scattered through the layer: asked for ahead
        prefetch(W[members[top[j]]])
    n = 0
    for j in range(m):
        row = members[top[j]]
        n = heap_push(b[row] + dot(W[row, :d], H[r]), row, k, n, ids, scores)
    heap_sorted(n, k, ids, scores)


def _row_kernel(offer):
    @njit(cache=True, nogil=True, parallel=True, fastmath=REASSOC)
    def query_row(H, C, starts, budget, levels, q, meta, sums, W, b, members, keep, T, ids,
                  scores):
        """The whole query of one row ``H`` [1, d] in one call, into ``ids``, ``scores`` [1,
        k]: its centroid scores against ``C`` [n, d + 1] (biases last), its clusters
        (:func:`_choose`), their labels' estimates (the query quantized to ``levels`` where
        the estimate is int8), each of ``T`` threads over every T-th cluster, and the
        ``keep`` best rescored."""
        d = H.shape[1]
        coarse = np.empty(C.shape[0], np.float32)
        for t in prange(T):
            for c in range(t * C.shape[0] // T, (t + 1) * C.shape[0] // T):
                s = C[c, d]
                for i in range(d):
                    s += C[c, i] * H[0, i]
                coarse[c] = s
        chosen = np.empty(C.shape[0], np.int32)
        m = _choose(coarse, starts, budget, chosen)
        hq = np.zeros((1, q.shape[1]), np.uint8)
        scale = np.zeros(1, np.float32)
        zero = np.zeros(1, np.int32)
        if levels:
            _quantize_row(H, 0, levels, hq, scale, zero)
        pos = np.empty((T, keep), np.int64)
        best = np.empty((T, keep), np.float32)
        held = np.zeros(T, np.int64)
        for task in prange(T):
            my_pos = np.empty(keep, np.int64)
            my_best = np.empty(keep, np.float32)
            est = np.empty(4, np.float32)
            n = 0
            for j in range(task, m, T):
                c = chosen[j]
                n = offer(0, starts[c], starts[c + 1], H, hq, scale, zero, q, meta, sums, n,
                          my_pos, my_best, est)
            pos[task], best[task], held[task] = my_pos, my_best, n
        top = np.empty(keep, np.int64)
        top_est = np.empty(keep, np.float32)
        n = 0
        for task in range(T):
            for j in range(held[task]):
                n = heap_push(best[task, j], pos[task, j], keep, n, top, top_est)
        _rescore_row(H, 0, W, b, members, top, n, ids[0], scores[0])
    return query_row


_ROWS = {kind: _row_kernel(offer) for kind, offer in _OFFERS.items()}


class LabelClusters:
    """An inverted file of a layer's label vectors (see the module docstring).

    ``clusters``: how many (default :func:`cluster_count` of the layer's rows); ``probe``: the
    share of the labels a query scores (default ``DEFAULT_PROBE``; more finds more of the exact
    top-k, slower). Ids are the layer's rows.
    """

    backend = "clusters"

    def __init__(self, clusters: int | None = None, probe: float = DEFAULT_PROBE, seed: int = 0):
        if clusters is not None and (isinstance(clusters, bool) or
                                     not isinstance(clusters, (int, np.integer)) or clusters < 1):
            raise ValueError(f"clusters must be a positive integer, got {clusters!r}")
        if isinstance(probe, bool) or not isinstance(probe, numbers.Real) or not 0 < probe <= 1:
            raise ValueError(f"probe must be a share of the labels in (0, 1], got {probe!r}")
        self.clusters, self.probe, self.seed = clusters, float(probe), seed
        self.centroids = self.starts = self.members = None
        self.n = 0

    def build(self, W, b, threads: int = 1, start: "LabelClusters | None" = None) -> "LabelClusters":
        """Cluster the rows of ``W`` [n, H] with biases ``b`` [n]; from the centroids of
        ``start`` (an index of an earlier state of the same layer) where it has as many."""
        configure_threading()
        W = np.asarray(W, np.float32)
        V = np.ascontiguousarray(np.hstack((W, np.asarray(b, np.float32)[:, None])))
        self.n = V.shape[0]
        n_clusters = min(self.n, self.clusters or cluster_count(self.n))
        C, assign = kmeans(V, n_clusters, self.seed, threads, getattr(start, "centroids", None))
        self.members = np.argsort(assign, kind="stable").astype(np.int32)
        self.starts = np.searchsorted(assign[self.members], np.arange(n_clusters + 1)).astype(np.int64)
        self.centroids = C
        # the int8 rows in cluster order, so that a cluster's labels are read in one piece,
        # their depth padded with zeros for VNNI
        d = W.shape[1]
        padded = np.zeros((self.n, -(-d // _LANE_BYTES) * _LANE_BYTES), np.float32)
        padded[:, :d] = W[self.members]
        self.rows = quantize_labels(padded, V[self.members, d])
        self.sums = self.rows.q.sum(axis=1, dtype=np.int32)
        # the biases as given: a view of V would hold its whole copy of the layer
        self.W, self.b = W, np.ascontiguousarray(b, np.float32)
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
    def budget(self) -> int:
        """Candidates a query scores."""
        return max(1, min(self.n, int(round(self.probe * self.n))))

    @property
    def nbytes(self) -> int:
        """What the index holds beside the layer: centroids, members, cluster bounds and the
        int8 copy of the layer in cluster order."""
        return (self.centroids.nbytes + self.members.nbytes + self.starts.nbytes +
                self.rows.nbytes + self.sums.nbytes)

    def chosen(self, H) -> tuple[np.ndarray, np.ndarray]:
        """``(clusters int32 [n, C], counts int64 [n])``: the clusters each row of ``H`` [n,
        hidden] scores, the first ``counts[r]`` of its row."""
        H = np.ascontiguousarray(H, np.float32)
        n_clusters = self.weights.shape[0]
        coarse = np.empty((H.shape[0], n_clusters), np.float32)
        # BLAS's own threads would spin after the product and take the cores from numba's
        with blas_threads(1):
            _coarse(H, self.weights, self.bias, min(numba.get_num_threads(), n_clusters), coarse)
        chosen = np.empty((H.shape[0], n_clusters), np.int32)
        counts = np.empty(H.shape[0], np.int64)
        _gather(coarse, self.starts, self.budget, chosen, counts)
        return chosen, counts

    def query(self, H, k: int, threads: int = 1, keep: int | None = None):
        """Top-k ``(rows int64 [n, k], scores float32 [n, k])`` of hidden vectors ``H`` [n,
        hidden], best first: the labels of each row's clusters (:meth:`chosen`) scored from
        the int8 copy, the ``keep`` best (default ``KEEP_PER_K`` k) again in float32."""
        H = np.ascontiguousarray(H, np.float32)
        n = H.shape[0]
        keep = max(k, min(self.n, keep or math.ceil(KEEP_PER_K * k)))
        q, meta = self.rows.q, self.rows.meta
        kind = int8_kind()
        ids = np.empty((n, k), np.int64)
        scores = np.empty((n, k), np.float32)
        if n == 1:  # one kernel: a batch's five cost more to start, and BLAS's product packs
            # its operands at every call (docs/serving.md)
            _ROWS[kind](
                H, self.centroids, self.starts, self.budget, LEVELS.get(kind, 0), q, meta,
                self.sums, self.W, self.b, self.members, keep, numba.get_num_threads(), ids,
                scores)
            return ids, scores
        chosen, counts = self.chosen(H)
        tasks = numba.get_num_threads()
        ptr, rows, bounds = _by_cluster(chosen, counts, self.starts, tasks)
        pos = np.empty((tasks, n, keep), np.int64)
        best = np.empty((tasks, n, keep), np.float32)
        held = np.empty((tasks, n), np.int64)
        if kind is not None:
            hq = np.zeros((n, q.shape[1]), np.uint8)
            t = np.empty(n, np.float32)
            z = np.empty(n, np.int32)
            _quantize_queries(H, LEVELS[kind], hq, t, z)
            _SCANS[kind](H, hq, t, z, q, meta, self.sums, self.starts, ptr, rows, bounds, pos,
                         best, held)
        else:
            _SCANS[None](H, H[:, :0].astype(np.uint8), np.empty(0, np.float32),
                         np.empty(0, np.int32), q, meta, self.sums, self.starts, ptr, rows, bounds,
                         pos, best, held)
        _rescore(H, self.W, self.b, self.members, pos, best, held, ids, scores)
        return ids, scores
