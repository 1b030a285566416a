import numpy as np
import scipy.sparse as sp

from slide.synthetic import make_dataset


def test_generator_is_deterministic_and_shaped():
    a = make_dataset("demo", n_train=500, n_test=100, seed=5)
    b = make_dataset("demo", n_train=500, n_test=100, seed=5)
    c = make_dataset("demo", n_train=500, n_test=100, seed=6)
    for u, v in zip(a, b):
        assert (u != v).nnz == 0
    assert (a[0] != c[0]).nnz > 0
    X, Y = a[0], a[1]
    assert X.shape == (500, 20_000) and Y.shape == (500, 10_000)
    assert np.all(np.diff(Y.indptr) >= 1) and np.all(np.diff(X.indptr) >= 1)
    np.testing.assert_allclose(sp.linalg.norm(X, axis=1), 1.0, rtol=1e-5)


def test_generator_label_frequencies_follow_a_power_law():
    _, Y, _, _ = make_dataset("eurlex-4k", n_train=5000, n_test=1, seed=0)
    freq = np.sort(np.bincount(Y.indices, minlength=Y.shape[1]))[::-1]
    # head labels are far more frequent than the median label, and a long tail is rare
    assert freq[0] > 20 * max(np.median(freq), 1)
    assert (freq <= 2).mean() > 0.2
