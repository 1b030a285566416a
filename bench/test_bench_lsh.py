"""LSH table build and query at Amazon-670K scale: 670,091 neurons of dimension 128.

    pytest bench/test_bench_lsh.py --benchmark-only --benchmark-json bench/results/lsh.json

Configurations: the SLIDE paper's (DWTA, K=6, L=50, 2^18 buckets, buckets of 10),
``lsh.autotune``'s for sparsity 0.005, and the engine's by its rule for the Amazon-670K preset's
shape (``slide.config.resolve``: 24 tables of 2^14 buckets of 64, K=5). Thread counts past the
machine's are skipped. ``extra_info`` records neurons/s, queries/s and the mean number of
candidates per query.
"""
import numba
import numpy as np
import pytest

from lsh import HashTables, TableConfig, autotune
from slide.config import SlideConfig, resolve
from slide.runtime import set_num_threads

N, DIM = 670_091, 128
CONFIGS = {
    "slide-paper": TableConfig(family="dwta", K=6, L=50, range_pow=18, bucket_size=10),
    "autotune": autotune(N, 0.005),
    "engine": TableConfig(**resolve(SlideConfig(), 135_909, N, 100_000,
                                    labels_per_row=2.5)["tables"]),
}
THREADS = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def weights():
    return np.random.default_rng(0).standard_normal((N, DIM), dtype=np.float32)


@pytest.fixture(scope="module", params=list(CONFIGS))
def tables(request, weights):
    t = HashTables(DIM, N, CONFIGS[request.param], seed=0)
    t.build(weights)
    return request.param, t


def _threads(n):
    if n > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"needs {n} threads")
    set_num_threads(n)


@pytest.mark.parametrize("threads", THREADS)
def test_build(benchmark, tables, weights, threads):
    _threads(threads)
    name, t = tables
    benchmark.pedantic(t.build, args=(weights,), rounds=3, warmup_rounds=1)
    benchmark.extra_info.update(config=name, threads=threads,
                                neurons_per_second=N / benchmark.stats.stats.median,
                                table_mb=t.buckets.nbytes / 2**20)


@pytest.mark.parametrize("threads", THREADS)
def test_query_batch_of_128(benchmark, tables, weights, threads):
    _threads(threads)
    name, t = tables
    # queries near stored neurons, as hidden activations near their label's weights are
    q = weights[:128] + 0.5 * np.random.default_rng(1).standard_normal((128, DIM), dtype=np.float32)
    _, n = t.query(q)
    benchmark.pedantic(t.query, args=(q,), rounds=20, warmup_rounds=2)
    benchmark.extra_info.update(config=name, threads=threads,
                                queries_per_second=128 / benchmark.stats.stats.median,
                                candidates_per_query=float(n.mean()))
