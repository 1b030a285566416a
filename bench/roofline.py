"""A roofline for the engine's training step: how fast could it go, and how far is it.

    python -m bench.roofline --preset amazon-670k --n-train 20000 --threads 2

1. **This machine's memory bandwidth**: a STREAM-like triad ``a = b + s·c`` over float32 arrays
   of ``--stream-mb`` each (far larger than any cache), numba-parallel, on 1 thread and on
   ``--threads``; best of 5 (STREAM's convention: 3 arrays' bytes per pass). It and the
   matrix product (3.) are measured before and again after the timed window, and the higher
   of the two is the roof: on a machine shared with other tenants one measurement can fall in
   a slow minute, and a roof measured low would flatter the fraction.
2. **The bytes one training sample must move**, from the engine's resolved settings and the
   data's shape (per batch, divided by the batch size), counting each distinct row once (the
   least any implementation of this step moves), by phase:

   * ``forward_hidden``: the input rows of the sample's non-zero features (``nnz · H0 · 4``);
   * ``hash``: hashing the batch's hidden rows and drawing its pool: no bytes or operations
     counted (the rows are in cache; hashing is comparisons, not arithmetic);
   * ``select+output``: the hash-table buckets it reads (``tables · bucket · 4``) and its own
     output rows (labels + LSH candidates). A row no other sample and not the pool touches
     (*alone*) gets its Adam step there: weights read and written, both moments read and
     written, no gradient row. The others: weights read, gradient rows read and written;
   * ``pool_matmul``: the batch's shared rows, read (gathered); a pool row in no sample's own
     set gets its Adam step there (weights written, both moments read and written), the
     others' gradient rows are read and written;
   * ``backward_hidden``: an input row of one sample's features alone gets its Adam step there
     (weights, both moments read and written); the other input rows' gradient rows are read
     and written;
   * ``adam``: weights, both moments and the gradient of every other distinct touched row, read
     and written (output rows neither alone nor pool-only, input rows not alone);
   * ``rehash``: re-inserting every output row (weights read, tables written), times the
     rehashes the timed window actually ran (counted by the tables), spread over its samples.
     The schedule's interval grows (x1.25 per rehash), so the later the window starts
     (``--warm-steps``, which may run past the first epoch: each epoch a new permutation), the
     fewer it holds.

   Distinct rows per batch are estimated as draws without overlap structure:
   ``n · (1 - exp(-draws / n))`` for n rows and the batch's draws; rows alone as the LSH
   candidates' draws that no other draw of the batch meets, ``draws_c · exp(-(draws - 1) / n)``
   (at Amazon-670K shape 31,000 a batch against 30,200 counted in the engine: the estimate
   errs towards fewer bytes, a higher roofline), and pool-only rows as the pool's rows that no
   own draw meets, ``pool · exp(-own draws / n)``. The input rows, distinct and alone (a
   feature in one sample's row of the batch), are counted on the timed batches (features are
   skewed: at Amazon-670K shape 6,580 distinct and 5,800 alone a batch, against 9,260 and
   8,940 for uniform draws, the estimate used without data).
3. **This machine's arithmetic rate**: a 2,048-square float32 matrix product through numpy's
   BLAS, 1 thread and ``--threads``, best of 3; and the floating-point operations a sample
   needs per phase (its rows' dot and outer products, the pool's three matrix products,
   Adam's ~10 per updated weight; hashing not counted, its arithmetic depends on the family).
   The pool's products span the random pool and the batch's distinct labels (every sample
   meets the other samples' labels as negatives), counted on the timed batches: at
   Amazon-670K shape about 690 labels beside the 3,095 drawn rows.
   A phase's least time is the larger of its memory time and its arithmetic time: the
   classic roofline, where a phase is bound by whichever roof it meets first.
4. **The engine's measured time per phase** (its own ``timings_``, after ``--warm-steps``
   batches, over ``--steps`` batches), and the fraction of the roofline it reaches: per phase
   ``least time / measured time``, and overall ``measured samples/s / limit``; the fraction of
   the memory roof alone is reported beside it.
5. **What scattered rows allow**: the step's rows are scattered reads and writes of a few H
   floats each, which no memory system serves at the triad's rate. ``scattered_bandwidth``
   times Adam's pattern with no arithmetic (a batch's distinct output rows, in increasing
   order, each read and written: its row of a row block the output layer's size, weights and
   both moments in one run, and its row of a compact gradient; each asked for a few rows
   ahead, as the engine's kernels ask); the same bytes at that rate, the rehash at the
   triad's, give an attainable limit, reported beside the roofline.

6. **Rounds** (``--rounds R``): the timed batches in R rounds, with the ``--threads`` roofs
   (triad and matrix product) measured again just before each round and after the last. Each
   round's fraction is against the higher of the two measurements either side of it, and the
   median of the rounds is reported beside the whole window's fraction, which is against the
   highest roofs measured at any point. On a shared machine whose neighbours take bandwidth
   and cores for minutes at a time, a roof measured a minute away from the batches it judges
   can belong to another load; the rounds' spread shows how much of a fraction is the hour's.

Writes the figures as JSON to the path given with ``--out``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import numpy as np
from numba import njit, prange

from bench.common import dataset, machine, write_json
from slide.runtime import prefetch_w
from slide.kernels import AHEAD


@njit(cache=True, nogil=True, parallel=True)
def _triad(a, b, c, s):
    for i in prange(a.size):
        a[i] = b[i] + s * c[i]


def triad_arrays(mb: int) -> tuple:
    """The triad's three float32 arrays of ``mb`` MiB each, paged in."""
    n = mb * (1 << 20) // 4
    return np.zeros(n, np.float32), np.ones(n, np.float32), np.full(n, 2.0, np.float32)


def stream_bandwidth(mb: int, threads: int, reps: int = 5, arrays=None) -> float:
    """Bytes per second of the triad on ``threads`` numba threads (best of ``reps``), over
    ``arrays`` (:func:`triad_arrays`) or three fresh arrays of ``mb`` MiB."""
    from slide.runtime import set_num_threads
    set_num_threads(threads)
    a, b, c = triad_arrays(mb) if arrays is None else arrays
    _triad(a, b, c, np.float32(3.0))  # compile, page in
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        _triad(a, b, c, np.float32(3.0))
        best = min(best, time.perf_counter() - t0)
    return 3 * a.size * 4 / best


@njit(cache=True, nogil=True, parallel=True)
def _scattered_update(rows, R, D):
    """Rows ``rows`` of row block ``R`` [n, 3w] and the first ``rows.size`` rows of gradient
    ``D`` [m, w] (row t for ``rows[t]``: the step's compact gradient) read and written as Adam
    writes them (weights += first moment += second moment += gradient; gradient = 0), each
    row of ``R`` and of ``D`` asked for ``AHEAD`` rows early, as the engine's kernels ask."""
    w = D.shape[1]
    for t in prange(rows.size):
        if t + AHEAD < rows.size:
            prefetch_w(R[rows[t + AHEAD]])
            prefetch_w(D[t + AHEAD])
        r, d = R[rows[t]], D[t]
        for j in range(w):
            r[j] += r[w + j]
            r[w + j] += r[2 * w + j]
            r[2 * w + j] += d[j]
            d[j] = 0.0


def scattered_bandwidth(n_rows: int, width: int, touched: int, threads: int,
                        reps: int = 5) -> float:
    """Bytes per second (read + written) of one pass over ``touched`` distinct random rows,
    in increasing order, of a float32 row block [n_rows, 3·width] (a row's weights and both
    moments, :mod:`slide.kernels`) and over as many rows of a compact gradient [touched,
    width], both on cache lines (:func:`lsh.aligned_empty`), each row read and written: Adam's
    access pattern with no arithmetic, rows asked for ahead as in the engine, on ``threads``
    numba threads (median of ``reps`` passes, each over fresh rows)."""
    from slide.runtime import aligned_empty, set_num_threads
    set_num_threads(threads)
    rng = np.random.default_rng(0)
    sets = [np.unique(rng.integers(0, n_rows, touched)).astype(np.int32) for _ in range(reps + 1)]
    # on cache lines, as the engine's row blocks and compact gradients are
    arrays = [aligned_empty((n_rows, 3 * width), np.float32),
              aligned_empty((max(s.size for s in sets), width), np.float32)]
    for a in arrays:
        a.fill(1.0)  # paged in
    _scattered_update(sets[0], *arrays)  # compile
    times = []
    for rows in sets[1:]:
        t0 = time.perf_counter()
        _scattered_update(rows, *arrays)
        times.append((time.perf_counter() - t0) / rows.size)
    return 8 * width * 4 / float(np.median(times))


def machine_roofs(stream_mb: int, threads: int) -> tuple:
    """(triad bytes/s on 1 thread, on ``threads``, sgemm FLOP/s on 1 thread, on ``threads``)."""
    return (stream_bandwidth(stream_mb, 1), stream_bandwidth(stream_mb, threads),
            matmul_flops(1), matmul_flops(threads))


def matmul_flops(threads: int, n: int = 2048, reps: int = 3) -> float:
    """float32 floating-point operations per second of an ``n``-square matrix product through
    numpy's BLAS on ``threads`` threads (best of ``reps``)."""
    from slide.runtime import blas_threads
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    with blas_threads(threads):
        a @ b  # warm-up: thread pool, page-in
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def _distinct(n: int, draws: float) -> float:
    return n * (1.0 - math.exp(-draws / max(n, 1)))


def _alone(resolved: dict, n_labels: int, labels: float) -> float:
    """Rows of a batch in one sample's LSH candidates and in no other draw of the batch (the
    engine gives them their Adam step in the output step); none where the output is whole
    (the pool is every row)."""
    B, pool = resolved["batch_size"], resolved["pool"]
    if pool >= n_labels:
        return 0.0
    draws = B * (resolved["lsh_cap"] + labels) + pool
    return B * resolved["lsh_cap"] * math.exp(-(draws - 1) / n_labels)


def _pool_only(resolved: dict, n_labels: int, labels: float) -> float:
    """Rows of the batch's shared pool that no sample's own set holds (the engine gives them
    their Adam step with the pool's products): every row but the batch's labels where the
    output is whole."""
    own = resolved["batch_size"] * (resolved["lsh_cap"] + labels)
    return resolved["pool"] * math.exp(-own / max(n_labels, 1))


def _inputs(resolved: dict, n_features: int, nnz: float, input_rows=None) -> tuple:
    """A batch's (distinct, alone) input rows: ``input_rows`` as counted, or estimated as
    uniform draws (``B · nnz`` of ``n_features``)."""
    if input_rows is not None:
        return tuple(float(x) for x in input_rows)
    draws = resolved["batch_size"] * nnz
    return _distinct(n_features, draws), draws * math.exp(-(draws - 1) / max(n_features, 1))


def bytes_per_sample(resolved: dict, n_features: int, n_labels: int, nnz: float,
                     labels: float, rehashes_per_sample: float | None = None,
                     input_rows=None) -> dict:
    """The least bytes per training sample, by phase (see the module docstring).

    ``rehashes_per_sample``: output-layer rehashes per sample in the measured window (the
    schedule's interval grows, so a window sees fewer the later it starts); default one per
    ``resolved["rehash_every"]`` samples, the first interval. ``input_rows``: a batch's
    (distinct, alone) input rows as counted; default estimated (:func:`_inputs`)."""
    B = resolved["batch_size"]
    H0, H = resolved["hidden"][0], resolved["hidden"][-1]
    own = resolved["lsh_cap"] + labels  # a sample's own output rows
    pool = resolved["pool"]
    t = resolved.get("tables") or {}
    n_tables, bucket = t.get("L", 0), t.get("bucket_size", 0)
    u_own = _distinct(n_labels, B * own)  # distinct own rows of a batch
    u_out = _distinct(n_labels, B * own + pool)
    u_in, in_alone = _inputs(resolved, n_features, nnz, input_rows)
    alone, pool_only = _alone(resolved, n_labels, labels), _pool_only(resolved, n_labels, labels)
    per = {
        "forward_hidden": nnz * H0 * 4,
        "hash": 0.0,
        "select+output": n_tables * bucket * 4 + (alone * (H + 1) * 6 * 4
                                                  + (u_own - alone) * H * 12) / B,
        "pool_matmul": (pool * H * 4 + pool_only * (H + 1) * 5 * 4
                        + (pool - pool_only) * H * 8) / B,
        "backward_hidden": (in_alone * H0 * 6 * 4 + (u_in - in_alone) * H0 * 8) / B,
        "adam": ((u_out - alone - pool_only) * (H + 1) + (u_in - in_alone) * H0) * 8 * 4 / B,
        "rehash": (n_labels * H * 4 + n_tables * n_labels * 4) * (
            1.0 / resolved["rehash_every"] if rehashes_per_sample is None else rehashes_per_sample),
    }
    per["total"] = sum(per.values())
    return per


def _pool_columns(resolved: dict, n_labels: int, labels: float, batch_labels=None) -> float:
    """Rows of a batch's pool products: the random pool joined with the batch's distinct labels
    (``batch_labels`` as counted, or estimated as ``B · labels`` draws), so that every sample
    meets the other samples' labels as negatives (:func:`slide.sampling.shared_negatives`);
    every row where the output is whole."""
    pool = resolved["pool"]
    if pool >= n_labels:
        return float(pool)
    if batch_labels is None:
        batch_labels = _distinct(n_labels, resolved["batch_size"] * labels)
    return pool + batch_labels * (1.0 - pool / n_labels)


def flops_per_sample(resolved: dict, n_features: int, n_labels: int, nnz: float,
                     labels: float, input_rows=None, batch_labels=None) -> dict:
    """The floating-point operations per training sample, by phase (multiply and add count
    two): the phases of :func:`bytes_per_sample`, hashing not counted. ``batch_labels``: a
    batch's distinct labels as counted; default estimated (:func:`_pool_columns`)."""
    B = resolved["batch_size"]
    sizes = [int(h) for h in resolved["hidden"]]
    H0, H = sizes[0], sizes[-1]
    stack = sum(2 * a * b for a, b in itertools.pairwise(sizes))  # one pass through layers 1..
    own = resolved["lsh_cap"] + labels
    u_out = _distinct(n_labels, B * own + resolved["pool"])
    u_in, in_alone = _inputs(resolved, n_features, nnz, input_rows)
    alone, pool_only = _alone(resolved, n_labels, labels), _pool_only(resolved, n_labels, labels)
    per = {
        "forward_hidden": 2 * nnz * H0 + stack,
        "hash": 0.0,
        # per own row: its logit (a dot product), its gradient row and its share of dH; Adam's
        # step for the rows alone
        "select+output": 3 * 2 * own * H + 10 * alone * (H + 1) / B,
        # logits, dH and the gradient rows of the shared pool and the batch's labels: three
        # products over the batch; Adam's step for the pool-only rows
        "pool_matmul": 3 * 2 * _pool_columns(resolved, n_labels, labels, batch_labels) * H
                       + 10 * pool_only * (H + 1) / B,
        # the input rows' gradients (outer products), Adam's step for the input rows alone,
        # and the stack's two products per layer
        "backward_hidden": 2 * nnz * H0 + 10 * in_alone * H0 / B + 2 * stack,
        "adam": 10 * ((u_out - alone - pool_only) * (H + 1) + (u_in - in_alone) * H0) / B,
        "rehash": 0.0,
    }
    per["total"] = sum(per.values())
    return per


#: seconds to wait after a probe: BLAS's worker threads keep spinning after a product on
#: several threads, and a round started at once shared its cores with them (rounds of 10
#: batches ran at 3,400-4,700 samples/s without the wait, 3,900-8,800 with it)
_BLAS_SPIN = 0.5


def roofline_limit(need: dict, work: dict, bw: float, fl: float) -> tuple:
    """(each phase's least seconds per sample, the roofline in samples/s) for the bytes ``need``
    and operations ``work`` per sample (:func:`bytes_per_sample`, :func:`flops_per_sample`) at
    ``bw`` bytes/s and ``fl`` FLOP/s: a phase's least time is the later of its two roofs."""
    least = {k: max(need[k] / bw, work[k] / fl) for k in need if k != "total"}
    return least, 1.0 / sum(least.values())


def _builds(model) -> int:
    """The output layer's table builds so far (0 where every neuron is active)."""
    return model.tables_.builds if model.tables_ is not None else 0


def batch_order(n_rows: int, batch: int, n_batches: int) -> np.ndarray:
    """Row ids int64 [n_batches · batch] of ``n_batches`` batches, epoch after epoch: each epoch a
    new permutation of the ``n_rows`` rows cut to whole batches, so that no batch holds a row
    twice and a window may sit as late in training as a run's steady state. The first epoch is
    ``default_rng(0).permutation(n_rows)``, the order of every window inside it."""
    per_epoch = n_rows // batch
    orders = [np.random.default_rng(0 if e == 0 else [0, e]).permutation(n_rows)[:per_epoch * batch]
              for e in range(-(-n_batches // per_epoch))]
    return np.concatenate(orders)[:n_batches * batch]


def warmed_model(preset: str, n_train: int, threads: int, config: dict, warm_steps: int,
                 steps: int):
    """A model of the engine (``config``: overrides of its settings; seed 0, no early stopping)
    on ``n_train`` rows of ``preset``, trained ``warm_steps`` batches (compile, the first
    rehashes) in :func:`batch_order`. Returns ``(X, Y, Xp, model, timed)``: the data, its
    preprocessed rows and the row ids int64 of the ``steps`` batches that follow, for the
    caller to time. Raises ValueError where the rows hold no whole batch."""
    from slide.estimator import SlideClassifier
    X, Y, _, _ = dataset(preset, n_train, 10)
    model = SlideClassifier(threads=threads, early_stopping=False, seed=0, **config)
    model.initialize(X, Y)
    Y = model.targets(X, Y)  # over the output rows
    B = model.batch_size_
    if X.shape[0] < B:
        raise ValueError(f"--n-train must hold a batch of {B} rows, got {X.shape[0]}")
    Xp = model.preprocess(X)
    order = batch_order(X.shape[0], B, warm_steps + steps)
    model.state_.train_rows(Xp, Y, order[:warm_steps * B])
    return X, Y, Xp, model, order[warm_steps * B:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="amazon-670k")
    p.add_argument("--n-train", type=int, default=20000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="timed batches")
    p.add_argument("--warm-steps", type=int, default=8,
                   help="batches before the timed ones (compile, the first rehashes)")
    p.add_argument("--rounds", type=int, default=1,
                   help="split the timed batches into rounds, the roofs measured between them")
    p.add_argument("--stream-mb", type=int, default=512)
    p.add_argument("--config", default="{}", help="JSON overrides of the engine's settings")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not 1 <= args.rounds <= args.steps:
        p.error(f"--rounds must be between 1 and --steps ({args.steps}), got {args.rounds}")

    before = machine_roofs(args.stream_mb, args.threads)

    w = args.warm_steps
    try:
        X, Y, Xp, model, timed = warmed_model(args.preset, args.n_train, args.threads,
                                              json.loads(args.config), w, args.steps)
    except ValueError as e:
        p.error(str(e))
    B = model.batch_size_
    model.state_.timings = {}
    cuts = np.arange(args.rounds + 1) * args.steps // args.rounds * B
    # the N-thread roofs just before each round, and after the last (the window's own
    # measurements where there is one round)
    arrays = triad_arrays(args.stream_mb) if args.rounds > 1 else None
    probes = [] if args.rounds > 1 else [(before[1], before[3])]
    rounds = []
    for r in range(args.rounds):
        if arrays is not None:
            probes.append((stream_bandwidth(args.stream_mb, args.threads, 3, arrays),
                           matmul_flops(args.threads)))
            time.sleep(_BLAS_SPIN)
        part = timed[cuts[r]:cuts[r + 1]]
        builds = _builds(model)
        t0 = time.perf_counter()
        model.state_.train_rows(Xp, Y, part)
        rounds.append({"samples": int(part.size), "seconds": time.perf_counter() - t0,
                       "rehashes": _builds(model) - builds})
    del arrays
    seconds = sum(r["seconds"] for r in rounds)
    rate = timed.size / seconds
    after = machine_roofs(args.stream_mb, args.threads)
    probes.append((after[1], after[3]))
    # the whole window against the highest roofs measured around it
    bw1, fl1 = max(before[0], after[0]), max(before[2], after[2])
    bw, fl = (max(x) for x in zip((before[1], before[3]), *probes))
    for when, roofs in (("before", before), ("after", after)):
        print(f"{when} the window: triad {roofs[0] / 1e9:.1f} GB/s on 1 thread, "
              f"{roofs[1] / 1e9:.1f} GB/s on {args.threads}; sgemm {roofs[2] / 1e9:.0f} GFLOP/s "
              f"on 1 thread, {roofs[3] / 1e9:.0f} GFLOP/s on {args.threads}")
    rehashes = sum(r["rehashes"] for r in rounds)
    shape = (X.shape[1], Y.shape[1], X.nnz / X.shape[0], Y.nnz / Y.shape[0])
    batches = [timed[lo:lo + B] for lo in range(0, timed.size, B)]
    counts = [np.bincount(Xp[rows].indices, minlength=X.shape[1]) for rows in batches]
    inputs = (np.mean([(c > 0).sum() for c in counts]), np.mean([(c == 1).sum() for c in counts]))
    batch_labels = float(np.mean([np.unique(Y[rows].indices).size for rows in batches]))
    need = bytes_per_sample(model.resolved_, *shape, rehashes_per_sample=rehashes / timed.size,
                            input_rows=inputs)
    work = flops_per_sample(model.resolved_, *shape, input_rows=inputs, batch_labels=batch_labels)
    least, limit = roofline_limit(need, work, bw, fl)
    memory_limit = bw / need["total"]
    for r, round_ in enumerate(rounds):  # each round against the higher of its two probes
        r_bw, r_fl = (max(x) for x in zip(probes[r], probes[r + 1]))
        r_need = bytes_per_sample(model.resolved_, *shape, input_rows=inputs,
                                  rehashes_per_sample=round_["rehashes"] / round_["samples"])
        r_rate = round_["samples"] / round_["seconds"]
        round_.update(bandwidth=r_bw, matmul_flops=r_fl, samples_per_second=r_rate,
                      roofline_samples_per_second=roofline_limit(r_need, work, r_bw, r_fl)[1])
        round_["fraction"] = r_rate / round_["roofline_samples_per_second"]
    # what scattered rows allow: the same bytes at Adam's pattern's rate instead of the
    # triad's, for every phase but the rehash (which streams the weights)
    H = int(model.resolved_["hidden"][-1])
    u_out = int(Y.shape[1] * -math.expm1(-(B * (model.resolved_["lsh_cap"] + shape[3])
                                          + model.resolved_["pool"]) / Y.shape[1]))
    sbw = scattered_bandwidth(Y.shape[1], H, max(u_out, 1), args.threads)
    attainable = {k: max(need[k] / (bw if k == "rehash" else sbw), work[k] / fl) for k in least}
    attainable_limit = 1.0 / sum(attainable.values())
    print(f"{args.preset}, {args.n_train} rows, batch {B}, hidden {model.resolved_['hidden']}, "
          f"active {model.resolved_['active_target']} ({model.resolved_['lsh_cap']} LSH + "
          f"{model.resolved_['pool']} shared), {args.threads} threads; batches {w} to "
          f"{w + args.steps} timed, {rehashes} rehashes among them; input rows a batch: "
          f"{inputs[0]:.0f} distinct, {inputs[1]:.0f} alone; {batch_labels:.0f} distinct labels "
          f"a batch join the shared pool")
    print(f"{'phase':16s} {'KB/sample':>10s} {'MFLOP/sample':>13s} {'bound':>8s} {'least us':>9s} "
          f"{'us/sample':>10s} {'GB/s':>7s} {'GFLOP/s':>8s} {'of roofline':>12s}")
    phases = []
    for name, t_least in least.items():
        b, f = need[name], work[name]
        sec = model.timings_.get(name, 0.0) / timed.size
        bound = "compute" if f / fl > b / bw else "memory"
        phases.append({"phase": name, "bytes_per_sample": b, "flops_per_sample": f,
                       "bound": bound, "least_seconds_per_sample": t_least,
                       "seconds_per_sample": sec,
                       "bytes_per_second": b / sec if sec else None,
                       "flops_per_second": f / sec if sec else None,
                       "fraction_of_memory_roof": (b / bw) / sec if sec else None,
                       "fraction_of_roofline": t_least / sec if sec else None,
                       "fraction_of_attainable": attainable[name] / sec if sec else None})
        print(f"{name:16s} {b / 1e3:10.1f} {f / 1e6:13.3f} {bound:>8s} {1e6 * t_least:9.1f} "
              f"{1e6 * sec:10.1f} {b / sec / 1e9 if sec else 0:7.2f} {f / sec / 1e9 if sec else 0:8.1f} "
              f"{t_least / sec if sec else 0:12.1%}")
    other = seconds - sum(model.timings_.values())
    print(f"{'(outside phases)':16s} {'':10s} {'':13s} {'':8s} {'':9s} {1e6 * other / timed.size:10.1f}")
    print(f"total: {need['total'] / 1e3:.1f} KB and {work['total'] / 1e6:.2f} MFLOP per sample; "
          f"roofline {limit:.0f} samples/s (memory roof alone {memory_limit:.0f} at "
          f"{bw / 1e9:.1f} GB/s); measured {rate:.0f} samples/s = {rate / limit:.1%} of it "
          f"({rate / memory_limit:.1%} of the memory roof alone)")
    print(f"scattered rows (Adam's pattern, {max(u_out, 1)} rows of a row block of 3 x {H} floats "
          f"and of a gradient): {sbw / 1e9:.1f} GB/s; at that rate the step could reach "
          f"{attainable_limit:.0f} samples/s: measured {rate / attainable_limit:.1%} of it")
    if args.rounds > 1:
        fractions = [r["fraction"] for r in rounds]
        print(f"{'round':>5s} {'batches':>8s} {'samples/s':>10s} {'triad GB/s':>11s} "
              f"{'GFLOP/s':>8s} {'roofline':>9s} {'fraction':>9s}")
        for r, round_ in enumerate(rounds):
            print(f"{r + 1:5d} {round_['samples'] // B:8d} {round_['samples_per_second']:10.0f} "
                  f"{round_['bandwidth'] / 1e9:11.1f} {round_['matmul_flops'] / 1e9:8.0f} "
                  f"{round_['roofline_samples_per_second']:9.0f} {round_['fraction']:9.1%}")
        print(f"rounds against the roofs measured either side: median {np.median(fractions):.1%} "
              f"of the roofline (from {min(fractions):.1%} to {max(fractions):.1%})")
    if args.out:
        write_json(args.out, {"machine": machine(), "args": vars(args),
                              "bandwidth": {"1": bw1, str(args.threads): bw},
                              "matmul_flops": {"1": fl1, str(args.threads): fl},
                              "roofs_before_after": {"before": list(before),
                                                     "after": list(after)},
                              "probes": [list(x) for x in probes],
                              "resolved": model.resolved_, "rehashes_in_window": rehashes,
                              "input_rows_per_batch": {"distinct": inputs[0], "alone": inputs[1]},
                              "distinct_labels_per_batch": batch_labels,
                              "bytes_per_sample": need,
                              "flops_per_sample": work, "phases": phases,
                              "measured_samples_per_second": rate,
                              "roofline_samples_per_second": limit,
                              "memory_roof_samples_per_second": memory_limit,
                              "fraction": rate / limit,
                              "fraction_of_memory_roof": rate / memory_limit,
                              "scattered_bandwidth": sbw,
                              "attainable_samples_per_second": attainable_limit,
                              "fraction_of_attainable": rate / attainable_limit,
                              "rounds": rounds,
                              "fraction_median_of_rounds": float(np.median(
                                  [r["fraction"] for r in rounds]))})


if __name__ == "__main__":
    main()
