import contextlib
import copy
import pickle
import threading

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.exceptions import NotFittedError

from gpu_ref import DenseClassifier
from slide.runtime import CACHE_LINE
from gpu_ref.dense import softmax_grads, uniform_targets
from slide.config import hidden_blocks
from slide.data import DataFormatError
from slide.metrics import precision_at_k
from slide.estimator import SlideClassifier


def _small(tiny_data, n=64, labels=300):
    X, Y = tiny_data[0], tiny_data[1][:, :labels]
    keep = np.flatnonzero(np.diff(Y.indptr) > 0)[:n]
    return X[keep], Y[keep]


@pytest.mark.parametrize("activation", ["relu", "identity"])
@pytest.mark.parametrize("hidden", [(32,), (24, 16)])
def test_one_step_with_every_neuron_active_equals_dense_reference(tiny_data, hidden, activation):
    X, Y = _small(tiny_data)
    eng = SlideClassifier(hidden=hidden, activation=activation, sparsity=1.0, threads=1,
                          batch_size=64, seed=3)
    ref = DenseClassifier(hidden=hidden, activation=activation, batch_size=64, seed=3, device="cpu")
    # weight decay on: both decay exactly the rows a step touches
    eng.partial_fit(X, Y)
    ref.partial_fit(X, Y)
    # Adam's first step moves a weight by about lr whatever its gradient's size, so a gradient
    # at float32's noise (|g| near eps) may move it by a different share of lr
    for k, v in ref.params_.items():
        np.testing.assert_allclose(eng.params_[k], v, atol=5e-5, rtol=1e-4, err_msg=k)
    # and after a few more steps, still the same model
    for _ in range(3):
        eng.partial_fit(X, Y)
        ref.partial_fit(X, Y)
    for k, v in ref.params_.items():
        np.testing.assert_allclose(eng.params_[k], v, atol=1e-4, rtol=1e-3, err_msg=k)


@pytest.mark.parametrize("activation", ["relu", "identity"])
def test_engine_gradient_matches_numerical_gradient(tiny_data, activation):
    """Finite differences of the dense loss (float64) against the engine's accumulated gradient."""
    X, Y = _small(tiny_data, n=8, labels=40)
    eng = SlideClassifier(hidden=(12, 5), activation=activation, sparsity=1.0, threads=1,
                          batch_size=8, seed=1)
    eng.initialize(X, Y)
    before = {k: v.copy() for k, v in eng.params_.items()}
    grads = {}

    def capture(out_rows, in_rows, g):
        """In place of Adam: the step's compact gradients, laid out by row."""
        for name, rows in (("W", out_rows), ("b", out_rows), ("W0", in_rows)):
            grads[name] = _expand(g[name], rows, eng.params_[name].shape[0])
        grads.update({k: g[k].copy() for k in ("b0", "Wh", "bh")})

    eng.state_.apply_gradients = capture
    eng.state_.updates_in_place = lambda: False  # every row through the gradients, to read them
    eng.partial_fit(X, Y)
    assert eng.step_ == 0 and grads
    for k in before:  # nothing was updated
        assert np.array_equal(before[k], eng.params_[k])
    params = {k: v.astype(np.float64) for k, v in eng.params_.items()}
    Xp, T = eng.preprocess(X), uniform_targets(eng.labels_.to_rows(Y))
    blocks = hidden_blocks(eng.resolved_["hidden"])

    def loss():
        return softmax_grads(np, Xp, T, params, blocks, activation == "relu")[0]

    rng = np.random.default_rng(0)
    for name in ("W", "b", "Wh", "bh", "W0", "b0"):
        flat = params[name].reshape(-1)
        cand = np.flatnonzero(grads[name].reshape(-1) != 0)
        picks = rng.choice(cand if cand.size else np.arange(flat.size), size=min(6, max(cand.size, 1)), replace=False)
        checked = 0
        for i in picks:
            old = flat[i]
            l0 = loss()
            flat[i] = old + 1e-5
            lp = loss()
            flat[i] = old - 1e-5
            lm = loss()
            flat[i] = old
            left, right = (l0 - lm) / 1e-5, (lp - l0) / 1e-5
            if abs(left - right) > 1e-3 + 1e-2 * abs(left):
                continue  # a ReLU kink (a unit exactly at zero): no derivative to compare
            num = (lp - lm) / 2e-5
            assert abs(num - grads[name].reshape(-1)[i]) < 1e-4 + 1e-3 * abs(num), (name, i, num)
            checked += 1
        assert checked >= 1, name


@pytest.mark.parametrize("source", ["lsh", "clusters"])
def test_learns_and_beats_most_frequent_baseline(tiny_data, source):
    Xtr, Ytr, Xte, Yte = tiny_data
    model = SlideClassifier(hidden=(64,), sparsity=0.25, seed=0, epochs=6, early_stopping=False,
                            negatives_from=source)
    model.fit(Xtr, Ytr, validation=(Xte, Yte))
    losses = [h["loss"] for h in model.history_]
    assert losses[-1] < losses[0] * 0.8
    popular = np.argsort(-np.bincount(Ytr.indices, minlength=Ytr.shape[1]))[:1]
    base = precision_at_k(Yte, np.tile(popular, (Xte.shape[0], 1)), 1)[0]
    assert model.history_[-1]["val_P@1"] > base + 0.15, (model.history_[-1]["val_P@1"], base)
    lsh_p1 = model.evaluate(Xte, Yte, mode="lsh")["P@1"]
    assert lsh_p1 > base + 0.1


@pytest.mark.parametrize("source", ["lsh", "clusters"])
def test_one_thread_is_bit_for_bit_reproducible(tiny_data, source):
    X, Y = tiny_data[0][:600], tiny_data[1][:600]
    runs = []
    for _ in range(2):
        m = SlideClassifier(hidden=(16,), sparsity=0.2, threads=1, seed=4, rehash_every=256, epochs=2,
                            negatives_from=source)
        m.fit(X, Y)
        runs.append(m.params_)
    for k in runs[0]:
        assert np.array_equal(runs[0][k], runs[1][k]), k


def _part_of_block(a, B, j):
    """Whether ``a`` is column block j of row block ``B`` [n, 3·H] (its columns j·H:(j + 1)·H,
    in its memory), and ``B`` starts on a cache line."""
    H = B.shape[1] // 3
    return (B.ctypes.data % CACHE_LINE == 0 and a.shape == (B.shape[0], H)
            and a.strides == B.strides and a.ctypes.data == B.ctypes.data + j * H * B.itemsize
            and np.shares_memory(a, B))


@pytest.mark.parametrize("source", ["lsh", "clusters"])
def test_save_load_predict_identical_and_resume_continues(tmp_path, tiny_data, source):
    X, Y, Xte, _ = tiny_data
    X, Y = X[:800], Y[:800]
    kw = dict(hidden=(16,), sparsity=0.2, threads=1, seed=2, rehash_every=300, early_stopping=False,
              negatives_from=source)
    straight = SlideClassifier(**kw, epochs=2).fit(X, Y)
    first = SlideClassifier(**kw, epochs=1).fit(X, Y)
    first.save(tmp_path / "ck")
    first.save(tmp_path / "serve", inference_only=True)
    loaded = SlideClassifier.load(tmp_path / "ck")
    served = SlideClassifier.load(tmp_path / "serve")
    # the trained model's weights and moments are views of its row blocks, and so are the
    # model's loaded from a training checkpoint (read into them); a model loaded to serve holds
    # plain arrays: all three answer the same
    for model in (first, loaded):
        blocks = model.row_blocks()
        for name in ("W", "W0"):
            for j, (key, d) in enumerate(((name, model.params_), (name + ".m", model.moments_),
                                          (name + ".v", model.moments_))):
                assert _part_of_block(d[key], blocks[name], j)
                src = first.params_ if d is model.params_ else first.moments_
                np.testing.assert_array_equal(d[key], src[key])
    assert list(loaded.params_) == list(first.params_)
    assert list(loaded.moments_) == list(first.moments_)
    for name in ("W", "W0"):
        assert served.params_[name].flags.c_contiguous
    for mode in ("exact", "lsh"):
        a, sa = first.predict_topk(Xte[:50], 5, mode=mode)
        for other in (loaded, served):
            b, sb = other.predict_topk(Xte[:50], 5, mode=mode)
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(sa, sb)
    loaded.set_params(warm_start=True).fit(X, Y)
    assert loaded.epoch_ == 2 and loaded.step_ == straight.step_
    for k in straight.params_:
        assert np.array_equal(straight.params_[k], loaded.params_[k]), k
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert files == ["config.json", f"model-{first.step_}.npz"]
    with pytest.raises(NotFittedError):
        SlideClassifier().row_blocks()
    # a weight array replaced from outside goes into a new row block when the model trains
    loaded.params_["W"] = loaded.params_["W"] * 2
    want = loaded.params_["W"].copy()
    B = loaded.row_blocks()["W"]
    assert _part_of_block(loaded.params_["W"], B, 0) and np.array_equal(loaded.params_["W"], want)


def test_dense_and_engine_checkpoints_are_interchangeable(tmp_path, tiny_data):
    X, Y = _small(tiny_data, n=200)
    ref = DenseClassifier(hidden=(16,), seed=0, device="cpu", epochs=1).fit(X, Y)
    ref.save(tmp_path / "d")
    eng = SlideClassifier.load(tmp_path / "d")
    np.testing.assert_array_equal(eng.predict_topk(X[:20], 3)[0], ref.predict_topk(X[:20], 3)[0])
    eng.save(tmp_path / "e")
    back = DenseClassifier.load(tmp_path / "e", device="cpu")
    np.testing.assert_allclose(back.params_["W"], ref.params_["W"])


def test_bad_inputs_give_clear_errors(tiny_data):
    X, Y = tiny_data[0][:100], tiny_data[1][:100]
    m = SlideClassifier(hidden=(8,), sparsity=0.5).fit(X, Y)
    with pytest.raises(DataFormatError, match="features, but SlideClassifier is expecting"):
        m.predict(sp.csr_matrix((3, X.shape[1] + 1), dtype=np.float32))
    bad = X.copy()
    bad.data[0] = np.nan
    with pytest.raises(DataFormatError, match="NaN"):
        m.partial_fit(bad, Y)
    with pytest.raises(DataFormatError, match="out of range"):
        m.evaluate(X[:2], [[0], [Y.shape[1] + 5]])
    with pytest.raises(DataFormatError, match="rows"):
        m.partial_fit(X[:3], Y[:2])
    with pytest.raises(NotFittedError, match="not fitted"):
        SlideClassifier().predict(X)
    with pytest.raises(TypeError, match="hiden"):
        SlideClassifier(hiden=3)
    with pytest.raises(ValueError, match="sparsity"):
        SlideClassifier(sparsity=2.0).fit(X, Y)


def test_sampled_hidden_layer_computes_only_its_active_neurons(tmp_path, tiny_data):
    Xtr, Ytr, Xte, Yte = tiny_data
    m = SlideClassifier(hidden=(64, 1024), hidden_sparsity=(1.0, 0.05), sparsity=0.25, seed=0,
                        epochs=5, early_stopping=False)
    m.fit(Xtr, Ytr, validation=(Xte, Yte))
    target = m.resolved_["hidden_layers"][1]["target"]
    assert target == 52
    h = m.embed(Xte)
    assert h.shape == (Xte.shape[0], 1024)
    per_row = (h != 0).sum(axis=1)
    assert per_row.max() <= target and per_row.mean() > 5
    assert np.unique(np.flatnonzero(h.any(axis=0))).size > 3 * target  # rows pick different neurons
    popular = np.argsort(-np.bincount(Ytr.indices, minlength=Ytr.shape[1]))[:1]
    base = precision_at_k(Yte, np.tile(popular, (Xte.shape[0], 1)), 1)[0]
    assert m.history_[-1]["val_P@1"] > base + 0.1, (m.history_[-1]["val_P@1"], base)
    m.save(tmp_path / "s")
    loaded = SlideClassifier.load(tmp_path / "s")
    np.testing.assert_array_equal(loaded.embed(Xte[:50]), m.embed(Xte[:50]))
    with pytest.raises(ValueError, match="first hidden layer"):
        SlideClassifier(hidden=(64, 32), hidden_sparsity=(0.5, 1.0)).fit(Xtr, Ytr)
    with pytest.raises(ValueError, match="one value"):
        SlideClassifier(hidden=(64, 32), hidden_sparsity=(1.0,)).fit(Xtr, Ytr)


def test_label_lists_and_hidden_stack(tiny_data):
    X, Y = tiny_data[0][:300], tiny_data[1][:300]
    lists = [Y.indices[Y.indptr[i]:Y.indptr[i + 1]].tolist() for i in range(300)]
    m = SlideClassifier(hidden=(32, 16), sparsity=0.1, seed=0).fit(X, lists)
    assert m.n_labels_ == Y.indices.max() + 1
    ids, scores = m.predict_topk(X[:10], 4)
    assert ids.shape == (10, 4) and (np.diff(scores, axis=1) <= 0).all()
    assert m.embed(X[:5]).shape == (5, 16)


def test_sklearn_pipeline_after_tfidf():
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.pipeline import make_pipeline
    rng = np.random.default_rng(0)
    topics = {0: "cat dog pet fur paw", 1: "stock market price trade bank", 2: "goal match team ball score",
              3: "rain cloud storm wind snow"}
    docs, labels = [], []
    for _ in range(400):
        ts = rng.choice(4, size=rng.integers(1, 3), replace=False)
        words = sum((topics[t].split() for t in ts), [])
        docs.append(" ".join(rng.choice(words, size=8)))
        labels.append(sorted(ts.tolist()))
    pipe = make_pipeline(TfidfVectorizer(), SlideClassifier(hidden=(16,), sparsity=1.0, seed=0, lr=0.01))
    pipe.set_params(slideclassifier__epochs=5).fit(docs[:300], labels[:300])
    pred = pipe.predict(docs[300:])  # top-1 as a label-indicator matrix
    assert pred.shape == (100, 4) and (pred.sum(axis=1) == 1).all()
    assert np.mean([pred[i].indices[0] in l for i, l in enumerate(labels[300:])]) > 0.9
    from sklearn.metrics import f1_score
    from sklearn.model_selection import cross_val_score
    from sklearn.preprocessing import MultiLabelBinarizer
    Y = MultiLabelBinarizer(classes=range(4)).fit_transform(labels)
    assert f1_score(Y[300:], pred.toarray(), average="samples") > 0.6
    scores = cross_val_score(pipe, docs, Y, cv=2, scoring="f1_samples")
    assert np.isfinite(scores).all() and scores.min() > 0.5, scores
    proba = pipe.predict_proba(docs[300:305])
    assert proba.shape == (5, 4) and np.allclose(proba.sum(axis=1), 1, atol=1e-5)
    ids, p = pipe[-1].predict_topk_proba(pipe[0].transform(docs[300:305]), 2)
    np.testing.assert_allclose(p, np.take_along_axis(proba, ids, 1), rtol=1e-5)
    from sklearn.base import clone
    assert clone(pipe).get_params()["slideclassifier__lr"] == 0.01


def test_concurrent_parallel_kernels_from_two_threads(tiny_data, run_threads):
    """Two Python threads launching parallel kernels at once (heterogeneous training does):
    the threading layer must be thread-safe (numba's workqueue would abort the process)."""
    import numba
    X, Y = tiny_data[0][:500], tiny_data[1][:500]
    models = [SlideClassifier(hidden=(16,), sparsity=0.2, seed=s, epochs=2) for s in (0, 1)]
    errors = run_threads(lambda m: m.fit(X, Y), models)
    assert not errors, errors
    assert numba.threading_layer() in ("omp", "tbb")
    assert all(np.isfinite(m.params_["W"]).all() for m in models)


def test_serving_tables_move_recall_towards_exact(tiny_data):
    Xtr, Ytr, Xte, _ = tiny_data
    m = SlideClassifier(hidden=(32,), sparsity=0.05, seed=0, epochs=3, early_stopping=False).fit(Xtr, Ytr)
    exact = m.predict_topk(Xte, 5)[0]

    def recall():
        ids = m.predict_topk(Xte, 5, mode="lsh")[0]
        return np.mean([np.intersect1d(a[a >= 0], b).size / 5 for a, b in zip(ids, exact)])

    base = recall()  # the first LSH query built the default serving tables
    # the training tables' settings (the rule's; this model's hard negatives came from its
    # label clusters, which serving's tables do not use)
    L, bucket_size = m.resolved_["tables"]["L"], m.resolved_["tables"]["bucket_size"]
    assert m.resolved_["negatives_from"] == "clusters"
    # the default candidates: four times the most that training's bounded tables could return,
    # however many serving tables there are
    budget = min(4 * L * bucket_size, m.n_labels_)
    assert m.serving_tables_.config.L == L and m.serving_candidates_ == budget
    assert m.set_serving(4 * L).serving_tables_.config.L == 4 * L
    assert m.serving_candidates_ == budget and m.serving_tables_.center
    more = recall()
    assert more >= base and more > 0.5, (base, more)
    # the 8 candidates found in the most tables find less than all of them
    m.set_serving(4 * L, candidates=8)
    few = recall()
    assert few < more and m.serving_candidates_ == 8, (few, more)
    m.set_serving(None)  # the defaults: as many tables as training's
    assert m.serving_tables_.config.L == L and recall() == base
    # serving tables follow the weights: rebuilt (centred on the new mean row) after training
    m.set_serving(L)
    before = m.serving_tables_.offset.copy()
    screen = m.server_.candidate_screen()
    m.partial_fit(Xtr[:64], Ytr[:64])
    ids, scores = m.predict_topk(Xte[:20], 5, mode="lsh")
    assert np.abs(before - m.params_["W"].mean(0)).max() > 1e-5
    np.testing.assert_allclose(m.serving_tables_.offset, m.params_["W"].mean(0), atol=1e-6)
    # ... and so is the int8 copy their candidates are screened with: each row's top-5 of its
    # candidates by the new weights' float32 scores
    assert m.server_.candidate_screen() is not screen
    h = m.embed(Xte[:20])
    cand, n_c = m.serving_tables_.query(h, m.serving_candidates_)
    for r in range(20):
        c = cand[r, :n_c[r]]
        s = h[r] @ m.params_["W"][c].T + m.params_["b"][c]
        top = np.argsort(-s, kind="stable")[:5]
        np.testing.assert_array_equal(ids[r, :top.size], c[top])
        np.testing.assert_allclose(scores[r, :top.size], s[top], rtol=1e-5, atol=1e-6)
    for bad in ({"tables": 0}, {"tables": 4, "candidates": 0}, {"tables": True}):
        with pytest.raises(ValueError, match="positive integer"):
            m.set_serving(**bad)
    dense = SlideClassifier(hidden=(8,), sparsity=1.0, epochs=1).fit(Xtr[:200], Ytr[:200])
    with pytest.raises(ValueError, match="no tables"):
        dense.set_serving(8)


def test_queries_run_on_the_threads_set_after_fitting(tiny_data):
    """``set_params(threads=N)`` on a fitted (or loaded) model holds from its next query, as
    ``n_jobs`` does in scikit-learn; a query used to run on the threads of the last fit."""
    import numba

    Xtr, Ytr, Xte, _ = tiny_data
    m = SlideClassifier(hidden=(16,), sparsity=0.05, seed=0, epochs=1, early_stopping=False,
                        threads=2).fit(Xtr[:500], Ytr[:500])
    previous = numba.get_num_threads()
    try:
        for threads in (1, 2, 1):
            if threads > numba.config.NUMBA_NUM_THREADS:
                continue
            m.set_params(threads=threads)
            for query in (lambda: m.predict_topk(Xte[:3], 5), lambda: m.embed(Xte[:3]),
                          lambda: m.predict_topk(Xte[:3], 5, mode="lsh")):
                numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
                query()
                assert numba.get_num_threads() == threads  # the query's own setting
        with pytest.raises(ValueError, match="threads"):
            m.set_params(threads=0).predict_topk(Xte[:3], 5)
    finally:
        numba.set_num_threads(previous)


def test_a_copy_trains_weights_of_its_own(tiny_data):
    """A copy of a trained model (deepcopy, pickle) trains in row blocks of its own, made from
    the copy's arrays: what it trains is what it predicts with, and the original stays as it
    was."""
    X, Y = tiny_data[0][:400], tiny_data[1][:400]
    m = SlideClassifier(hidden=(16,), sparsity=0.2, threads=1, seed=0, epochs=1,
                        early_stopping=False).fit(X, Y)
    before = {k: m.params_[k].copy() for k in ("W", "W0")}
    c = copy.deepcopy(m)
    c.partial_fit(X[:64], Y[:64])
    blocks = c.row_blocks()
    for k in ("W", "W0"):
        assert np.array_equal(m.params_[k], before[k])
        assert not np.array_equal(c.params_[k], before[k])
        assert _part_of_block(c.params_[k], blocks[k], 0)


def test_a_copy_serves_as_its_original_does(tiny_data):
    """A copy of a served model keeps its serving tables' settings and answers as it does; once
    the copy trains, its serving follows its own weights, and the original's stays."""
    X, Y = tiny_data[0][:400], tiny_data[1][:400]
    m = SlideClassifier(hidden=(16,), sparsity=0.2, threads=1, seed=0, epochs=1,
                        early_stopping=False).fit(X, Y).set_serving(tables=7, candidates=30)
    ids = m.predict_topk(X[:20], 5, mode="lsh")[0]
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert c.serving_tables_.config.L == 7 and c.serving_candidates_ == 30
        np.testing.assert_array_equal(c.predict_topk(X[:20], 5, mode="lsh")[0], ids)
    c.partial_fit(X[:64], Y[:64])
    c.predict_topk(X[:20], 5, mode="lsh")  # the serving tables follow at the next query
    np.testing.assert_allclose(c.serving_tables_.offset, c.params_["W"].mean(0), atol=1e-6)
    np.testing.assert_array_equal(m.predict_topk(X[:20], 5, mode="lsh")[0], ids)
    assert np.abs(m.serving_tables_.offset - c.serving_tables_.offset).max() > 1e-5


def test_serving_from_several_threads_at_once(tiny_data, run_threads):
    """A model serves queries from a pool of threads: the first queries, which all find the
    tables to rehash after training and the serving tables and the int8 copies to build, and
    those after, answer as one query at a time does on a copy of the model."""
    Xtr, Ytr, Xte, _ = tiny_data
    m = SlideClassifier(hidden=(32,), sparsity=0.05, seed=0, epochs=1, early_stopping=False)
    m.fit(Xtr, Ytr).partial_fit(Xtr[:64], Ytr[:64])  # the tables are stale from here
    alone = copy.deepcopy(m)
    n = 24
    want = {mode: [alone.predict_topk(Xte[r:r + 1], 5, mode=mode) for r in range(n)]
            for mode in ("exact", "lsh")}
    wrong = []

    def work(first):
        for mode in ("lsh", "exact", "lsh"):
            for r in range(first, n, 4):
                ids, scores = m.predict_topk(Xte[r:r + 1], 5, mode=mode)
                if not (np.array_equal(ids, want[mode][r][0])
                        and np.allclose(scores, want[mode][r][1], rtol=1e-6)):
                    wrong.append((mode, r))

    errors = run_threads(work, range(4))
    assert not errors and not wrong, (errors[:3], wrong[:5])


def test_mark_rows_lists_each_row_once_and_finds_rows_with_one_source_of_gradient():
    """Hand-computed: a row in one own set and nowhere else is ALONE, a pool row in no own set
    POOL, a row in two own sets or in the pool and an own set SHARED; every row is listed once,
    in the order first met, each SHARED row once more with its slot, in the same order, and the
    marks are cleared with the rows updated in place listed."""
    import slide.kernels as K

    pool = np.array([5, 9], np.int32)
    lists = np.array([[1, 2, 9], [2, 3, 7]], np.int32)
    lengths = np.array([3, 2], np.int64)  # 7 is past the second list's length
    owners, touched = np.zeros(10, np.uint8), np.zeros(10, np.int32)
    marks = {True: [K.POOL, K.SHARED, K.ALONE, K.SHARED, K.ALONE], False: [K.SHARED] * 5}
    for in_place, want_shared, want_in_place in ((True, [9, 2], [5, 1, 3]),
                                                 (False, [5, 9, 1, 2, 3], [])):
        slots, shared = np.full(10, -1, np.int32), np.zeros(10, np.int32)
        n, n_shared = K.mark_rows(pool, lists, lengths, owners, in_place, touched, slots, shared)
        assert list(touched[:n]) == [5, 9, 1, 2, 3]
        assert [owners[i] for i in touched[:n]] == marks[in_place]
        assert list(shared[:n_shared]) == want_shared
        assert list(slots[want_shared]) == list(range(n_shared))
        assert (slots[want_in_place] == -1).all()  # no slot: updated in place
        rest = np.zeros(10, np.int32)
        n_in_place = K.clear_marks(owners, touched[:n], rest)
        assert list(rest[:n_in_place]) == want_in_place
        assert not owners.any()


@pytest.mark.parametrize("n_rows", [3, 300])
def test_clear_marks_without_a_list_resets_every_mark_and_lists_nothing(n_rows):
    """Without room for a list the marks are reset on every thread: by the listed rows where
    they are few (3 of 1,000 marks), all marks in order where there is one per line of 64 or
    more (300); other marks are UNTOUCHED already either way."""
    import slide.kernels as K

    rng = np.random.default_rng(n_rows)
    owners = np.zeros(1000, np.uint8)
    touched = rng.choice(1000, n_rows, replace=False).astype(np.int32)
    owners[touched] = rng.choice([K.ALONE, K.POOL, K.SHARED], n_rows)
    assert owners[touched].all()
    assert K.clear_marks(owners, touched, np.zeros(0, np.int32)) == 0
    assert not owners.any()


def _row_block(W, M, V):
    """The kernels' row block of a matrix: row i its weights, then both moments."""
    return np.concatenate([W, M, V], axis=1)


def _row_parts(B):
    """Weights, first and second moments: views of row block ``B``."""
    H = B.shape[1] // 3
    return B[:, :H], B[:, H:2 * H], B[:, 2 * H:]


def _expand(compact, rows, n):
    """A step's compact gradient as a full-size array of n rows: row ``rows[t]`` holds row t."""
    full = np.zeros((n,) + compact.shape[1:], compact.dtype)
    full[rows] = compact[:rows.size]
    return full


def _output_case(in_place: bool):
    """One sample through select_active, mark_rows and output_step on a 40-label layer whose
    LSH union is larger than the cap; returns what the test below checks."""
    import slide.kernels as K
    from lsh import HashTables, TableConfig
    from lsh.tables import QueryScratch

    rng = np.random.default_rng(0)
    n_labels, H, cap, label = 40, 6, 3, 7
    W = rng.standard_normal((n_labels, H)).astype(np.float32)
    b = rng.standard_normal(n_labels).astype(np.float32)
    h = np.abs(rng.standard_normal((1, H))).astype(np.float32)
    tables = HashTables(H, n_labels, TableConfig(family="simhash", K=1, L=2, range_pow=1,
                                                 bucket_size=64), seed=0)
    tables.build(W)
    codes = tables.family.hash_dense(h)
    found = np.setdiff1d(tables.query_one(h[0]), [label])
    assert found.size > cap  # the cap cuts the union
    # the pool holds the label (as the engine's does) and one found row; the other found rows
    # are outside it, so own rows can be the sample's alone
    pool = np.union1d(np.setdiff1d(np.arange(n_labels), found), found[-1:]).astype(np.int32)
    pool_pos, pool_bits = np.full(n_labels, -1, np.int32), np.zeros((n_labels + 7) // 8, np.uint8)
    zpool = (h @ W[pool].T + b[pool]).astype(np.float32)
    qs = QueryScratch(1, 2, 64, extra=1)
    active = np.zeros((1, cap + 1), np.int32)
    n_active = np.zeros(1, np.int64)
    y_indptr = np.array([0, 1], np.int64)
    K.select_active(y_indptr, np.array([label], np.int32), codes, tables.buckets, tables.seen,
                    qs.slots, qs.where, qs.cand, qs.hits, qs.hist, cap, pool, pool_pos, pool_bits,
                    zpool, active, n_active, 1)
    assert (pool_pos == -1).all() and not pool_bits.any()  # left as found
    assert (qs.slots == -1).all()  # the query set is empty again
    owners, touched = np.zeros(n_labels, np.uint8), np.zeros(n_labels, np.int32)
    slots, shared = np.zeros(n_labels, np.int32), np.zeros(n_labels, np.int32)
    n_touched, n_shared = K.mark_rows(pool, active, n_active, owners, in_place, touched, slots,
                                      shared)
    B = _row_block(W, np.zeros_like(W), np.zeros_like(W))
    params = {"B": B, "b": b.copy(), "gW": np.zeros_like(W), "gb": np.zeros_like(b),
              "bM": np.zeros_like(b), "bV": np.zeros_like(b)}
    params["W"], params["M"], params["V"] = _row_parts(B)
    p = params
    dH, losses = np.zeros((1, H), np.float32), np.zeros(1, np.float32)
    hyper = (4e-3, 0.9, 0.999, 1e-8, 3, 0.5)  # lr, beta1, beta2, eps, step, weight decay
    K.output_step(y_indptr, h, p["B"], p["b"], p["gW"], p["gb"], p["bM"], p["bV"], owners, slots,
                  zpool, active, n_active, 1, np.zeros((1, cap + 1), np.float32), dH,
                  losses, np.zeros((0, 3), np.float32), np.zeros((0, 1), np.float32), *hyper)
    rest = np.zeros(n_labels, np.int32)
    n_in_place = K.clear_marks(owners, touched[:n_touched], rest)
    assert not owners.any()  # every mark cleared for the next step
    shared = shared[:n_shared]
    # the compact gradients (row t for shared[t]) laid out by label, for the checks
    p["gW"], p["gb"] = _expand(p["gW"], shared, n_labels), _expand(p["gb"], shared, n_labels)
    return dict(W=W, b=b, h=h, label=label, found=found, pool=pool, zpool=zpool,
                own=active[0, :n_active[0]], params=params, losses=losses, hyper=hyper,
                shared=shared, in_place=rest[:n_in_place])


def _pair_scratch(nnz: int):
    """backward_hidden's scratch for the entries of shared input rows."""
    return np.zeros(nnz + 1, np.int64), np.zeros(nnz, np.int32), np.zeros(nnz, np.float32)


def _claimed_step(threads: int):
    """select_active, mark_rows, output_step and backward_hidden on a batch of 9 samples whose
    own sets and input features are their own alone (one label shared with the pool), on
    ``threads`` threads claiming the samples; returns what the samples write alone."""
    import scipy.sparse as sp

    import slide.kernels as K
    from slide.runtime import engine_threads
    from lsh.tables import QueryScratch

    rng = np.random.default_rng(3)
    n, n_labels, H, n_f = 9, 60, 8, 30
    # two labels, one, and none for the last sample (an empty own set: nothing to claim ahead)
    labels = [[3 * r] + ([3 * r + 1] if r % 3 == 0 else []) for r in range(n - 1)] + [[]]
    y_indptr = np.cumsum([0] + [len(y) for y in labels]).astype(np.int64)
    y_indices = np.concatenate(labels).astype(np.int32)
    pool = np.append(np.arange(40, 60), 0).astype(np.int32)  # sample 0's label is in the pool
    X = sp.lil_matrix((n, n_f), dtype=np.float32)
    for r in range(n):  # features of one sample each
        X[r, [3 * r, 3 * r + 1]] = rng.random(2) + 0.5
    X = sp.csr_matrix(X)
    W = rng.standard_normal((n_labels, H)).astype(np.float32)
    B = _row_block(W, np.zeros_like(W), np.full_like(W, 1e-3))
    b, bM, bV = (rng.standard_normal(n_labels).astype(np.float32), np.zeros(n_labels, np.float32),
                 np.full(n_labels, 1e-3, np.float32))
    W0 = _row_block(*(np.abs(rng.standard_normal((n_f, H))).astype(np.float32) for _ in range(3)))
    acts = np.abs(rng.standard_normal((n, H))).astype(np.float32)
    zpool = (acts @ W[pool].T + b[pool]).astype(np.float32)
    hyper = (1e-2, 0.9, 0.999, 1e-8, 3, 0.1)
    with engine_threads(threads) as T:
        assert T == threads
        qs = QueryScratch(T, 1, 1, extra=2)
        active, n_active = np.zeros((n, 2), np.int32), np.zeros(n, np.int64)
        # no LSH (lsh_cap 0): codes, buckets and seen as the engine passes them without tables
        no_tables = (np.zeros((n, 1), np.int32), np.zeros((0, 1, 1), np.int32),
                     np.zeros((0, 1), np.int32))
        K.select_active(y_indptr, y_indices, *no_tables, qs.slots, qs.where, qs.cand, qs.hits,
                        qs.hist, 0, pool, np.full(n_labels, -1, np.int32), np.zeros(8, np.uint8),
                        zpool, active, n_active, T)
        owners, touched = np.zeros(n_labels, np.uint8), np.zeros(n_labels, np.int32)
        slots, shared = np.zeros(n_labels, np.int32), np.zeros(n_labels, np.int32)
        K.mark_rows(pool, active, n_active, owners, True, touched, slots, shared)
        gW, gb = np.zeros((2, H), np.float32), np.zeros(2, np.float32)
        dH, losses = np.zeros((n, H), np.float32), np.zeros(n, np.float32)
        mean = K.output_step(y_indptr, acts, B, b, gW, gb, bM, bV, owners, slots, zpool, active,
                             n_active, T, np.zeros((T, 2), np.float32), dH, losses,
                             np.zeros((0, 3), np.float32), np.zeros((0, 1), np.float32), *hyper)
        assert mean == pytest.approx(losses.astype(np.float64).mean(), rel=1e-12)
        owners_in, touched_in = np.zeros(n_f, np.uint8), np.zeros(X.nnz, np.int32)
        slots_in, shared_in = np.zeros(n_f, np.int32), np.zeros(X.nnz, np.int32)
        _, n_shared = K.mark_ids(X.indices, owners_in, True, touched_in, slots_in, shared_in)
        gW0, gb0 = np.zeros((X.nnz, H), np.float32), np.zeros(H, np.float32)
        K.backward_hidden(X.indptr.astype(np.int64), X.indices, X.data, acts, dH, W0, owners_in,
                          slots_in, n_shared, np.zeros(1, np.float32), np.zeros(1, np.int64),
                          np.array([H], np.int64), gW0, gb0,
                          np.zeros(1, np.float32), np.zeros(1, np.float32), np.zeros(1, np.int64),
                          T, np.zeros((T, 2 * H), np.float32), np.zeros((n, H), np.float32),
                          *_pair_scratch(X.nnz), True, *hyper)
    return dict(active=active, n_active=n_active, zpool=zpool, B=B, b=b, bM=bM, bV=bV, gW=gW,
                gb=gb, dH=dH, losses=losses, W0=W0, gb0=gb0)


def test_threads_claiming_samples_give_each_sample_what_one_thread_gives():
    """The per-sample kernels share a batch out as each thread finishes a sample: on 2 threads
    every sample is processed once, and everything a sample alone writes (its active set, pool
    logit gradients, loss, hidden gradient, the rows it alone touches, updated in place) is the
    same bits as on one thread, and so is the input biases' gradient, summed over the samples
    by one thread. (Rows of the output layer that two samples add to are Hogwild's: here one
    sample adds to the shared one.)"""
    one, two = _claimed_step(1), _claimed_step(2)
    assert list(one["n_active"]) == [2, 1, 1, 2, 1, 1, 2, 1, 0]
    for k in one:
        assert np.array_equal(two[k], one[k]), k
    assert one["zpool"][0, -1] == 0  # sample 0's label: in its own set, out of its pool
    assert one["losses"][:-1].min() > 0
    # the last sample's whole softmax is its pool's: its probabilities, scaled by 1/n, sum to 1/n
    np.testing.assert_allclose(one["zpool"][-1].sum(), 1 / 9, rtol=1e-5)
    assert one["gW"].any()  # the shared row got sample 0's gradient


def test_shared_input_rows_sum_their_samples_in_order_on_any_thread_count():
    """An input row that several samples of the batch hold gets its gradient summed over them
    by one thread, in sample order: X.T @ D over those rows (D: each sample's first-layer
    gradient, dH where the unit is active), the same bits on 1 and 2 threads; the biases' is
    D's column sums. Rows of one sample get their Adam step instead, not a gradient row."""
    import scipy.sparse as sp

    import slide.kernels as K
    from slide.runtime import engine_threads

    rng = np.random.default_rng(5)
    n, n_f, H = 40, 16, 8
    dense = np.where(rng.random((n, n_f)) < 0.4, rng.random((n, n_f)) + 0.5, 0).astype(np.float32)
    dense[:, 12:] = 0
    dense[[3, 3, 17, 39], [12, 13, 14, 15]] = 1.5  # features of one sample each
    X = sp.csr_matrix(dense)
    acts = rng.standard_normal((n, H)).astype(np.float32)  # about half the units active
    dH = rng.standard_normal((n, H)).astype(np.float32)
    D = np.where(acts > 0, dH, 0).astype(np.float32)
    hyper = (1e-2, 0.9, 0.999, 1e-8, 3, 0.1)
    out = {}
    for threads in (1, 2):
        with engine_threads(threads) as T:
            W0 = _row_block(*(rng.standard_normal((n_f, H)).astype(np.float32) for _ in range(3)))
            owners, touched = np.zeros(n_f, np.uint8), np.zeros(X.nnz, np.int32)
            slots, shared = np.zeros(n_f, np.int32), np.zeros(X.nnz, np.int32)
            _, n_shared = K.mark_ids(X.indices, owners, True, touched, slots, shared)
            gW0, gb0 = np.zeros((X.nnz, H), np.float32), np.zeros(H, np.float32)
            d_first = np.zeros((n, H), np.float32)
            K.backward_hidden(X.indptr.astype(np.int64), X.indices, X.data, acts, dH, W0, owners,
                              slots, n_shared, np.zeros(1, np.float32), np.zeros(1, np.int64),
                              np.array([H], np.int64), gW0, gb0, np.zeros(1, np.float32),
                              np.zeros(1, np.float32), np.zeros(1, np.int64), T,
                              np.zeros((T, 2 * H), np.float32), d_first, *_pair_scratch(X.nnz),
                              True, *hyper)
            out[threads] = gW0[:n_shared], gb0, d_first, shared[:n_shared].copy()
    (g1, b1, d1, rows), (g2, b2, d2, rows2) = out[1], out[2]
    assert 0 < rows.size < n_f and np.array_equal(rows, rows2)  # some rows of one sample only
    assert np.array_equal(g1, g2) and np.array_equal(b1, b2) and np.array_equal(d1, d2)
    np.testing.assert_array_equal(d1, D)
    expected = (X.T.toarray().astype(np.float64) @ D)[rows]
    np.testing.assert_allclose(g1, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b1, D.astype(np.float64).sum(0), rtol=1e-5, atol=1e-6)


def test_output_step_softmax_is_own_set_and_the_random_rest_of_the_pool():
    """The step's softmax runs over the sample's own neurons (labels + the LSH candidates kept
    under the cap) and the pool neurons its query did not find, each once: candidates the cap
    cut are in neither."""
    case = _output_case(in_place=False)
    W, b, h, label = case["W"], case["b"], case["h"], case["label"]
    found, pool, own = case["found"], case["pool"], case["own"]
    n_labels = W.shape[0]
    assert own[0] == label and own.size == 4 and np.isin(own[1:], found).all()
    cut = np.setdiff1d(found, own)
    ids = np.arange(n_labels)
    inside = np.isin(ids, np.union1d(pool, own)) & ~np.isin(ids, cut)
    z = (W @ h[0] + b).astype(np.float64)
    p = np.where(inside, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    rest = ~np.isin(pool, found) & (pool != label)
    np.testing.assert_allclose(case["zpool"][0, rest], p[pool[rest]], rtol=1e-5)
    assert (case["zpool"][0, ~rest] == 0).all()
    y = (np.arange(n_labels) == label).astype(np.float64)
    np.testing.assert_allclose(case["params"]["gb"][own], (p - y)[own], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(case["params"]["gW"][own], np.outer((p - y)[own], h[0]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(case["losses"][0], -np.log(p[label]), rtol=1e-5)
    # without in-place updates every touched row is listed for Adam, each once
    assert case["in_place"].size == 0
    assert sorted(case["shared"]) == sorted(set(pool) | set(own))


def test_rows_a_sample_owns_alone_get_adams_step_in_place():
    """An own row outside the pool and every other own set gets its Adam step inside the output
    step: the same weights, moments and biases, bit for bit, as through the accumulators and
    adam_rows / adam_entries; shared rows still go through the accumulators."""
    import slide.kernels as K

    ref, fused = _output_case(in_place=False), _output_case(in_place=True)
    alone = np.setdiff1d(ref["own"], ref["pool"])
    pool_only = np.setdiff1d(ref["pool"], ref["own"])  # updated later, by pool_gradients
    assert alone.size >= 2
    assert np.array_equal(np.sort(fused["in_place"]), np.union1d(alone, pool_only))
    assert np.array_equal(np.sort(fused["shared"]), np.intersect1d(ref["pool"], ref["own"]))
    r, f = ref["params"], fused["params"]
    lr, beta1, beta2, eps, step, decay = ref["hyper"]
    rows = alone.astype(np.int32)
    K.adam_rows(rows, rows, r["B"], r["gW"], lr, beta1, beta2, eps, step, decay)
    K.adam_entries(rows, rows, r["b"], r["bM"], r["bV"], r["gb"], lr, beta1, beta2, eps, step, 0.0)
    for k in ("W", "b", "M", "V", "bM", "bV", "gW", "gb"):
        assert np.array_equal(f[k], r[k]), k
    assert not np.array_equal(f["W"][alone], ref["W"][alone])  # the rows did move
    assert not f["gW"][alone].any() and not f["gb"][alone].any()
    np.testing.assert_array_equal(fused["zpool"], ref["zpool"])


def test_longest_row_of_csr_row_pointers():
    """The most entries in one row, from the row pointers alone, 0 without rows or entries."""
    from slide import kernels as K
    Y = sp.csr_matrix(np.array([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0]], np.float32))
    assert K.longest_row(Y.indptr) == 3
    assert K.longest_row(Y[:2].indptr) == 2
    assert K.longest_row(Y[1:2].indptr) == 0
    assert K.longest_row(np.zeros(1, np.int64)) == 0


def test_mark_ids_finds_the_features_of_one_sample_alone():
    """Hand-computed: a feature met once is ALONE, twice SHARED; each listed once, in order."""
    import slide.kernels as K

    ids = np.array([4, 1, 6, 1, 0, 6, 6], np.int32)
    owners, touched = np.zeros(8, np.uint8), np.zeros(7, np.int32)
    slots, shared = np.full(8, -1, np.int32), np.zeros(7, np.int32)
    assert K.mark_ids(ids, owners, True, touched, slots, shared) == (4, 2)
    assert list(touched[:4]) == [4, 1, 6, 0]
    assert [owners[i] for i in touched[:4]] == [K.ALONE, K.SHARED, K.SHARED, K.ALONE]
    assert list(shared[:2]) == [1, 6] and slots[1] == 0 and slots[6] == 1
    alone = np.zeros(7, np.int32)
    assert K.clear_marks(owners, touched[:4], alone) == 2
    assert list(alone[:2]) == [4, 0] and not owners.any()
    n, n_shared = K.mark_ids(ids, owners, False, touched, slots, shared)
    assert n == n_shared == 4 and all(owners[i] == K.SHARED for i in touched[:n])
    assert list(shared[:4]) == [4, 1, 6, 0] and list(slots[shared[:4]]) == [0, 1, 2, 3]


@pytest.mark.parametrize("hidden", [(6,), (6, 4)])
def test_input_rows_of_one_sample_get_adams_step_in_the_backward_pass(hidden):
    """A feature in one sample's row only gets its Adam step inside backward_hidden: the same
    input weights and moments, bit for bit, as through the accumulator and adam_rows; features
    shared by two samples still go through the accumulator."""
    import scipy.sparse as sp

    import slide.kernels as K

    rng = np.random.default_rng(1)
    X = sp.csr_matrix(np.array([[1.0, 0, 2, 0, 0, 0.5], [0, 3, 2, 0, 1, 0], [0, 0, 0, 4, 1, 0]],
                               np.float32))
    sizes = np.array(hidden, np.int64)
    n_f, H0 = X.shape[1], hidden[0]
    blocks = hidden_blocks(hidden)  # the stack's offsets, as the engine lays them out
    h_off = np.array([blk[0] for blk in blocks] or [0], np.int64)
    b_off = np.array([blk[1] for blk in blocks] or [0], np.int64)
    Wh = rng.standard_normal(max(1, sum(blk[2] * blk[3] for blk in blocks))).astype(np.float32)
    acts = np.abs(rng.standard_normal((3, int(sizes.sum())))).astype(np.float32)
    acts[0, 1] = 0.0  # a ReLU at zero
    dH = rng.standard_normal((3, hidden[-1])).astype(np.float32)
    hyper = (1e-2, 0.9, 0.999, 1e-8, 3, 0.1)
    start = {k: rng.standard_normal((n_f, H0)).astype(np.float32) for k in ("W0", "M0")}
    start["V0"] = np.abs(rng.standard_normal((n_f, H0))).astype(np.float32)
    out = {}
    for in_place in (False, True):
        B = _row_block(start["W0"], start["M0"], start["V0"])
        p = dict(zip(("W0", "M0", "V0"), _row_parts(B)))
        gW0, gb0 = np.zeros((n_f, H0), np.float32), np.zeros(H0, np.float32)
        gWh, gbh = np.zeros_like(Wh), np.zeros(max(1, sum(blk[2] for blk in blocks)), np.float32)
        owners, touched = np.zeros(n_f, np.uint8), np.zeros(X.nnz, np.int32)
        slots, shared = np.zeros(n_f, np.int32), np.zeros(X.nnz, np.int32)
        n, n_shared = K.mark_ids(X.indices, owners, in_place, touched, slots, shared)
        K.backward_hidden(X.indptr.astype(np.int64), X.indices, X.data, acts, dH, B, owners,
                          slots, n_shared, Wh, h_off, sizes, gW0, gb0, gWh, gbh, b_off,
                          1, np.zeros((1, 2 * max(hidden)), np.float32),
                          np.zeros((3, H0), np.float32), *_pair_scratch(X.nnz), True, *hyper)
        alone = np.zeros(n, np.int32)
        n_alone = K.clear_marks(owners, touched[:n], alone)
        K.adam_rows(shared[:n_shared], np.arange(n_shared, dtype=np.int32), B, gW0, *hyper)
        out[in_place] = p, alone[:n_alone], gW0, gb0, gWh
    (ref, none, *ref_g), (fused, alone, *fused_g) = out[False], out[True]
    assert none.size == 0 and sorted(alone) == [0, 1, 3, 5]  # features of one sample's row
    for k in ("W0", "M0", "V0"):
        assert np.array_equal(fused[k], ref[k]), k
    assert not np.array_equal(fused["W0"][alone], start["W0"][alone])  # they did move
    for a, b in zip(fused_g, ref_g):  # and the accumulators end equal: all zero for W0
        assert np.array_equal(a, b)


@pytest.mark.parametrize("chunk", [256, 6])  # a block at once; blocks in chunks, the last short
@pytest.mark.parametrize("bounds", [[0, 37], [0, 5, 5, 20, 37]])
def test_pool_products_match_numpy_for_any_split_of_the_pool(bounds, chunk):
    """The shared pool's logits and gradients, split over blocks of the pool (one per thread;
    uneven, one empty) and the blocks into chunks, equal the three numpy products: dH gets
    every block's share; a pool row that is no sample's own gets Adam's step with its gradient
    in place, the others accumulate it."""
    import slide.kernels as K

    rng = np.random.default_rng(1)
    n, H, n_out = 9, 16, 100
    h = rng.standard_normal((n, H)).astype(np.float32)
    W = rng.standard_normal((n_out, H)).astype(np.float32)
    b = rng.standard_normal(n_out).astype(np.float32)
    pool = rng.choice(n_out, 37, replace=False).astype(np.int32)
    bounds = np.array(bounds, np.int64)
    P, T = pool.size, bounds.size - 1
    W_pool, z, vec = np.empty((P, H), np.float32), np.empty((n, P), np.float32), np.empty(P, np.float32)
    K.pool_logits(h, W, b, pool, W_pool, z, vec, bounds, chunk)
    z_block = np.empty_like(z)  # the row block's rows are led by the same weights
    K.pool_logits(h, _row_block(W, W + 1, W + 2), b, pool, W_pool, z_block, vec, bounds, chunk)
    np.testing.assert_array_equal(z_block, z)
    np.testing.assert_allclose(z, h @ W[pool].T + b[pool], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(W_pool, W[pool])

    # back: pool rows marked POOL get Adam's step in place, the others accumulate
    dz = rng.standard_normal((n, P)).astype(np.float32)
    dH0 = rng.standard_normal((n, H)).astype(np.float32)
    owners = np.zeros(n_out, np.uint8)
    owners[pool] = K.SHARED
    lone = pool[::3]
    owners[lone] = K.POOL
    slots = rng.permutation(n_out).astype(np.int32)  # the SHARED rows' rows of the gradient
    B = _row_block(W, np.full_like(W, 0.1), np.full_like(W, 0.2))
    state = {"B": B, "b": b.copy(), "bM": np.full_like(b, 0.1), "bV": np.full_like(b, 0.2)}
    before = {k: v.copy() for k, v in state.items()}
    hyper = (1e-2, 0.9, 0.999, 1e-8, 4, 0.5)  # lr, beta1, beta2, eps, step, weight decay
    dH, gW, gb = dH0.copy(), np.ones_like(W), np.ones_like(b)
    g_pool = np.empty((P, H), np.float32)
    K.pool_gradients(h, W_pool, dz.copy(), pool, dH, state["B"], state["b"], gW, gb, state["bM"],
                     state["bV"], owners, slots, g_pool, vec, np.full((T, n, H), np.nan, np.float32),
                     bounds, chunk, *hyper)
    np.testing.assert_allclose(dH, dH0 + dz @ W[pool], rtol=1e-5, atol=1e-5)  # weights before
    np.testing.assert_allclose(g_pool, dz.T @ h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(vec, dz.sum(axis=0), rtol=1e-5, atol=1e-5)
    shared = owners[pool] == K.SHARED
    np.testing.assert_array_equal(gW[slots[pool[shared]]], 1 + g_pool[shared])
    np.testing.assert_array_equal(gb[slots[pool[shared]]], 1 + vec[shared])
    assert (gW[slots[lone]] == 1).all() and (gb[slots[lone]] == 1).all()  # no gradient row
    # the rows updated in place: as adam_rows / adam_entries with the same gradients
    at = np.flatnonzero(~shared).astype(np.int32)
    ref = {k: v.copy() for k, v in before.items()}
    K.adam_rows(lone, at, ref["B"], g_pool.copy(), *hyper)
    K.adam_entries(lone, at, ref["b"], ref["bM"], ref["bV"], vec.copy(), *hyper[:-1], 0.0)
    for k in state:
        np.testing.assert_array_equal(state[k], ref[k], err_msg=k)
    assert not np.array_equal(_row_parts(state["B"])[0][lone], W[lone])
    rest = np.setdiff1d(np.arange(n_out), lone)
    assert all(np.array_equal(state[k][rest], before[k][rest]) for k in state)
    rest = slots[np.setdiff1d(np.arange(n_out), pool)]
    assert (gW[rest] == 1).all() and (gb[rest] == 1).all()


class _RecordingGuard:
    """Stands in for a :class:`slide.distributed.DataParallel` where only its guard is
    reached: records the exceptions that pass through it."""

    def __init__(self):
        self.seen = []

    @contextlib.contextmanager
    def guard(self):
        try:
            yield
        except Exception as e:
            self.seen.append(e)
            raise


def test_a_model_trains_on_one_thread_at_a_time(tiny_data):
    """A second thread that starts training a model while another trains it gets an error,
    not a race through the same parameters and step buffers; once the first is done, any
    thread may train it."""
    X, Y = tiny_data[0][:300], tiny_data[1][:300]
    model = SlideClassifier(hidden=(16,), seed=0, epochs=2, early_stopping=False, threads=1)
    inside, release, errors = threading.Event(), threading.Event(), []

    def hold(m, record):  # the first epoch's end: the model is training on this thread
        inside.set()
        release.wait(60)

    def train():
        try:
            model.fit(X, Y, on_epoch=hold)
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    t = threading.Thread(target=train)
    t.start()
    try:
        assert inside.wait(120)
        with pytest.raises(RuntimeError, match="already training on another thread"):
            model.partial_fit(X[:20], Y[:20])
        with pytest.raises(RuntimeError, match="already training on another thread"):
            model.fit(X, Y)
        # on MPI the check is inside the rank's guard, which ends the job rather than leave
        # the other ranks waiting (a stand-in guard records what reached it)
        for train_on in (model.partial_fit, model.fit):
            guard = _RecordingGuard()
            with pytest.raises(RuntimeError, match="already training on another thread"):
                train_on(X[:20], Y[:20], distributed=guard)
            assert [type(e) for e in guard.seen] == [RuntimeError]
        copy.deepcopy(model).partial_fit(X[:20], Y[:20])  # a copy is no one's to train yet
    finally:
        release.set()
        t.join()
    assert not errors and model.epoch_ == 2
    model.partial_fit(X[:20], Y[:20])  # the first thread is done: this one may train it
