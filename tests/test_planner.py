import json
import time

import pytest

from slide.estimator import SlideClassifier
from slide.loop import first_cycle
from slide.plan import Plan
from slide.planner import MARGIN, TARGET_SHARE, Planner, Probe, candidates, choose, predict

ROWS = 10_000


def test_plan_round_trips_and_says_how_to_run_it():
    p = Plan(ranks=2, hosts=4, mode="delayed", every=32, lr=0.008, beta1=0.5, threads=1)
    assert Plan.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert p.processes == 8 and p.groups == 8 and Plan(ranks=4).groups == 1
    cmd = p.command("train.txt")
    assert cmd.startswith("mpiexec -n 8 -ppn 2 slide train train.txt")
    for part in ("--distributed delayed", "--average-every 32", "--lr 0.008", "--beta1 0.5",
                 "--threads 1"):
        assert part in cmd
    assert Plan.default().command("t.txt") == "slide train t.txt"
    assert Plan(gpu="adaptive").argv()[-4:] == ["--mode", "hetero", "--policy", "adaptive"]
    assert Plan.default().name == "default" and "lr=0.008" in p.name
    assert Plan(lr=0.1).describe(Plan(lr=0.1)) == "default"
    with pytest.raises(ValueError, match="ranks"):
        Plan(ranks=0)
    with pytest.raises(ValueError, match="GPU worker"):
        Plan(gpu="hogbatch", ranks=2)
    with pytest.raises(ValueError, match="no setting"):
        Plan.from_json({"cores": 3})


def test_candidates_are_thread_counts_the_default_first():
    plans = candidates({"batch_size": 128, "lr": 4e-3, "epochs": 9}, Plan.default(), cores=8)
    assert plans == [Plan.default(), Plan(threads=4)]
    assert candidates({}, Plan(threads=3, lr=0.1)) == [Plan(threads=3, lr=0.1), Plan(threads=1, lr=0.1)]
    assert candidates({}, Plan(threads=1)) == [Plan(threads=1)]  # one core: nothing to halve


def probe(plan, rate, epochs=10, batch=128):
    return Probe(plan, 4096, 4096 / rate, batch, epochs)


def test_prediction_is_the_remaining_samples_at_the_probes_rate_plus_evaluations():
    p = predict(probe(Plan(threads=1), 2000.0, epochs=12), ROWS, done=6000, spent=30.0,
                eval_seconds=2.0, metric="loss")
    # the final score where the last halving begins: epoch 10 of 12
    assert p.epochs == 12 and TARGET_SHARE * 12 == pytest.approx(10)
    assert p.seconds == pytest.approx(30.0 + (10 * ROWS - 6000) / 2000 + 10 * 2.0)
    # a ranked score's plan runs a first cycle of three epochs, then nine: its last halving
    # begins at epoch 3 + 7.5
    p = predict(probe(Plan(threads=1), 2000.0, epochs=12), ROWS, done=6000, spent=30.0,
                eval_seconds=2.0, metric="nDCG@5")
    assert first_cycle("nDCG@5", 12) == 3
    assert p.seconds == pytest.approx(30.0 + (11 * ROWS - 6000) / 2000 + 11 * 2.0)


def test_the_planner_chooses_the_plan_the_speed_curves_make_soonest():
    """Rates and planned epochs where the answer is known: a plan at twice the batch takes the
    same steps, so twice the epochs, and wins only where it more than doubles the rate."""
    d = Plan.default()
    cases = [
        # (samples/s, epochs) of the default, then the others; the plan that should win
        ([(1000, 10), (2500, 20)], 1),  # twice the batch at 2.5x the rate: 0.8 of the time
        ([(1000, 10), (1800, 20)], 0),  # twice the batch at 1.8x: slower
        ([(1000, 10), (900, 20), (1300, 10)], 2),  # half the threads, faster (a busy machine)
        ([(1000, 10), (1050, 10)], 0),  # within the margin: the default
    ]
    for curves, want in cases:
        probes = [probe(d if i == 0 else Plan(threads=i), r, e) for i, (r, e) in enumerate(curves)]
        preds = [predict(p, ROWS, done=5000, spent=5.0, eval_seconds=0.5) for p in probes]
        chosen, why = choose(preds)
        assert chosen is preds[want], (curves, [p.seconds for p in preds])
        assert ("sooner than the default" in why) == (want == 0)
    # the margin is what keeps the default on a near tie
    preds = [predict(probe(d, 1000), ROWS, 0, 0.0, 0.0),
             predict(probe(Plan(threads=1), 1000 / (1 - MARGIN / 2)), ROWS, 0, 0.0, 0.0)]
    assert choose(preds)[0] is preds[0] and choose(preds, margin=0.0)[0] is preds[1]


def test_the_run_replans_its_end_where_the_loop_cuts_the_plan():
    lines, seen = [], []
    planner = Planner(recheck=1e12, log=lines.append)  # off the prediction never counts here
    planner.started_ = time.perf_counter()
    report = {"chosen": {"epochs": 20, "samples_per_second": 1e6}, "rows": 100,
              "probe_samples": 0, "probe_seconds": 0.0, "eval_seconds": 0.0, "checks": []}
    check = planner.watch(report, lambda m, entry: seen.append(entry["epoch"]))
    for entry in ({"epoch": 1}, {"epoch": 2, "planned_epochs": 6}, {"epoch": 3}):
        check(None, entry)
    assert seen == [1, 2, 3] and len(report["checks"]) == 3
    first, cut, after = report["checks"]
    assert "replanned_seconds" not in first and "replanned_seconds" not in after
    # the 4 epochs left of the cut plan at the 2 epochs' measured pace
    assert cut["replanned_seconds"] == pytest.approx(3 * cut["elapsed"], rel=1e-6)
    assert len(lines) == 1 and "the plan is cut to 6 epochs" in lines[0]


def _model(**kw):
    kw = {"epochs": 6, **kw}
    return SlideClassifier(hidden=(64,), refit=False, tfidf=False, weight_decay=1.0, seed=3,
                           lr=4e-3, **kw)


def test_the_chosen_plan_trains_on_from_the_probes(tiny_data, tmp_path):
    Xtr, Ytr, Xte, Yte = tiny_data
    lines = []
    base = Plan.of(_model().get_params())
    one = base.but(threads=1)
    model = Planner(plans=[base, one], log=lines.append).fit(_model(), Xtr, Ytr)
    report = model.plan_
    assert [c["plan"] for c in report["candidates"]] == ["default", "threads=1"]
    # the probes are the start of the run's first epoch, which goes on from there
    assert report["probe_samples"] == report["warmup_samples"] + sum(
        p["samples"] for p in report["probes"])
    n = Xtr.shape[0] - round(0.1 * Xtr.shape[0])
    ran = [h["epoch"] for h in model.history_]
    assert model.samples_seen_ == ran[-1] * n
    chosen = Plan.from_json(report["chosen"]["settings"])
    assert model.get_params()["threads"] == chosen.threads
    assert [c["epoch"] for c in report["checks"]] == ran and ran[-1] <= report["chosen"]["epochs"]
    assert any(line.startswith("plan: ") for line in lines)
    assert model.evaluate(Xte, Yte)["P@1"] > 0.4  # a plain fit: 0.55
    model.save(tmp_path / "m")
    assert SlideClassifier.load(tmp_path / "m").plan_ == json.loads(json.dumps(report))


def test_a_plan_at_another_batch_size_takes_the_rules_epochs_for_it(tiny_data, monkeypatch):
    Xtr, Ytr, _, _ = tiny_data
    base = Plan.of(_model(epochs=None).get_params())
    wide = base.but(batch_size=64)
    monkeypatch.setattr("slide.planner.choose", lambda preds, margin: (preds[-1], "the last"))
    model = _model(epochs=None)
    report = Planner(plans=[base, wide], log=lambda *a: None).prepare(model, Xtr, Ytr)
    probes = {p["batch_size"]: p["epochs"] for p in report["probes"]}
    assert probes[64] == min(100, max(5, -(-10_000 // -(-2700 // 64))))
    assert probes[32] == min(100, max(5, -(-10_000 // -(-2700 // 32))))
    assert model.get_params()["batch_size"] == 64
    assert model.get_params()["epochs"] == probes[64]
    assert model.epoch_position_ == report["probe_samples"]


def test_a_given_validation_set_is_the_one_the_probes_use(tiny_data):
    """With ``validation`` given, fit holds nothing out: the probes are the start of an epoch
    over every training row, as the run is."""
    Xtr, Ytr, Xte, Yte = tiny_data
    model = _model(epochs=2)
    model = Planner(plans=[Plan.of(model.get_params())], log=lambda *a: None).fit(
        model, Xtr, Ytr, validation=(Xte, Yte))
    assert model.plan_["rows"] == Xtr.shape[0]
    assert model.samples_seen_ == 2 * Xtr.shape[0]


def test_planning_leaves_runs_it_cannot_continue_to_the_default(tiny_data):
    Xtr, Ytr, _, _ = tiny_data
    lines = []
    model = Planner(log=lines.append).fit(
        SlideClassifier(hidden=(32,), epochs=2, threads=1), Xtr, Ytr)
    assert model.plan_["chosen"]["plan"] == "default"
    assert "trains again on every row" in model.plan_["reason"]
    assert model.stopping_["refit"]["epochs"] >= 1
    with pytest.raises(ValueError, match="early_stopping"):
        Planner().prepare(_model(early_stopping=False), Xtr, Ytr)


def test_slide_train_plan_auto_prints_and_records_the_plan(tiny_data, tmp_path, capsys):
    from slide.cli import main
    from slide.data import write_xmc
    write_xmc(tmp_path / "t.txt", tiny_data[0], tiny_data[1])
    base = ["train", str(tmp_path / "t.txt"), "--epochs", "3", "--hidden", "16", "--no-refit",
            "--no-tfidf", "--weight-decay", "1", "--no-progress"]
    assert main(base + ["--plan", "auto", "--metrics-json", str(tmp_path / "r.json"),
                        "--save", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "plan probe 1/" in out and "plan: " in out
    doc = json.loads((tmp_path / "r.json").read_text())
    plan = doc["plan"]
    assert plan["chosen"]["plan"] in [c["plan"] for c in plan["candidates"]]
    assert len(plan["checks"]) == len(doc["epochs"])
    assert all("plan_elapsed" in e for e in doc["epochs"])
    chosen = Plan.from_json(plan["chosen"]["settings"])
    assert doc["config"]["threads"] == chosen.threads
    assert SlideClassifier.load(tmp_path / "m").plan_["chosen"] == plan["chosen"]
    assert main(base + ["--plan", "auto", "--resume", "--save", str(tmp_path / "m"),
                        "--overwrite"]) != 0
    assert "not with --resume" in capsys.readouterr().err
