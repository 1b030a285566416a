import os
import threading

import numpy as np
import pytest

from slide.synthetic import DatasetShape, make_dataset

# easier than the calibrated presets (more label signal per row), so that the tests' small
# models learn it in a few epochs
TINY = DatasetShape("tiny", n_features=2000, n_labels=400, n_train=3000, n_test=600,
                    features_per_sample=30.0, labels_per_sample=2.0, cluster_size=20,
                    same_cluster=0.8, label_share=0.3, topic_share=0.3)


#: the most worker processes ``-n auto`` starts: each compiles the kernels its modules use for
#: itself (where another has not cached them yet), so many more than the cores only repeat work
MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_WORKERS, cores or 1))


@pytest.fixture(scope="session")
def tiny_data():
    return make_dataset(TINY, seed=7)


def clustered_layer(n: int, d: int, groups: int, n_queries: int, seed: int = 0):
    """``(W, b, H)``: ``n`` label rows of width ``d`` about ``groups`` directions of their own,
    small biases, and ``n_queries`` hidden rows near some of those directions."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((groups, d)).astype(np.float32)
    W = (centres[rng.integers(0, groups, n)] + 0.5 * rng.standard_normal((n, d))).astype(np.float32)
    b = (0.1 * rng.standard_normal(n)).astype(np.float32)
    H = (centres[rng.integers(0, groups, n_queries)]
         + 0.3 * rng.standard_normal((n_queries, d))).astype(np.float32)
    return W, b, H


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def run_threads():
    """``run_threads(work, args)``: ``work(a)`` for each of ``args`` on a Python thread of its
    own, all started together; returns the exceptions they raised, for the test to report."""
    def run_all(work, args):
        errors, start = [], threading.Barrier(len(args))

        def run(a):
            start.wait()
            try:
                work(a)
            except Exception as e:  # reported by the test
                errors.append(e)

        threads = [threading.Thread(target=run, args=(a,)) for a in args]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors
    return run_all
