"""The prior correction: where the output layer is computed whole, predictions rank by the
logits less PRIOR_CORRECTION · log(training prior)."""
import numpy as np

from slide import SlideClassifier
from slide.base import PRIOR_CORRECTION, softmax_loss


def test_whole_output_ranks_by_logits_less_a_share_of_the_log_prior(tmp_path, tiny_data):
    X, Y, Xte, Yte = tiny_data
    m = SlideClassifier(hidden=(16,), epochs=2, threads=1, seed=0, early_stopping=False).fit(X[:800], Y[:800])
    assert not m.resolved_["sampled"]
    counts = np.bincount(Y[:800].indices, minlength=Y.shape[1])[m.labels_.ids]
    prior = (counts + 1.0) / (Y[:800].nnz + m.n_outputs_)  # by hand
    np.testing.assert_allclose(m.prior_shift(), -PRIOR_CORRECTION * np.log(prior), rtol=1e-5)
    h = m.embed(Xte[:50])
    raw = h @ m.params_["W"].T + m.params_["b"]
    S = m.decision_function(Xte[:50])[:, m.labels_.ids]
    np.testing.assert_allclose(S, raw + m.prior_shift(), rtol=1e-5, atol=1e-5)
    ids, scores = m.predict_topk(Xte[:50], 5)
    want = m.labels_.ids[np.argsort(-S, axis=1, kind="stable")[:, :5]]
    assert (ids[:, 0] == want[:, 0]).mean() > 0.95
    np.testing.assert_allclose(scores, -np.sort(-S, axis=1)[:, :5], rtol=1e-5, atol=1e-5)
    # the validation loss stays training's: of the logits as trained
    loss, n = softmax_loss(raw, m.labels_.to_rows(Yte[:50]))
    assert np.isclose(m.evaluate(Xte[:50], Yte[:50], loss=True)["loss"], loss / n, rtol=1e-5)
    # it travels with the model
    m.save(tmp_path / "m")
    back = SlideClassifier.load(tmp_path / "m")
    np.testing.assert_array_equal(back.predict_topk(Xte[:50], 5)[0], ids)


def test_a_sampled_output_has_no_correction(tiny_data):
    X, Y = tiny_data[0][:800], tiny_data[1][:800]
    m = SlideClassifier(hidden=(16,), sparsity=0.5, epochs=1, threads=1, seed=0).fit(X, Y)
    assert m.resolved_["sampled"] and m.prior_shift() is None
    np.testing.assert_array_equal(m.server_.bias(), m.params_["b"])
