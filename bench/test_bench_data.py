"""Reading an Amazon-670K-shaped file of 100,000 rows (about 96 MB).

    pytest bench/test_bench_data.py --benchmark-only
"""
import os

import pytest

from bench.common import dataset
from slide.data import read_xmc, write_xmc


@pytest.fixture(scope="module")
def amazon_file(tmp_path_factory):
    X, Y, _, _ = dataset("amazon-670k", 100_000, 1, seed=0)
    path = tmp_path_factory.mktemp("data") / "amazon_100k.txt"
    write_xmc(path, X, Y)
    return path


def test_read_amazon_100k(benchmark, amazon_file):
    X, Y = benchmark.pedantic(read_xmc, args=(amazon_file,), rounds=5, warmup_rounds=1)
    assert X.shape == (100_000, 135_909) and Y.shape == (100_000, 670_091)
    benchmark.extra_info.update(megabytes=os.path.getsize(amazon_file) / 1e6,
                                rows_per_second=100_000 / benchmark.stats.stats.median)
