"""numba kernels of the sparse engine: forward, active-set selection, backward, Adam.

Array layout (all float32, C-contiguous):

* input layer  ``W0`` [n_features, H0] (input-major: a sample's non-zero features each read one
  contiguous row), ``b0`` [H0];
* hidden stack ``Wh`` flat [Σ H_l·H_{l-1}] with ``h_off`` int64 [n_hidden] offsets (each block is
  [H_l, H_{l-1}]), ``bh`` flat [Σ H_l] with ``b_off``; the stack holds layers 1..n_hidden-1;
* output layer ``W`` [n_out, H_last] (neuron-major: an active neuron's row is contiguous), ``b``.

Per-sample activations of all hidden layers are stored back to back in ``acts`` [batch, Σ H].
A sample's output active set is its own neurons (its labels and LSH candidates), handled here,
plus a random pool shared by the batch, whose logits and gradients are matrix products
(:func:`pool_logits`, :func:`pool_gradients`). Gradients go into shared accumulators shaped
like the parameters, lock-free (Hogwild): threads may race on a row and lose an addition, by
design. With one thread everything is deterministic.
"""
import numpy as np
from numba import njit, prange

from lsh.tables import query_union, select_candidates

#: the dot products may be summed in any order: LLVM then vectorises the reduction (a strict
#: left-to-right float sum cannot be), 3-4x faster over rows scattered in a 670K-row layer. The
#: order is fixed by the compiled code, so one thread still repeats exactly.
_REASSOC = {"reassoc", "contract"}


@njit(cache=True, nogil=True, fastmath=_REASSOC)
def _dot(a, b):
    """Σ a[j]·b[j] over two float32 vectors of equal length (float32 result)."""
    s = np.float32(0.0)
    for j in range(a.size):
        s += a[j] * b[j]
    return s


# --------------------------------------------------------------------------------------------
# Forward through the hidden layers
# --------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, parallel=True)
def forward_input(x_indptr, x_indices, x_data, W0, b0, acts):
    """First hidden layer, ReLU(x W0 + b0), for a batch of CSR rows into ``acts[:, :H0]``."""
    H0 = W0.shape[1]
    for r in prange(x_indptr.size - 1):
        h = acts[r, :H0]
        h[:] = b0
        for p in range(x_indptr[r], x_indptr[r + 1]):
            row = W0[x_indices[p]]
            v = x_data[p]
            for j in range(H0):
                h[j] += v * row[j]
        for j in range(H0):
            h[j] = max(h[j], np.float32(0.0))


@njit(cache=True, nogil=True, parallel=True)
def forward_layer(acts, lo_in, lo_out, W, b, active, n_active):
    """Hidden layer ReLU(W h + b) from ``acts[:, lo_in:lo_in+n_in]`` into
    ``acts[:, lo_out:lo_out+n_out]`` for W [n_out, n_in]. With ``active`` [n, m] (m > 0) only
    the neurons ``active[r, :n_active[r]]`` are computed and the others are 0 (a sampled layer);
    with m == 0 every neuron is."""
    n_out, n_in = W.shape
    for r in prange(acts.shape[0]):
        prev = acts[r, lo_in:lo_in + n_in]
        out = acts[r, lo_out:lo_out + n_out]
        k = n_out if active.shape[1] == 0 else n_active[r]
        if active.shape[1] > 0:
            out[:] = 0.0
        for a in range(k):
            i = a if active.shape[1] == 0 else active[r, a]
            out[i] = max(b[i] + _dot(W[i], prev), np.float32(0.0))


# --------------------------------------------------------------------------------------------
# Active-set selection
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _select_own(labels, codes, buckets, seen, stamp, hits, gen, cand, hist, lsh_cap, active):
    """A sample's own active neurons: its labels, then up to ``lsh_cap`` LSH candidates ranked
    by hit count. Returns (own count, union size): the query's whole union (labels aside) is
    left in ``cand[:union]``; the labels and the union are stamped with ``gen``."""
    n = 0
    for i in range(labels.size):
        lab = labels[i]
        if stamp[lab] != gen:
            stamp[lab] = gen
            active[n] = lab
            n += 1
    u = 0
    if buckets.shape[0] > 0 and lsh_cap > 0:
        u = query_union(buckets, seen, codes, stamp, hits, gen, cand)
        n += select_candidates(cand, u, hits, hist, lsh_cap, True, active[n:])
    return n, u


# --------------------------------------------------------------------------------------------
# Training step: the output layer, then back through the hidden layers
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, parallel=True)
def output_step(y_indptr, y_indices, acts, codes, W, b, gW, gb, buckets, seen, stamp, hits, gens,
                cand, hist, lsh_cap, pool_pos, zpool, active, n_active, bounds, logits_buf, dH,
                losses):
    """Softmax cross-entropy over each sample's active set, and the output layer's gradients.

    A sample's active set is its own neurons (labels + LSH candidates, see :func:`_select_own`)
    plus the batch's shared random pool of P neurons. The pool's logits ``zpool`` [n, P] come in
    precomputed (one matrix product for the batch); pool neurons that are also in the sample's
    own set, or that its LSH query found but the cap cut, are left out: the pool stands for the
    random rest of the layer. They are found through ``pool_pos`` int32 [n_labels] (a neuron's
    position in the pool, -1 outside it): a lookup per found neuron instead of a stamp check
    per pool neuron, and the pool's max and exp become plain loops over a contiguous row.

    On return ``zpool`` holds the pool's logit gradients (scaled by 1/n) for the caller's
    matrix products, ``dH`` [n, H] the own set's share of the gradient w.r.t. the last hidden
    layer (scaled by 1/n), and the own rows' gradients are added to ``gW``/``gb`` (Hogwild).
    Target: uniform over the sample's labels. ``losses`` [n] gets each sample's loss;
    ``active``/``n_active`` the own sets (for Adam).
    """
    n = y_indptr.size - 1
    scale = np.float32(1.0 / n)
    H = W.shape[1]
    lo_last = acts.shape[1] - H
    P = zpool.shape[1]
    for c in prange(bounds.size - 1):
        logits = logits_buf[c]
        st = stamp[c]
        for r in range(bounds[c], bounds[c + 1]):
            gens[c] += 1
            gen = gens[c]
            labels = y_indices[y_indptr[r]: y_indptr[r + 1]]
            own = active[r]
            k, u = _select_own(labels, codes[r], buckets, seen, st, hits[c], gen, cand[c],
                               hist[c], lsh_cap, own)
            n_active[r] = k
            h = acts[r, lo_last:]
            zp = zpool[r]
            zmax = np.float32(-np.inf)
            for a in range(k):
                s = b[own[a]] + _dot(W[own[a]], h)
                logits[a] = s
                zmax = max(zmax, s)
            # the pool is the random rest: out of it go the sample's own neurons and whatever
            # else its query found (the candidates the cap cut); their exp below is 0
            for a in range(k):
                j = pool_pos[own[a]]
                if j >= 0:
                    zp[j] = -np.inf
            found = cand[c]
            for a in range(u):
                j = pool_pos[found[a]]
                if j >= 0:
                    zp[j] = -np.inf
            for j in range(P):
                zmax = max(zmax, zp[j])
            total = np.float32(0.0)
            for a in range(k):
                logits[a] = np.exp(logits[a] - zmax)
                total += logits[a]
            for j in range(P):
                zp[j] = np.exp(zp[j] - zmax)
                total += zp[j]
            inv = np.float32(1.0) / total
            n_lab = labels.size
            loss = np.float32(0.0)
            for a in range(n_lab):  # labels are the first n_lab own neurons
                loss -= np.log(max(logits[a] * inv, np.float32(1e-30)))
            losses[r] = loss / max(n_lab, 1)
            # g = p - y; the own set's share of dh here, the pool's share is a matrix product
            dh = dH[r]
            dh[:] = 0.0
            y = np.float32(1.0 / max(n_lab, 1))
            for a in range(k):
                gs = (logits[a] * inv - (y if a < n_lab else np.float32(0.0))) * scale
                i = own[a]
                wa = W[i]
                ga = gW[i]
                gb[i] += gs
                for j in range(H):
                    dh[j] += gs * wa[j]
                    ga[j] += gs * h[j]
            for j in range(P):
                zp[j] *= inv * scale


@njit(cache=True, nogil=True)
def _backward_hidden(x_ids, x_vals, act, dh_last, W0, Wh, h_off, sizes, gW0, gb0, gWh, gbh,
                     b_off, dbuf):
    """Back-propagate ``dh_last`` (gradient w.r.t. the last hidden activation) to all hidden
    parameters; ``dbuf`` is scratch of size max(sizes) * 2."""
    n_layers = sizes.size
    # offsets of each layer's activation inside act
    lo_last = 0
    for l in range(n_layers - 1):
        lo_last += sizes[l]
    m = dbuf.size // 2
    cur = dbuf[:m]
    nxt = dbuf[m:]
    H = sizes[n_layers - 1]
    for j in range(H):
        cur[j] = dh_last[j] if act[lo_last + j] > 0 else np.float32(0.0)
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
            cur[j] = nxt[j] if prev[j] > 0 else np.float32(0.0)
        lo = lo_in
    H0 = sizes[0]
    for j in range(H0):
        gb0[j] += cur[j]
    for p in range(x_ids.size):
        g = gW0[x_ids[p]]
        v = x_vals[p]
        for j in range(H0):
            g[j] += v * cur[j]


@njit(cache=True, nogil=True, parallel=True)
def backward_hidden(x_indptr, x_indices, x_data, acts, dH, W0, Wh, h_off, sizes, gW0, gb0, gWh,
                    gbh, b_off, bounds, dbuf):
    """Back-propagate ``dH`` [n, H_last] (gradient w.r.t. the last hidden activations, already
    scaled by 1/n) into the hidden layers' gradients (Hogwild); ``dbuf`` [threads, 2·max H]."""
    for c in prange(bounds.size - 1):
        for r in range(bounds[c], bounds[c + 1]):
            lo, hi = x_indptr[r], x_indptr[r + 1]
            _backward_hidden(x_indices[lo:hi], x_data[lo:hi], acts[r], dH[r], W0, Wh, h_off, sizes,
                             gW0, gb0, gWh, gbh, b_off, dbuf[c])


# --------------------------------------------------------------------------------------------
# The shared pool: its logits and gradients as matrix products on numba's threads
# --------------------------------------------------------------------------------------------
# Each thread takes a contiguous block of the pool and multiplies only its own rows, through a
# single-threaded BLAS (numba's np.dot calls scipy's BLAS, which the caller holds at one thread:
# see lsh.engine_threads): its weight rows are gathered, multiplied and their gradients added
# back while in its cache. A multi-threaded BLAS instead would leave numba's workers spinning
# beside BLAS's between kernels; one BLAS thread alone left the other cores idle for a third
# of the step at 16 threads.
@njit(cache=True, nogil=True)
def _transpose(src, dst):
    """dst[j, r] = src[r, j] for src [n, m] and dst [m, n] (either may be a strided view), 16
    rows of src at a time so that their cache lines are read whole."""
    n, m = src.shape
    for r0 in range(0, n, 16):
        for j in range(m):
            for r in range(r0, min(r0 + 16, n)):
                dst[j, r] = src[r, j]


@njit(cache=True, nogil=True, parallel=True)
def pool_logits(h, W, b, pool, W_pool, z, z_t, bounds):
    """The shared pool's logits ``z = h @ W[pool].T + b[pool]``.

    ``h`` float32 [n, H] (the last hidden layer), ``W`` float32 [n_out, H], ``b`` [n_out],
    ``pool`` int32 [P]. ``W_pool`` float32 [P, H] receives ``W[pool]`` (the backward pass
    reads it again), ``z`` float32 [n, P] the logits; ``z_t`` [P, n] is scratch. Thread c
    takes pool positions ``bounds[c]:bounds[c + 1]`` (int64 [T + 1]).
    """
    for c in prange(bounds.size - 1):
        lo, hi = bounds[c], bounds[c + 1]
        if hi > lo:
            Wc, zt = W_pool[lo:hi], z_t[lo:hi]
            for t in range(hi - lo):
                Wc[t] = W[pool[lo + t]]
            np.dot(Wc, h.T, zt)
            for t in range(hi - lo):
                zt[t] += b[pool[lo + t]]
            _transpose(zt, z[:, lo:hi])


@njit(cache=True, nogil=True, parallel=True)
def pool_gradients(h, W_pool, z, pool, dH, gW, gb, z_t, g_pool, dH_parts, bounds):
    """Back through the shared pool, given its logit gradients ``z`` float32 [n, P]:
    ``dH += z @ W_pool`` and, Hogwild, ``gW[pool] += z.T @ h``, ``gb[pool] += z.sum(0)``.

    Shapes and ``bounds`` as in :func:`pool_logits`; ``dH`` float32 [n, H]. Scratch: ``z_t``
    [P, n], ``g_pool`` [P, H] and ``dH_parts`` [T, n, H] (each thread's share of dH, summed
    after: a block of the pool adds to every row of dH).
    """
    T = bounds.size - 1
    for c in prange(T):
        lo, hi = bounds[c], bounds[c + 1]
        if hi > lo:
            zt, g = z_t[lo:hi], g_pool[lo:hi]
            _transpose(z[:, lo:hi], zt)
            np.dot(zt, h, g)
            for t in range(hi - lo):
                i = pool[lo + t]
                gb[i] += zt[t].sum()
                gW[i] += g[t]
            np.dot(zt.T, W_pool[lo:hi], dH_parts[c])
        else:
            dH_parts[c] = 0.0
    n = dH.shape[0]
    for c in prange(T):
        for r in range(c * n // T, (c + 1) * n // T):
            for part in range(T):
                dH[r] += dH_parts[part, r]


# --------------------------------------------------------------------------------------------
# Adam over touched rows
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def unique_rows(extra, lists, lengths, mark, out):
    """Distinct ids of ``extra`` [m] and of ragged ``lists`` [n, w] (first ``lengths[i]`` of each
    row) into ``out``, in increasing order; ``mark`` uint8 [n_ids] is all zero on entry and on
    exit. Returns the count. The order is Adam's: walking the parameter rows forward lets the
    prefetcher follow (a third faster than in discovery order at 670K rows), and reading the
    marks back costs one pass over ``n_ids`` bytes (a batch's 8,600 input ids of 135,909: 0.05
    ms against 0.68 for ``np.unique``'s sort). One thread: split over two, the random marks and
    the pass took as long or longer."""
    for i in extra:
        mark[i] = 1
    for r in range(lists.shape[0]):
        for a in range(lengths[r]):
            mark[lists[r, a]] = 1
    n = 0
    for i in range(mark.size):
        if mark[i]:
            mark[i] = 0
            out[n] = i
            n += 1
    return n


@njit(cache=True, nogil=True, inline="always")
def _adam_step(m, v, j, gj, b1, b2, lr, eps, c1, c2):
    """Update moments m[j], v[j] with gradient gj; return the weight decrement."""
    m[j] = b1 * m[j] + (1 - b1) * gj
    v[j] = b2 * v[j] + (1 - b2) * gj * gj
    return lr * (m[j] * c1) / (np.sqrt(v[j] * c2) + eps)


@njit(cache=True, nogil=True, inline="always")
def _adam(w, m, v, g, j, b1, b2, lr, eps, c1, c2, decay):
    w[j] -= _adam_step(m, v, j, g[j], b1, b2, lr, eps, c1, c2) + decay * w[j]
    g[j] = 0.0


@njit(cache=True, nogil=True)
def _adam_constants(lr, beta1, beta2, eps, step):
    """float32 constants; bias corrections for the global step (lazy Adam: rows that were not
    touched keep their moments undecayed, as in sparse Adam)."""
    return (np.float32(beta1), np.float32(beta2), np.float32(lr), np.float32(eps),
            np.float32(1.0 / (1.0 - beta1 ** step)), np.float32(1.0 / (1.0 - beta2 ** step)))


@njit(cache=True, nogil=True, parallel=True)
def adam_rows(rows, grad_rows, W, M, V, G, lr, beta1, beta2, eps, step, weight_decay):
    """Adam on rows ``rows[t]`` of W [n, d] (moments M, V) with gradient ``G[grad_rows[t]]``,
    zeroed after use: ``grad_rows = rows`` for full-size accumulators, ``arange`` for a compact
    block of gradient rows."""
    b1, b2, lr32, eps32, c1, c2 = _adam_constants(lr, beta1, beta2, eps, step)
    decay = np.float32(lr * weight_decay)
    for t in prange(rows.size):
        i = rows[t]
        w, m, v, g = W[i], M[i], V[i], G[grad_rows[t]]
        for j in range(w.size):
            _adam(w, m, v, g, j, b1, b2, lr32, eps32, c1, c2, decay)


@njit(cache=True, nogil=True, parallel=True)
def adam_entries(idx, grad_idx, W, M, V, G, lr, beta1, beta2, eps, step, weight_decay):
    """Adam on entries ``idx[t]`` of flat arrays with gradient ``G[grad_idx[t]]`` (biases)."""
    b1, b2, lr32, eps32, c1, c2 = _adam_constants(lr, beta1, beta2, eps, step)
    for t in prange(idx.size):
        i = idx[t]
        gj = G[grad_idx[t]]
        W[i] -= _adam_step(M, V, i, gj, b1, b2, lr32, eps32, c1, c2)
        G[grad_idx[t]] = 0.0


@njit(cache=True, nogil=True, parallel=True)
def adam_dense(W, M, V, G, lr, beta1, beta2, eps, step, weight_decay):
    """Adam on every entry of flat arrays (biases and the small hidden stack)."""
    b1, b2, lr32, eps32, c1, c2 = _adam_constants(lr, beta1, beta2, eps, step)
    decay = np.float32(lr * weight_decay)
    for j in prange(W.size):
        _adam(W, M, V, G, j, b1, b2, lr32, eps32, c1, c2, decay)


# --------------------------------------------------------------------------------------------
# Inference
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, parallel=True)
def score_candidates(acts_last, W, b, cand, lengths, out):
    """out[r, a] = W[cand[r, a]] · h_r + b for the first lengths[r] candidates, -inf after."""
    for r in prange(cand.shape[0]):
        h = acts_last[r]
        for a in range(cand.shape[1]):
            if a >= lengths[r]:
                out[r, a] = -np.inf
                continue
            i = cand[r, a]
            out[r, a] = b[i] + _dot(W[i], h)
