"""The shared pool's two kernels on their own, at Amazon-670K shape, on 1 and 2 threads.

    pytest bench/test_bench_pool.py --benchmark-only --benchmark-json OUT.json

A batch of 128 hidden rows (H = 128) against a pool of 3,095 rows drawn afresh each round from
an output layer of 670,091 rows, held as the row block it trains in (weights and both Adam
moments, 1 GB): ``pool_logits`` (gather the pool's rows, its logits as one product per thread)
and ``pool_gradients`` (the pool rows' gradients and Adam steps in place, every pool row in no
sample's own set, and the hidden gradient). These are the pool phase of the training step
without the rest of it, so that a change to them can be timed at a resolution the whole step,
on a shared machine, does not give. Medians over rounds; compile in the warm-up round.
"""
import numpy as np
import pytest

from bench.common import output_layer
from slide.runtime import engine_threads, thread_chunks
from slide import kernels
from slide.sampling import shared_negatives

N_LABELS, H, POOL, BATCH = 670_091, 128, 3_095, 128


@pytest.fixture(scope="module")
def layer():
    return output_layer(N_LABELS, H, BATCH)


def _pool(layer):
    """The step's own draw of a pool (no batch labels joined to it here)."""
    return shared_negatives(int(layer["rng"].integers(2**63)), N_LABELS, POOL, np.empty(0, np.int32))


def _buffers(threads):
    return (np.empty((POOL, H), np.float32), np.empty((BATCH, POOL), np.float32),
            np.empty(POOL, np.float32), np.empty((POOL, H), np.float32),
            np.empty((threads, BATCH, H), np.float32))


@pytest.mark.parametrize("threads", [1, 2])
def test_pool_logits(benchmark, layer, threads):
    with engine_threads(threads) as n:
        bounds = thread_chunks(POOL)
        W_pool, z, vec, _, _ = _buffers(n)

        def one_batch(pool):
            kernels.pool_logits(layer["h"], layer["block"], layer["b"], pool, W_pool, z, vec,
                                bounds, kernels.POOL_CHUNK)

        benchmark.pedantic(one_batch, setup=lambda: ((_pool(layer),), {}), rounds=60,
                           warmup_rounds=1)
    benchmark.extra_info.update(threads=n, pool=POOL, n_labels=N_LABELS)


@pytest.mark.parametrize("threads", [1, 2])
def test_pool_gradients(benchmark, layer, threads):
    owners = layer["owners"]
    with engine_threads(threads) as n:
        bounds = thread_chunks(POOL)
        W_pool, z, vec, g_pool, dH_parts = _buffers(n)
        dH = np.zeros((BATCH, H), np.float32)
        grads = np.zeros((1, H), np.float32), np.zeros(1, np.float32)  # no row is SHARED

        def setup():
            pool = _pool(layer)
            owners[:] = kernels.UNTOUCHED
            owners[pool] = kernels.POOL  # in no sample's own set: Adam in place
            kernels.pool_logits(layer["h"], layer["block"], layer["b"], pool, W_pool, z, vec,
                                bounds, kernels.POOL_CHUNK)
            np.multiply(z, np.float32(1e-3), out=z)  # stands for the logit gradients
            return (pool,), {}

        def one_batch(pool):
            kernels.pool_gradients(layer["h"], W_pool, z, pool, dH, layer["block"], layer["b"],
                                   *grads, layer["bM"], layer["bV"], owners, layer["slots"],
                                   g_pool, vec, dH_parts, bounds, kernels.POOL_CHUNK,
                                   1e-3, 0.9, 0.999, 1e-8, 10, 0.1)

        benchmark.pedantic(one_batch, setup=setup, rounds=60, warmup_rounds=1)
    benchmark.extra_info.update(threads=n, pool=POOL, n_labels=N_LABELS)
