import json
import math

import numpy as np
import pytest

from slide.estimator import SlideClassifier
from slide.plan import Plan
from slide.planner import (MARGIN, MAX_EFFICIENCY, Planner, Probe, candidates, choose,
                           efficiency, predict)

ROWS, EPOCHS = 10_000, 10
POINTS = np.array([2_000, 4_000, 6_000, 8_000])


def curve(plan, kappa, rate, eval_seconds=1.0):
    """A probe whose score is the default's curve 0.05·ln(samples) at kappa times the samples:
    the plan progresses kappa times as fast a sample, at ``rate`` samples a second."""
    scores = 0.05 * np.log(kappa * POINTS)
    return Probe(plan, POINTS.tolist(), scores.tolist(), int(POINTS[-1] - POINTS[0]),
                 (POINTS[-1] - POINTS[0]) / rate, eval_seconds, POINTS[-1] / rate + 4.0,
                 EPOCHS, ROWS)


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
    with pytest.raises(ValueError, match="ranks"):
        Plan(ranks=0)
    with pytest.raises(ValueError, match="GPU worker"):
        Plan(gpu="hogbatch", ranks=2)
    with pytest.raises(ValueError, match="no setting"):
        Plan.from_json({"cores": 3})
    rule = {"batch_size": 128, "lr": 4e-3, "epochs": 9}
    d, fast, slow, wide = candidates(rule)
    assert d == Plan.default() and fast.lr == 8e-3 and slow.lr == 2e-3
    assert wide.batch_size == 256 and wide.lr == pytest.approx(4e-3 * math.sqrt(2))


@pytest.mark.parametrize("kappa", [0.7, 1.0, 1.3, 1.9])
def test_efficiency_is_the_samples_the_default_needs_for_a_probes_score(kappa):
    ref = curve(Plan.default(), 1.0, 1000)
    assert efficiency(ref, curve(Plan(lr=1.0), kappa, 1000)) == pytest.approx(kappa)
    # beyond what a short probe can vouch for, clipped
    assert efficiency(ref, curve(Plan(lr=1.0), 5.0, 1000)) == MAX_EFFICIENCY
    # a default that did not improve gives nothing to compare against
    flat = Probe(Plan.default(), POINTS.tolist(), [0.2] * 4, 6000, 6.0, 1.0, 10.0, EPOCHS, ROWS)
    assert efficiency(flat, curve(Plan(lr=1.0), 1.5, 1000)) == 1.0


def test_prediction_is_remaining_samples_at_the_probes_rate_plus_evaluations():
    ref = curve(Plan.default(), 1.0, 1000)
    p = predict(ref, curve(Plan(lr=1.0), 1.25, 2000, eval_seconds=2.0), spent=30.0)
    need = EPOCHS * ROWS / 1.25  # 80,000 samples: 8 epochs
    assert p.epochs == 8
    assert p.seconds == pytest.approx(30.0 + (need - POINTS[-1]) / 2000 + 8 * 2.0)
    assert predict(ref, ref, 0.0).epochs == EPOCHS


def test_the_planner_chooses_the_plan_the_curves_make_soonest():
    d = curve(Plan.default(), 1.0, 1000)
    # (kappa, rate) per plan, and the plan that reaches the target soonest
    cases = [
        ([(1.6, 1000), (1.0, 1100)], 1),  # more progress a sample at the same speed
        ([(0.9, 1000), (1.0, 2000)], 2),  # twice the speed at the same progress
        ([(1.5, 500), (0.5, 3000)], 2),  # 0.75 against 1.5 of the default's pace
        ([(1.05, 1000), (0.8, 1300)], 0),  # within the margin: the default
        ([(0.6, 1000), (0.5, 1000)], 0),  # all slower
    ]
    for plans, want in cases:
        probes = [d] + [curve(Plan(lr=float(i + 1)), k, r) for i, (k, r) in enumerate(plans)]
        preds = [predict(d, p, 10.0) for p in probes]
        chosen, why = choose(preds)
        assert chosen is preds[want], (plans, [p.seconds for p in preds])
        assert ("sooner than the default" in why) == (want == 0)
    # the margin is what keeps the default on a near tie
    preds = [predict(d, p, 0.0) for p in (d, curve(Plan(lr=1.0), 1.0 / (1 - MARGIN / 2), 1000))]
    assert choose(preds)[0] is preds[0] and choose(preds, margin=0.0)[0] is preds[1]


def _model(**kw):
    return SlideClassifier(hidden=(64,), refit=False, tfidf=False, weight_decay=1.0, epochs=6,
                           threads=1, seed=3, lr=4e-3, **kw)


def test_the_chosen_plan_runs_on_from_its_probe(tiny_data, tmp_path):
    Xtr, Ytr, Xte, Yte = tiny_data
    lines = []
    base = Plan.of(_model().get_params())
    fast = base.but(lr=8e-3)
    model = Planner(plans=[base, fast], log=lines.append).fit(_model(), Xtr, Ytr)
    report = model.plan_
    assert [c["plan"] for c in report["candidates"]] == ["default", "lr=0.008"]
    # the default's probe sized both: equal samples, within the first epoch
    samples = [p["samples"][-1] for p in report["probes"]]
    assert samples[0] == samples[1] == report["probe_samples"] < 0.9 * Xtr.shape[0]
    chosen = Plan.from_json(report["chosen"]["settings"])
    assert model.get_params()["lr"] == chosen.lr
    # one check per epoch run, and the run planned the chosen epochs
    ran = [h["epoch"] for h in model.history_]
    assert [c["epoch"] for c in report["checks"]] == ran
    assert ran[-1] <= report["chosen"]["epochs"]
    assert any(line.startswith("plan: ") for line in lines)
    assert model.evaluate(Xte, Yte)["P@1"] > 0.4  # a plain fit: 0.55
    model.save(tmp_path / "m")
    assert SlideClassifier.load(tmp_path / "m").plan_ == json.loads(json.dumps(report))


def test_a_probe_is_the_start_of_the_plans_own_run(tiny_data):
    """The chosen plan's probe is the first samples of its run: the model it continues from
    holds them (its position in epoch 1), and the run goes on from there."""
    Xtr, Ytr, _, _ = tiny_data
    planner = Planner(plans=[Plan.of(_model().get_params())], log=lambda *a: None)
    model = _model()
    report = planner.prepare(model, Xtr, Ytr)
    assert model.epoch_ == 0 and model.epoch_position_ == report["probe_samples"]
    assert model.samples_seen_ == report["probe_samples"]
    model.train(Xtr, Ytr, continue_training=True, until_epoch=2)
    n = Xtr.shape[0] - round(0.1 * Xtr.shape[0])
    assert model.samples_seen_ == 2 * n


def test_planning_leaves_runs_it_cannot_continue_to_the_default(tiny_data):
    Xtr, Ytr, _, _ = tiny_data
    lines = []
    model = Planner(log=lines.append).fit(
        SlideClassifier(hidden=(32,), epochs=2, threads=1), Xtr, Ytr)
    assert model.plan_["chosen"]["plan"] == "default"
    assert "trains again on every row" in model.plan_["reason"]
    with pytest.raises(ValueError, match="early_stopping"):
        Planner().prepare(_model(early_stopping=False), Xtr, Ytr)
