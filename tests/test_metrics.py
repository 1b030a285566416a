import numpy as np
import pytest
import scipy.sparse as sp

from slide.metrics import (evaluate, ndcg_at_k, precision_at_k, propensities, psp_at_k, topk,
                           topk_product)

Y = sp.csr_matrix(np.array([[1, 0, 1, 0, 0], [0, 0, 0, 0, 1], [0, 1, 1, 1, 0]], np.float32))
TOP = np.array([[2, 1, 0], [0, 1, 2], [3, 4, 1]])


def test_precision_hand_computed():
    # row 0: hit, miss, hit; row 1: none; row 2: hit, miss, hit
    p = precision_at_k(Y, TOP, 3)
    np.testing.assert_allclose(p, [2 / 3, (1 / 2 + 0 + 1 / 2) / 3, (2 / 3 + 0 + 2 / 3) / 3])


def test_ndcg_hand_computed():
    d = 1 / np.log2([2, 3, 4])
    r0 = (d[0] + d[2]) / (d[0] + d[1])
    r2 = (d[0] + d[2]) / (d[0] + d[1] + d[2])
    n = ndcg_at_k(Y, TOP, 3)
    np.testing.assert_allclose(n[0], 2 / 3)
    np.testing.assert_allclose(n[2], (r0 + 0 + r2) / 3)


def test_scores_and_topk_agree():
    s = np.array([[0.1, 0.5, 0.9, -1, 0], [3, 2, 1, 0, -1], [0, 1, 0, 5, 2]], np.float32)
    ids, vals = topk(s, 3)
    np.testing.assert_array_equal(ids, TOP)
    np.testing.assert_allclose(vals, np.take_along_axis(s, TOP, 1))
    np.testing.assert_allclose(precision_at_k(Y, s, 3), precision_at_k(Y, TOP, 3))


def test_topk_matches_sort_and_breaks_ties_by_index(rng):
    s = rng.integers(0, 5, size=(50, 40)).astype(np.float32)
    ids, vals = topk(s, 7)
    ref = np.lexsort((np.tile(np.arange(40), (50, 1)), -s), axis=1)[:, :7]
    np.testing.assert_array_equal(ids, ref)
    ids, _ = topk(s[:, :3], 5)
    assert (ids[:, 3:] == -1).all()


def test_psp_hand_computed():
    p = np.array([0.5, 0.25, 1.0, 0.5, 1.0])
    w = 1 / p
    psp = psp_at_k(Y, TOP, p, 1)
    # top-1 hits: row 0 label 2 (w=1), row 1 miss, row 2 label 3 (w=2); best: 2 + 1 + 4
    np.testing.assert_allclose(psp[0], (w[2] + w[3]) / (w[0] + w[4] + w[1]))


def test_propensity_formula():
    Ytr = sp.csr_matrix(np.array([[1, 0], [1, 0], [1, 1], [1, 0]], np.float32))
    A, B = 0.55, 1.5
    C = (np.log(4) - 1) * (B + 1) ** A
    np.testing.assert_allclose(propensities(Ytr, A, B), 1 / (1 + C * np.exp(-A * np.log(np.array([4, 1]) + B))))


def test_evaluate_keys_and_errors():
    res = evaluate(Y, TOP[:, :3], 3)
    assert set(res) == {"P@1", "P@3", "nDCG@1", "nDCG@3"}
    with pytest.raises(ValueError):
        precision_at_k(Y, TOP[:2], 3)
    with pytest.raises(ValueError):
        precision_at_k(Y, TOP, 5)


def test_arguments_in_scikit_learn_order_lists_accepted_and_misuse_refused():
    lists_true = [[0, 2], [4], [1, 2, 3]]
    lists_pred = [list(r) for r in TOP]
    np.testing.assert_allclose(precision_at_k(lists_true, lists_pred, 3), precision_at_k(Y, TOP, 3))
    np.testing.assert_allclose(precision_at_k(Y.toarray(), TOP, 3), precision_at_k(Y, TOP, 3))
    with pytest.raises(ValueError, match="true labels first"):
        precision_at_k(TOP, Y, 3)  # reversed: a top-k id matrix is not a 0/1 indicator
    with pytest.raises(ValueError, match="true labels first"):
        evaluate(Y.toarray() * 3, TOP, 3)
    with pytest.raises(ValueError, match="not their inverses"):
        psp_at_k(Y, TOP, 1 / np.array([0.5, 0.25, 1.0, 0.5, 1.0]), 1)
    with pytest.raises(ValueError, match="label id 7"):
        precision_at_k(Y, np.array([[7], [0], [1]]), 1)


@pytest.mark.parametrize("k", [2.7, 0, -1, True, "5", None])
def test_k_must_be_a_positive_integer(k):
    from slide.metrics import check_k, topk
    with pytest.raises(ValueError, match="positive integer"):
        check_k(k)
    with pytest.raises(ValueError, match="positive integer"):
        topk(np.zeros((2, 3), np.float32), k)
    assert check_k(3.0) == 3 and check_k(np.int64(2)) == 2


def test_topk_product_hand_computed():
    H = np.array([[1, 0], [0, 2]], np.float32)
    W = np.array([[3, 1], [0, 0], [1, 4], [2, 2]], np.float32)
    b = np.array([0, 5, 0, -1], np.float32)
    # scores: row 0 = [3, 5, 1, 1], row 1 = [2, 5, 8, 3]
    ids, vals = topk_product(H, W, b, 3, tile=1)
    assert ids.tolist() == [[1, 0, 2], [2, 1, 3]]
    assert vals.tolist() == [[5, 3, 1], [8, 5, 3]]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tile", [1, 7, 64, None])
def test_topk_product_equals_topk_of_the_score_matrix(rng, threads, tile):
    import numba
    # small integers: every score is exact whatever the summation order, and many are equal
    # across tiles and threads (ties go to the lower id)
    H = rng.integers(-3, 4, (23, 6)).astype(np.float32)
    W = rng.integers(-3, 4, (301, 6)).astype(np.float32)
    b = rng.integers(-2, 3, 301).astype(np.float32)
    previous = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for k in (1, 5, 40):
            ids, vals = topk_product(H, W, b, k, tile=tile)
            ref_ids, ref_vals = topk(H @ W.T + b, k)
            np.testing.assert_array_equal(ids, ref_ids)
            np.testing.assert_array_equal(vals, ref_vals)
    finally:
        numba.set_num_threads(previous)
    ids, vals = topk_product(H[:2], W[:3], b[:3], 5)  # fewer labels than k: padded
    assert (ids[:, 3:] == -1).all() and np.isneginf(vals[:, 3:]).all()


def test_recall_against_the_exact_top_k_by_hand():
    from slide.metrics import recall_against
    exact = np.array([[3, 1, 2], [5, 6, 7]])
    found = np.array([[1, 9, 3], [-1, 7, -1]])  # row 0: 2 of 3; row 1: 1 of 3, padding left out
    assert recall_against(found, exact) == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert recall_against(exact, exact) == 1.0
    # a padded exact top-k (fewer labels than k) does not count the padding found as a hit
    assert recall_against(np.array([[0, -1]]), np.array([[0, -1]])) == 0.5
