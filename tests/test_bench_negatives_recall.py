import numpy as np

from bench import negatives_recall
from slide.candidates import ClusterCandidates
from slide.estimator import SlideClassifier


def test_recall_of_each_source_against_the_exact_top_k_labels_aside(tiny_data, monkeypatch):
    X, Y = tiny_data[0][:400], tiny_data[1][:400]
    model = SlideClassifier(hidden=(16,), sparsity=0.2, threads=1, epochs=1,
                            early_stopping=False, negatives_from="lsh").fit(X, Y)
    rows = np.arange(50)
    got = negatives_recall._recalls(model, X, Y, rows, 4)
    assert 0 <= got["lsh"] <= got["lsh union"] <= 1 and 0 <= got["clusters"] <= 1
    assert got["lsh_cap"] == model.resolved_["lsh_cap"] and got["cluster negatives"] == min(16, got["lsh_cap"])
    # a source that answers the exact top 4 without the row's labels holds all of it
    state = model.state_
    h = state.last(state.forward(model.preprocess(X[rows])))
    S = np.argsort(-(h @ state.params["W"].T + state.params["b"]), axis=1, kind="stable")
    T = model.targets(X[rows], Y[rows])
    want = np.array([[i for i in s if i not in T.indices[T.indptr[j]:T.indptr[j + 1]]][:4]
                     for j, s in enumerate(S)], np.int32)
    monkeypatch.setattr(ClusterCandidates, "lookup", lambda self, h: (None, want[None], None))
    assert negatives_recall._recalls(model, X, Y, rows, 4)["clusters"] == 1.0
