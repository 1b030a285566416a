"""Hard negatives from the output layer's label clusters (``negatives_from="clusters"``)."""
import numpy as np
import pytest
import scipy.sparse as sp

from slide.candidates import ClusterCandidates
from slide.config import CLUSTER_NEGATIVES
from slide.checkpoint import CheckpointError, read_checkpoint
from slide.clusters import LabelClusters, _means
from slide.estimator import SlideClassifier
from slide.runtime import engine_threads
from tests.conftest import clustered_layer


def _layer(n=600, d=24, seed=0):
    """Label rows about 30 directions, and 50 hidden rows near some of them."""
    return clustered_layer(n, d, 30, 50, seed)


def _exact(W, b, H, k):
    return np.argsort(-(H @ W.T + b), axis=1, kind="stable")[:, :k]


def test_a_refresh_keeps_the_clusters_and_indexes_the_moved_rows():
    W, b, H = _layer()
    index = LabelClusters(probe=1.0, spill=False).build(W, b)
    assign, C = index.assign.copy(), index.centroids.copy()
    rng = np.random.default_rng(1)
    W2 = W + 0.3 * rng.standard_normal(W.shape).astype(np.float32)
    b2 = b + 0.1 * rng.standard_normal(b.shape).astype(np.float32)
    assert not np.array_equal(_exact(W, b, H, 10), _exact(W2, b2, H, 10))
    index.refresh(W2, b2)
    np.testing.assert_array_equal(index.assign, assign)  # each label where it was
    means = C.copy()
    _means(W2, b2, assign, means)
    np.testing.assert_allclose(index.centroids, means, rtol=1e-6)
    assert not np.allclose(index.centroids, C, atol=1e-3)
    # every cluster probed and rescored: the moved layer's exact top-10
    np.testing.assert_array_equal(index.query(H, 10, keep=W.shape[0])[0], _exact(W2, b2, H, 10))


def test_a_refresh_needs_a_built_index_of_as_many_labels():
    W, b, _ = _layer()
    with pytest.raises(ValueError, match="build it first"):
        LabelClusters().refresh(W, b)
    index = LabelClusters(spill=False).build(W, b)
    with pytest.raises(ValueError, match="holds 600 labels; refresh got 599"):
        index.refresh(W[1:], b[1:])


def test_the_source_answers_each_row_with_its_best_labels_by_the_index(monkeypatch):
    W, b, H = _layer()
    params = {"W": W, "b": b}
    source = ClusterCandidates(W.shape[0], params, ask=8)
    source.rehash(W)
    assert source.builds == 1 and source.query_shape == (1, 8)
    asked = source.index.query(H, 8, rescore=False)[0]  # the step scores them itself
    codes, buckets, seen = source.lookup(H)
    # row r's one code is r, and bucket r of the one table holds its answer
    np.testing.assert_array_equal(codes[:, 0], np.arange(H.shape[0]))
    np.testing.assert_array_equal(buckets[0], asked)
    assert seen.shape == (1, H.shape[0]) and np.all(seen == 8)
    found = np.mean([np.intersect1d(a, e).size for a, e in zip(asked, _exact(W, b, H, 8))])
    assert found >= 6  # most of the exact top 8 from a twentieth of the layer
    # a rehash re-indexes in the same clusters; a rebuild moves them, from the last centroids
    moved = {}
    monkeypatch.setattr(LabelClusters, "refresh",
                        lambda self, W, b: moved.setdefault("refresh", self) or self)
    source.rehash(W)
    assert moved["refresh"] is source.index and source.builds == 1
    source.rebuild(W, seed=5)
    assert source.builds == 2
    # a grown layer is clustered anew
    params["b"] = np.concatenate((b, b[:10]))
    source.n_labels = 610
    source.rehash(np.vstack((W, W[:10])))
    assert source.builds == 3 and source.index.n == 610


def test_no_hard_negatives_asks_nothing_of_the_clusters():
    W, b, H = _layer()
    source = ClusterCandidates(W.shape[0], {"W": W, "b": b}, ask=0)
    source.rehash(W)
    source.rebuild(W)
    assert source.index is None and source.arrays() == {}
    codes, buckets, seen = source.lookup(H)
    assert buckets.shape[0] == 0 and seen.shape[0] == 0 and codes.shape == (H.shape[0], 1)


def _clustered(tiny_data, n=600, **kw):
    X, Y = tiny_data[0][:n], tiny_data[1][:n]
    return X, Y, dict(hidden=(16,), sparsity=0.2, threads=1, seed=3, rehash_every=150, rebuild_every=400,
                      negatives_from="clusters", early_stopping=False, **kw)


def test_a_steps_own_active_set_is_its_labels_and_the_clusters_answer(tiny_data, monkeypatch):
    X, Y, kw = _clustered(tiny_data, n=64)
    model = SlideClassifier(**kw, epochs=1).fit(X, Y)
    state = model.state_
    assert isinstance(state.tables, ClusterCandidates)
    assert model.resolved_["cluster_negatives"] == min(CLUSTER_NEGATIVES, model.resolved_["lsh_cap"])
    answers = []
    lookup = ClusterCandidates.lookup
    monkeypatch.setattr(ClusterCandidates, "lookup",
                        lambda self, h: answers.append(lookup(self, h)) or answers[-1])
    Xb, Yb = model.preprocess(X[:16]), model.targets(X[:16], Y[:16])
    with engine_threads(1):
        state.train_step(Xb, Yb)
    (_, buckets, _), = answers
    w = state.work
    for r in range(16):
        labels = Yb.indices[Yb.indptr[r]:Yb.indptr[r + 1]]
        own = w.active[r, :w.n_active[r]]
        want = list(dict.fromkeys([*labels.tolist(), *buckets[0, r].tolist()]))
        assert own.tolist() == want


def test_clusters_learn_and_resume_exactly(tmp_path, tiny_data):
    X, Y, kw = _clustered(tiny_data)
    straight = SlideClassifier(**kw, epochs=2).fit(X, Y)
    first = SlideClassifier(**kw, epochs=1).fit(X, Y)
    assert first.state_.tables.builds >= 2  # built, then moved by the schedule's rebuild
    first.save(tmp_path / "ck")
    ck = read_checkpoint(tmp_path / "ck")
    C, assign = ck.label_clusters(first.state_.n_labels, 16)
    np.testing.assert_array_equal(assign, first.state_.tables.index.assign)
    loaded = SlideClassifier.load(tmp_path / "ck")
    assert loaded.negatives_from == "clusters" and isinstance(loaded.state_.tables,
                                                              ClusterCandidates)
    np.testing.assert_array_equal(loaded.state_.tables.index.assign, assign)
    loaded.set_params(warm_start=True).fit(X, Y)
    for k in straight.params_:
        assert np.array_equal(straight.params_[k], loaded.params_[k]), k
    # and it learned: the most frequent labels' P@1 is beaten
    from slide.metrics import precision_at_k
    top = np.asarray(Y.sum(0)).ravel().argsort()[::-1][:5]
    base = precision_at_k(Y, np.tile(top, (Y.shape[0], 1)), 1)[0]
    assert precision_at_k(Y, straight.predict_topk(X, 1)[0], 1)[0] > 2 * base
    # serving's LSH tables come from the training tables' settings, which clusters leave unused
    ids, _ = straight.predict_topk(X[:20], 5, mode="lsh")
    assert ids.shape == (20, 5)


def test_a_checkpoints_clusters_are_checked(tmp_path, tiny_data):
    X, Y, kw = _clustered(tiny_data, n=200)
    SlideClassifier(**kw, epochs=1).fit(X, Y).save(tmp_path / "ck")
    ck = read_checkpoint(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"int32 clusters in \[0, C\) of the 401 labels"):
        ck.label_clusters(401, 16)
    with pytest.raises(CheckpointError, match=r"centroids \[C, 9\]"):
        ck.label_clusters(ck.labels.size, 8)


def test_negatives_from_is_checked_and_kept_after_fitting(tiny_data):
    with pytest.raises(ValueError, match="negatives_from must be one of lsh, clusters"):
        SlideClassifier(negatives_from="hnsw").fit(*tiny_data[:2])
    X, Y, kw = _clustered(tiny_data, n=100)
    model = SlideClassifier(**kw, epochs=1).fit(X, Y)
    with pytest.raises(ValueError, match="negatives_from changed since the model was fitted"):
        model.set_params(negatives_from="lsh", warm_start=True).fit(X, Y)


def test_added_labels_are_clustered_with_the_rest(tiny_data):
    X, Y, kw = _clustered(tiny_data, n=300)
    model = SlideClassifier(**kw, epochs=1).fit(X, Y)
    rows = model.state_.n_labels
    # seven new labels, each with a positive: each gets an output row
    Y7 = sp.csr_matrix((np.ones(7, np.float32), (np.arange(7), Y.shape[1] + np.arange(7))),
                       shape=(7, Y.shape[1] + 7))
    model.add_labels(7, X[:7], Y7)
    assert model.state_.tables.index.n == model.state_.n_labels == rows + 7
    model.partial_fit(X[:7], Y7)  # trains on the grown layer


def test_a_row_whose_clusters_hold_fewer_labels_than_it_asks(tiny_data):
    """200 labels probed at 5%: a row's clusters may hold fewer than its 16; its bucket stops
    at what they hold, and a step over such rows selects only real labels."""
    W, b, H = _layer(n=200)
    source = ClusterCandidates(200, {"W": W, "b": b}, ask=16)
    source.rehash(W)
    _, buckets, seen = source.lookup(H)
    assert seen.min() < 16 and seen.max() <= 16
    for r in range(H.shape[0]):
        assert np.all(buckets[0, r, :seen[0, r]] >= 0) and np.all(buckets[0, r, seen[0, r]:] == -1)
    X, Y = tiny_data[0][:300], tiny_data[1][:300, :200]
    model = SlideClassifier(hidden=(16,), sparsity=0.4, hard_negatives=16, threads=1,
                            negatives_from="clusters", early_stopping=False, epochs=1).fit(X, Y)
    w = model.state_.work
    assert all(np.all(w.active[r, :w.n_active[r]] >= 0) for r in range(w.n_active.size))


def test_the_memory_estimate_counts_the_clusters_in_place_of_the_output_tables():
    """Where the clusters give the hard negatives the output's tables are not built: the
    estimate counts the index instead, at least what a built one holds and not half again."""
    from slide.config import SlideConfig, resolve
    from slide.resources import model_memory_bytes
    n, width = 20000, 64
    parts = {}
    for source in ("clusters", "lsh"):
        resolved = resolve(SlideConfig(hidden=(width,), negatives_from=source), 500, n, 50000)
        parts[source] = model_memory_bytes(resolved, 500, n, threads=2)
    assert parts["clusters"]["hash_tables"] == 0 < parts["lsh"]["hash_tables"]
    assert "label_clusters" not in parts["lsh"]
    held, passing = ClusterCandidates.expected_bytes(n, width)
    assert parts["clusters"]["label_clusters"] == held + passing
    W, b, _ = clustered_layer(n, width, 200, 1)
    source = ClusterCandidates(n, {"b": b}, CLUSTER_NEGATIVES)
    source.rehash(W)
    assert source.nbytes <= held < 1.5 * source.nbytes
