"""predict_topk(mode="ann"): an HNSW index of the label vectors from hnswlib or FAISS (the ann
extra; skipped where neither is installed, except the error that says so)."""
import importlib.util

import numpy as np
import pytest

from slide import SlideClassifier
from slide.ann import BACKENDS, LabelIndex, available_backend

INSTALLED = [b for b in BACKENDS if importlib.util.find_spec(b) is not None]


@pytest.fixture(scope="module")
def fitted(tiny_data):
    X, Y, Xte, _ = tiny_data
    return SlideClassifier(hidden=(16,), epochs=2, threads=1, seed=0).fit(X[:1500], Y[:1500]), Xte


@pytest.mark.parametrize("backend", INSTALLED)
def test_ann_finds_the_exact_top_k_with_its_scores(fitted, backend):
    model, Xte = fitted
    exact, exact_scores = model.predict_topk(Xte[:300], 10)
    model.set_ann(backend=backend, ef=200)
    ids, scores = model.predict_topk(Xte[:300], 10, mode="ann")
    recall = np.mean([np.intersect1d(a, b).size / 10 for a, b in zip(ids, exact)])
    assert recall > 0.97
    # its scores are the model's scores of the labels it returns, best first
    S = model.decision_function(Xte[:300])
    np.testing.assert_allclose(scores, np.take_along_axis(S, ids, 1), rtol=1e-4, atol=1e-5)
    assert np.all(np.diff(scores, axis=1) <= 1e-6)


@pytest.mark.parametrize("backend", INSTALLED)
def test_the_index_follows_the_weights_and_the_rows(fitted, tiny_data, backend):
    import copy
    model, Xte = fitted
    model = copy.deepcopy(model)
    model.set_ann(backend=backend, ef=200)
    first = model.server_.label_index()
    model.predict_topk(Xte[:5], 5, mode="ann")
    assert model.server_.label_index() is first  # kept while the weights stand
    X, Y = tiny_data[0], tiny_data[1]
    model.partial_fit(X[1500:1600], Y[1500:1600])
    ids, scores = model.predict_topk(Xte[:50], 5, mode="ann")
    assert model.server_.label_index() is not first  # rebuilt from the new weights
    np.testing.assert_allclose(scores, model.predict_topk(Xte[:50], 5)[1], rtol=1e-4, atol=1e-5)
    # labels added later are in the index with their rows
    model.add_labels(3)
    assert model.server_.label_index().n == model.n_outputs_


@pytest.mark.parametrize("backend", INSTALLED)
def test_fewer_labels_than_k_are_padded(backend):
    index = LabelIndex(backend=backend, ef=16).build(np.eye(3, 4, dtype=np.float32),
                                                     np.zeros(3, np.float32))
    rows, scores = index.query(np.array([[0, 1, 0, 0]], np.float32), 5)
    assert rows[0, 0] == 1 and rows[0, 3:].tolist() == [-1, -1] and np.isneginf(scores[0, 3:]).all()


def test_without_a_backend_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="ann extra"):
        available_backend()
    with pytest.raises(ValueError, match="backend must be one of"):
        available_backend("annoy")
