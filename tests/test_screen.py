import numba
import numpy as np
import pytest

from slide import screen
from slide.metrics import topk
from slide.screen import has_int8_dot, quantize_labels, quantize_rows, screened_topk

needs_vnni = pytest.mark.skipif(not has_int8_dot(), reason="the CPU has no AVX-512 VNNI")


def _threads(n):
    previous = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    return previous


def test_quantized_rows_and_their_bounds(rng):
    W = rng.standard_normal((70, 9)).astype(np.float32)
    W[3] = 0  # a zero row: scale 0, no error
    b = rng.standard_normal(70).astype(np.float32)
    q = quantize_rows(W, b)
    assert q.packed.shape == (2, 3, 256) and q.scale.shape == (128,) and (q.n_rows, q.dim) == (70, 9)
    # the biases, and for the padding labels the lowest float32: never a candidate
    assert np.array_equal(q.bias[:70], b) and (q.bias[70:] == -np.finfo(np.float32).max).all()
    with pytest.raises(ValueError, match="one bias per row"):
        quantize_rows(W, b[:69])
    # unpack: label j's byte at depth i is packed[j // 64, i // 4, 4 (j % 64) + i % 4]
    Q = q.packed.reshape(2, 3, 64, 4).transpose(0, 2, 1, 3).reshape(128, 12)
    assert (Q[70:] == 0).all() and (Q[:, 9:] == 0).all()  # padding labels and depths
    Q = Q[:70, :9].astype(np.float64)
    assert np.abs(Q).max() == 127 and (Q[3] == 0).all()
    assert np.array_equal(q.sums[:70], Q.sum(axis=1)) and (q.sums[70:] == 0).all()
    deq = Q * q.scale[:70, None].astype(np.float64)
    assert np.all(np.abs(deq - W) <= q.scale[:70, None] / 2 + 1e-7)
    assert np.all(q.norm[:70] >= np.linalg.norm(W.astype(np.float64), axis=1))
    assert np.all(q.error[:70] >= np.linalg.norm(deq - W, axis=1))
    assert q.error[3] < 1e-30  # zero, one float32 step up


@needs_vnni
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(23, 301, 6), (130, 1000, 130), (5, 64, 8), (3, 2, 4)])
def test_screened_topk_equals_topk_of_the_score_matrix(rng, threads, shape, signed, monkeypatch):
    n, L, d = shape
    # small integers: every score is exact whatever the order of summation, and many are
    # equal (ties go to the lower id), while their int8 copies are not exact. Signed rows
    # (an identity layer's) are quantised with a zero point; here every other row is signed
    H = rng.integers(0, 4, (n, d)).astype(np.float32)
    if signed:
        H[::2] -= 2
    W = rng.integers(-3, 4, (L, d)).astype(np.float32)
    b = rng.integers(-2, 3, L).astype(np.float32)
    q = quantize_rows(W, b)
    # the screen serves every row: none goes to the float32 kernel
    monkeypatch.setattr(screen, "topk_product", lambda *a, **kw: pytest.fail("float32 kernel"))
    previous = _threads(threads)
    try:
        for k in (1, 5, 40):
            ids, vals = screened_topk(H, W, b, k, q)
            ref_ids, ref_vals = topk(H @ W.T + b, k)
            np.testing.assert_array_equal(ids, ref_ids)
            np.testing.assert_array_equal(vals, ref_vals)
    finally:
        numba.set_num_threads(previous)


@needs_vnni
@pytest.mark.parametrize("signed", [False, True])
def test_screened_topk_separates_scores_closer_than_the_int8_step(rng, signed):
    # labels whose scores differ by far less than the int8 quantisation error: the bound must
    # send them all to the float32 rescoring, which orders them exactly
    base = rng.standard_normal(32).astype(np.float32)
    W = np.repeat(base[None], 300, axis=0) + rng.standard_normal((300, 32)).astype(np.float32) * 1e-3
    W = np.vstack([W, rng.standard_normal((5000, 32)).astype(np.float32)])
    b = np.zeros(W.shape[0], np.float32)
    H = np.maximum(rng.standard_normal((17, 32)), 0).astype(np.float32)
    H[:, :] += np.maximum(base, 0) * 3  # rows that prefer the near-identical labels
    if signed:  # an identity layer's rows: quantised with a zero point
        H += (base * 3 - 0.5).astype(np.float32)
    ids, vals = screened_topk(H, W, b, 10, quantize_rows(W, b))
    S = H.astype(np.float64) @ W.T.astype(np.float64)
    got = np.take_along_axis(S, ids, 1)
    # the 10 best scores, in order, up to float32 rounding (~4e-6 at these scores of ~60;
    # the near-identical labels' scores are ~1e-3 apart, the int8 bound ~1e-1 wide)
    np.testing.assert_allclose(got, -np.sort(-S, axis=1)[:, :10], rtol=1e-6, atol=0)
    np.testing.assert_allclose(vals, got, rtol=1e-6, atol=0)
    assert (ids < 300).sum() > 100  # the test is about the near-identical labels


@needs_vnni
def test_screened_topk_falls_back_where_the_screen_cannot_serve(rng):
    H = np.abs(rng.standard_normal((9, 12))).astype(np.float32)
    W = rng.standard_normal((500, 12)).astype(np.float32)
    b = rng.standard_normal(500).astype(np.float32)
    q = quantize_rows(W, b)
    ref = topk(H @ W.T + b, 5)
    # a candidate list of 2 per row and chunk overflows: those rows take the float32 kernel
    np.testing.assert_array_equal(screened_topk(H, W, b, 5, q, capacity=2)[0], ref[0])
    assert screened_topk(H[:0], W, b, 5, q)[0].shape == (0, 5)
    with pytest.raises(ValueError, match="quantize W again"):
        screened_topk(H, W[:400], b[:400], 5, q)


@needs_vnni
def test_exact_predictions_go_through_the_screen_and_follow_training(monkeypatch, tiny_data):
    from slide import SlideClassifier, serving
    calls = []
    real = serving.screened_topk

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(serving, "SCREEN_MIN_LABELS", 1)
    monkeypatch.setattr(serving, "screened_topk", counted)
    X, Y = tiny_data[0], tiny_data[1]
    m = SlideClassifier(hidden=16, epochs=1, early_stopping=False, seed=0, threads=1).fit(X, Y)
    for _ in range(2):  # the int8 copy is rebuilt after the weights move
        ids, vals = m.predict_topk(X[:50], 5)
        ref_ids, ref_vals = topk(m.decision_function(X[:50]), 5)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(vals, ref_vals, rtol=1e-5, atol=1e-6)
        m.partial_fit(X[:64], Y[:64])
    assert len(calls) == 2


def test_exact_predictions_of_few_rows_screen_every_label(monkeypatch, tiny_data):
    """Blocks of a few rows, where the tiled screen is not used, take the int8 screen by label
    over every label: the same top-k and scores as the score matrix's, also after training
    and with duplicated output rows (ties to the lower id)."""
    from slide import SlideClassifier, serving
    calls = []
    real = serving.screened_candidates

    def counted(*args, **kw):
        calls.append(args[0].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(serving, "SCREEN_MIN_LABELS", 1 << 40)
    monkeypatch.setattr(serving, "screened_candidates", counted)
    X, Y = tiny_data[0], tiny_data[1]
    m = SlideClassifier(hidden=16, epochs=1, early_stopping=False, seed=0, threads=2).fit(X, Y)
    # a tie at the top of every row, which the screen must break as the matrix does
    m.params_["W"][7] = m.params_["W"][3]
    m.params_["b"][[3, 7]] = 10.0
    m.state_.version += 1
    assert (topk(m.decision_function(X[:24]), 2)[0] == m.labels_.to_labels(np.array([3, 7]))).all()
    for _ in range(2):  # the int8 copy is rebuilt after the weights move
        ref_ids, ref_vals = topk(m.decision_function(X[:24]), 5)
        for n in (1, 3, serving.FEW_ROWS):
            for lo in range(0, 24, n):
                ids, vals = m.predict_topk(X[lo:lo + n], 5)
                np.testing.assert_array_equal(ids, ref_ids[lo:lo + n])
                np.testing.assert_allclose(vals, ref_vals[lo:lo + n], rtol=1e-5, atol=1e-6)
        m.partial_fit(X[:64], Y[:64])
    assert calls and max(calls) == serving.FEW_ROWS
    calls.clear()
    m.predict_topk(X[:serving.FEW_ROWS + 1], 5)
    assert not calls  # more rows: the float32 tiles


def test_labels_quantized_by_label_and_their_bounds(rng):
    W = rng.standard_normal((70, 9)).astype(np.float32)
    W[3] = 0  # a zero row: scale 0, no error
    b = rng.standard_normal(70).astype(np.float32)
    # the weights inside a wider row block quantise as the plain matrix does
    block = np.concatenate([W, np.ones_like(W)], axis=1)
    for lab in (quantize_labels(W, b), quantize_labels(block[:, :9], b)):
        assert lab.q.shape == (70, 9) and lab.q.dtype == np.int8 and lab.meta.shape == (70, 4)
        Q = lab.q.astype(np.float64)
        scale = lab.meta[:, screen.SCALE]
        assert np.abs(Q).max() == 127 and (Q[3] == 0).all() and scale[3] == 0
        assert np.array_equal(lab.meta[:, screen.BIAS], b)
        deq = Q * scale[:, None].astype(np.float64)
        assert np.all(np.abs(deq - W) <= scale[:, None] / 2 + 1e-7)
        assert np.all(lab.meta[:, screen.NORM] >= np.linalg.norm(W.astype(np.float64), axis=1))
        assert np.all(lab.meta[:, screen.ERROR] >= np.linalg.norm(deq - W, axis=1))
        # the same int8 rows and bounds as the exact screen's tiles hold
        tiles = quantize_rows(W, b)
        T = tiles.packed.reshape(2, 3, 64, 4).transpose(0, 2, 1, 3).reshape(128, 12)[:70, :9]
        assert np.array_equal(T, lab.q)
        for col, name in ((screen.SCALE, "scale"), (screen.NORM, "norm"), (screen.ERROR, "error")):
            assert np.array_equal(lab.meta[:, col], getattr(tiles, name)[:70])
    with pytest.raises(ValueError, match="one bias per row"):
        quantize_labels(W, b[:69])


def _candidates_topk(h, W, b, cand, lengths, k):
    """Each row's top-k of its candidates from the float64 score matrix: ids (-1 where the
    score is not finite) and scores, ties to the earlier candidate."""
    ids = np.full((len(cand), k), -1)
    scores = np.full((len(cand), k), -np.inf, np.float32)
    for r in range(len(cand)):
        c = cand[r, :lengths[r]]
        s = h[r].astype(np.float64) @ W[c].T.astype(np.float64) + b[c]
        order = np.argsort(-s, kind="stable")[:k]  # stable: ties to the earlier candidate
        ids[r, :order.size] = np.where(np.isfinite(s[order]), c[order], -1)
        scores[r, :order.size] = s[order]
    return ids, scores


def test_screened_candidates_match_the_score_matrix(rng):
    """Each row's top-k of its candidates: label ids best first, ties to the earlier candidate,
    -1 / -inf where a row has fewer than k candidates, -1 where a score is not finite; the row
    block's rows (led by the weights) give the same; a row's candidates in 1 run, in 3 (7 in
    runs of 2, 2, 3) and in more runs than candidates (empty ones)."""
    n_out, H, k = 50, 8, 4
    W = rng.standard_normal((n_out, H)).astype(np.float32)
    W[7] = W[3]  # labels 3 and 7 score alike for every row
    b = rng.standard_normal(n_out).astype(np.float32)
    b[7] = b[3]
    b[11] = np.inf  # a score that is not finite
    h = rng.standard_normal((3, H)).astype(np.float32)
    cand = np.array([[9, 7, 3, 20, 11, 30, 0], [7, 3, 1, 0, 0, 0, 0], [5, 6, 0, 0, 0, 0, 0]],
                    np.int32)
    lengths = np.array([7, 3, 2], np.int64)
    labels = quantize_labels(W, b)
    want_ids, want_scores = _candidates_topk(h, W, b, cand, lengths, k)
    block = np.concatenate([W, W + 1, W + 2], axis=1)
    for rows, parts in ((W, 1), (block, 1), (W, 3), (W, 9)):
        ids, scores = np.empty((3, k), np.int64), np.empty((3, k), np.float32)
        screen.screened_candidates(h, rows, b, labels, cand, lengths, parts, ids, scores)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(scores, want_scores, rtol=1e-6)
    assert ids[0, 0] == -1 and scores[0, 0] == np.inf  # label 11's infinite score
    assert list(ids[1]).index(7) < list(ids[1]).index(3)  # a tie: 7 is the earlier candidate
    assert list(ids[2, 2:]) == [-1, -1]
    # one row of candidates for every row: as if each had its own copy of it
    every = np.full(3, 7, np.int64)
    want_ids, want_scores = _candidates_topk(h, W, b, np.repeat(cand[:1], 3, axis=0), every, k)
    for parts in (1, 3):
        screen.screened_candidates(h, W, b, labels, cand[:1], every, parts, ids, scores)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(scores, want_scores, rtol=1e-6)
    with pytest.raises(ValueError, match="quantize W again"):
        screen.screened_candidates(h[:, :5], W, b, labels, cand, lengths, 1, ids, scores)
    with pytest.raises(ValueError, match="each of the 3 rows"):
        screen.screened_candidates(h, W, b, labels, cand[:2], lengths, 1, ids, scores)
    with pytest.raises(ValueError, match="one bias per row"):
        screen.screened_candidates(h, W, b[:7], labels, cand, lengths, 1, ids, scores)
    with pytest.raises(ValueError, match="within the 7 candidates"):
        screen.screened_candidates(h, W, b, labels, cand, lengths + 1, 1, ids, scores)


@pytest.mark.parametrize("threads", [1, 2])
def test_screened_candidates_separate_scores_closer_than_the_int8_step(rng, threads):
    """Candidates whose scores lie closer together than the int8 copy can tell apart come out
    in their float32 order, on many candidates a row and in parts, against the score matrix.
    Each row's candidates are built around it: a score t (a thousandth apart from the next)
    along the row plus a large part orthogonal to it, whose quantisation error moves the int8
    score by far more than a thousandth."""
    n, per_row, d, k = 4, 1500, 24, 5
    h = rng.standard_normal((n, d)).astype(np.float32)
    blocks = []
    for r in range(n):
        u = h[r].astype(np.float64) / np.linalg.norm(h[r])
        R = rng.standard_normal((per_row, d))
        R -= np.outer(R @ u, u)  # orthogonal to the row: no part of its score
        t = 1e-3 * rng.permutation(per_row)
        blocks.append(np.outer(t, u) / np.linalg.norm(h[r]) + R)
    W = np.concatenate(blocks).astype(np.float32)
    b = np.zeros(n * per_row, np.float32)
    cand = np.stack([rng.permutation(per_row) + r * per_row for r in range(n)]).astype(np.int32)
    lengths = np.array([per_row, per_row - 1, 700, 3], np.int64)
    labels = quantize_labels(W, b)
    approx = (labels.q.astype(np.float64) * labels.meta[:, :1]) @ h[0]
    true = W[:per_row].astype(np.float64) @ h[0]
    assert np.abs(approx[:per_row] - true).max() > 0.01  # the int8 copy alone cannot rank these
    want_ids, want_scores = _candidates_topk(h, W, b, cand, lengths, k)
    previous = _threads(threads)
    try:
        for parts in (1, 2, 5):
            ids, scores = np.empty((n, k), np.int64), np.empty((n, k), np.float32)
            screen.screened_candidates(h, W, b, labels, cand, lengths, parts, ids, scores)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)
    finally:
        numba.set_num_threads(previous)


def test_a_named_numba_target_has_vnni_only_where_its_features_say(monkeypatch):
    """``NUMBA_CPU_NAME=haswell`` compiles for an AVX2 machine: the int8 paths must not emit
    VNNI there, whatever the host has."""
    from numba import config
    from slide.screen import target_has
    monkeypatch.setattr(config, "CPU_NAME", "haswell")
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,-avx512f,-avx512vnni")
    assert has_int8_dot.__wrapped__() is False
    assert target_has("avx2") and not target_has("avx512f")
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx512f,+avx512vnni")
    assert has_int8_dot.__wrapped__() is True
