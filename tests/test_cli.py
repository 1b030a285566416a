import json
import subprocess
import sys

import pytest

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
               "--no-progress", "--seed", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "final: P@1=" in out
    doc = json.loads((d / "m.json").read_text())
    assert len(doc["epochs"]) == 3
    for key in ("epoch", "train_seconds", "samples_per_second", "loss", "val_loss", "val_P@1",
                "test_P@1", "test_P@3", "test_P@5", "test_nDCG@5", "peak_rss_mb"):
        assert key in doc["epochs"][-1]
    assert doc["config"]["hidden"] == [32] and doc["peak_rss_mb"] > 0
    assert main(["eval", str(d / "model"), str(d / "eur_test.txt")]) == 0
    assert "P@1=" in capsys.readouterr().out
    assert main(["predict", str(d / "model"), str(d / "eur_test.txt"), "--top-k", "3", "-o", str(d / "p.txt")]) == 0
    lines = (d / "p.txt").read_text().splitlines()
    assert len(lines) == 300 and len(lines[0].split()) == 3
    # resume to 4 epochs continues the same run
    assert main(["train", str(d / "eur_train.txt"), "--epochs", "4", "--save", str(d / "model"), "--resume",
                 "--no-progress"]) == 0
    assert json.loads((d / "model" / "config.json").read_text())["epoch"] == 4


def test_dense_engine_from_cli(synth, capsys):
    d = synth
    assert main(["train", str(d / "eur_train.txt"), "--engine", "dense", "--device", "cpu", "--epochs", "1",
                 "--hidden", "16", "--no-progress", "--test", str(d / "eur_test.txt")]) == 0
    assert "final: P@1=" in capsys.readouterr().out


def test_hetero_mode_from_cli(synth, capsys):
    d = synth
    assert main(["train", str(d / "eur_train.txt"), "--mode", "hetero", "--policy", "hogbatch", "--device", "cpu",
                 "--epochs", "1", "--hidden", "16", "--no-progress", "--test", str(d / "eur_test.txt"),
                 "--metrics-json", str(d / "h.json")]) == 0
    rec = json.loads((d / "h.json").read_text())["epochs"][0]
    assert rec["cpu_updates"] > 0 and rec["gpu_updates"] > 0 and "test_P@1" in rec
    assert main(["train", str(d / "eur_train.txt"), "--mode", "hetero", "--engine", "dense"]) == 2


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
    assert main(["data", "synth", "nope", str(tmp_path / "x")]) == 2
    with pytest.raises(SystemExit) as e:
        main(["train", "--epochs", "0"])
    assert e.value.code == 2


def test_console_script_is_installed():
    r = subprocess.run([sys.executable, "-m", "slide.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "train" in r.stdout
