"""Fixtures for the pytest-benchmark suites (``pytest bench/ --benchmark-only``)."""
import numpy as np
import pytest

from bench.common import dataset

SHAPES = {
    # name: (preset, n_train, n_test)
    "amazon-670k": ("amazon-670k", 4096, 256),
    "small": ("eurlex-4k", 4096, 256),
}


@pytest.fixture(scope="session", params=list(SHAPES))
def shape_data(request):
    preset, n_train, n_test = SHAPES[request.param]
    return request.param, dataset(preset, n_train, n_test, seed=0)


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(0)
