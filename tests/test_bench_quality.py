"""The accuracy table's harness, end to end on a small preset, in-process."""
import argparse
import json

from bench import quality


def test_quality_table_in_process(tmp_path):
    out = tmp_path / "q"
    doc = quality.run(argparse.Namespace(
        data_dir=str(tmp_path / "none"), sets="", presets="eurlex-4k:600", engines="slide,knn,xr-linear",
        peers_python="", threads=1, seed=0, in_process=True, out=str(out)))
    rows = {r["engine"]: r for r in doc["rows"]}
    assert set(rows) == {"slide", "knn"}
    assert any("XR-Linear skipped" in n for n in doc["notes"])
    for r in rows.values():
        assert 0 <= r["P@5"] <= r["P@1"] <= 1 and r["train_seconds"] >= 0
    assert "eurlex-4k" in (tmp_path / "q.md").read_text()
    assert json.loads((tmp_path / "q.json").read_text())["table"] == doc["table"]


def test_table_says_where_the_width_was_chosen():
    row = {"dataset": "d", "engine": "slide", "P@1": 0.5, "P@3": 0.4, "P@5": 0.3, "PSP@5": 0.3,
           "train_seconds": 1.0, "peak_rss_mb": 100.0, "kept_epoch": 4, "epochs": 9, "refit": True,
           "widths_tried": ["512", "2048"],
           "settings": {"hidden": [2048], "lr": 0.004, "weight_decay": 0.1, "batch_size": 32}}
    text = quality.table([row], ["slide"])
    assert "hidden [2048] (of 512 / 2048), lr 0.004, weight_decay 0.1, batch_size 32; epoch 4 of 9, " \
           "then refit on every row" in text
    assert "(of" not in quality.table([{**row, "widths_tried": []}], ["slide"])
