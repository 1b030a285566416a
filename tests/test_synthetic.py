import dataclasses

import numpy as np
import pytest
import scipy.sparse as sp

from slide.synthetic import PRESETS, DatasetShape, make_dataset

SMALL = DatasetShape("small", n_features=3000, n_labels=2000, n_train=4000, n_test=500,
                     features_per_sample=40.0, labels_per_sample=3.0, cluster_size=20,
                     same_cluster=0.8, label_share=0.3)


def test_generator_is_deterministic_and_shaped():
    a = make_dataset("demo", n_train=500, n_test=100, seed=5)
    b = make_dataset("demo", n_train=500, n_test=100, seed=5)
    c = make_dataset("demo", n_train=500, n_test=100, seed=6)
    for u, v in zip(a, b):
        assert (u != v).nnz == 0
    assert (a[0] != c[0]).nnz > 0
    X, Y = a[0], a[1]
    assert X.shape == (500, PRESETS["demo"].n_features) and Y.shape == (500, PRESETS["demo"].n_labels)
    assert np.all(np.diff(Y.indptr) >= 1) and np.all(np.diff(X.indptr) >= 1)
    np.testing.assert_allclose(sp.linalg.norm(X, axis=1), 1.0, rtol=1e-5)
    # each row's columns in order, as a loader's are: a query's checks would copy and sort them
    for M in (a[0], a[2]):
        rows = np.repeat(np.arange(M.shape[0]), np.diff(M.indptr))
        assert np.all((np.diff(M.indices) > 0) | (np.diff(rows) > 0))
    with pytest.raises(ValueError, match="unknown preset"):
        make_dataset("nope")


def test_rows_have_the_shape_asked_for():
    X, Y, _, _ = make_dataset(SMALL, seed=0)
    assert np.diff(X.indptr).mean() == pytest.approx(40.0, rel=0.05)  # distinct features
    assert np.diff(Y.indptr).mean() == pytest.approx(3.0, rel=0.05)
    assert (X.data > 0).all() and X.data.max() <= 1.0


def test_label_frequencies_follow_a_power_law():
    _, Y, _, _ = make_dataset(SMALL, seed=0)
    freq = np.sort(np.bincount(Y.indices, minlength=Y.shape[1]))[::-1]
    # head labels are far more frequent than the median label, and a long tail is rare
    assert freq[0] > 10 * max(np.median(freq), 1)
    assert (freq <= 2).mean() > 0.15


def test_labels_of_a_row_are_related():
    """Further labels come mostly from the first label's cluster: each label co-occurs with a
    small set of partners, far smaller than when labels are drawn independently."""
    def partners(shape):
        _, Y, _, _ = make_dataset(shape, seed=0)
        C = (Y.T @ Y).tocsr()
        C.setdiag(0)
        C.eliminate_zeros()
        used = np.diff(Y.indptr)
        freq = np.bincount(Y.indices, minlength=Y.shape[1])
        head = np.argsort(-freq)[:100]
        return np.diff(C.indptr)[head].mean(), used
    clustered, _ = partners(SMALL)
    independent, _ = partners(dataclasses.replace(SMALL, same_cluster=0.0))
    assert clustered < 0.6 * independent


def test_features_carry_label_signal():
    """Rows sharing a label are more alike than random rows (the signal a model learns)."""
    X, Y, _, _ = make_dataset(SMALL, seed=1)
    lab = np.argmax(np.bincount(Y.indices, minlength=Y.shape[1]))
    rows = Y[:, lab].nonzero()[0][:50]
    same = (X[rows] @ X[rows].T).toarray()[np.triu_indices(rows.size, 1)].mean()
    rand = (X[:50] @ X[50:100].T).toarray().mean()
    assert same > 1.5 * rand
