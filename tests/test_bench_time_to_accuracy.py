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
