"""The dense reference's own mechanisms on numpy: fused operations, sampled softmax, the
prefetching epoch. (Agreement of cupy with these is in test_gpu.py.)"""
import numpy as np
import pytest
import scipy.sparse as sp

from gpu_ref import DenseClassifier, ops
from gpu_ref.dense import uniform_targets


def _logits_and_targets(rng, n=7, m=11):
    z = rng.standard_normal((n, m)).astype(np.float32) * 3
    mask = rng.random((n, m)) < 0.3
    mask[0] = False  # a row without labels: no loss, no gradient
    mask[1:, 0] = True  # every other row has labels
    Y = sp.csr_matrix(mask.astype(np.float32))
    return z, Y


def test_softmax_xent_matches_hand_computed_loss_and_gradient(rng):
    z, Y = _logits_and_targets(rng)
    n = z.shape[0]
    T = Y.toarray() / np.maximum(Y.sum(axis=1).A, 1)
    logp = z - np.log(np.exp(z.astype(np.float64)).sum(axis=1, keepdims=True))
    want_loss = -(T * logp).sum()
    want_grad = (np.exp(logp) * (T.sum(axis=1, keepdims=True) > 0) - T) / n
    got = z.copy()
    loss = ops.softmax_xent_(np, got, *uniform_targets(Y))
    assert abs(float(loss) - want_loss) < 1e-4 * abs(want_loss)
    np.testing.assert_allclose(got, want_grad, atol=1e-6)


def test_adam_rows_equals_adam_on_the_rows_and_leaves_others(rng):
    w, m, v = (rng.standard_normal((9, 4)).astype(np.float32) for _ in range(3))
    v = np.abs(v)
    rows = np.array([1, 4, 8])
    g = rng.standard_normal((3, 4)).astype(np.float32)
    want = [a[rows].copy() for a in (w, m, v)]
    ops.adam_(np, *want, g, 1e-2, 0.9, 0.999, 1e-8, 3, 0.5)
    got = [a.copy() for a in (w, m, v)]
    ops.adam_rows_(np, *got, g, rows, 1e-2, 0.9, 0.999, 1e-8, 3, 0.5)
    others = np.setdiff1d(np.arange(9), rows)
    for a, b, orig in zip(got, want, (w, m, v)):
        np.testing.assert_array_equal(a[rows], b)
        np.testing.assert_array_equal(a[others], orig[others])


def test_sampled_softmax_over_every_label_is_the_full_softmax(tiny_data):
    X, Y = tiny_data[0][:512], tiny_data[1][:512]
    full = DenseClassifier(hidden=(16,), batch_size=64, seed=1, device="cpu", epochs=1,
                           early_stopping=False).fit(X, Y)
    sampled = DenseClassifier(hidden=(16,), batch_size=64, seed=1, device="cpu", epochs=1,
                              early_stopping=False, negatives=Y.shape[1]).fit(X, Y)
    for k in full.params_:
        np.testing.assert_allclose(sampled.params_[k], full.params_[k], rtol=1e-4, atol=1e-6)


def test_sampled_softmax_learns_and_touches_only_its_rows(tiny_data):
    Xtr, Ytr, Xte, Yte = tiny_data
    model = DenseClassifier(hidden=(32,), seed=0, device="cpu", epochs=4, early_stopping=False,
                            negatives=32, lr=3e-3)
    model.fit(Xtr, Ytr, validation=(Xte, Yte))
    assert model.history_[-1]["val_P@1"] > 0.2, model.history_[-1]
    before = {k: v.copy() for k, v in model.params_.items()}
    Xb, Yb = model.preprocess(Xtr[:8]), Ytr[:8]
    batch = model.prepare_batch(Xb, Yb)
    model.step_batch(batch)
    changed = np.flatnonzero((model.params_["W"] != before["W"]).any(axis=1))
    assert set(changed) <= set(batch["out_rows"]) and set(Yb.indices) <= set(changed)
    assert batch["out_rows"].size <= 32 + Yb.nnz


def test_prefetching_epoch_equals_step_by_step(tiny_data):
    X, Y = tiny_data[0][:300], tiny_data[1][:300]
    a = DenseClassifier(hidden=(8,), batch_size=32, seed=2, device="cpu", negatives=50)
    b = DenseClassifier(hidden=(8,), batch_size=32, seed=2, device="cpu", negatives=50)
    for mdl in (a, b):
        mdl.initialize(*mdl.check_data(X, Y, fitted=False))
    Y = a.targets(X, Y)
    Xp, order = a.preprocess(X), np.random.default_rng(0).permutation(300)
    rec = a.train_epoch(Xp, Y, order)
    losses = [b.train_step(Xp[np.sort(order[lo:lo + 32])], Y[np.sort(order[lo:lo + 32])])
              for lo in range(0, 300, 32)]
    for k in a.params_:
        np.testing.assert_array_equal(a.params_[k], b.params_[k])
    sizes = [min(32, 300 - lo) for lo in range(0, 300, 32)]
    assert rec["loss"] == pytest.approx(np.dot(losses, sizes) / 300, rel=1e-5)


def test_dense_settings_are_checked_and_saved(tmp_path, tiny_data):
    X, Y = tiny_data[0][:200], tiny_data[1][:200]
    with pytest.raises(ValueError, match="negatives"):
        DenseClassifier(negatives=-1, device="cpu").fit(X, Y)
    with pytest.raises(ValueError, match="precision"):
        DenseClassifier(precision="fp16", device="cpu").fit(X, Y)
    m = DenseClassifier(hidden=(8,), epochs=1, negatives=20, precision="fp32", device="cpu").fit(X, Y)
    m.save(tmp_path / "d")
    back = DenseClassifier.load(tmp_path / "d", device="cpu")
    assert (back.negatives, back.precision) == (20, "fp32")
    # the data statistics the settings follow travel with it
    assert back.labels_per_row_ == pytest.approx(Y.nnz / Y.shape[0]) == m.labels_per_row_
    assert back.resolved_ == m.resolved_


def test_hard_rows_are_each_rows_best_by_the_exact_product(rng, monkeypatch):
    from gpu_ref import dense
    H = rng.standard_normal((37, 6)).astype(np.float32)
    W = rng.standard_normal((53, 6)).astype(np.float32)
    b = rng.standard_normal(53).astype(np.float32)
    S = H @ W.T + b
    want = np.unique(np.argsort(-S, axis=1)[:, :5])
    monkeypatch.setattr(dense, "HARD_BLOCK_ELEMENTS", 4 * 53)  # blocks of 4 rows, the last short
    got = dense.hard_rows(np, H, W, b, 5)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    # a row's own best is in, a label no row ranks in its top five is not
    assert set(np.argmax(S, axis=1)) <= set(got) and got.size < 53
    np.testing.assert_array_equal(dense.hard_rows(np, H, W, b, 99), np.arange(53))
    assert dense.hard_rows(np, H, W, b, 0).size == 0


def test_join_rows_renumbers_the_targets_over_the_joined_rows():
    from gpu_ref.dense import join_rows
    out_rows = np.array([2, 5, 9], np.int32)
    targets = (np.array([0, 0, 1], np.int32), np.array([0, 2, 1], np.int32),
               np.array([0.5, 0.5, 1.0], np.float32))
    joined, (r, cols, w) = join_rows(np, out_rows, targets, np.array([1, 5, 7], np.int32))
    np.testing.assert_array_equal(joined, [1, 2, 5, 7, 9])
    np.testing.assert_array_equal(joined[cols], [2, 9, 5])  # the same labels as before
    np.testing.assert_array_equal(r, targets[0])
    np.testing.assert_array_equal(w, targets[2])


def test_mined_negatives_over_every_label_are_the_full_softmax(tiny_data):
    X, Y = tiny_data[0][:512], tiny_data[1][:512]
    full = DenseClassifier(hidden=(16,), batch_size=64, seed=1, device="cpu", epochs=1,
                           early_stopping=False).fit(X, Y)
    hard = DenseClassifier(hidden=(16,), batch_size=64, seed=1, device="cpu", epochs=1,
                           early_stopping=False, negatives=0, mined_negatives=Y.shape[1]).fit(X, Y)
    for k in full.params_:
        np.testing.assert_allclose(hard.params_[k], full.params_[k], rtol=1e-4, atol=1e-6)


def test_a_step_with_mined_negatives_updates_the_labels_and_each_rows_best(tiny_data):
    from gpu_ref.dense import forward
    X, Y = tiny_data[0], tiny_data[1]
    model = DenseClassifier(hidden=(16,), seed=0, device="cpu", epochs=1, early_stopping=False,
                            negatives=0, mined_negatives=3).fit(X, Y)
    Xb, Yb = model.preprocess(X[:8]), model.targets(X[:8], Y[:8])
    h = forward(np, Xb, model.params_, model._blocks,
                model.resolved_["activation"] == "relu")[-1]
    S = h @ model.params_["W"].T + model.params_["b"]
    want = set(np.argsort(-S, axis=1)[:, :3].ravel()) | set(Yb.indices)
    before = model.params_["W"].copy()
    model.step_batch(model.prepare_batch(Xb, Yb))
    changed = set(np.flatnonzero((model.params_["W"] != before).any(axis=1)))
    assert changed == want, (sorted(changed ^ want))


def test_mined_negatives_are_checked_and_saved(tmp_path, tiny_data):
    X, Y = tiny_data[0][:200], tiny_data[1][:200]
    with pytest.raises(ValueError, match="mined_negatives must be"):
        DenseClassifier(negatives=8, mined_negatives=-1, device="cpu").fit(X, Y)
    with pytest.raises(ValueError, match="needs a sampled softmax"):
        DenseClassifier(mined_negatives=4, device="cpu").fit(X, Y)
    m = DenseClassifier(hidden=(8,), epochs=1, negatives=8, mined_negatives=4,
                        device="cpu").fit(X, Y)
    m.save(tmp_path / "d")
    assert DenseClassifier.load(tmp_path / "d", device="cpu").mined_negatives == 4


@pytest.mark.parametrize("m, k", [(1000, 1), (1000, 7), (997, 16), (40, 16), (20, 20)])
def test_top_columns_are_each_rows_k_largest(rng, m, k):
    from gpu_ref.dense import top_columns
    S = rng.standard_normal((9, m)).astype(np.float32)
    S[3] = np.round(S[3])  # ties: any k columns whose values are the k largest will do
    got = top_columns(np, S, k)
    assert got.shape == (9, k)
    for row, cols in zip(S, got):
        assert np.unique(cols).size == k
        np.testing.assert_array_equal(np.sort(row[cols]), np.sort(row)[m - k:])
