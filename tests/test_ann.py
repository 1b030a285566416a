"""predict_topk(mode="ann"): the engine's clusters of the label vectors, and an HNSW index of
them from hnswlib or FAISS (the ann extra; skipped where neither is installed, except the error
that says so)."""
import importlib.util
import os

import numpy as np
import pytest

from slide import SlideClassifier
import slide.clusters
from slide.ann import LIBRARIES, LabelIndex, available_backend, make_index
from slide.clusters import LabelClusters, cluster_count

INSTALLED = [b for b in LIBRARIES if importlib.util.find_spec(b) is not None]
#: every backend, each with settings that find nearly all of a small model's top-k
SETTINGS = [("clusters", {"probe": 0.5})] + [(b, {"ef": 200}) for b in INSTALLED]


@pytest.fixture(scope="module")
def fitted(tiny_data):
    X, Y, Xte, _ = tiny_data
    return SlideClassifier(hidden=(16,), epochs=2, threads=1, seed=0).fit(X[:1500], Y[:1500]), Xte


@pytest.mark.parametrize("backend, settings", SETTINGS)
def test_ann_finds_the_exact_top_k_with_its_scores(fitted, backend, settings):
    model, Xte = fitted
    exact, exact_scores = model.predict_topk(Xte[:300], 10)
    model.set_ann(backend=backend, **settings)
    ids, scores = model.predict_topk(Xte[:300], 10, mode="ann")
    recall = np.mean([np.intersect1d(a, b).size / 10 for a, b in zip(ids, exact)])
    assert recall > 0.97
    # its scores are the model's scores of the labels it returns, best first
    S = model.decision_function(Xte[:300])
    np.testing.assert_allclose(scores, np.take_along_axis(S, ids, 1), rtol=1e-4, atol=1e-5)
    assert np.all(np.diff(scores, axis=1) <= 1e-6)


@pytest.mark.parametrize("backend, settings", SETTINGS)
def test_the_index_follows_the_weights_and_the_rows(fitted, tiny_data, backend, settings):
    import copy
    model, Xte = fitted
    model = copy.deepcopy(model)
    model.set_ann(backend=backend, **settings)
    first = model.server_.label_index()
    model.predict_topk(Xte[:5], 5, mode="ann")
    assert model.server_.label_index() is first  # kept while the weights stand
    X, Y = tiny_data[0], tiny_data[1]
    model.partial_fit(X[1500:1600], Y[1500:1600])
    ids, scores = model.predict_topk(Xte[:50], 5, mode="ann")
    assert model.server_.label_index() is not first  # rebuilt from the new weights
    exact = model.predict_topk(Xte[:50], 5)[1]
    found = np.isclose(scores, exact, rtol=1e-4, atol=1e-5)
    assert found.mean() > 0.95 and found[:, 0].all()
    # labels added later are in the index with their rows
    model.add_labels(3)
    assert model.server_.label_index().n == model.n_outputs_


@pytest.mark.parametrize("backend", ["clusters"] + INSTALLED)
def test_fewer_labels_than_k_are_padded(backend):
    index = make_index(backend=backend, ef=16).build(np.eye(3, 4, dtype=np.float32),
                                                     np.zeros(3, np.float32))
    rows, scores = index.query(np.array([[0, 1, 0, 0]], np.float32), 5)
    assert rows[0, 0] == 1 and rows[0, 3:].tolist() == [-1, -1] and np.isneginf(scores[0, 3:]).all()


def test_without_a_library_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert available_backend() == "clusters"  # the engine's own needs nothing more
    with pytest.raises(ImportError, match="ann extra"):
        available_backend("hnswlib")
    with pytest.raises(ImportError, match="ann extra"):
        LabelIndex()
    with pytest.raises(ValueError, match="backend must be one of"):
        available_backend("annoy")


def _layer(n=3000, d=40, seed=0):
    """Label rows in 60 groups about their own directions, and queries near some of them."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((60, d)).astype(np.float32)
    W = (centres[rng.integers(0, 60, n)] + 0.5 * rng.standard_normal((n, d))).astype(np.float32)
    b = (0.1 * rng.standard_normal(n)).astype(np.float32)
    H = (centres[rng.integers(0, 60, 200)] + 0.3 * rng.standard_normal((200, d))).astype(np.float32)
    return W, b, H


def _single_rows(index, H, k=10, **kw):
    """Each row of ``H`` asked alone (one kernel of its own), stacked."""
    answers = [index.query(H[r:r + 1], k, **kw) for r in range(H.shape[0])]
    return np.vstack([a[0] for a in answers]), np.vstack([a[1] for a in answers])


def _probe_all(W, b, H):
    """With every cluster probed and every estimate rescored the answer is the exact top-k,
    in a batch and a row at a time; with the default rescoring the int8 estimates alone must
    rank the top-k first."""
    S = H @ W.T + b
    exact = np.argsort(-S, axis=1, kind="stable")[:, :10]
    index = LabelClusters(probe=1.0).build(W, b)
    for rows, scores in (index.query(H, 10, keep=W.shape[0]),
                         _single_rows(index, H[:40], keep=W.shape[0])):
        np.testing.assert_array_equal(rows, exact[:len(rows)])
        np.testing.assert_allclose(scores, np.take_along_axis(S[:len(rows)], rows, 1),
                                   rtol=1e-5, atol=1e-5)
    for rows in (index.query(H, 10)[0], _single_rows(index, H)[0]):
        assert np.mean([np.intersect1d(a, e).size for a, e in zip(rows, exact)]) >= 9.9


@pytest.mark.parametrize("kind", sorted({slide.clusters.int8_kind(), None}, key=str))
def test_clusters_score_every_label_exactly_when_probing_all(monkeypatch, kind):
    """The host's int8 dot product, and the float fallback of CPUs without one."""
    monkeypatch.setattr(slide.clusters, "int8_kind", lambda: kind)
    _probe_all(*_layer())


AVX2 = ",".join(["+avx", "+avx2", "+fma", "+f16c", "+bmi", "+bmi2", "+popcnt", "+sse4.2",
                 "-avx512f", "-avx512bw", "-avx512vl", "-avx512dq", "-avx512cd", "-avx512vnni"])


@pytest.mark.skipif(slide.clusters.int8_kind() != "vnni",
                    reason="the host's own kernels are AVX2 ones (tested above), or it has no AVX2")
def test_clusters_on_an_avx2_target(tmp_path):
    """numba compiling for an AVX2 machine (``vpmaddubsw``, 7-bit queries) on a host with
    AVX-512 VNNI, in a process of its own: the same answers as the host's kernels."""
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=AVX2,
               NUMBA_CACHE_DIR=str(tmp_path))
    code = ("import slide.clusters as c, tests.test_ann as t; assert c.int8_kind() == 'avx2'; "
            "t._probe_all(*t._layer()); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_clusters_find_most_of_the_top_k_from_a_share_of_the_labels():
    W, b, H = _layer()
    index = LabelClusters(probe=0.1).build(W, b)
    assert index.centroids.shape[0] == cluster_count(3000) == 512
    assert sorted(index.members.tolist()) == list(range(3000))  # each label in one cluster
    assert np.all(np.diff(index.starts) >= 0) and index.starts[-1] == 3000
    exact = np.argsort(-(H @ W.T + b), axis=1)[:, :10]
    rows = index.query(H, 10)[0]
    recall = np.mean([np.intersect1d(a, e).size / 10 for a, e in zip(rows, exact)])
    assert recall > 0.9
    # a row alone takes the batch's clusters (its centroid scores may round otherwise)
    assert np.mean(np.all(_single_rows(index, H)[0] == rows, axis=1)) >= 0.98
    # every row's candidates: whole clusters holding at least the budget, best centroids first
    chosen, counts = index.chosen(H)
    sizes = np.diff(index.starts)
    for r in range(20):
        mine = chosen[r, :counts[r]]
        assert sizes[mine].sum() >= index.budget > sizes[mine[:-1]].sum()
        coarse = H[r] @ index.weights.T + index.bias
        others = np.setdiff1d(np.arange(coarse.size), mine)
        bin_width = (coarse.max() - coarse.min()) / 255
        assert coarse[others].max() <= coarse[mine].min() + bin_width * 1.001


def test_a_row_alone_scores_the_candidates_it_would_in_a_batch():
    """Every label of a row's clusters (:meth:`LabelClusters.chosen`) is a candidate, whether
    the row comes alone or in a batch: with every estimate rescored, its top-50 is the exact
    top-50 of them (most of its 60-odd, so that a cluster missed shows). Large biases, so
    that the centroids' count in the choice."""
    W, b, H = _layer()
    b = 20 * b
    index = LabelClusters(probe=0.02).build(W, b)
    chosen, counts = index.chosen(H)
    S = H @ W.T + b
    want = []
    for r in range(H.shape[0]):
        mine = [index.members[index.starts[c]:index.starts[c + 1]] for c in chosen[r, :counts[r]]]
        labels = np.concatenate(mine)
        want.append(labels[np.argsort(-S[r, labels], kind="stable")[:50]])
    for rows, _ in (index.query(H, 50, keep=W.shape[0]),
                    _single_rows(index, H, 50, keep=W.shape[0])):
        # a row alone may round a centroid's score otherwise, at the edge of its choice
        assert np.mean([np.array_equal(a, w) for a, w in zip(rows, want)]) >= 0.97


def test_clusters_settings_are_checked():
    for bad in ({"probe": 0.0}, {"probe": 1.5}, {"clusters": 0}, {"probe": True}):
        with pytest.raises(ValueError):
            LabelClusters(**bad)
    assert cluster_count(1) == 1 and cluster_count(21316) == 1024 and cluster_count(10) == 10


def test_clusters_rebuilt_from_the_last_centroids(fitted, tiny_data, monkeypatch):
    """After the weights move (training, added labels) the clusters start from the last
    index's centroids; new settings start afresh."""
    import copy
    model, Xte = fitted
    model = copy.deepcopy(model)
    starts = []
    kmeans = slide.clusters.kmeans

    def recording(V, n_clusters, seed=0, threads=1, start=None):
        starts.append(None if start is None else np.array(start))
        return kmeans(V, n_clusters, seed, threads, start)
    monkeypatch.setattr(slide.clusters, "kmeans", recording)
    model.set_ann(probe=0.5)
    model.predict_topk(Xte[:5], 5, mode="ann")
    first = model.server_.label_index()
    assert starts[-1] is None
    X, Y = tiny_data[0], tiny_data[1]
    model.partial_fit(X[1500:1600], Y[1500:1600])
    ids, scores = model.predict_topk(Xte[:50], 5, mode="ann")
    np.testing.assert_array_equal(starts[-1], first.centroids)
    assert np.isclose(scores, model.predict_topk(Xte[:50], 5)[1], rtol=1e-4, atol=1e-5).mean() > 0.95
    second = model.server_.label_index()
    # rows that carry two labels new to the model: they get output rows, the server restarts
    import scipy.sparse as sp
    rows = Y[1600:1700]
    fresh = sp.csr_matrix((np.ones(20, np.float32), (np.arange(20), np.arange(20) % 2)),
                          shape=(rows.shape[0], 2))
    outputs = model.n_outputs_
    model.partial_fit(X[1600:1700], sp.hstack([rows, fresh]).tocsr())
    assert model.n_outputs_ >= outputs + 2
    assert model.server_.label_index().n == model.n_outputs_
    np.testing.assert_array_equal(starts[-1], second.centroids)
    model.set_ann(probe=0.4)
    model.predict_topk(Xte[:5], 5, mode="ann")
    assert starts[-1] is None
