"""numba kernels of the sparse engine: forward, active-set selection, backward, Adam.

Array layout (all float32, C-contiguous):

* input layer  ``W0`` [n_features, H0] (input-major: a sample's non-zero features each read one
  contiguous row), ``b0`` [H0];
* hidden stack ``Wh`` flat [Σ H_l·H_{l-1}] with ``h_off`` int64 [n_hidden] offsets (each block is
  [H_l, H_{l-1}]), ``bh`` flat [Σ H_l] with ``b_off``; the stack holds layers 1..n_hidden-1;
* output layer ``W`` [n_out, H_last] (neuron-major: an active neuron's row is contiguous), ``b``.

The two matrices a step reads by scattered rows, ``W0`` and ``W``, train as *row blocks*
[n, 3·H]: row i is the weights, Adam's first moment and second moment of row i back to back
(:func:`row_parts`), so that a row's update reads and writes one 1.5 KB run at H = 128 instead
of three 512-byte runs in three arrays: memory serves the one run faster (docs/runtime.md). A
kernel that only reads weights takes "rows led
by the weights": the plain matrix [n, H] or its row block, of which it reads the first H
entries of a row (H from another argument).

Kernels that walk scattered rows ask for them before use (:mod:`slide.runtime`): into every
cache level :data:`AHEAD` rows ahead, and, where they update the rows, into L2 :data:`FAR` rows
ahead, the lines of the whole update (the output step asks in its forward half for what its
update half will touch).

Per-sample activations of all hidden layers are stored back to back in ``acts`` [batch, Σ H].
A sample's output active set is its own neurons (its labels and LSH candidates, chosen by
:func:`select_active`), plus a random pool shared by the batch, whose logits and gradients are
matrix products (:func:`pool_logits`, :func:`pool_gradients`). A row whose whole gradient one
kernel computes gets its Adam step there, while its weights are in cache (:func:`mark_rows`):
an own row that no other sample and not the pool touches, in :func:`output_step` (most of them
at 670K labels), and a pool row that is no sample's own, in :func:`pool_gradients`. The other
rows' gradients are summed in the step's *compact gradient*, a row for each of them (its slot,
given by :func:`mark_rows`) instead of a full-size array that a step would write at scattered
rows, lock-free (Hogwild): threads may race on a row and lose an addition, by design; Adam then
updates those rows (:func:`adam_rows`). Input rows that several samples hold are the exception:
each one's gradient is summed by one thread over the samples after their pass
(:func:`backward_hidden`), where a feature most samples hold would have its row's cache lines
taken from thread to thread. With one thread everything is deterministic.

The per-sample kernels (:func:`select_active`, :func:`output_step`, :func:`backward_hidden`)
run one loop on each of ``n_threads`` threads, each claiming the batch's next unclaimed sample
from a shared counter as it finishes one (:func:`slide.runtime.fetch_add`; the output step as
the sample's last rows go, to ask for the next one's first rows), instead of a fixed chunk
each: a sample's cost varies with its labels, its candidates and its cache misses, and fixed
chunks leave threads waiting for the slowest. Their scratch is per thread; with one thread the
samples go in order.
"""
import numpy as np
from numba import njit, prange

from slide.preprocess import row_divisor, weighed
from slide.runtime import copy_into, fetch_add, prefetch, prefetch_l2, prefetch_w
from lsh.tables import claim, query_union, select_candidates
from slide.blas import gemm
from slide.vecmath import MAX_LANES, dot, exp_nonpositive, fmax, fsum


#: the Adam kernels' arithmetic may fuse a multiply and an add (one rounding instead of two):
#: the update is about a dozen vector operations a weight, and in the output step, which waits
#: on memory, it is still a cost of its own
_CONTRACT = {"contract"}


#: rows asked for ahead of use by the kernels that walk scattered rows: enough to keep several
#: rows in flight, few enough that they are still in L1 when used (docs/runtime.md)
AHEAD = 4
#: float32 values in a 64-byte cache line
_LINE_FLOATS = 16
#: tasks a single row's first layer is split into (docs/ann-kernels.md)
_ROW_SHARES = 2

#: rows asked of L2 ahead of use by the kernels that update scattered rows, beside AHEAD's ask
#: of every level: L2 keeps many more misses in flight than L1, so more of a row's lines are on
#: their way at once. In the output step the rows its update will touch are asked for in the
#: forward half, which otherwise waits on the weights alone (docs/runtime.md)
FAR = 16


# --------------------------------------------------------------------------------------------
# Forward through the hidden layers
# --------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, parallel=True)
def forward_input(x_indptr, x_indices, x_data, idf, l2, W0, b0, relu, acts):
    """First hidden layer, ReLU(x W0 + b0) (``relu``, bool) or x W0 + b0, for a batch of CSR
    rows into ``acts[:, :H0]`` (``W0``: rows led by the weights, H0 = ``b0.size``), each row
    weighed as it is read (``idf``, ``l2``: :func:`slide.preprocess.row_divisor`; an empty
    ``idf`` and False for rows weighed already). A row alone (a single row's query) is split
    by columns into ``_ROW_SHARES`` tasks, in whole cache lines, so that threads share its
    waits on the weight rows (the same sums, bit for bit)."""
    n, H0 = x_indptr.size - 1, b0.size
    # a fixed number of shares, as measured on two threads; each share's sums are the same
    # on any thread count
    parts = max(1, min(_ROW_SHARES, H0 // _LINE_FLOATS)) if n == 1 else 1
    for task in prange(n * parts):
        r, part = task // parts, task % parts
        lo = (part * H0 // parts) // _LINE_FLOATS * _LINE_FLOATS
        hi = H0 if part == parts - 1 else ((part + 1) * H0 // parts) // _LINE_FLOATS * _LINE_FLOATS
        h = acts[r, lo:hi]
        h[:] = b0[lo:hi]
        end = x_indptr[r + 1]
        divisor = row_divisor(x_indptr[r], end, x_indices, x_data, idf, l2)
        for p in range(x_indptr[r], end):
            if p + AHEAD < end:
                prefetch(W0[x_indices[p + AHEAD], lo:hi])
            row = W0[x_indices[p], lo:hi]
            v = weighed(p, x_indices, x_data, idf) / divisor
            for j in range(hi - lo):
                h[j] += v * row[j]
        if relu:
            for j in range(hi - lo):
                h[j] = max(h[j], np.float32(0.0))


@njit(cache=True, nogil=True, parallel=True)
def forward_layer(acts, lo_in, lo_out, W, b, active, n_active, relu):
    """Hidden layer ReLU(W h + b) (``relu``, bool) or W h + b from ``acts[:, lo_in:lo_in+n_in]``
    into ``acts[:, lo_out:lo_out+n_out]`` for W [n_out, n_in]. With ``active`` [n, m] (m > 0)
    only the neurons ``active[r, :n_active[r]]`` are computed and the others are 0 (a sampled
    layer, ReLU only: see :func:`backward_hidden`); with m == 0 every neuron is."""
    n_out, n_in = W.shape
    for r in prange(acts.shape[0]):
        prev = acts[r, lo_in:lo_in + n_in]
        out = acts[r, lo_out:lo_out + n_out]
        k = n_out if active.shape[1] == 0 else n_active[r]
        if active.shape[1] > 0:
            out[:] = 0.0
        for a in range(k):
            i = a if active.shape[1] == 0 else active[r, a]
            a_i = b[i] + dot(W[i], prev)
            out[i] = max(a_i, np.float32(0.0)) if relu else a_i


# --------------------------------------------------------------------------------------------
# Active-set selection
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _select_own(labels, codes, buckets, seen, slots, where, cand, hits, hist, lsh_cap, active):
    """A sample's own active neurons: its labels, then up to ``lsh_cap`` LSH candidates ranked
    by hit count. Returns (own count, union size): the query's whole union (labels aside) is
    left in ``cand[:union]`` (:func:`lsh.tables.query_union`); the query set is empty again
    on return."""
    n = 0
    for i in range(labels.size):
        lab = labels[i]
        if claim(slots, where, lab):
            active[n] = lab
            n += 1
    u = 0
    if buckets.shape[0] > 0 and lsh_cap > 0:
        u = query_union(buckets, seen, codes, slots, where, cand, hits)
        n += select_candidates(cand, hits, u, hist, lsh_cap, True, active[n:])
    slots[:] = -1
    return n, u


# --------------------------------------------------------------------------------------------
# Training step: the output layer, then back through the hidden layers
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, parallel=True)
def select_active(y_indptr, y_indices, codes, buckets, seen, slots, where, cand, hits, hist,
                  lsh_cap, pool, pool_pos, pool_bits, zpool, active, n_active, n_threads):
    """Each sample's own active neurons into ``active`` [n, w] / ``n_active`` [n] (its labels,
    then up to ``lsh_cap`` LSH candidates, see :func:`_select_own`), and its row of the pool's
    logits ``zpool`` [n, P] cut to the random rest of the layer.

    Pool neurons that are also in the sample's own set, or that its LSH query found but the cap
    cut, get logit -inf (their softmax weight is 0): the pool stands for the neurons the query
    did not find. They are found through the pool ``pool`` int32 [P]'s position map
    ``pool_pos`` int32 [n_labels] (-1 outside it) and membership bits ``pool_bits`` uint8
    [ceil(n_labels / 8)], both set here and cleared before returning (all -1 and 0 on entry
    and exit): a found neuron's bit, in L2 where the map is not, answers most lookups before
    the map would. Per-thread query scratch
    (``slots``, ``where``, ``cand``, ``hits``, ``hist``) as in
    :class:`lsh.tables.QueryScratch`, one for each of ``n_threads`` threads, which claim the
    samples one at a time (see the module docstring).
    """
    for j in range(pool.size):
        i = pool[j]
        pool_pos[i] = j
        pool_bits[i >> 3] |= np.uint8(1 << (i & 7))
    n = y_indptr.size - 1
    next_row = np.zeros(1, np.int64)
    for c in prange(n_threads):
        r = fetch_add(next_row, 1)
        while r < n:
            own = active[r]
            k, u = _select_own(y_indices[y_indptr[r]: y_indptr[r + 1]], codes[r], buckets, seen,
                               slots[c], where[c], cand[c], hits[c], hist[c], lsh_cap, own)
            n_active[r] = k
            zp = zpool[r]
            for a in range(k):
                i = own[a]
                if pool_bits[i >> 3] & (1 << (i & 7)):
                    zp[pool_pos[i]] = -np.inf
            found = cand[c]
            for a in range(u):
                i = found[a]
                if pool_bits[i >> 3] & (1 << (i & 7)):
                    zp[pool_pos[i]] = -np.inf
            r = fetch_add(next_row, 1)
    for j in range(pool.size):
        i = pool[j]
        pool_pos[i] = -1
        pool_bits[i >> 3] = 0


#: ``owners`` marks of :func:`mark_rows`: untouched; in one sample's own set and nowhere else;
#: in the shared pool and no sample's own set; touched otherwise. A row ALONE or POOL has its
#: whole gradient in one kernel, which gives it its Adam step in place; a SHARED row's gradient
#: is summed in the step's compact gradient, at its slot (``slots[i]``: its place in the list
#: of SHARED rows) for Adam after the batch.
UNTOUCHED, ALONE, POOL, SHARED = 0, 1, 2, 3


@njit(cache=True, nogil=True)
def mark_rows(extra, lists, lengths, owners, in_place, touched, slots, shared):
    """Mark the rows a step touches in ``owners`` uint8 [n_ids] (all UNTOUCHED on entry): with
    ``in_place``, the ids of ``extra`` [m] (the shared pool) POOL and those of ragged ``lists``
    [n, w] (first ``lengths[i]`` of each row: the samples' own sets) ALONE, where no other entry
    holds them, and SHARED otherwise; without (ranks that sum their gradients first), all
    SHARED. Each distinct row goes once into ``touched``, in the order first met, and each
    SHARED row once into ``shared``, in the same order, with its place there in ``slots`` int32
    [n_ids] (the row of the step's compact gradient it adds to). Returns both counts. One
    thread: the marks must not race, or two samples could each take a row for their own."""
    pool_mark, own_mark = (POOL, ALONE) if in_place else (SHARED, SHARED)
    n = 0
    for i in extra:
        n = _mark(owners, i, pool_mark, touched, n)
    for r in range(lists.shape[0]):
        for a in range(lengths[r]):
            n = _mark(owners, lists[r, a], own_mark, touched, n)
    return n, _list_shared(owners, touched[:n], slots, shared)


@njit(cache=True, nogil=True)
def mark_ids(ids, owners, in_place, touched, slots, shared):
    """Mark ``ids`` [m] in ``owners`` uint8 [n_ids] (all UNTOUCHED on entry): with ``in_place``,
    an id met once ALONE, and SHARED otherwise (a batch's input features: a feature of one
    sample's row has its whole gradient in that sample's backward pass). Lists and slots as
    :func:`mark_rows`; returns both counts. One thread."""
    first = ALONE if in_place else SHARED
    n = 0
    for i in ids:
        n = _mark(owners, i, first, touched, n)
    return n, _list_shared(owners, touched[:n], slots, shared)


@njit(cache=True, nogil=True, inline="always")
def _mark(owners, i, first, touched, n):
    """Row i gets mark ``first`` and is listed at ``touched[n]`` if no entry met it yet, SHARED
    otherwise; returns the new list length."""
    if owners[i] == UNTOUCHED:
        owners[i] = first
        touched[n] = i
        return n + 1
    owners[i] = SHARED
    return n


@njit(cache=True, nogil=True, inline="always")
def _list_shared(owners, touched, slots, shared):
    """The SHARED rows of ``touched`` into ``shared``, in order, each with its place there in
    ``slots``; returns their count. A pass of its own: giving a row its slot in the marking
    loop, as it became SHARED, slowed that loop many times over."""
    k = 0
    for i in touched:
        if owners[i] == SHARED:
            slots[i] = k
            shared[k] = i
            k += 1
    return k


@njit(cache=True, nogil=True, parallel=True)
def clear_marks(owners, touched, in_place):
    """Set the marks of the rows of ``touched`` [m] (:func:`mark_rows`' list) back to
    UNTOUCHED and, where ``in_place`` has room (data parallelism's averages need it), list
    those updated in place (ALONE or POOL) into it, in the order listed; returns their count
    (0 without a list). The list takes a pass over the listed rows (a scan of all the marks
    costs more). Without it the marks are reset on every thread: all of them, in order, where
    the rows listed are at least one per line of 64 marks, so that most lines are written
    either way; the listed rows' otherwise."""
    if in_place.size == 0:
        if touched.size * 64 >= owners.size:
            for i in prange(owners.size):
                owners[i] = UNTOUCHED
        else:
            for t in prange(touched.size):
                owners[touched[t]] = UNTOUCHED
        return 0
    n_in_place = 0
    for i in touched:
        if owners[i] != SHARED:
            in_place[n_in_place] = i
            n_in_place += 1
        owners[i] = UNTOUCHED
    return n_in_place


@njit(cache=True, nogil=True, inline="always")
def _grad_row(owners, slots, i, own):
    """Where row i's gradient goes in this step: -1 where its mark is ``own`` (the calling
    kernel computes its whole gradient and gives it its Adam step in place), otherwise its
    row of the step's compact gradient."""
    return -1 if owners[i] == own else slots[i]


@njit(cache=True, nogil=True, parallel=True, fastmath=_CONTRACT)
def output_step(y_indptr, acts, W, b, gW, gb, bM, bV, owners, slots, zpool, active, n_active,
                n_threads, logits_buf, dH, losses, norm, own_logits, lr, beta1, beta2, eps, step,
                weight_decay):
    """Softmax cross-entropy over each sample's active set, and the output layer's gradients.

    A sample's active set is its own neurons ``active[r, :n_active[r]]`` (its labels first, then
    its LSH candidates, from :func:`select_active`) plus the batch's shared pool, whose logits
    ``zpool`` [n, P] come in precomputed (one matrix product for the batch) and already cut to
    the random rest of the layer. Target: uniform over the sample's labels.

    On return ``zpool`` holds the pool's logit gradients (scaled by 1/n) for the caller's matrix
    products, ``dH`` [n, H] the own set's share of the gradient w.r.t. the last hidden layer
    (scaled by 1/n) and ``losses`` [n] each sample's loss; returns their mean (float64). An own
    row marked ALONE in ``owners`` (see :func:`mark_rows`) gets its Adam step here, with the
    weights still in cache: its whole gradient is this sample's, so the step is the same as
    through Adam after the batch, and no gradient row is written or read back (``W``: the
    output layer's row block [n_out, 3H]; the bias moments ``bM``, ``bV``; Adam's
    hyperparameters for ``step``, as :func:`adam_rows` and :func:`adam_entries`). Other own
    rows add their gradients to the step's compact gradient ``gW`` [S, H] / ``gb`` [S] at
    their ``slots`` (:func:`mark_rows`; Hogwild) for Adam after the batch. ``n_threads``
    threads claim the samples one at a time (see the module docstring), each with its row of
    scratch ``logits_buf`` float32 [n_threads, w].

    ``norm`` float32 [n, 3] or [0, 3]: where given, the softmax's normaliser comes from outside
    (an output layer sharded by label, :mod:`slide.shards`): row r holds the largest logit and
    the sum of exp(logit - largest) over every shard's active set (:func:`logit_stats`
    combined), and the weight of each of the sample's labels in the target (1 / its labels in
    every shard); the loss is then this shard's share of the sample's. The own neurons' logits
    are then read from ``own_logits`` [n, w] (:func:`logit_stats` computed them).
    """
    n = y_indptr.size - 1
    scale = np.float32(1.0 / n)
    H = gW.shape[1]
    lo_last = acts.shape[1] - H
    P = zpool.shape[1]
    k_w = _adam_constants(lr, beta1, beta2, eps, step, weight_decay)
    k_b = _adam_constants(lr, beta1, beta2, eps, step, 0.0)  # biases: no decay
    given = norm.shape[0] > 0
    next_row = np.zeros(1, np.int64)  # the next sample to claim
    for c in prange(n_threads):
        logits = logits_buf[c]
        lanes = np.empty(MAX_LANES, np.float32)  # fmax's scratch, once per thread
        r = fetch_add(next_row, 1)
        while r < n:
            nxt = -1  # the next sample, claimed as this one's last rows go (see below)
            own = active[r]
            k = n_active[r]
            h = acts[r, lo_last:]
            zp = zpool[r]
            zmax = np.float32(-np.inf)
            for a in range(k):
                if a + AHEAD < k:
                    # the bias and its two moments are scattered lines outside the row's run,
                    # each a wait of its own where not asked for early (the bias here, the
                    # moments in the update below)
                    ahead = own[a + AHEAD]
                    prefetch(W[ahead, :H])
                    prefetch_w(b[ahead:ahead + 1])
                if a + FAR < k:
                    # what the update half will touch, into L2: it then finds its lines one
                    # level up, not in memory
                    far = own[a + FAR]
                    _prefetch_far(far, _grad_row(owners, slots, far, ALONE), W, gW)
                if given:
                    s = own_logits[r, a]
                else:
                    s = b[own[a]] + dot(W[own[a], :H], h)
                logits[a] = s
                zmax = max(zmax, s)
            zmax = max(zmax, fmax(zp, lanes))
            n_lab = y_indptr[r + 1] - y_indptr[r]
            y = np.float32(1.0 / max(n_lab, 1))  # the target of each label
            if given:
                zmax = norm[r, 0]
                y = norm[r, 2]
            for a in range(k):
                logits[a] = exp_nonpositive(logits[a] - zmax)
            for j in range(P):
                zp[j] = exp_nonpositive(zp[j] - zmax)
            if given:
                inv = np.float32(1.0) / norm[r, 1]
            else:
                inv = np.float32(1.0) / (fsum(logits[:k]) + fsum(zp))
            loss = np.float32(0.0)
            for a in range(n_lab):  # labels are the first n_lab own neurons
                loss -= np.log(max(logits[a] * inv, np.float32(1e-30)))
            losses[r] = loss * y
            # g = p - y; the own set's share of dh here, the pool's share is a matrix product
            dh = dH[r]
            dh[:] = 0.0
            for a in range(k):
                # the rows this loop writes (a row's weights are in cache from the forward
                # half: only its moments are asked for), and the next sample's first weights
                if a + AHEAD < k:
                    ahead = own[a + AHEAD]
                    if owners[ahead] == ALONE:
                        prefetch_w(W[ahead, H:])
                        prefetch_w(bM[ahead:ahead + 1])
                        prefetch_w(bV[ahead:ahead + 1])
                    else:
                        prefetch_w(gW[slots[ahead]])
                else:
                    # the next sample is claimed here, so that its first weights can be asked
                    # for; claimed earlier, a thread would hold it through this whole sample
                    # while others ran out of samples at the batch's end
                    if nxt < 0:
                        nxt = fetch_add(next_row, 1)
                    if nxt < n and a + AHEAD - k < n_active[nxt]:
                        prefetch(W[active[nxt, a + AHEAD - k], :H])
                gs = (logits[a] * inv - (y if a < n_lab else np.float32(0.0))) * scale
                i = own[a]
                wa = W[i, :H]
                for j in range(H):
                    dh[j] += gs * wa[j]
                # a loop of its own: with dh in it, five arrays would be more than LLVM checks
                # for overlap at run time, and it would not vectorise
                at = _grad_row(owners, slots, i, ALONE)
                _update_row(i, at, W, gW, h, gs, k_w)
                _update_bias(i, at, b, bM, bV, gb, gs, k_b)
            for j in range(P):
                zp[j] *= inv * scale
            r = nxt if nxt >= 0 else fetch_add(next_row, 1)  # no own rows: not claimed yet
    return _mean(losses)


@njit(cache=True, nogil=True)
def _mean(x):
    """The mean of float32 ``x`` as a float64 (0 for none): a kernel returns it, since numpy's
    small-array calls between the step's kernels, which leave the caches cold, cost tens of
    microseconds."""
    total = 0.0
    for v in x:
        total += v
    return total / max(x.size, 1)


@njit(cache=True, nogil=True)
def longest_row(indptr):
    """The most entries in one row of a CSR matrix with row pointers ``indptr`` [n + 1] (0 for
    no rows); a kernel, for the reason :func:`_mean` is one."""
    most = 0
    for r in range(indptr.size - 1):
        most = max(most, indptr[r + 1] - indptr[r])
    return most


@njit(cache=True, nogil=True, inline="always")
def _prefetch_update(i, at, B, G):
    """Ask for what row i's update will write: its row of row block ``B`` (weights and both
    moments) where it gets its Adam step in place (``at`` -1), its gradient row ``G[at]``
    otherwise."""
    if at < 0:
        prefetch_w(B[i])
    else:
        prefetch_w(G[at])


@njit(cache=True, nogil=True, inline="always")
def _prefetch_far(i, at, B, G):
    """Ask L2 (:data:`FAR` rows ahead) for what row i's step will touch: its row of row block
    ``B`` where it gets its Adam step in place (``at`` -1), its weights and its gradient row
    ``G[at]`` otherwise."""
    if at < 0:
        prefetch_l2(B[i])
    else:
        prefetch_l2(B[i, :G.shape[1]])
        prefetch_l2(G[at])


#: numpy's error model: no zero check on Adam's division, which kept the loop scalar (a prange
#: body gets it from parallel=True; a kernel it calls does not)
@njit(cache=True, nogil=True, error_model="numpy", fastmath=_CONTRACT)
def _backward_hidden(x_ids, x_vals, act, dh_last, W0, owners, k_w, Wh, h_off, sizes, gWh, gbh,
                     b_off, dbuf, d_first, relu):
    """Back-propagate ``dh_last`` (gradient w.r.t. the last hidden activation) through the
    hidden stack (its gradients added to ``gWh``/``gbh``, Hogwild) to the first hidden layer's
    pre-activation, written to ``d_first`` [H0]; an input row marked ALONE in ``owners`` gets
    its Adam step here (``W0``: the input layer's row block; constants ``k_w``), the others are
    left to :func:`_shared_input_rows`. ``dbuf`` is scratch of size max(sizes) * 2. ``relu``:
    a neuron passes its gradient where its activation is positive (ReLU's derivative, which is
    also 0 for the neurons a sampled layer did not compute), else everywhere (the identity)."""
    n_layers = sizes.size
    # offsets of each layer's activation inside act
    lo_last = 0
    for l in range(n_layers - 1):
        lo_last += sizes[l]
    half = dbuf.size // 2
    cur = dbuf[:half]
    nxt = dbuf[half:]
    H = sizes[n_layers - 1]
    for j in range(H):
        cur[j] = dh_last[j] if act[lo_last + j] > 0 or not relu else np.float32(0.0)
    lo = lo_last
    for l in range(n_layers - 1, 0, -1):
        n_in, n_outl = sizes[l - 1], sizes[l]
        lo_in = lo - n_in
        prev = act[lo_in: lo]
        W = Wh[h_off[l - 1]: h_off[l - 1] + n_outl * n_in].reshape(n_outl, n_in)
        gW = gWh[h_off[l - 1]: h_off[l - 1] + n_outl * n_in].reshape(n_outl, n_in)
        gb = gbh[b_off[l - 1]: b_off[l - 1] + n_outl]
        for j in range(n_in):
            nxt[j] = 0.0
        for i in range(n_outl):
            d = cur[i]
            if d == 0:
                continue
            gb[i] += d
            wi = W[i]
            gi = gW[i]
            for j in range(n_in):
                nxt[j] += d * wi[j]
                gi[j] += d * prev[j]
        for j in range(n_in):
            cur[j] = nxt[j] if prev[j] > 0 or not relu else np.float32(0.0)
        lo = lo_in
    copy_into(d_first, cur[:sizes[0]])
    for p in range(x_ids.size):
        if p + AHEAD < x_ids.size and owners[x_ids[p + AHEAD]] == ALONE:
            prefetch_w(W0[x_ids[p + AHEAD]])
        if p + FAR < x_ids.size and owners[x_ids[p + FAR]] == ALONE:
            prefetch_l2(W0[x_ids[p + FAR]])
        f = x_ids[p]
        if owners[f] == ALONE:
            w, m, v = row_parts(W0, f)
            _adam_row(w, m, v, d_first, x_vals[p], k_w)


@njit(cache=True, nogil=True)
def _shared_pairs(x_indptr, x_indices, x_data, owners, slots, n_shared, starts, pair_rows,
                  pair_vals):
    """The batch's entries in SHARED input rows grouped by row: the entries of the row at slot
    s (:func:`mark_ids`) are ``pair_rows`` (their sample) and ``pair_vals`` (their value) at
    ``starts[s]:starts[s + 1]``, in sample order (a counting sort; ``starts`` int64 [S + 1])."""
    starts[:n_shared + 1] = 0
    for p in range(x_indices.size):
        f = x_indices[p]
        if owners[f] == SHARED:
            starts[slots[f] + 1] += 1
    for s in range(n_shared):
        starts[s + 1] += starts[s]
    for r in range(x_indptr.size - 1):  # each entry at its row's next place
        for p in range(x_indptr[r], x_indptr[r + 1]):
            f = x_indices[p]
            if owners[f] == SHARED:
                k = starts[slots[f]]
                pair_rows[k] = r
                pair_vals[k] = x_data[p]
                starts[slots[f]] = k + 1
    for s in range(n_shared, 0, -1):  # each start was moved to the next row's
        starts[s] = starts[s - 1]
    starts[0] = 0


@njit(cache=True, nogil=True, fastmath=_CONTRACT)
def _shared_input_rows(D, starts, pair_rows, pair_vals, gW0, lo, hi):
    """The gradients of the SHARED input rows at slots ``lo:hi``, each summed in sample order
    over the batch's entries in it (:func:`_shared_pairs`) into its row of ``gW0``, from the
    samples' first-layer gradients ``D`` [n, H0]."""
    for s in range(lo, hi):
        g = gW0[s]
        for k in range(starts[s], starts[s + 1]):
            v, d = pair_vals[k], D[pair_rows[k]]
            for j in range(g.size):
                g[j] += v * d[j]


@njit(cache=True, nogil=True, parallel=True)
def backward_hidden(x_indptr, x_indices, x_data, acts, dH, W0, owners, slots, n_shared, Wh,
                    h_off, sizes, gW0, gb0, gWh, gbh, b_off, n_threads, dbuf, D, starts,
                    pair_rows, pair_vals, relu, lr, beta1, beta2, eps, step, weight_decay):
    """Back-propagate ``dH`` [n, H_last] (gradient w.r.t. the last hidden activations, already
    scaled by 1/n) into the hidden layers' gradients; ``dbuf`` [n_threads, 2·max H].

    First per sample: the hidden stack's gradients (Hogwild), and the sample's first-layer
    gradient into ``D`` float32 [n, H0]. An input row marked ALONE in ``owners`` uint8
    [n_features] (:func:`mark_ids`: a feature of one sample of the batch, most of them on
    sparse data) has its whole gradient in that sample's pass and gets its Adam step
    there (``W0``: the input layer's row block [n_features, 3·H0]; Adam's hyperparameters for
    ``step``, as :func:`adam_rows`). ``n_threads`` threads claim the samples one at a time (see
    the module docstring), each with its row of ``dbuf``.

    Then the ``n_shared`` other rows: each one's gradient, summed over the samples that hold
    it, into the step's compact gradient ``gW0`` [S, H0] at its ``slots`` int32 [n_features]
    (:func:`mark_ids`) for Adam after the batch, and the input biases' into ``gb0``, each sum
    by one thread in sample order. Added by every sample as it went, the rows of features that
    most samples hold would take each write as a cache line the other threads had just taken.
    Scratch for the rows' entries, :func:`_shared_pairs`: ``starts`` int64
    [S + 1], ``pair_rows`` int32 and ``pair_vals`` float32 [nnz]. ``relu`` (bool): the hidden
    layers' activation is ReLU, else the identity."""
    k_w = _adam_constants(lr, beta1, beta2, eps, step, weight_decay)
    n = x_indptr.size - 1
    _shared_pairs(x_indptr, x_indices, x_data, owners, slots, n_shared, starts, pair_rows,
                  pair_vals)
    next_row = np.zeros(1, np.int64)  # the next sample to claim
    for c in prange(n_threads):
        r = fetch_add(next_row, 1)
        while r < n:
            lo, hi = x_indptr[r], x_indptr[r + 1]
            _backward_hidden(x_indices[lo:hi], x_data[lo:hi], acts[r], dH[r], W0, owners, k_w,
                             Wh, h_off, sizes, gWh, gbh, b_off, dbuf[c], D[r], relu)
            r = fetch_add(next_row, 1)
    # each thread a run of rows holding about as many entries as the others'
    bounds = np.searchsorted(starts[:n_shared + 1],
                             np.arange(n_threads + 1) * starts[n_shared] // n_threads)
    bounds[n_threads] = n_shared
    H0 = gb0.size
    for c in prange(n_threads):
        _shared_input_rows(D, starts, pair_rows, pair_vals, gW0, bounds[c], bounds[c + 1])
        for r in range(n):  # the biases: each thread a block of them
            d = D[r]
            for j in range(c * H0 // n_threads, (c + 1) * H0 // n_threads):
                gb0[j] += d[j]


# --------------------------------------------------------------------------------------------
# The shared pool: its logits and gradients as matrix products on numba's threads
# --------------------------------------------------------------------------------------------
# Each thread takes a contiguous block of the pool and multiplies only its own rows, through a
# single-threaded BLAS (scipy's, which the caller holds at one thread: see
# slide.runtime.engine_threads): its weight rows are gathered, multiplied and their gradients
# added back while in its cache. A multi-threaded BLAS instead would leave numba's workers
# spinning beside BLAS's between kernels, or, alone, the other cores idle. The products read
# and write the thread's block of columns of the [n, P] logits in place (slide.blas.gemm), so
# the softmax reads each sample's pool logits as one row.
#
# A thread's block goes through in chunks of POOL_CHUNK columns whose gathered weight rows,
# logit columns and gradient rows stay in L2 from one operation on them to the next: the
# gathered rows into their product, the logit gradients through two products and the column
# sums, each gradient row into its Adam step (docs/runtime.md).
@njit(cache=True, nogil=True, parallel=True)
def logit_stats(acts, H, W, b, zpool, active, n_active, stats, own_logits):
    """Each sample's largest logit over its active set (own neurons ``active[r, :n_active[r]]``
    and the pool's logits ``zpool`` [n, P], as :func:`output_step` takes them) and the sum of
    exp(logit - largest), into ``stats`` float32 [n, 2]: one shard's part of the softmax's
    normaliser (-inf and 0 for an empty set); the own neurons' logits into ``own_logits``
    [n, w], which ``output_step`` then reads. ``W``: the output rows led by their ``H``
    weights; the last hidden layer is ``acts``' last ``H`` columns."""
    n, P = zpool.shape
    lo_last = acts.shape[1] - H
    for r in prange(n):
        own = active[r]
        k = n_active[r]
        h = acts[r, lo_last:]
        zp = zpool[r]
        z = own_logits[r]
        zmax = np.float32(-np.inf)
        for j in range(P):
            zmax = max(zmax, zp[j])
        for a in range(k):
            if a + AHEAD < k:
                prefetch(W[own[a + AHEAD], :H])
            z[a] = b[own[a]] + dot(W[own[a], :H], h)
            zmax = max(zmax, z[a])
        total = np.float32(0.0)
        if zmax > -np.inf:
            for a in range(k):
                total += exp_nonpositive(z[a] - zmax)
            for j in range(P):
                total += exp_nonpositive(zp[j] - zmax)
        stats[r, 0] = zmax
        stats[r, 1] = total


#: columns of the pool a thread takes at once (the kernels' ``chunk``)
POOL_CHUNK = 256


@njit(cache=True, nogil=True, parallel=True)
def pool_logits(h, W, b, pool, W_pool, z, b_pool, bounds, chunk):
    """The shared pool's logits ``z = h @ W[pool].T + b[pool]``.

    ``h`` float32 [n, H] (the last hidden layer), ``W`` the output layer's rows led by the
    weights (float32 [n_out, H] or its row block), ``b`` [n_out], ``pool`` int32 [P].
    ``W_pool`` float32 [P, H] receives ``W[pool]`` (the backward pass reads it again), ``z``
    float32 [n, P] the logits; ``b_pool`` float32 [P] is scratch. Thread c takes pool positions
    ``bounds[c]:bounds[c + 1]`` (int64 [T + 1]), ``chunk`` of them at a time (:data:`POOL_CHUNK`).
    """
    H = W_pool.shape[1]
    for c in prange(bounds.size - 1):
        for lo in range(bounds[c], bounds[c + 1], chunk):
            hi = min(lo + chunk, bounds[c + 1])
            Wc, bc = W_pool[lo:hi], b_pool[lo:hi]
            for t in range(hi - lo):
                if t + AHEAD < hi - lo:
                    prefetch(W[pool[lo + t + AHEAD], :H])
                copy_into(Wc[t], W[pool[lo + t], :H])
                bc[t] = b[pool[lo + t]]
            # the biases first, the product added to them: BLAS zeroes C in a pass of its own
            # where beta is 0, and adding the biases after would take another
            # z[r, lo:hi], not a row of the column block z[:, lo:hi]: a row of that block has
            # numba's layout "A" (strides unknown when compiled), which keeps the loop scalar
            for r in range(z.shape[0]):
                copy_into(z[r, lo:hi], bc)
            gemm(h, False, Wc, True, z[:, lo:hi], 1.0)


@njit(cache=True, nogil=True, parallel=True, fastmath=_CONTRACT)
def pool_gradients(h, W_pool, z, pool, dH, W, b, gW, gb, bM, bV, owners, slots, g_pool, col_sums,
                   dH_parts, bounds, chunk, lr, beta1, beta2, eps, step, weight_decay):
    """Back through the shared pool, given its logit gradients ``z`` float32 [n, P]:
    ``dH += z @ W_pool`` and the pool rows' gradients ``z.T @ h`` and ``z.sum(0)``.

    A pool row marked POOL in ``owners`` (:func:`mark_rows`: no sample's own) has its whole
    gradient here and gets its Adam step in place (``W``: the output layer's row block; ``b``,
    its moments ``bM``, ``bV``; Adam's hyperparameters for ``step``, as :func:`adam_rows`); the
    others add their gradients to the step's compact gradient ``gW``/``gb`` at their ``slots``
    (Hogwild). ``dH`` reads the weights gathered before any
    update (``W_pool``). Shapes, ``bounds`` and ``chunk`` as in :func:`pool_logits`; ``dH``
    float32 [n, H].
    Scratch: ``g_pool`` [P, H], ``col_sums`` [P] and ``dH_parts`` [T, n, H] (each thread's share
    of dH, summed after: a block of the pool adds to every row of dH).
    """
    k_w = _adam_constants(lr, beta1, beta2, eps, step, weight_decay)
    k_b = _adam_constants(lr, beta1, beta2, eps, step, 0.0)  # biases: no decay
    T = bounds.size - 1
    for c in prange(T):
        dH_parts[c] = 0.0  # each chunk adds its share
        for lo in range(bounds[c], bounds[c + 1], chunk):
            hi = min(lo + chunk, bounds[c + 1])
            zc, g, sums = z[:, lo:hi], g_pool[lo:hi], col_sums[lo:hi]
            gemm(zc, True, h, False, g, 0.0)
            sums[:] = 0.0
            for r in range(z.shape[0]):
                zr = z[r, lo:hi]  # contiguous, unlike a row of zc: see pool_logits
                for t in range(hi - lo):
                    sums[t] += zr[t]
            for t in range(hi - lo):
                if t + AHEAD < hi - lo:
                    ahead = pool[lo + t + AHEAD]
                    _prefetch_update(ahead, _grad_row(owners, slots, ahead, POOL), W, gW)
                if t + FAR < hi - lo:
                    far = pool[lo + t + FAR]
                    _prefetch_far(far, _grad_row(owners, slots, far, POOL), W, gW)
                i = pool[lo + t]
                at = _grad_row(owners, slots, i, POOL)
                _update_row(i, at, W, gW, g[t], np.float32(1.0), k_w)
                _update_bias(i, at, b, bM, bV, gb, sums[t], k_b)
            gemm(zc, False, W_pool[lo:hi], False, dH_parts[c], 1.0)
    n = dH.shape[0]
    for c in prange(T):
        for r in range(c * n // T, (c + 1) * n // T):
            for part in range(T):
                row, add = dH[r], dH_parts[part, r]
                for j in range(row.size):
                    row[j] += add[j]


# --------------------------------------------------------------------------------------------
# Adam over touched rows
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _adam_constants(lr, beta1, beta2, eps, step, weight_decay):
    """Adam's float32 constants ``(b1, 1 - b1, b2, 1 - b2, a, e, 1 - lr·decay)`` for
    :func:`_adam_step`, with the bias corrections c1 = 1 / (1 - b1^t), c2 = 1 / (1 - b2^t) of
    the global step t (lazy Adam: rows that were not touched keep their moments undecayed, as in
    sparse Adam) folded in: ``lr·c1·m / (sqrt(c2·v) + eps) = a·m / (sqrt(v) + e)`` with
    ``a = lr·c1 / sqrt(c2)`` and ``e = eps / sqrt(c2)``, two multiplies a weight fewer. All
    float32, so that the moments update in float32 lanes (``1 - b1`` computed inside promoted
    them to float64: a quarter slower)."""
    f = np.float32
    root_c2 = np.sqrt(1.0 / (1.0 - beta2 ** step))
    return (f(beta1), f(1.0 - beta1), f(beta2), f(1.0 - beta2),
            f(lr / (1.0 - beta1 ** step) / root_c2), f(eps / root_c2), f(1.0 - lr * weight_decay))


@njit(cache=True, nogil=True, inline="always")
def _adam_step(m, v, j, gj, k):
    """Update moments m[j], v[j] with gradient gj; return the step (without decay). ``k``:
    :func:`_adam_constants`."""
    mj = k[0] * m[j] + k[1] * gj
    vj = k[2] * v[j] + k[3] * gj * gj
    m[j] = mj
    v[j] = vj
    return k[4] * mj / (np.sqrt(vj) + k[5])


@njit(cache=True, nogil=True, inline="always")
def _adam_weight(w, m, v, j, gj, k):
    """Adam with decoupled weight decay on w[j] for gradient gj: ``w·(1 - lr·decay) - step``."""
    w[j] = k[6] * w[j] - _adam_step(m, v, j, gj, k)


@njit(cache=True, nogil=True, inline="always")
def _adam_row(w, m, v, g, scale, k):
    """Adam on a row w (moments m, v) whose whole gradient is ``scale * g``, computed by the
    caller's kernel (no gradient row to read or clear)."""
    for j in range(w.size):
        _adam_weight(w, m, v, j, scale * g[j], k)


@njit(cache=True, nogil=True, inline="always")
def row_parts(B, i):
    """Row i of row block ``B`` [n, 3H]: views of its weights, first and second moments [H]."""
    H = B.shape[1] // 3
    R = B[i]
    return R[:H], R[H:2 * H], R[2 * H:]


@njit(cache=True, nogil=True, inline="always")
def _update_row(i, at, B, G, g, scale, k):
    """Row i's share of a step whose gradient for it is ``scale * g`` (g: the row's length):
    with ``at`` -1 (the caller's kernel computes the row's whole gradient) its Adam step on its
    row of row block ``B``, otherwise added to row ``G[at]`` of the step's compact gradient
    (Hogwild) for Adam after the batch (:func:`_grad_row`)."""
    if at < 0:
        w, m, v = row_parts(B, i)
        _adam_row(w, m, v, g, scale, k)
    else:
        acc = G[at]
        for j in range(acc.size):
            acc[j] += scale * g[j]


@njit(cache=True, nogil=True, inline="always")
def _update_bias(i, at, b, bM, bV, gb, g, k):
    """:func:`_update_row` for bias entry i with gradient g (``k`` without decay)."""
    if at < 0:
        b[i] -= _adam_step(bM, bV, i, g, k)
    else:
        gb[at] += g


@njit(cache=True, nogil=True, inline="always")
def _adam(w, m, v, g, j, k):
    """:func:`_adam_weight` with the gradient g[j] of a gradient row, zeroed after use."""
    _adam_weight(w, m, v, j, g[j], k)
    g[j] = 0.0


@njit(cache=True, nogil=True, parallel=True, fastmath=_CONTRACT)
def adam_rows(rows, grad_rows, B, G, lr, beta1, beta2, eps, step, weight_decay):
    """Adam on rows ``rows[t]`` of row block ``B`` [n, 3d] (weights and moments, see
    :func:`row_parts`) with gradient ``G[grad_rows[t]]`` [d], zeroed after use (``arange`` for
    a step's compact gradient, row t for ``rows[t]``). The rows may come in any order: each is
    prefetched a few ahead."""
    k = _adam_constants(lr, beta1, beta2, eps, step, weight_decay)
    for t in prange(rows.size):
        if t + AHEAD < rows.size:
            prefetch_w(B[rows[t + AHEAD]])
            prefetch_w(G[grad_rows[t + AHEAD]])
        if t + FAR < rows.size:
            prefetch_l2(B[rows[t + FAR]])
            prefetch_l2(G[grad_rows[t + FAR]])
        w, m, v = row_parts(B, rows[t])
        g = G[grad_rows[t]]
        for j in range(w.size):
            _adam(w, m, v, g, j, k)


@njit(cache=True, nogil=True, parallel=True, fastmath=_CONTRACT)
def adam_entries(idx, grad_idx, W, M, V, G, lr, beta1, beta2, eps, step, weight_decay):
    """Adam on entries ``idx[t]`` of flat arrays with gradient ``G[grad_idx[t]]`` (biases: no
    decay)."""
    k = _adam_constants(lr, beta1, beta2, eps, step, 0.0)
    for t in prange(idx.size):
        i = idx[t]
        W[i] -= _adam_step(M, V, i, G[grad_idx[t]], k)
        G[grad_idx[t]] = 0.0


@njit(cache=True, nogil=True, parallel=True, fastmath=_CONTRACT)
def adam_dense(W, M, V, G, lr, beta1, beta2, eps, step, weight_decay):
    """Adam on every entry of flat arrays (biases and the small hidden stack)."""
    k = _adam_constants(lr, beta1, beta2, eps, step, weight_decay)
    for j in prange(W.size):
        _adam(W, M, V, G, j, k)
