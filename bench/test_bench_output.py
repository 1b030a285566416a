"""The output step on its own, at Amazon-670K shape, with its rows in memory or in cache.

    pytest bench/test_bench_output.py --benchmark-only --benchmark-json OUT.json

A batch of 128 samples, each with 2 labels and 256 other own rows (the default ``lsh_cap``)
drawn afresh each round, and a pool of 3,095 logits, through ``output_step``: every own row's
forward dot product, the softmax over own rows and pool, and each own row's gradient and Adam
step in place (every row is marked ALONE). The rows come from the first ``rows`` rows of an
output layer of 670,091 rows held as the row block it trains in (weights and both moments,
1 GB):

* ``rows=670091``: the whole layer, so that nearly every row comes from memory, as in training;
* ``rows=40000``: a 61 MB slice, which stays in the last-level cache between rounds: the same
  work without the memory system's wait, the floor the kernel's arithmetic and cache traffic
  set. On 2 threads, samples there share rows, and two cores writing one row's lines pass them
  back and forth; on 1 thread they do not.

The ratio of the two says how much of the kernel is waiting on memory. Medians over rounds;
compile in the warm-up round.
"""
import numpy as np
import pytest

from bench.common import output_layer
from slide.runtime import engine_threads
from slide import kernels

N_LABELS, H, POOL, BATCH, LABELS, CANDIDATES = 670_091, 128, 3_095, 128, 2, 256


@pytest.fixture(scope="module")
def layer():
    layer = output_layer(N_LABELS, H, BATCH)
    layer["owners"][:] = kernels.ALONE  # every own row has its Adam step in the kernel
    layer["z"] = layer["rng"].standard_normal((BATCH, POOL), np.float32)
    return layer


@pytest.mark.parametrize("rows", [N_LABELS, 40_000])
@pytest.mark.parametrize("threads", [1, 2])
def test_output_step(benchmark, layer, threads, rows):
    k = LABELS + CANDIDATES
    y_indptr = np.arange(BATCH + 1, dtype=np.int64) * LABELS
    n_active = np.full(BATCH, k, np.int32)
    dH, losses = np.empty((BATCH, H), np.float32), np.empty(BATCH, np.float32)
    grads = np.zeros((1, H), np.float32), np.zeros(1, np.float32)  # no row is SHARED
    with engine_threads(threads) as n:
        logits = np.empty((n, k), np.float32)

        def setup():
            rng = layer["rng"]
            # distinct rows within a sample, as its own set is
            active = np.stack([rng.choice(rows, k, replace=False) for _ in range(BATCH)])
            return (active.astype(np.int32), layer["z"].copy()), {}

        def one_batch(active, z):
            kernels.output_step(y_indptr, layer["h"], layer["block"], layer["b"], *grads,
                                layer["bM"], layer["bV"], layer["owners"], layer["slots"], z,
                                active, n_active, n, logits, dH, losses, np.zeros((0, 3), np.float32),
                                np.zeros((0, 1), np.float32),
                                1e-3, 0.9, 0.999, 1e-8, 10, 1.0)

        benchmark.pedantic(one_batch, setup=setup, rounds=40, warmup_rounds=1)
    benchmark.extra_info.update(threads=n, rows=rows, own_rows=k, pool=POOL)
