import json
import subprocess
import sys

import pytest

from slide import SlideClassifier
from slide.cli import main


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    assert main(["data", "synth", "eurlex-4k", str(d / "eur"), "--train", "1500", "--test", "300"]) == 0
    return d


def test_train_eval_predict_round_trip(synth, capsys):
    d = synth
    rc = main(["train", str(d / "eur_train.txt"), "--test", str(d / "eur_test.txt"), "--epochs", "3",
               "--hidden", "32", "--metrics-json", str(d / "m.json"), "--save", str(d / "model"),
               "--no-progress", "--seed", "1", "--no-refit", "--no-tfidf", "--lr", "4e-3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "final: P@1=" in out and "trained again" not in out
    doc = json.loads((d / "m.json").read_text())
    assert len(doc["epochs"]) == 3
    for key in ("epoch", "train_seconds", "samples_per_second", "loss", "val_nDCG@5", "val_P@1",
                "test_P@1", "test_P@3", "test_P@5", "test_nDCG@5", "peak_rss_mb"):
        assert key in doc["epochs"][-1]
    assert doc["config"]["hidden"] == [32] and doc["peak_rss_mb"] > 0
    # the run's clock: every epoch's training in it, the test scoring not
    clock = [r["elapsed"] for r in doc["epochs"]]
    assert clock == sorted(clock) and clock[-1] <= doc["wall_seconds"]
    assert clock[-1] >= sum(r["train_seconds"] for r in doc["epochs"])
    assert clock[-1] < doc["wall_seconds"] - sum(r["test_eval_seconds"] for r in doc["epochs"][:-1]) + 1e-6
    assert main(["eval", str(d / "model"), str(d / "eur_test.txt")]) == 0
    assert "P@1=" in capsys.readouterr().out
    assert main(["predict", str(d / "model"), str(d / "eur_test.txt"), "--top-k", "3", "-o", str(d / "p.txt")]) == 0
    lines = (d / "p.txt").read_text().splitlines()
    assert lines[0] == "300 3993" and len(lines) == 301 and len(lines[1].split()) == 3
    assert main(["eval", str(d / "model"), str(d / "eur_test.txt"), "--k", "10"]) == 0
    out = capsys.readouterr().out
    assert all(f"{m}@{j}=" in out for m in ("P", "nDCG") for j in (1, 3, 5, 10)), out
    # queries on the threads asked for (numba's setting is the calling thread's own)
    import numba
    previous = numba.get_num_threads()
    try:
        assert main(["eval", str(d / "model"), str(d / "eur_test.txt"), "--mode", "lsh",
                     "--threads", "1"]) == 0
        assert "P@1=" in capsys.readouterr().out and numba.get_num_threads() == 1
    finally:
        numba.set_num_threads(previous)
    # mode ann: the engine's clusters, no library needed; near the exact mode's figures
    import re
    figures = {}
    for mode in ("exact", "ann"):
        assert main(["eval", str(d / "model"), str(d / "eur_test.txt"), "--mode", mode]) == 0
        figures[mode] = float(re.search(r"P@1=([0-9.]+)", capsys.readouterr().out).group(1))
    assert abs(figures["ann"] - figures["exact"]) <= 0.05, figures
    (d / "names.txt").write_text("".join(f"label_{i}\n" for i in range(3993)))
    assert main(["predict", str(d / "model"), str(d / "eur_test.txt"), "--top-k", "2", "--proba",
                 "--label-names", str(d / "names.txt"), "-o", str(d / "q.txt")]) == 0
    row = (d / "q.txt").read_text().splitlines()[1].split()
    probs = [float(t.split(":")[1]) for t in row]
    assert all(t.startswith("label_") for t in row) and 0 < sum(probs) <= 1 and probs[0] >= probs[1]
    # resume to 4 epochs continues the same run, and its metrics are appended
    assert main(["train", str(d / "eur_train.txt"), "--epochs", "4", "--save", str(d / "model"), "--resume",
                 "--no-progress", "--metrics-json", str(d / "m.json")]) == 0
    assert json.loads((d / "model" / "config.json").read_text())["epoch"] == 4
    assert [r["epoch"] for r in json.loads((d / "m.json").read_text())["epochs"]] == [1, 2, 3, 4]
    assert f"model saved to {d / 'model'}" in capsys.readouterr().out


def test_train_refits_small_sets_on_every_row(synth, capsys):
    d = synth
    assert main(["train", str(d / "eur_train.txt"), "--epochs", "2", "--hidden", "16", "--no-progress",
                 "--metrics-json", str(d / "r.json"), "--save", str(d / "refit")]) == 0
    out = capsys.readouterr().out
    doc = json.loads((d / "r.json").read_text())
    rows = doc["n_train"]
    kept = doc["stopping"]["kept_epoch"]
    assert rows < 10_000 and f"then trained again on all {rows} rows for {kept} epochs" in out
    assert doc["epochs"][-1]["refit"]
    assert doc["stopping"]["refit"]["rows"] == rows and "(the refit's weights)" in out


def test_train_names_each_run_it_chooses_among(tiny_data, capsys, tmp_path):
    from slide.data import write_xmc
    write_xmc(tmp_path / "t.txt", tiny_data[0][:1000], tiny_data[1][:1000])
    assert main(["train", str(tmp_path / "t.txt"), "--epochs", "2", "--hidden", "16", "--no-progress",
                 "--metrics-json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "r.json").read_text())
    choice = doc["stopping"]["choice"]
    # the rule's decay beats 0.3, and idf weighting is tried on the rule's settings last
    assert list(choice["validation_scores"]) == ["rule", "decay 0.3", "tf-idf"]
    assert f"settings chosen on the validation set: {choice['chosen']}, the best score of those tried" in out
    assert "[rule]  epoch=1" in out and "[decay 0.3]  epoch=2" in out and "[tf-idf]  epoch=2" in out
    assert [r.get("choice") for r in doc["epochs"]] == ["rule"] * 2 + ["decay 0.3"] * 2 + ["tf-idf"] * 2 + [None]


def test_outputs_and_resume_flags_checked_before_training(synth, capsys, tmp_path):
    train = str(synth / "eur_train.txt")
    base = ["train", train, "--epochs", "1", "--hidden", "16", "--no-progress"]
    (tmp_path / "afile").write_text("x")
    cases = [(["--save", str(tmp_path / "afile")], "not a directory"),
             (["--metrics-json", str(tmp_path / "missing" / "m.json")], "missing or not writable"),
             (["--resume", "--save", str(tmp_path / "nothing")], "no model in")]
    for extra, message in cases:
        assert main(base + extra) == 2
        out, err = capsys.readouterr()
        assert message in err and "epoch=" not in out, (extra, err)
    assert main(base + ["--save", str(tmp_path / "m")]) == 0
    assert "model saved to" in capsys.readouterr().out
    assert main(base + ["--save", str(tmp_path / "m")]) == 2  # would overwrite a model
    assert "--overwrite" in capsys.readouterr().err
    assert main(base + ["--save", str(tmp_path / "m"), "--overwrite"]) == 0
    capsys.readouterr()
    resume = ["train", train, "--epochs", "2", "--no-progress", "--save", str(tmp_path / "m"), "--resume"]
    assert main(resume + ["--hidden", "64"]) == 2
    assert "differs from the checkpoint" in capsys.readouterr().err
    assert main(resume + ["--hard-negatives", "8"]) == 2  # a sampling setting is kept too
    assert "--hard-negatives 8 differs" in capsys.readouterr().err
    assert main(resume + ["--negatives-from", "lsh"]) == 2  # and where they come from (the rule's)
    assert "--negatives-from lsh differs from the checkpoint's negatives_from=clusters" in \
        capsys.readouterr().err
    assert main(resume + ["--hidden", "16"]) == 0  # the same value is fine
    # idf weighting chosen on the slice: the weighting it trained with is the same value
    weighted = SlideClassifier.load(tmp_path / "m").preprocessor_.tfidf
    assert main(resume + ["--tfidf" if weighted else "--no-tfidf"]) == 0
    assert main(resume + ["--no-tfidf" if weighted else "--tfidf"]) == 2
    assert "differs from the checkpoint" in capsys.readouterr().err
    assert main(base) == 0
    assert "model not saved" in capsys.readouterr().out


def test_dense_engine_from_cli(synth, capsys):
    d = synth
    assert main(["train", str(d / "eur_train.txt"), "--engine", "dense", "--device", "cpu", "--epochs", "1",
                 "--hidden", "16", "--no-progress", "--test", str(d / "eur_test.txt")]) == 0
    assert "final: P@1=" in capsys.readouterr().out


def test_hetero_mode_from_cli(synth, capsys):
    d = synth
    # two epochs: the GPU worker waits for a second of the engine alone, longer than an epoch
    # of this set, so it joins in the second
    assert main(["train", str(d / "eur_train.txt"), "--mode", "hetero", "--policy", "hogbatch", "--device", "cpu",
                 "--epochs", "2", "--hidden", "16", "--no-progress", "--no-refit", "--test", str(d / "eur_test.txt"),
                 "--metrics-json", str(d / "h.json")]) == 0
    rec = json.loads((d / "h.json").read_text())["epochs"][-1]
    assert rec["cpu_updates"] > 0 and rec["gpu_updates"] > 0 and "test_P@1" in rec
    assert main(["train", str(d / "eur_train.txt"), "--mode", "hetero", "--engine", "dense"]) == 2


def test_hard_negatives_from_the_label_clusters_from_cli(synth, capsys, tmp_path):
    d = synth
    assert main(["train", str(d / "eur_train.txt"), "--epochs", "1", "--hidden", "16",
                 "--sparsity", "0.1", "--no-progress", "--no-refit", "--negatives-from",
                 "clusters", "--save", str(tmp_path / "m")]) == 0
    from slide.candidates import ClusterCandidates
    from slide.estimator import SlideClassifier
    model = SlideClassifier.load(tmp_path / "m")
    assert model.negatives_from == "clusters" and isinstance(model.tables_, ClusterCandidates)


def test_sampled_and_mined_negatives_from_cli(synth, capsys, tmp_path):
    d = synth
    base = ["train", str(d / "eur_train.txt"), "--device", "cpu", "--epochs", "1", "--hidden", "16",
            "--no-progress", "--no-refit", "--metrics-json", str(tmp_path / "m.json")]
    assert main([*base, "--engine", "dense", "--negatives", "64", "--mined-negatives", "4",
                 "--save", str(tmp_path / "dense")]) == 0
    from gpu_ref import DenseClassifier
    m = DenseClassifier.load(tmp_path / "dense", device="cpu")
    assert (m.negatives, m.mined_negatives) == (64, 4)
    # a resumed dense model keeps its sampling
    assert main([*base, "--engine", "dense", "--negatives", "32", "--resume",
                 "--save", str(tmp_path / "dense")]) == 2
    assert "differs from the checkpoint's negatives=64" in capsys.readouterr().err
    assert main([*base, "--mode", "hetero", "--policy", "hogbatch", "--negatives", "32",
                 "--mined-negatives", "3"]) == 0
    config = json.loads((tmp_path / "m.json").read_text())["config"]
    assert (config["hetero_gpu_mined"], config["hetero_gpu_pool"]) == (3, 32)
    # the engine's own active set has flags of its own
    assert main([*base, "--mined-negatives", "3"]) == 2
    assert "--sparsity and --hard-negatives" in capsys.readouterr().err
    assert main([*base, "--engine", "dense", "--mined-negatives", "3"]) == 2
    assert "needs a sampled softmax" in capsys.readouterr().err


def test_stats(synth, capsys):
    assert main(["data", "stats", str(synth / "eur_test.txt")]) == 0
    assert "300 samples, 5000 features, 3993 labels" in capsys.readouterr().out


def test_bad_files_and_arguments(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("2 4 3\n0 1:1\n1 9:1\n")
    assert main(["train", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3: feature id out of range" in err
    assert main(["train", str(tmp_path / "missing.txt")]) == 2
    assert main(["eval", str(tmp_path / "nomodel"), str(bad)]) == 2
    with pytest.raises(SystemExit) as e:  # argparse lists the presets
        main(["data", "synth", "nope", str(tmp_path / "x")])
    assert e.value.code == 2 and "amazon-670k" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["train", "--epochs", "0"])
    assert e.value.code == 2


def test_plots_from_train_and_from_metrics(synth, capsys, tmp_path):
    d = synth
    assert main(["train", str(d / "eur_train.txt"), "--test", str(d / "eur_test.txt"), "--epochs", "2",
                 "--hidden", "8", "--no-progress", "--metrics-json", str(tmp_path / "m.json"),
                 "--plot", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(tmp_path / "m.json")]) == 0
    assert (tmp_path / "m.png").stat().st_size > 1000
    (tmp_path / "bad.json").write_text("{}")
    assert main(["plot", str(tmp_path / "bad.json")]) == 2
    assert "no per-epoch records" in capsys.readouterr().err


def test_export_for_inference_only(synth, capsys):
    d = synth
    assert main(["train", str(d / "eur_train.txt"), "--epochs", "1", "--hidden", "16", "--no-progress",
                 "--save", str(d / "full")]) == 0
    assert main(["export", str(d / "full"), str(d / "small")]) == 0
    size = {m: sum(f.stat().st_size for f in (d / m).iterdir()) for m in ("full", "small")}
    assert size["small"] < 0.5 * size["full"], size
    capsys.readouterr()
    for m in ("full", "small"):
        assert main(["predict", str(d / m), str(d / "eur_test.txt"), "-o", str(d / f"{m}.txt")]) == 0
    assert (d / "full.txt").read_text() == (d / "small.txt").read_text()
    assert main(["train", str(d / "eur_train.txt"), "--epochs", "2", "--save", str(d / "small"),
                 "--resume", "--no-progress"]) == 2
    assert "inference only" in capsys.readouterr().err


def test_version_and_broken_pipe(synth):
    out = subprocess.run([sys.executable, "-m", "slide.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("slide ")
    d = synth
    assert main(["train", str(d / "eur_train.txt"), "--epochs", "1", "--hidden", "8", "--no-progress",
                 "--save", str(d / "pipe_model")]) == 0
    cmd = (f"{sys.executable} -m slide.cli predict {d / 'pipe_model'} {d / 'eur_test.txt'} | head -2")
    res = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    assert len(res.stdout.splitlines()) == 2 and "Traceback" not in res.stderr, res.stderr


def test_console_script_is_installed():
    r = subprocess.run([sys.executable, "-m", "slide.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "train" in r.stdout
