"""The examples run as written, on a small cut of generated data."""
import importlib.util
import os

import numpy as np

from slide.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recommend_files_runs_on_a_small_cut(tmp_path, capsys):
    assert cli(["data", "synth", "eurlex-4k", str(tmp_path / "d"), "--train", "2000", "--test", "300"]) == 0
    out = _load("recommend_files").main([
        "--train", str(tmp_path / "d_train.txt"), "--test", str(tmp_path / "d_test.txt"),
        "--names", "", "--epochs", "2", "--threads", "1", "--new-share", "0.2",
        "--export", str(tmp_path / "vectors")])
    printed = capsys.readouterr().out
    for step in ("1. trained on 1,600 older commits", "2. 400 newest commits", "3. top-10 through",
                 "4. wrote labels.npy"):
        assert step in printed, printed
    assert 0 <= out["recall@10"] <= 1 and out["new_rows"] >= 0
    assert np.load(tmp_path / "vectors" / "queries.npy").shape[0] == 300
