"""The accuracy table's harness, end to end on a small preset, in-process."""
import argparse
import json

import numpy as np
import pytest
import scipy.sparse as sp

from bench import quality


def test_quality_table_in_process(tmp_path):
    out = tmp_path / "q"
    doc = quality.run(argparse.Namespace(
        data_dir=str(tmp_path / "none"), sets="", presets="eurlex-4k:600", engines="slide,knn,xr-linear",
        peers_python="", threads=1, seed=0, negatives_from=None, in_process=True,
        out=str(out)))
    rows = {r["engine"]: r for r in doc["rows"]}
    assert set(rows) == {"slide", "knn"}
    assert any("XR-Linear skipped" in n for n in doc["notes"])
    for r in rows.values():
        assert 0 <= r["P@5"] <= r["P@1"] <= 1 and r["train_seconds"] >= 0
    # the engine's test P@1 after each epoch against its training seconds so far: the last
    # point is the model as fitted (the refit, where it ran), the seconds only grow
    curve = rows["slide"]["curve"]
    assert len(curve) == len(doc["rows"][0]["curve"]) > 1
    assert all(a[0] <= b[0] for a, b in zip(curve, curve[1:]))
    assert curve[-1][1] == pytest.approx(rows["slide"]["P@1"])
    assert "eurlex-4k" in (tmp_path / "q.md").read_text()
    assert json.loads((tmp_path / "q.json").read_text())["table"] == doc["table"]


def test_table_says_where_settings_were_chosen():
    row = {"dataset": "d", "engine": "slide", "P@1": 0.5, "P@3": 0.4, "P@5": 0.3, "PSP@5": 0.3,
           "train_seconds": 1.0, "peak_rss_mb": 100.0, "kept_epoch": 4, "epochs": 9, "refit": True,
           "choice": "hidden 2048", "choices_tried": ["rule", "hidden 2048", "decay 0.3"],
           "settings": {"hidden": [2048], "lr": 0.001, "weight_decay": 1.0, "batch_size": 32}}
    text = quality.table([row], ["slide"])
    assert "hidden [2048], lr 0.001, weight_decay 1, batch_size 32 (hidden 2048, of rule / hidden 2048 / " \
           "decay 0.3); epoch 4 of 9, then refit on every row" in text
    assert "(hidden 2048" not in quality.table([{**row, "choices_tried": []}], ["slide"])


def test_table_has_a_difference_column_per_peer():
    rows = [{"dataset": "d", "engine": e, "P@1": p, "P@3": 0.3, "P@5": 0.2, "PSP@5": 0.2,
             "train_seconds": 1.0, "peak_rss_mb": 10.0} for e, p in
            (("slide", 0.60), ("xr-linear", 0.55), ("parabel", 0.625))]
    head, rule, line = quality.table(rows, ["slide", "xr-linear", "parabel"]).splitlines()[:3]
    assert head == "| dataset | slide P@1 | xr-linear P@1 | parabel P@1 | slide − XR-Linear | slide − Parabel |"
    assert rule.count("---") == 6
    assert line == "| d | 0.600 | 0.550 | 0.625 | +0.050 | -0.025 |"


def test_peers_are_skipped_without_their_environment(tmp_path):
    doc = quality.run(argparse.Namespace(
        data_dir=str(tmp_path / "none"), sets="", presets="", engines="xr-linear,parabel",
        peers_python="", threads=1, seed=0, in_process=True, out=str(tmp_path / "q")))
    assert doc["rows"] == []
    assert [n.split(" ")[0] for n in doc["notes"]] == ["XR-Linear", "Parabel"]


def test_peer_inputs_round_trip(tmp_path):
    """What a peer worker reads: the rows as given, L2-normalised (an empty row stays empty),
    sorted; and, for Parabel, the training file it trains from, which reads back through the
    project's own reader as the same normalised rows and labels, a row without labels and one
    without features included. XR-Linear gets no file."""
    from bench.peer_io import load_problem
    from bench.peers import prepare
    from slide.data import read_dataset
    X = sp.csr_matrix(np.array([[3.0, 0, 4.0], [0, 0, 0], [0, 2.0, 0], [1.0, 1.0, 0]], np.float32))
    Y = sp.csr_matrix(np.array([[1, 0], [0, 1], [0, 0], [1, 1]], np.float32))
    assert prepare("xr-linear", X, Y, X[:2], tmp_path) == [str(tmp_path / "in.npz")]
    inputs = prepare("parabel", X, Y, X[:2], tmp_path)
    assert inputs == [str(tmp_path / "in.npz"), "--train-file", str(tmp_path / "train.txt")]
    Xtr, Ytr, Xte = load_problem(inputs[0])
    expected = np.array([[0.6, 0, 0.8], [0, 0, 0], [0, 1, 0], [0.70710677, 0.70710677, 0]], np.float32)
    np.testing.assert_allclose(Xtr.toarray(), expected, rtol=1e-6)
    np.testing.assert_allclose(Xte.toarray(), expected[:2], rtol=1e-6)
    np.testing.assert_array_equal(Ytr.toarray(), Y.toarray())
    Xr, Yr = read_dataset(inputs[2])
    np.testing.assert_allclose(Xr.toarray(), expected, rtol=1e-6)
    np.testing.assert_array_equal(Yr.toarray(), Y.toarray())


def test_specs_for_a_shape_and_a_folder_made_multi_class(tmp_path):
    from slide.data import write_xmc
    # a generator shape given inline: its counts and row means
    name, Xtr, Ytr, Xte, Yte = quality.load_set("shape:300/40/500/100/12/1.5", str(tmp_path), 0)
    assert name == "shape:300/40/500/100/12/1.5"
    assert Xtr.shape == (500, 300) and Ytr.shape == (500, 40) and Xte.shape == (100, 300)
    assert 1.2 < Ytr.nnz / 500 < 1.8
    with pytest.raises(SystemExit, match="bad shape"):
        quality.load_set("shape:300/40/500", str(tmp_path), 0)
    # a real folder made multi-class: each row's first listed label, unlabelled rows left out
    X = sp.csr_matrix(np.array([[1, 0, 2], [0, 3, 0], [4, 0, 0]], np.float32))
    Y = sp.csr_matrix(np.array([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1]], np.float32))
    (tmp_path / "s").mkdir()
    for part in ("train", "test"):
        write_xmc(str(tmp_path / "s" / f"{part}.txt"), X, Y)
    name, Xtr, Ytr, Xte, Yte = quality.load_set("single:s", str(tmp_path), 0)
    assert name == "single:s"
    assert Xtr.toarray().tolist() == [[1, 0, 2], [4, 0, 0]]
    assert Ytr.toarray().tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    assert (Yte != Ytr).nnz == 0 and Ytr.dtype == np.float32


def test_seconds_to_pass_each_peer():
    curve = [[1.0, 0.2, "rule"], [2.5, 0.5, "rule"], [4.0, 0.7, "tf-idf"]]
    assert quality.seconds_to_pass(curve, 0.1) == 1.0
    assert quality.seconds_to_pass(curve, 0.5) == 4.0  # passed: above, not level with
    assert quality.seconds_to_pass(curve, 0.7) is None
    rows = [{"dataset": "d", "engine": "slide", "P@1": 0.7, "curve": curve},
            {"dataset": "d", "engine": "xr-linear", "P@1": 0.45, "train_seconds": 1.25},
            {"dataset": "d", "engine": "parabel", "P@1": 0.75, "train_seconds": 2.0},
            {"dataset": "e", "engine": "slide", "P@1": 0.3, "curve": curve}]
    lines = quality.passing_table(rows, ["slide", "xr-linear", "parabel"])
    assert lines[1] == "| dataset | slide s to pass XR-Linear | XR-Linear s | slide s to pass Parabel | Parabel s |"
    assert lines[3] == "| d | 2.5 (2.0×) | 1.2 | never | 2.0 |"
    assert len(lines) == 4  # e: no peer scored there
    assert quality.passing_table(rows, ["slide"]) == []


def test_a_cut_keeps_labels_of_enough_positives_and_weighs_by_idf(tmp_path):
    from slide.data import write_xmc
    # six rows: label 0 in four (kept at CUT_POSITIVES), label 1 in two (dropped, and with it
    # the rows holding only it); feature 2 in no kept row (dropped)
    X = sp.csr_matrix(np.array([[1, 1, 0], [1, 0, 0], [2, 0, 0], [0, 1, 0], [1, 0, 3],
                                [0, 0, 1]], np.float32))
    Y = sp.csr_matrix(np.array([[1, 0], [1, 0], [1, 0], [1, 0], [0, 1], [0, 1]], np.float32))
    assert quality.CUT_POSITIVES == 4
    (tmp_path / "s").mkdir()
    for part in ("train", "test"):
        write_xmc(str(tmp_path / "s" / f"{part}.txt"), X, Y)
    name, Xtr, Ytr, Xte, Yte = quality.load_set("cut:s/6", str(tmp_path), 0)
    assert name == "cut:s/6" and Ytr.shape == (4, 1) and Ytr.nnz == 4 and Yte.shape == (4, 1)
    # idf from the cut's four rows: feature 0 in three (log(4/3) + 1), feature 1 in two
    idf = np.log(4 / np.array([3, 2])) + 1
    raw = np.array([[1, 1], [1, 0], [2, 0], [0, 1]]) * idf
    want = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    np.testing.assert_allclose(np.sort(Xtr.toarray(), axis=0), np.sort(want, axis=0), rtol=1e-6)
    np.testing.assert_allclose(np.sort(Xte.toarray(), axis=0), np.sort(want, axis=0), rtol=1e-6)
    with pytest.raises(SystemExit, match="bad cut"):
        quality.load_set("cut:s", str(tmp_path), 0)
