import numba
import numpy as np
import pytest
import scipy.sparse as sp

from slide import SlideClassifier
from slide.preprocess import Preprocessor


def _counts():
    return sp.csr_matrix(np.array([[3, 0, 4, 0], [0, 0, 2, 0], [1, 1, 0, 0]], np.float32))


def test_l2_rows_by_hand():
    Xt = Preprocessor().fit(_counts()).transform(_counts())
    np.testing.assert_allclose(Xt.toarray(), [[0.6, 0, 0.8, 0], [0, 0, 1, 0],
                                              [2 ** -0.5, 2 ** -0.5, 0, 0]], rtol=1e-6)
    assert Xt.dtype == np.float32


def test_tfidf_by_hand_and_unseen_features():
    pre = Preprocessor(tfidf=True).fit(_counts())
    np.testing.assert_array_equal(pre.document_frequency_, [2, 1, 2, 0])
    idf = np.log(4 / np.array([3, 2, 3, 1])) + 1  # smoothed, as scikit-learn's TfidfTransformer
    np.testing.assert_allclose(pre.idf_, idf, rtol=1e-6)
    row = np.array([3 * idf[0], 0, 4 * idf[2], 0])
    np.testing.assert_allclose(pre.transform(_counts()).toarray()[0], row / np.linalg.norm(row), rtol=1e-6)
    np.testing.assert_array_equal(pre.seen_features(), [True, True, True, False])
    from sklearn.feature_extraction.text import TfidfTransformer
    ref = TfidfTransformer().fit(_counts()).transform(_counts())
    np.testing.assert_allclose(pre.transform(_counts()).toarray(), ref.toarray(), rtol=1e-5)


def test_empty_rows_stay_empty_and_input_is_not_modified():
    X = sp.csr_matrix(np.array([[0, 0], [2, 0]], np.float32))
    before = X.copy()
    Xt = Preprocessor().fit(X).transform(X)
    np.testing.assert_array_equal(Xt.toarray(), [[0, 0], [1, 0]])
    assert (X != before).nnz == 0


def test_model_applies_and_saves_its_preprocessing(tmp_path, tiny_data):
    """Rows scaled by a constant give the same model: every entry point normalises them."""
    X, Y, Xte, _ = tiny_data
    X, Y = X[:600], Y[:600]
    kw = dict(hidden=(16,), sparsity=0.25, threads=1, seed=0, epochs=1, early_stopping=False)
    a = SlideClassifier(**kw).fit(X, Y)
    b = SlideClassifier(**kw).fit(X * 7.0, Y)
    np.testing.assert_allclose(a.params_["W"], b.params_["W"], atol=1e-5)
    np.testing.assert_allclose(a.embed(Xte[:20]), b.embed(Xte[:20] * 0.01), atol=1e-5)
    np.testing.assert_array_equal(a.predict_topk(Xte[:20], 3)[0], b.predict_topk(Xte[:20] * 3, 3)[0])
    t = SlideClassifier(**kw, tfidf=True).fit(X, Y)
    t.save(tmp_path / "m")
    loaded = SlideClassifier.load(tmp_path / "m")
    assert loaded.preprocessor_.tfidf
    np.testing.assert_array_equal(loaded.preprocessor_.idf_, t.preprocessor_.idf_)
    np.testing.assert_array_equal(loaded.predict_topk(Xte[:30], 5)[0], t.predict_topk(Xte[:30], 5)[0])


def test_features_absent_from_training_start_at_zero(tiny_data):
    X, Y = tiny_data[0][:300], tiny_data[1][:300]
    m = SlideClassifier(hidden=(8,), sparsity=0.5, epochs=1, early_stopping=False).fit(X, Y)
    absent = np.bincount(X.indices, minlength=X.shape[1]) == 0
    assert absent.any()
    assert not m.params_["W0"][absent].any()
    assert m.params_["W0"][~absent].any(axis=1).all()


def test_bad_norm():
    with pytest.raises(ValueError, match="norm"):
        Preprocessor(norm="l1")


@pytest.mark.parametrize("tfidf", [False, True])
def test_rows_weighed_in_place_match_the_whole_matrix_formula(tfidf):
    """The row kernel gives, bit for bit, the numpy formula over the whole matrix: idf per
    value, float64 row norms, float32 division; empty rows stay empty."""
    rng = np.random.default_rng(0)
    X = sp.random(300, 50, density=0.1, format="csr", dtype=np.float32, random_state=rng)
    X.data = rng.integers(1, 9, X.nnz).astype(np.float32)
    X.data[X.indptr[7]:X.indptr[8]] = 0  # an empty row
    X.eliminate_zeros()
    pre = Preprocessor(tfidf=tfidf).fit(X)
    want = X.copy()
    if tfidf:
        want.data *= pre.idf_[want.indices]
    rows = np.repeat(np.arange(X.shape[0]), np.diff(want.indptr))
    norms = np.sqrt(np.bincount(rows, weights=np.square(want.data, dtype=np.float64),
                                minlength=X.shape[0]))
    norms[norms == 0] = 1.0
    want.data /= norms[rows].astype(np.float32)
    got = pre.transform(X)
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.data, want.data)
    assert got.getrow(7).nnz == 0


@pytest.mark.parametrize("tfidf,norm", [(False, "l2"), (True, "l2"), (True, None), (False, None)])
def test_first_layer_weighs_raw_rows_as_the_preprocessed_copy(tiny_data, tfidf, norm):
    """Queries weigh their rows as the first layer reads them (``forward(X, weighing)``):
    the activations equal, bit for bit, those of the preprocessed copy training reads,
    an empty row's included."""
    X, Y, Xte, _ = tiny_data
    m = SlideClassifier(hidden=(16, 8), sparsity=0.5, threads=2, seed=0, epochs=1,
                        early_stopping=False, tfidf=tfidf, norm=norm).fit(X[:400], Y[:400])
    rows = m.check_data(sp.vstack([Xte[:30] * 3.0, sp.csr_matrix((1, X.shape[1]))]).tocsr())
    got = m.state_.forward(rows, m.preprocessor_.weighing())
    want = m.state_.forward(m.preprocess(rows))
    np.testing.assert_array_equal(got, want)
    empty = m.state_.forward(sp.csr_matrix((1, X.shape[1]), dtype=np.float32))[0]
    np.testing.assert_array_equal(got[-1], empty)  # no division by a zero norm
    if norm is not None or tfidf:  # a weighing that changes the rows: the raw rows differ
        assert not np.array_equal(got, m.state_.forward(rows))


@pytest.mark.parametrize("hidden", [40, 16])
def test_a_row_alone_takes_its_first_layer_in_column_shares(hidden):
    """A row alone: its first-layer columns are split into shares (in whole cache lines, the
    last share the rest, 40 = 16 + 24) on however many threads, with the same sums bit for
    bit as the row's in a batch, weighed as read; 16 columns make one share."""
    from slide.kernels import forward_input
    from slide.runtime import set_num_threads
    rng = np.random.default_rng(0)
    X = sp.random(6, 300, density=0.1, format="csr", dtype=np.float32, random_state=1)
    W0 = rng.standard_normal((300, hidden)).astype(np.float32)
    b0 = rng.standard_normal(hidden).astype(np.float32)
    idf = rng.uniform(0.5, 2.0, 300).astype(np.float32)

    def first_layer(rows):
        acts = np.full((rows.shape[0], hidden + 3), np.nan, np.float32)
        forward_input(rows.indptr.astype(np.int64), rows.indices, rows.data, idf, True, W0, b0,
                      True, acts)
        return acts
    held = numba.get_num_threads()
    try:
        set_num_threads(1)
        want = first_layer(X)
        for threads in (1, 2, 3):
            set_num_threads(threads)
            for r in range(X.shape[0]):
                got = first_layer(X[r:r + 1])
                np.testing.assert_array_equal(got[0, :hidden], want[r, :hidden])
                assert np.all(np.isnan(got[0, hidden:]))  # nothing written past the layer
    finally:
        set_num_threads(held)
    dense = X.toarray() * idf
    dense /= np.linalg.norm(dense, axis=1, keepdims=True)
    np.testing.assert_allclose(want[:, :hidden], np.maximum(dense @ W0 + b0, 0), rtol=1e-4,
                               atol=1e-5)
