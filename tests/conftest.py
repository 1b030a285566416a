import numpy as np
import pytest

from slide.synthetic import DatasetShape, make_dataset

# easier than the calibrated presets (more label signal per row), so that the tests' small
# models learn it in a few epochs
TINY = DatasetShape("tiny", n_features=2000, n_labels=400, n_train=3000, n_test=600,
                    features_per_sample=30.0, labels_per_sample=2.0, cluster_size=20,
                    same_cluster=0.8, label_share=0.3, topic_share=0.3)


@pytest.fixture(scope="session")
def tiny_data():
    return make_dataset(TINY, seed=7)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
