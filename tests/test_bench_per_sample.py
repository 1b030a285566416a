"""The per-sample harness: one curve point an epoch for each engine, the engines it knows."""
import json

import pytest

from bench import per_sample


def test_each_engine_gets_a_point_an_epoch(tmp_path):
    out = tmp_path / "ps"
    per_sample.main(["--sets", "demo:1500", "--engines", "dense-sampled,dense-sampled+mined",
                     "--epochs", "2", "--n-test", "200", "--negatives", "64", "--mined", "4",
                     "--out", str(out)])
    doc = json.loads((tmp_path / "ps.json").read_text())
    assert [r["engine"] for r in doc["runs"]] == ["dense-sampled", "dense-sampled+mined"]
    for r in doc["runs"]:
        assert [c["epoch"] for c in r["curve"]] == [1, 2]
        assert [c["samples"] for c in r["curve"]] == [r["rows"], 2 * r["rows"]]
        assert all(0 <= c["P@1"] <= 1 for c in r["curve"])
    assert "| demo:1500 | dense-sampled+mined |" in (tmp_path / "ps.md").read_text()


def test_engines_carry_their_negatives():
    import argparse
    args = argparse.Namespace(epochs=2, seed=0, threads=1, device="cpu", negatives=64, mined=5)
    m = per_sample.make("dense-sampled+mined", args)
    assert (m.negatives, m.mined_negatives, m.epochs, m.early_stopping) == (64, 5, 2, False)
    assert per_sample.make("dense", args).negatives is None
    assert per_sample.make("slide", args).epochs == 2
    with pytest.raises(ValueError, match="unknown engine"):
        per_sample.make("dense+mined", args)
