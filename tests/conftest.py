import numpy as np
import pytest

from slide.synthetic import DatasetShape, make_dataset

TINY = DatasetShape("tiny", n_features=2000, n_labels=400, n_train=3000, n_test=600,
                    features_per_sample=30.0, labels_per_sample=2.0)


@pytest.fixture(scope="session")
def tiny_data():
    return make_dataset(TINY, seed=7)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
