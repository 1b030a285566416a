"""Output rows only for the labels with a training positive (slide.labels), and labels added to
a fitted model."""
import json
import os

import numpy as np
import pytest
import scipy.sparse as sp

from gpu_ref import DenseClassifier
from slide.estimator import SlideClassifier
from slide.labels import LabelMap
from slide.synthetic import make_dataset
from tests.conftest import TINY

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _spread(Y, ids, n_labels):
    """``Y``'s columns moved to label ids ``ids`` of a space of ``n_labels``."""
    Y = sp.csr_matrix(Y)
    return sp.csr_matrix((Y.data, ids[Y.indices], Y.indptr), shape=(Y.shape[0], n_labels))


def test_label_map_by_hand():
    m = LabelMap.of(np.array([False, True, False, True, True, False]))
    assert m.ids.tolist() == [1, 3, 4] and m.size == 3 and not m.is_identity
    assert m.rows().tolist() == [-1, 0, -1, 1, 2, -1]
    Y = sp.csr_matrix(np.array([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 1, 0, 1]],
                               np.float32))
    R = m.to_rows(Y)  # labels 0, 2 and 5 have no row: left out
    assert R.shape == (3, 3) and R.toarray().tolist() == [[1, 0, 1], [0, 0, 0], [0, 1, 0]]
    assert m.to_labels(np.array([[2, 0, -1]])).tolist() == [[4, 1, -1]]
    S = m.scatter(np.array([[0.5, 1.5, 2.5]], np.float32), -np.inf)
    assert S.tolist() == [[-np.inf, 0.5, -np.inf, 1.5, 2.5, -np.inf]]
    assert m.missing(Y).tolist() == [0, 2, 5]
    grown = m.extend([5, 0])  # new rows after the others
    assert grown.ids.tolist() == [1, 3, 4, 5, 0] and grown.rows()[[5, 0]].tolist() == [3, 4]
    with pytest.raises(ValueError, match="already has one"):
        m.extend([3])
    assert LabelMap.identity(4).is_identity and LabelMap.of(np.ones(4, bool)).is_identity


@pytest.mark.parametrize("cls", [SlideClassifier, DenseClassifier])
def test_a_wide_label_space_trains_as_the_labels_it_uses(cls, tiny_data):
    """Labels spread over a space of a million train exactly as the same labels packed
    together: the same model, with its outputs in the wide space's ids."""
    X, Y, Xte, _ = tiny_data
    X, Y = X[:400], Y[:400]
    used = np.flatnonzero(np.bincount(Y.indices, minlength=Y.shape[1]))
    Y = Y[:, used]  # packed: every label has a positive
    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(1_000_000, used.size, replace=False))
    wide = _spread(Y, ids, 1_000_000)
    kw = dict(hidden=(16,), epochs=2, seed=0, early_stopping=False)
    kw.update(device="cpu") if cls is DenseClassifier else kw.update(threads=1)
    packed = cls(**kw).fit(X, Y)
    spread = cls(**kw).fit(X, wide)
    assert spread.n_labels_ == 1_000_000 and spread.n_outputs_ == used.size
    assert spread.labels_.ids.tolist() == ids.tolist()
    for k in packed.params_:
        np.testing.assert_array_equal(np.asarray(packed.params_[k]), np.asarray(spread.params_[k]))
    top_p, s_p = packed.predict_topk(Xte[:50], 5)
    top_w, s_w = spread.predict_topk(Xte[:50], 5)
    assert top_w.tolist() == ids[top_p].tolist()
    np.testing.assert_array_equal(s_p, s_w)
    # evaluated in the wide space, against the wide labels
    assert spread.evaluate(X[:100], wide[:100], loss=True) == \
        pytest.approx(packed.evaluate(X[:100], Y[:100], loss=True))
    # the dense outputs: a label without a row has no score and no probability
    P = spread.predict_proba(Xte[:3])
    assert P.shape == (3, 1_000_000) and np.allclose(P.sum(axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(P[:, ids], packed.predict_proba(Xte[:3]), rtol=1e-6)
    assert not P[:, np.setdiff1d(np.arange(1000), ids)].any()
    assert spread.predict(Xte[:3], k=2).shape == (3, 1_000_000)
    if cls is SlideClassifier:
        S = spread.decision_function(Xte[:3])
        assert np.isneginf(S[:, 0 if 0 not in ids else 1]).all() and np.isfinite(S[:, ids]).all()


def test_labels_survive_save_load_and_resume(tmp_path, tiny_data):
    X, Y, Xte, _ = tiny_data
    wide = _spread(Y[:300], np.arange(Y.shape[1]) * 50, Y.shape[1] * 50)
    m = SlideClassifier(hidden=(8,), epochs=1, threads=1, seed=0, early_stopping=False).fit(X[:300], wide)
    m.save(tmp_path / "m")
    back = SlideClassifier.load(tmp_path / "m")
    assert back.n_labels_ == m.n_labels_ and back.labels_.ids.tolist() == m.labels_.ids.tolist()
    assert back.predict_topk(Xte[:20])[0].tolist() == m.predict_topk(Xte[:20])[0].tolist()
    back.partial_fit(X[300:400], _spread(Y[300:400], np.arange(Y.shape[1]) * 50, Y.shape[1] * 50))
    assert back.n_outputs_ >= m.n_outputs_ and back.step_ > m.step_


def test_checkpoints_from_before_label_rows_load_with_a_row_for_every_label():
    """A checkpoint written before models kept rows only for labels with a positive (a row for
    each of its 400 labels, 218 of which had one) loads, predicts as it did, and trains on."""
    path = os.path.join(FIXTURES, "checkpoint_before_label_rows")
    with open(path + "_expected.json") as fh:
        expected = json.load(fh)
    m = SlideClassifier.load(path)
    assert m.n_labels_ == 400 and m.n_outputs_ == 400 and m.labels_.is_identity
    assert m.held_out_ is None  # written before held-out rows were kept: ann's default probe
    # and before the hard negatives' source was a setting: it trained on the LSH tables, and
    # trains on them still (the rule would take the clusters at 400 labels)
    assert m.negatives_from == "lsh" and type(m.tables_).__name__ == "HashTables"
    _, _, Xte, Yte = make_dataset(TINY, seed=7)
    ids, scores = m.predict_topk(Xte[:20], 5)
    assert ids.tolist() == expected["ids"]
    np.testing.assert_allclose(scores, expected["scores"], rtol=1e-6)
    m.partial_fit(Xte[:64], Yte[:64])
    assert m.n_outputs_ == 400


def test_new_labels_get_rows_that_rank_them_and_leave_the_others_alone(tiny_data):
    """partial_fit with labels the model has not seen (inside the label space, and past it):
    each gets a row from its rows' hidden vectors, which ranks it for those rows at once; the
    rows there were do not move until the step trains them."""
    X, Y, _, _ = tiny_data
    old = Y[:600]
    # a sampled output (no prior correction): the rows' scores alone rank the labels
    m = SlideClassifier(hidden=(16,), sparsity=0.5, epochs=3, threads=1, seed=0,
                        early_stopping=False)
    m.fit(X[:600], old)
    n_before, W_before = m.n_outputs_, np.array(m.params_["W"])
    p1_before = m.evaluate(X[:600], old)["P@1"]
    # two new labels past the label space, on 40 rows each, and the labels the first rows
    # never had
    new = np.arange(Y.shape[1], Y.shape[1] + 2)
    rows = np.arange(600, 680)
    Yn = sp.lil_matrix((rows.size, Y.shape[1] + 2), dtype=np.float32)
    Yn[:40, new[0]] = 1
    Yn[40:, new[1]] = 1
    Yn = sp.csr_matrix(Yn)
    m.add_labels(2, X[rows], Yn)
    assert m.n_labels_ == Y.shape[1] + 2 and m.n_outputs_ == n_before + 2
    np.testing.assert_array_equal(np.asarray(m.params_["W"])[:n_before], W_before)
    top = m.predict_topk(X[rows], 10)[0]
    hits = np.mean([new[0] in t for t in top[:40]] + [new[1] in t for t in top[40:]])
    assert hits > 0.5  # ranked in the top 10 of its own rows before any training
    # training on them goes on in the grown space; a missing label of the old space gets its row
    absent = np.setdiff1d(np.arange(Y.shape[1]), m.labels_.ids[:n_before])
    if absent.size:
        Yo = sp.csr_matrix((np.ones(1, np.float32), [absent[0]], [0, 1]), shape=(1, Y.shape[1] + 2))
        m.partial_fit(X[700:701], Yo)
        assert absent[0] in m.labels_.ids
    m.partial_fit(X[rows], Yn)
    top = m.predict_topk(X[rows], 5)[0]
    assert np.mean([new[0] in t for t in top[:40]] + [new[1] in t for t in top[40:]]) > 0.8
    # and the labels there were still rank as they did on their own rows
    assert m.evaluate(X[:600], old)["P@1"] > p1_before - 0.05


def test_a_ten_million_label_header_trains_what_its_rows_use(tmp_path, capsys):
    """Three rows in a label space of ten million: a model of three output rows."""
    from slide.cli import main
    path = tmp_path / "big.txt"
    path.write_text("3 100 10000000\n1 1:0.5\n9999999 2:0.5\n7 3:1\n")
    assert main(["train", str(path), "--epochs", "1", "--no-progress", "--save",
                 str(tmp_path / "m")]) in (0, None)
    m = SlideClassifier.load(tmp_path / "m")
    assert m.n_labels_ == 10_000_000 and m.labels_.ids.tolist() == [1, 7, 9999999]
    assert m.params_["W"].shape[0] == 3
    assert os.path.getsize(next((tmp_path / "m").glob("*.npz"))) < 1 << 20


def test_embeddings_export_scores_as_the_model(tmp_path, tiny_data):
    from slide.cli import main
    from slide.data import write_xmc
    X, Y, Xte, Yte = tiny_data
    m = SlideClassifier(hidden=(8,), epochs=1, threads=1, seed=0, early_stopping=False).fit(X[:300], Y[:300])
    m.save(tmp_path / "m")
    write_xmc(tmp_path / "q.txt", Xte[:20], Yte[:20])
    assert main(["export", str(tmp_path / "m"), str(tmp_path / "e"), "--embeddings",
                 "--queries", str(tmp_path / "q.txt")]) == 0
    L = np.load(tmp_path / "e" / "labels.npy")
    ids = np.load(tmp_path / "e" / "label_ids.npy")
    Q = np.load(tmp_path / "e" / "queries.npy")
    assert L.shape == (m.n_outputs_, 9) and Q.shape == (20, 9)
    S = Q @ L.T  # the model's scores, by row
    top = ids[np.argsort(-S, axis=1)[:, :5]]
    want, scores = m.predict_topk(Xte[:20], 5)
    assert top.tolist() == want.tolist()
    np.testing.assert_allclose(np.sort(S, axis=1)[:, ::-1][:, :5], scores, rtol=1e-4, atol=1e-5)
    record = json.loads((tmp_path / "e" / "embeddings.json").read_text())
    if "hnswlib" in record["files"]:
        import hnswlib
        index = hnswlib.Index(space="ip", dim=9)
        index.load_index(str(tmp_path / "e" / "labels.hnsw"))
        assert index.get_current_count() == m.n_outputs_
    if "faiss" in record["files"]:
        import faiss
        _, I = faiss.read_index(str(tmp_path / "e" / "labels.faiss")).search(Q, 5)
        assert ids[I].tolist() == want.tolist()
