"""The time-to-accuracy harness: the linear peers' runs, skipped and plotted."""
import json

from bench import time_to_accuracy


def test_peers_are_skipped_without_their_environment(tmp_path):
    out = tmp_path / "tta"
    time_to_accuracy.main(["--engines", "xr-linear,parabel", "--peers-python", "", "--out", str(out)])
    doc = json.loads((tmp_path / "tta.json").read_text())
    assert doc["runs"] == []
    assert doc["notes"] == ["XR-Linear skipped: no peers environment",
                            "Parabel skipped: no peers environment"]
    assert (tmp_path / "tta.png").stat().st_size > 0


def test_plot_draws_a_peer_as_one_point_beside_the_engines(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    doc = {"machine": {"cores": 2, "cpu": "x86_64", "date": "2026-11-24"},
           "args": {"n_eval": 100, "preset": "demo", "n_train": 1000, "hidden": 128, "batch_size": 128,
                    "sparsity": 0.005, "threads": 2},
           "runs": [{"engine": "slide", "label": "slide",
                     "points": [{"seconds": 1.0, "P@1": 0.1}, {"seconds": 2.0, "P@1": 0.3}]},
                    {"engine": "parabel", "label": "Parabel (its defaults, trained once)", "peer": True,
                     "points": [{"seconds": 1.5, "P@1": 0.2}]}]}
    drawn = []
    real_savefig = plt.Figure.savefig

    def keep(fig, *args, **kwargs):  # the figure's lines, as saved
        drawn.extend((line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
                     for line in fig.axes[0].get_lines())
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    time_to_accuracy.plot(doc, str(tmp_path / "p.png"))
    labels = [d[0] for d in drawn]
    assert ("slide", [1.0, 2.0], [0.1, 0.3]) in drawn
    assert ("Parabel (its defaults, trained once)", [1.5], [0.2]) in drawn
    # the peer's P@1 carried across as a line of its own (not in the legend)
    assert any(y == [0.2, 0.2] for _, _, y in drawn) and len(labels) == 3


def test_mined_engines_carry_their_hard_negatives():
    import argparse
    import pytest
    args = argparse.Namespace(hidden=16, batch_size=32, seed=0, negatives=64, mined=5,
                              sparsity=0.1, threads=1)
    dense = time_to_accuracy._make("dense-cpu-sampled+mined", args)
    assert (dense.negatives, dense.mined_negatives, dense.device) == (64, 5, "cpu")
    assert time_to_accuracy._make("dense-cpu-sampled", args).mined_negatives == 0
    hetero = time_to_accuracy._make("hetero-hogbatch+mined", args)
    assert (hetero.config.policy, hetero.config.gpu_mined) == ("hogbatch", 5)
    assert time_to_accuracy._make("slide+clusters", args).negatives_from == "clusters"
    assert time_to_accuracy._make("slide+lsh", args).negatives_from == "lsh"
    assert time_to_accuracy._make("slide", args).negatives_from is None  # the rule's
    for bad in ("slide+mined", "dense-cpu+mined", "dense-cpu-sampled+other", "dense-cpu+clusters"):
        with pytest.raises(ValueError, match="unknown engine"):
            time_to_accuracy._make(bad, args)


def test_a_real_sets_folder_gives_its_rows_and_a_fixed_test_sample(tmp_path, tiny_data):
    import argparse
    import numpy as np
    from slide.data import write_xmc
    Xtr, Ytr, Xte, Yte = tiny_data
    (tmp_path / "set").mkdir()
    write_xmc(tmp_path / "set" / "train.txt", Xtr, Ytr)
    write_xmc(tmp_path / "set" / "test.txt", Xte, Yte)
    args = argparse.Namespace(preset="set", data_dir=str(tmp_path), n_train=10, n_eval=50, seed=0)
    X, Y, Xe, Ye = time_to_accuracy._data(args)
    assert X.shape[0] == Xtr.shape[0] and Xe.shape[0] == 50  # every training row, 50 to score
    again = time_to_accuracy._data(args)
    np.testing.assert_array_equal(again[3].indices, Ye.indices)
    assert Y.shape[1] >= Ytr.shape[1]
