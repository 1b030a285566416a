"""The training loop shared by every engine: validation slice, early stopping, best weights,
learning-rate plateaus, warm starts and resumption."""
import json
import math

import numpy as np
import pytest
import scipy.sparse as sp

from gpu_ref import DenseClassifier
from gpu_ref.hetero import HeteroConfig, HeteroTrainer
from slide import SlideClassifier, loop, resources
from slide.checkpoint import CheckpointError
from slide.config import (FULL_OUTPUT_LABELS, HARD_NEGATIVES, OUTPUT_STATE_BYTES, RARE_POSITIVES,
                          RARE_ROWS, RARE_SHARE, REFIT_ROWS, SAMPLED_DECAY, WIDE_FEATURES, SlideConfig,
                          active_target, checked_choice, idf_weighted, positives_per_step,
                          planned_epochs, rare_share, resolve, sampled_width, touched_share)
from slide.loop import (FIRST_CYCLE, FLAT_GAIN, MIN_RATE_SHARE, PLATEAU_FACTOR, EarlyStopping,
                        epoch_learning_rate, validation_split)
from slide.resources import model_memory_bytes
from slide.selection import (CANDIDATES, FEW_ROWS, LIGHT_DECAYS, LOW_RATE, LOW_RATE_POSITIVES,
                             WIDE_HIDDEN, choice_name, offered)


def test_validation_split_is_seeded_disjoint_and_bounded():
    tr, va = validation_split(1000, 0.1, seed=3)
    assert va.size == 100 and tr.size == 900 and not np.intersect1d(tr, va).size
    np.testing.assert_array_equal(va, validation_split(1000, 0.1, seed=3)[1])
    assert not np.array_equal(va, validation_split(1000, 0.1, seed=4)[1])
    assert validation_split(10**6, 0.1, 0)[1].size == 5000
    assert validation_split(3, 0.1, 0)[1].size == 1


def test_early_stopping_decisions():
    es = EarlyStopping(patience=4)
    scores = [0.1, 0.2, 0.2, 0.19, 0.2, 0.1]
    decisions = [es.update(e + 1, {"val_loss": 1 - s}) for e, s in enumerate(scores)]
    assert [d[0] for d in decisions] == [True, True, False, False, False, False]
    # the rate drops after every patience // 2 epochs without improvement, not when stopping
    assert [d[1] for d in decisions] == [False, False, False, True, False, False]
    assert es.best_epoch == 2 and es.stopped.startswith("no improvement") and es.lowered == 1
    assert EarlyStopping.from_json(es.to_json()) == es
    ranked = EarlyStopping(patience=4, metric="nDCG@5")  # higher is better
    assert [ranked.update(e + 1, {"val_nDCG@5": s})[0] for e, s in enumerate(scores)] == \
        [True, True, False, False, False, False]


def test_learning_rate_schedule_halves_after_each_sixth_from_a_third():
    rates = [epoch_learning_rate(1.0, e, 12) for e in range(12)]
    assert rates == [1, 1, 1, 1, .5, .5, .25, .25, .125, .125, .0625, .0625]
    assert [epoch_learning_rate(2.0, e, 5) for e in range(5)] == [2, 2, 1, .5, .25]
    assert epoch_learning_rate(1.0, 0, 12, lowered=2) == pytest.approx(PLATEAU_FACTOR ** 2)
    assert epoch_learning_rate(1.0, 30, 12) == 0.0625  # past the plan: the last rate


def test_schedule_runs_in_fit_and_a_checkpoint_resumes_it(tmp_path, tiny_data):
    X, Y = tiny_data[0][:300], tiny_data[1][:300]
    kw = dict(hidden=(8,), sparsity=1.0, epochs=6, early_stopping=False, seed=0, threads=1, lr=1e-3)
    straight = SlideClassifier(**kw).fit(X, Y)
    assert [h["learning_rate"] for h in straight.history_] == \
        pytest.approx([1e-3, 1e-3, 5e-4, 2.5e-4, 1.25e-4, 6.25e-5])
    def save_then_die(model, record):
        if record["epoch"] == 3:
            model.save(tmp_path / "ck")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        SlideClassifier(**kw).fit(X, Y, on_epoch=save_then_die)
    resumed = SlideClassifier.load(tmp_path / "ck")
    resumed.train(X, Y, until_epoch=6, continue_training=True)
    assert [h["learning_rate"] for h in resumed.history_] == [h["learning_rate"] for h in straight.history_]
    np.testing.assert_array_equal(resumed.params_["W"], straight.params_["W"])


@pytest.fixture
def one_cycle(monkeypatch):
    """The learning-rate plan without its first cycle, for the tests of what it does within a
    cycle (the first cycle has its own test)."""
    monkeypatch.setattr(loop, "FIRST_CYCLE", 0)


class _Scripted(SlideClassifier):
    """An engine whose validation scores follow a script (the loop's decisions are what is
    tested), recording the learning rate each epoch trained with."""

    script = ()

    def evaluate(self, X, Y, k=5, **kw):
        s = self.script[min(self.epoch_, len(self.script)) - 1]
        return {"P@1": s, "nDCG@5": s, "loss": 1 - s}


def test_loop_keeps_best_weights_lowers_rate_and_says_why(tiny_data, one_cycle):
    X, Y = tiny_data[0][:400], tiny_data[1][:400]
    m = _Scripted(hidden=(8,), sparsity=0.5, epochs=20, n_iter_no_change=4, seed=0, lr=1e-3,
                  refit=False, tfidf=False)
    m.script = [0.1, 0.3, 0.2, 0.25, 0.2, 0.1, 0.1, 0.1]
    weights, best = {}, {}

    def record(model, rec):
        weights[rec["epoch"]] = model.params_["W"].copy()
        best[rec["epoch"]] = model.best_params_["W"]

    m.fit(X, Y, on_epoch=record)
    assert m.epoch_ == 6 and m.stopping_["kept_epoch"] == 2
    assert "no improvement" in m.stopping_["reason"] and m.stopping_["validation"].startswith("held out")
    np.testing.assert_array_equal(m.params_["W"], weights[2])
    # epoch 2's best weights were copied into epoch 1's arrays, not beside them
    assert best[2] is best[1] and np.array_equal(best[2], weights[2])
    # still in the first third of the planned 20 epochs: only the plateau drop after epoch 4
    rates = [h["learning_rate"] for h in m.history_]
    assert rates == pytest.approx([1e-3] * 4 + [1e-3 * PLATEAU_FACTOR] * 2)
    assert m.early_stopping_.metric == "nDCG@5"  # a sampled output layer
    assert [h["best_epoch"] for h in m.history_] == [1, 2, 2, 2, 2, 2]


def test_a_run_stops_once_its_rate_falls_below_a_hundredth_of_its_start(tiny_data, one_cycle):
    # every third epoch a new best, two worse ones between: a plateau drop (x0.3) after each
    # pair, never patience's stop; with the plan's halvings (20 planned epochs) the rate of the
    # 11th epoch would be 0.25 x 0.3^3 = 0.0068 of the start, so the run ends after the 10th
    X, Y = tiny_data[0][:400], tiny_data[1][:400]
    m = _Scripted(hidden=(8,), sparsity=0.5, epochs=20, n_iter_no_change=4, seed=0, lr=1e-3,
                  refit=False, tfidf=False)
    m.script = [0.1, 0.05, 0.05, 0.2, 0.1, 0.1, 0.3, 0.1, 0.1, 0.4] + [0.5] * 10
    m.fit(X, Y)
    assert m.epoch_ == 10 and m.stopping_["kept_epoch"] == 10
    assert m.stopping_["reason"].startswith(f"the learning rate fell below {MIN_RATE_SHARE:g}")
    rates = [h["learning_rate"] for h in m.history_]
    assert rates[-1] >= MIN_RATE_SHARE * 1e-3 > epoch_learning_rate(1e-3, 10, 20, lowered=3)
    # without early stopping the plan runs whole, however low its rate
    assert SlideClassifier(hidden=(8,), sparsity=0.5, epochs=3, early_stopping=False,
                           seed=0).fit(X, Y).epoch_ == 3


def test_the_plan_is_cut_where_the_score_flattens_at_its_first_rate(tmp_path, tiny_data, one_cycle):
    # gains of 0.1, 0, then 0.002 (under FLAT_GAIN x 0.202, and 0.002 over two epochs): the
    # first rate ends with the 4th epoch and the plan of 30 epochs becomes 12, its halvings
    # every two epochs
    X, Y = tiny_data[0][:400], tiny_data[1][:400]
    kw = dict(hidden=(8,), sparsity=0.5, epochs=30, seed=0, lr=1e-3, refit=False, tfidf=False)
    script = [0.1, 0.2, 0.2, 0.202] + [0.202 + 0.01 * i for i in range(1, 27)]
    assert 0.002 < FLAT_GAIN * 0.202  # what the script relies on
    m = _Scripted(**kw)
    m.script = script
    m.fit(X, Y)
    rates = [h["learning_rate"] for h in m.history_]
    assert rates == pytest.approx([1e-3 * r for r in [1] * 4 + [.5] * 2 + [.25] * 2 + [.125] * 2
                                   + [.0625] * 2])
    assert m.early_stopping_.plan_end == 12 and m.stopping_["reason"] == "reached the planned 12 epochs"
    assert [h.get("planned_epochs") for h in m.history_][2:5] == [None, 12, None]

    # a run resumed from a checkpoint after the cut keeps it, whatever plan it is given
    def save_then_die(model, record):
        if record["epoch"] == 6:
            model.save(tmp_path / "ck")
            raise KeyboardInterrupt

    first = _Scripted(**kw)
    first.script = script
    with pytest.raises(KeyboardInterrupt):
        first.fit(X, Y, on_epoch=save_then_die)
    resumed = _Scripted.load(tmp_path / "ck")
    resumed.script = script
    resumed.train(X, Y, until_epoch=30, continue_training=True)
    assert [h["learning_rate"] for h in resumed.history_] == pytest.approx(rates)

    # a score that keeps gaining keeps the plan
    steady = _Scripted(**kw)
    steady.script = [0.1 * 1.1 ** i for i in range(30)]
    steady.fit(X, Y)
    assert steady.epoch_ == 30 and not steady.early_stopping_.plan_end
    # so does a score that falls by more than the floor's noise (a rate too high: the plateau's
    # drop is for that), a small step after a large one, a dip the next epoch recovers, a flat
    # epoch once the rate is lowered, and a cut that would not shorten the plan
    def judged(scores, planned=30, first_rate=True):
        es = EarlyStopping(metric="nDCG@5", patience=10)  # no plateau drop in three epochs
        for e, s in enumerate(scores):
            es.update(e + 1, {"val_nDCG@5": s})
        cut = es.cut_plan(len(scores), planned, first_rate)
        assert (cut < planned) == bool(es.plan_end)
        return cut

    assert judged([0.2, 0.2, 0.19]) == judged([0.15, 0.2, 0.201]) == \
        judged([0.2, 0.17, 0.201]) == judged([0.2, 0.2, 0.201], first_rate=False) == 30
    assert judged([0.2, 0.2, 0.201], planned=9) == 9
    # a small fall is as flat as a small rise
    assert judged([0.2, 0.2, 0.201]) == judged([0.2, 0.2, 0.199]) == 9
    # and a loss, whose small falls can hide large gains in ranking, is never judged
    whole = EarlyStopping(metric="loss")
    for e, loss in enumerate([2.0, 1.999, 1.998]):
        whole.update(e + 1, {"val_loss": loss})
    assert whole.cut_plan(3, 30, True) == 30 and not whole.plan_end


def test_a_sampled_output_plan_starts_with_a_short_first_cycle(tmp_path, tiny_data):
    # 15 planned epochs: a first cycle of three (rates 1, 1/2, 1/8), then the plan of twelve
    # from the first rate again; the second cycle's scores start below the first's best
    # (0.3) and pass it at epoch 8. Judged against the first cycle's best, epochs 4-7 would be
    # four without improvement: a plateau drop after two, and patience's stop after four.
    X, Y = tiny_data[0][:400], tiny_data[1][:400]
    kw = dict(hidden=(8,), sparsity=0.5, epochs=15, n_iter_no_change=4, seed=0, lr=1e-3,
              refit=False, tfidf=False)
    second = [0.2 * 1.12 ** i for i in range(12)]  # gains of 12%: never flat, never cut
    assert second[3] < 0.3 < second[4]
    weights = {}

    def record(model, rec):
        weights[rec["epoch"]] = model.params_["W"].copy()

    m = _Scripted(**kw)
    m.script = [0.1, 0.2, 0.3] + second
    m.fit(X, Y, on_epoch=record)
    rates = [h["learning_rate"] / 1e-3 for h in m.history_]
    assert rates == pytest.approx([1, .5, .125] + [1] * 4 + [.5] * 2 + [.25] * 2 + [.125] * 2
                                  + [.0625] * 2)
    assert [h["best_epoch"] for h in m.history_] == [1, 2, 3, 3, 3, 3, 3] + list(range(8, 16))
    assert m.epoch_ == 15 and m.stopping_["kept_epoch"] == 15 and m.early_stopping_.lowered == 0

    # a second cycle that never passes the first's best ends with the first's weights
    low = _Scripted(**kw)
    low.script = [0.1, 0.2, 0.3] + [0.2 * 1.025 ** i for i in range(12)]  # never flat
    low.fit(X, Y, on_epoch=record)
    assert low.stopping_["kept_epoch"] == 3 and low.epoch_ == 15
    np.testing.assert_array_equal(low.params_["W"], weights[3])

    # the cut counts the second cycle's epochs: flat at its 4th (epoch 7), it ends at 3 + 12
    cut = _Scripted(**{**kw, "epochs": 30})
    cut.script = [0.1, 0.2, 0.3, 0.15, 0.25, 0.25, 0.252] + [0.26 + 0.01 * i for i in range(30)]
    cut.fit(X, Y)
    assert cut.early_stopping_.plan_end == 15 and cut.epoch_ == 15
    assert [h["learning_rate"] / 1e-3 for h in cut.history_][3:] == pytest.approx(
        [1] * 4 + [.5] * 2 + [.25] * 2 + [.125] * 2 + [.0625] * 2)

    # none where the output is computed whole (its loss is judged) or the plan leaves the
    # second cycle fewer than six epochs
    whole = _Scripted(**{**kw, "sparsity": 1.0})
    whole.script = [0.1 * i for i in range(1, 16)]
    whole.fit(X, Y)
    assert whole.early_stopping_.first_cycle == 0
    assert [h["learning_rate"] for h in whole.history_][:5] == pytest.approx([1e-3] * 5)
    short = _Scripted(**{**kw, "epochs": 8})
    short.script = [0.1 * i for i in range(1, 16)]
    short.fit(X, Y)
    assert short.early_stopping_.first_cycle == 0

    # the rule's epochs for a sampled output put the first cycle on top of its steps' plan
    r = resolve(SlideConfig(), n_features=100, n_labels=100_000, n_train=64_000)
    assert r["sampled"] and r["epochs"] == planned_epochs(64_000, r["batch_size"]) + FIRST_CYCLE
    r = resolve(SlideConfig(early_stopping=False), n_features=100, n_labels=100_000, n_train=64_000)
    assert r["epochs"] == planned_epochs(64_000, r["batch_size"], early_stopping=False)


def test_held_out_rows_are_not_trained_on(tiny_data):
    X, Y = tiny_data[0][:500], tiny_data[1][:500]
    seen = []

    class Recording(SlideClassifier):
        def train_epoch(self, Xp, Y, order, progress=None, learning_rate=None):
            seen.append(order.size)
            return super().train_epoch(Xp, Y, order, progress, learning_rate)

    m = Recording(hidden=(8,), sparsity=0.5, epochs=1, validation_fraction=0.2, seed=0,
                  refit=False, tfidf=False, lr=4e-3).fit(X, Y)  # the rate given: one run
    assert sum(seen) == 400 and m.n_train_ == 400
    # a sampled output layer: ranked by nDCG@5, without the full softmax's loss
    assert "val_nDCG@5" in m.history_[0] and "val_loss" not in m.history_[0]
    seen.clear()
    Recording(hidden=(8,), sparsity=0.5, epochs=1, early_stopping=False).fit(X, Y)
    assert sum(seen) == 500


def test_fit_restarts_and_warm_start_continues(tiny_data):
    X, Y = tiny_data[0][:300], tiny_data[1][:300]
    m = SlideClassifier(hidden=(8,), sparsity=0.5, epochs=2, early_stopping=False, seed=0, threads=1)
    m.fit(X, Y)
    first = m.params_["W"].copy()
    m.fit(X, Y)
    assert m.epoch_ == 2
    np.testing.assert_array_equal(m.params_["W"], first)  # same seed, same fresh run
    m.set_params(warm_start=True).fit(X, Y)
    assert m.epoch_ == 4
    m.set_params(hidden=(16,))
    with pytest.raises(ValueError, match="hidden changed since the model was fitted"):
        m.fit(X, Y)
    with pytest.raises(ValueError, match="hidden changed"):
        m.partial_fit(X, Y)
    m.set_params(warm_start=False).fit(X, Y)  # a refit takes the new shape
    assert m.params_["W"].shape[1] == 16


def test_resume_during_early_stopping_equals_straight_run(tmp_path, tiny_data):
    X, Y = tiny_data[0][:600], tiny_data[1][:600]
    kw = dict(hidden=(16,), sparsity=0.25, threads=1, seed=2, rehash_every=300, epochs=12,
              n_iter_no_change=3, lr=0.05, weight_decay=0.0, refit=False, tfidf=False)

    def save_then_die(model, record):  # a checkpoint per epoch, then the process is killed
        model.save(tmp_path / f"ck{record['epoch']}")
        if record["epoch"] == 5:
            raise KeyboardInterrupt

    straight = SlideClassifier(**kw).fit(X, Y)
    # it went past its best, and the run is killed after it, while patience counts
    assert straight.stopping_["kept_epoch"] < 5 < straight.epoch_ < 12
    with pytest.raises(KeyboardInterrupt):
        SlideClassifier(**kw).fit(X, Y, on_epoch=save_then_die)
    resumed = SlideClassifier.load(tmp_path / "ck5")
    assert resumed.best_params_ is not None  # the checkpoint holds the best epoch's weights too
    resumed.train(X, Y, until_epoch=12, continue_training=True)
    assert resumed.stopping_["kept_epoch"] == straight.stopping_["kept_epoch"]
    assert [h["val_nDCG@5"] for h in resumed.history_] == [h["val_nDCG@5"] for h in straight.history_]
    assert [h["learning_rate"] for h in resumed.history_] == [h["learning_rate"] for h in straight.history_]
    for k in straight.params_:
        np.testing.assert_array_equal(resumed.params_[k], straight.params_[k], err_msg=k)


@pytest.mark.parametrize("engine", ["slide", "dense"])
def test_kill_inside_an_epoch_loses_at_most_save_every(tmp_path, tiny_data, engine):
    """Checkpoints every 4 batches; killed after the third, the run resumes inside the epoch and
    ends where an uninterrupted run ends (every output active, one thread: bit for bit)."""
    X, Y = tiny_data[0][:600], tiny_data[1][:600]
    kw = dict(hidden=(16,), seed=2, epochs=2, early_stopping=False, batch_size=32)
    make = (lambda: SlideClassifier(sparsity=1.0, threads=1, **kw)) if engine == "slide" else \
        (lambda: DenseClassifier(device="cpu", **kw))
    saves = []

    def save_then_die(model):
        model.save(tmp_path / "ck")
        saves.append(model.epoch_position_)
        if len(saves) == 3:
            raise KeyboardInterrupt

    straight = make().fit(X, Y)
    with pytest.raises(KeyboardInterrupt):
        make().train(X, Y, save_every=4, on_save=save_then_die)
    assert saves == [128, 256, 384]  # samples of the first epoch done at each save
    cls = type(straight)
    resumed = cls.load(tmp_path / "ck", **({} if engine == "slide" else {"device": "cpu"}))
    assert (resumed.epoch_, resumed.epoch_position_, resumed.step_) == (0, 384, 12)
    resumed.train(X, Y, until_epoch=2, continue_training=True)
    assert resumed.step_ == straight.step_
    for k in straight.params_:
        np.testing.assert_array_equal(resumed.params_[k], straight.params_[k], err_msg=k)


@pytest.mark.parametrize("make", [
    lambda: DenseClassifier(hidden=(16,), epochs=3, n_iter_no_change=2, device="cpu"),
    lambda: HeteroTrainer(SlideClassifier(hidden=(16,), sparsity=0.25, epochs=3, n_iter_no_change=2),
                          HeteroConfig(policy="hogbatch", cpu_batch=32, gpu_batch=64, gpu_pool=32,
                                       device="cpu")),
], ids=["dense", "hetero"])
def test_every_engine_runs_the_same_loop(tiny_data, make):
    X, Y = tiny_data[0][:500], tiny_data[1][:500]
    m = make().fit(X, Y)
    m = m.model if isinstance(m, HeteroTrainer) else m  # the trainer runs the engine's epochs
    assert len(m.history_) == 4 and m.stopping_["validation"].startswith("held out")
    # 500 rows: every engine then trains again on all of them for the kept epochs
    assert m.history_[-1]["refit"] and m.stopping_["refit"]["rows"] == 500
    for rec in m.history_[:-1]:
        for key in ("epoch", "loss", "val_P@1", "val_nDCG@5", "learning_rate", "best_epoch",
                    "samples_per_second"):
            assert key in rec, key
        # the full softmax's loss is the dense reference's score, not the sampled engine's
        assert ("val_loss" in rec) == isinstance(m, DenseClassifier)


def test_refit_trains_again_on_every_row_for_the_kept_epochs(tiny_data, one_cycle):
    X, Y = tiny_data[0][:600], tiny_data[1][:600]
    kw = dict(hidden=(8,), sparsity=0.5, epochs=20, seed=3, lr=1e-3, threads=1)
    m = _Scripted(n_iter_no_change=4, **kw)
    # best at epoch 5, after a plateau drop at epoch 4; stops after epoch 9
    m.script = [0.1, 0.3, 0.2, 0.25, 0.4, 0.1, 0.1, 0.1, 0.1, 0.1]
    m.fit(X, Y)
    kept = m.stopping_["kept_epoch"]
    rates = [h["learning_rate"] for h in m.history_[:kept]]
    assert kept == 5 and len(set(rates)) == 2 and len(m.history_) == 10
    assert m.stopping_["refit"]["epochs"] == 5 and m.stopping_["refit"]["rows"] == 600
    assert m.history_[-1]["refit"] and m.epoch_ == 5 and m.n_train_ == 600
    # the same as a fresh run on every row for those epochs, at those rates (one thread repeats)
    ref = SlideClassifier(early_stopping=False, **kw)
    X, Y = ref.check_data(X, Y, where="fit", fitted=False)
    ref.initialize(X, Y)
    Xp, Y = ref.preprocess(X), ref.targets(X, Y)
    for e, rate in enumerate(rates):
        ref.train_epoch(Xp, Y, np.random.default_rng([3, 2, e]).permutation(600), learning_rate=rate)
    for k in ref.params_:
        np.testing.assert_array_equal(m.params_[k], ref.params_[k], err_msg=k)
    # the rule: training rows after the held-out slice, below REFIT_ROWS; never without it
    assert resolve(SlideConfig(), 100, 10, REFIT_ROWS - 1)["refit"]
    assert not resolve(SlideConfig(), 100, 10, REFIT_ROWS)["refit"]
    assert resolve(SlideConfig(refit=True), 100, 10, 10 * REFIT_ROWS)["refit"]
    assert not resolve(SlideConfig(refit=False), 100, 10, 100)["refit"]
    assert not resolve(SlideConfig(refit=True, early_stopping=False), 100, 10, 100)["refit"]
    with pytest.raises(TypeError, match="refit must be True, False or None"):
        SlideConfig(refit="yes")


def test_defaults_follow_the_data_shape():
    small = resolve(SlideConfig(), n_features=1000, n_labels=300, n_train=5000)
    wide = resolve(SlideConfig(), n_features=135_909, n_labels=670_091, n_train=100_000)
    assert not small["sampled"] and wide["sampled"]
    assert wide["active_target"] == 3351
    # a sample's LSH candidates are its own rows: their count per sample is capped, whatever the
    # label count; the shared pool takes the rest of the active set
    assert wide["lsh_cap"] == HARD_NEGATIVES and wide["pool"] == 3351 - HARD_NEGATIVES
    assert small["lsh_cap"] == 0 and small["pool"] == small["active_target"] == 300
    mid = resolve(SlideConfig(), n_features=5000, n_labels=4000, n_train=10_000)
    assert mid["lsh_cap"] == min(1024 // 4, HARD_NEGATIVES) and mid["pool"] == 1024 - mid["lsh_cap"]
    # a wide, sparse input with a sampled output starts its input rows small
    assert wide["input_init"] == 0.1 and small["input_init"] == 0.5
    own = resolve(SlideConfig(hard_negatives=0), 135_909, 670_091, 100_000)
    assert own["lsh_cap"] == 0 and own["pool"] == 3351
    assert small["batch_size"] == 32 and wide["batch_size"] == 128
    assert resolve(SlideConfig(hidden=(64,), lr=0.01, epochs=3), 10, 5, 100)["hidden"] == [64]
    for r in (small, wide):
        assert r["epochs"] >= 5 and r["lr"] > 0


def test_active_set_floor_follows_the_labels_a_row_carries():
    # every neuron up to FULL_OUTPUT_LABELS labels, whatever the rows carry
    assert active_target(FULL_OUTPUT_LABELS, 3.0) == FULL_OUTPUT_LABELS
    assert active_target(300, 40.0) == 300
    # above it, 128 neurons a label a row carries, within 512 and 1024
    assert active_target(21_316, 3.54) == 512  # git_openstack's rows
    assert active_target(21_316, 6.0) == 768
    assert active_target(21_316, 20.0) == 1024
    assert active_target(FULL_OUTPUT_LABELS + 1, 1.0) == 512
    # where the label count asks for more, it has it; unknown rows: the floor's top
    assert active_target(670_091, 5.0) == 3351
    assert active_target(21_316, None) == 1024
    r = resolve(SlideConfig(), 13_964, 21_316, 63_000, labels_per_row=3.54)
    assert (r["active_target"], r["lsh_cap"], r["pool"]) == (512, 128, 384)
    assert resolve(SlideConfig(sparsity=0.05), 13_964, 21_316, 63_000,
                   labels_per_row=3.54)["active_target"] == 1066  # an explicit setting wins


def test_sampled_width_and_decay_follow_the_output_layer():
    # width: the widest whose output state (16 bytes a weight) fits OUTPUT_STATE_BYTES
    assert sampled_width(OUTPUT_STATE_BYTES // (16 * 512)) == 512
    assert sampled_width(OUTPUT_STATE_BYTES // (16 * 512) + 1) == 256
    assert sampled_width(OUTPUT_STATE_BYTES // (16 * 256) + 1) == 128
    assert sampled_width(670_091) == 128
    # the share of rows a step touches, by hand: 4 x 3 candidates + 8 shared draws of 100
    assert touched_share(100, 4, 3, 8) == pytest.approx(1 - math.exp(-0.2))
    wide = resolve(SlideConfig(), n_features=135_909, n_labels=670_091, n_train=90_000)
    mid = resolve(SlideConfig(), n_features=5000, n_labels=4000, n_train=14_000)
    small = resolve(SlideConfig(), n_features=1000, n_labels=300, n_train=5000)
    # 670K labels: a step touches 5% of the rows; the decay per touch stays at its cap
    share = touched_share(670_091, 128, HARD_NEGATIVES, 3351 - HARD_NEGATIVES)
    assert 0.04 < share < 0.06 and SAMPLED_DECAY / share > 1
    assert wide["hidden"] == [128] and wide["weight_decay"] == 1.0
    # 4K labels on the tables: nearly every row every step, so the decay is nearly
    # SAMPLED_DECAY; on the clusters (the rule there) a sample's 16 hard negatives, not the
    # tables' quarter, are what it touches: a third of the rows, three times the decay
    tables = resolve(SlideConfig(negatives_from="lsh"), n_features=5000, n_labels=4000,
                     n_train=14_000)
    share = touched_share(4000, tables["batch_size"], tables["lsh_cap"], tables["pool"])
    assert tables["weight_decay"] == pytest.approx(SAMPLED_DECAY / share) and share > 0.9
    assert mid["negatives_from"] == "clusters" and mid["cluster_negatives"] == 16
    share = touched_share(4000, mid["batch_size"], 16, mid["pool"])
    assert mid["weight_decay"] == pytest.approx(SAMPLED_DECAY / share) and 0.3 < share < 0.4
    assert mid["hidden"] == [512]
    # computed whole: every row every step at the small-set rate; the rule is not applied
    assert small["weight_decay"] == 1.0 and small["hidden"] == [512]
    # an explicit setting wins
    assert resolve(SlideConfig(weight_decay=0.0), 5000, 4000, 14_000)["weight_decay"] == 0.0
    # the hidden layer's activation: the identity where the output is sampled and every hidden
    # layer is dense, ReLU otherwise, unless given
    assert [r["activation"] for r in (wide, mid, small)] == ["identity", "identity", "relu"]
    sampled_hidden = SlideConfig(hidden=(64, 64), hidden_sparsity=(1.0, 0.5))
    assert resolve(sampled_hidden, 5000, 4000, 14_000)["activation"] == "relu"
    assert resolve(SlideConfig(activation="relu"), 5000, 4000, 14_000)["activation"] == "relu"
    assert resolve(SlideConfig(activation="identity"), 1000, 300, 5000)["activation"] == "identity"


def test_rare_features_get_the_settings_of_rarely_updated_rows(tmp_path, tiny_data):
    # the share of non-zeros in features of fewer than RARE_ROWS rows, by hand
    df = np.array([1, RARE_ROWS, RARE_ROWS - 1, 0, 100])
    assert rare_share(df) == pytest.approx((1 + RARE_ROWS - 1) / df.sum())
    assert rare_share(np.zeros(3, np.int64)) == 0.0
    whole = dict(n_features=1449, n_labels=45, n_train=800)  # under WIDE_FEATURES a row
    rare = resolve(SlideConfig(), **whole, rare_fraction=RARE_SHARE)
    common = resolve(SlideConfig(), **whole, rare_fraction=RARE_SHARE - 0.01)
    assert not rare["sampled"] and not common["sampled"]
    # a whole output's rows are all touched every step: the decay is SAMPLED_DECAY itself
    assert (rare["lr"], rare["weight_decay"], rare["input_init"]) == (4e-3, SAMPLED_DECAY, 0.1)
    assert (common["lr"], common["weight_decay"], common["input_init"]) == (1e-3, 1.0, 0.5)
    assert resolve(SlideConfig(lr=1e-3), **whole, rare_fraction=0.9)["lr"] == 1e-3  # explicit wins
    # the share travels with the model: a loaded checkpoint resolves the same settings, and one
    # written before it was recorded resolves as 0 (the settings it was trained with)
    m, _, _ = _saved_without(tmp_path, tiny_data, "rare_share")
    assert m.rare_share_ == pytest.approx(rare_share(m.preprocessor_.document_frequency_))
    assert SlideClassifier.load(tmp_path / "m").rare_share_ == 0.0


def test_wide_features_get_the_settings_of_rarely_updated_rows():
    # at least WIDE_FEATURES features a training row: the settings of rows updated in few
    # steps, whatever the rare share; one feature fewer: the common ones
    edge = dict(n_labels=45, n_train=1000, rare_fraction=0.0)
    wide = resolve(SlideConfig(), n_features=int(WIDE_FEATURES * 1000), **edge)
    narrow = resolve(SlideConfig(), n_features=int(WIDE_FEATURES * 1000) - 1, **edge)
    assert not wide["sampled"] and not narrow["sampled"]
    assert (wide["lr"], wide["weight_decay"], wide["input_init"]) == (4e-3, SAMPLED_DECAY, 0.1)
    assert (narrow["lr"], narrow["weight_decay"], narrow["input_init"]) == (1e-3, 1.0, 0.5)


def test_the_rule_reads_the_features_the_rows_hold(tiny_data):
    # columns that no training row uses (a hashed feature space's) leave the settings as they
    # are: the header alone would read as wide, ten times the rows
    X, Y = tiny_data[0][:1000], tiny_data[1][:1000]
    declared = sp.csr_matrix((X.data, X.indices, X.indptr), shape=(X.shape[0], 10 * X.shape[1]))
    assert declared.shape[1] >= WIDE_FEATURES * X.shape[0]
    kw = dict(hidden=(16,), epochs=1, threads=1, seed=0, tfidf=False, early_stopping=False)
    own = SlideClassifier(**kw).fit(X, Y)
    wide = SlideClassifier(**kw).fit(declared, Y)
    assert (own.resolved_["lr"], own.resolved_["input_init"]) == (1e-3, 0.5)
    assert wide.resolved_ == own.resolved_


def test_a_refit_keeps_the_settings_of_the_run_it_repeats(tmp_path, monkeypatch, tiny_data):
    # the 900 rows left after the slice hold 1,903 features, the refit's 1,000 hold 1,918: at 2
    # features a row the first are wide and the second are not; the refit trains the kept
    # run's settings all the same
    import slide.config
    monkeypatch.setattr(slide.config, "WIDE_FEATURES", 2.0)
    X, Y = tiny_data[0][:1000], tiny_data[1][:1000]
    m = SlideClassifier(hidden=(16,), epochs=3, threads=1, seed=0, tfidf=False).fit(X, Y)
    assert "refit" in m.stopping_ and m.n_train_ == 1000
    slow = (4e-3, SAMPLED_DECAY, 0.1)
    assert (m.resolved_["lr"], m.resolved_["weight_decay"], m.resolved_["input_init"]) == slow
    # what the rule gives the refit's rows by itself
    seen = int(m.preprocessor_.seen_features().sum())
    rule = resolve(SlideConfig(), seen, m.n_outputs_fitted_, 1000, m.rare_share_,
                   labels_per_row=m.labels_per_row_)
    assert (rule["lr"], rule["weight_decay"], rule["input_init"]) == (1e-3, 1.0, 0.5)
    # the kept decision travels with the model; a checkpoint without it resolves by the rule
    m.save(tmp_path / "m")
    assert SlideClassifier.load(tmp_path / "m").resolved_ == m.resolved_
    path = tmp_path / "m" / "config.json"
    meta = json.loads(path.read_text())
    assert meta["slow_rows"] is True
    del meta["slow_rows"]
    path.write_text(json.dumps(meta))
    assert SlideClassifier.load(tmp_path / "m").resolved_["weight_decay"] == 1.0
    meta["slow_rows"] = "yes"
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="slow_rows"):
        SlideClassifier.load(tmp_path / "m")


def test_checkpoints_from_before_the_activation_setting_load_with_relu(tmp_path, tiny_data):
    """A sampled output resolves to the identity; a checkpoint whose settings do not name the
    activation was written when every model was ReLU, and loads as one."""
    X, Y = tiny_data[0], tiny_data[1]
    m = SlideClassifier(sparsity=0.5, epochs=1, early_stopping=False, threads=1, seed=0).fit(X, Y)
    assert m.resolved_["activation"] == "identity"
    m.save(tmp_path / "m")
    assert SlideClassifier.load(tmp_path / "m").resolved_["activation"] == "identity"
    path = tmp_path / "m" / "config.json"
    meta = json.loads(path.read_text())
    assert meta["config"]["activation"] is None  # the rule's, as given
    del meta["config"]["activation"]
    path.write_text(json.dumps(meta))
    old = SlideClassifier.load(tmp_path / "m")
    assert old.activation == "relu" and old.resolved_["activation"] == "relu"
    # a ReLU layer zeroes what the identity passes: the two give different scores
    assert not np.allclose(old.decision_function(X[:20]), m.decision_function(X[:20]))


def _saved_without(tmp_path, tiny_data, key):
    """Fit a one-epoch model of the tiny set and save it to ``tmp_path/m``; check that it loads
    with the same settings and that its JSON records ``key`` as the model's ``key_``; then write
    the JSON back without ``key``, as a checkpoint from before it was recorded. Returns the
    model, that JSON and its path."""
    X, Y = tiny_data[0], tiny_data[1]
    m = SlideClassifier(epochs=1, early_stopping=False, threads=1, seed=0).fit(X, Y)
    m.save(tmp_path / "m")
    assert SlideClassifier.load(tmp_path / "m").resolved_ == m.resolved_
    path = tmp_path / "m" / "config.json"
    meta = json.loads(path.read_text())
    assert meta[key] == pytest.approx(getattr(m, key + "_"))
    del meta[key]
    path.write_text(json.dumps(meta))
    return m, meta, path


def test_rarely_positive_labels_get_the_settings_of_rarely_updated_rows(tmp_path, tiny_data):
    # a label's positives per step, by hand: 32 rows of 2.5 labels over 400 labels
    assert positives_per_step(400, 32, 2.5) == pytest.approx(0.2)
    # computed whole (under 1,025 labels), frequent features: the label rate decides
    whole = dict(n_features=5000, n_labels=1000, n_train=5000)  # batch 16 -> 32
    batch = resolve(SlideConfig(), **whole)["batch_size"]
    edge = RARE_POSITIVES * 1000 / batch  # labels per row at the threshold
    rare = resolve(SlideConfig(), **whole, labels_per_row=0.99 * edge)
    common = resolve(SlideConfig(), **whole, labels_per_row=edge)
    assert not rare["sampled"] and not common["sampled"]
    assert (rare["lr"], rare["weight_decay"], rare["input_init"]) == (4e-3, SAMPLED_DECAY, 0.1)
    assert (common["lr"], common["weight_decay"], common["input_init"]) == (1e-3, 1.0, 0.5)
    # unknown (a checkpoint written before it was recorded): the settings it was trained with
    assert resolve(SlideConfig(), **whole) == common
    # the eight real sets' shapes stay on the common side: Corel5k, the lowest, 32 x 3.52 / 374
    assert positives_per_step(374, 32, 3.52) > 2 * RARE_POSITIVES
    # the mean label count travels with the model; a checkpoint without it resolves as before
    m, meta, path = _saved_without(tmp_path, tiny_data, "labels_per_row")
    Y = tiny_data[1]
    assert m.labels_per_row_ == pytest.approx(Y.nnz / Y.shape[0])
    assert SlideClassifier.load(tmp_path / "m").labels_per_row_ is None
    meta["labels_per_row"] = -1.0
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="labels_per_row"):
        SlideClassifier.load(tmp_path / "m")


def _offered(config, n_features, n_labels, n_train, **kw):
    """The names of the candidates the selection table offers for this shape."""
    resolved = resolve(config, n_features, n_labels, n_train, **kw)
    return [c.name for c in offered(config, resolved, n_features, n_labels, n_train,
                                    kw.get("labels_per_row"))]


def test_choices_follow_the_rule(tiny_data):
    # the wide hidden layer where the width is derived, the output whole, the refit runs and
    # its state fits the budget, and the ladder of light decays where the decay is derived and
    # would be 1; nothing without early stopping
    whole = dict(n_features=1449, n_labels=45, n_train=800)
    WIDE, LADDER, IDF = ["hidden 2048"], [f"decay {d:g}" for d in LIGHT_DECAYS], ["tf-idf"]
    assert _offered(SlideConfig(), **whole) == WIDE + LADDER + IDF
    assert _offered(SlideConfig(hidden=(64,)), **whole) == LADDER + IDF
    assert _offered(SlideConfig(refit=False), **whole) == LADDER + IDF
    assert _offered(SlideConfig(), 1449, 45, REFIT_ROWS) == LADDER + IDF
    assert _offered(SlideConfig(weight_decay=1.0), **whole) == WIDE + IDF
    assert _offered(SlideConfig(), **whole, rare_fraction=RARE_SHARE) == WIDE + IDF
    for config in (SlideConfig(early_stopping=False), SlideConfig(sparsity=0.5, lr=4e-3, tfidf=False),
                   SlideConfig(hidden=(64,), weight_decay=0.5, tfidf=False)):
        assert _offered(config, **whole) == []
    # the lower rate where the output is sampled (its rule's rate is 4e-3), the rate is not
    # given and the rows are few
    LOW, rows = [f"lr {LOW_RATE:g}"], dict(labels_per_row=1.0)  # 800 positives, 45 labels
    assert _offered(SlideConfig(sparsity=0.5), **whole, **rows) == LOW + IDF
    assert _offered(SlideConfig(sparsity=0.5, lr=4e-3), **whole, **rows) == IDF
    assert _offered(SlideConfig(sparsity=0.5), 1449, 45, FEW_ROWS - 1, **rows) == LOW + IDF
    assert _offered(SlideConfig(sparsity=0.5), 1449, 45, FEW_ROWS, **rows) == []
    assert "lr 0.001" not in _offered(SlideConfig(), **whole, rare_fraction=RARE_SHARE, **rows)
    # labels of fewer than LOW_RATE_POSITIVES positives on average, or an unknown count: not
    few = LOW_RATE_POSITIVES * 45 / 800
    assert _offered(SlideConfig(sparsity=0.5), **whole, labels_per_row=few) == LOW + IDF
    assert _offered(SlideConfig(sparsity=0.5), **whole, labels_per_row=0.99 * few) == IDF
    assert _offered(SlideConfig(sparsity=0.5), **whole) == IDF
    # idf weighting, tried on the best of those where tfidf is not given and the rows are few,
    # whether the output is sampled or not
    assert _offered(SlideConfig(sparsity=0.5, lr=4e-3), **whole) == IDF
    assert _offered(SlideConfig(), 1449, 45, FEW_ROWS - 1)[-1:] == IDF
    assert "tf-idf" not in _offered(SlideConfig(), 1449, 45, FEW_ROWS)
    for config in (SlideConfig(tfidf=False), SlideConfig(tfidf=True), SlideConfig(early_stopping=False)):
        assert "tf-idf" not in _offered(config, **whole)
    too_wide = OUTPUT_STATE_BYTES // (16 * WIDE_HIDDEN)
    # (features that many times the rows: the rows' decay is 0.1, and no ladder)
    assert _offered(SlideConfig(), too_wide + 1 - 45, 45, 300) == IDF
    assert _offered(SlideConfig(), too_wide - 45, 45, 300) == WIDE + IDF
    # the table: the ladder's rungs each build on the one before, idf weighting on the best
    assert [(c.name, c.on) for c in CANDIDATES] == [
        ("hidden 2048", "rule"), ("decay 0.3", "rule"), ("decay 0.1", "decay 0.3"),
        ("decay 0.03", "decay 0.1"), ("lr 0.001", "rule"), ("tf-idf", "best")]
    # a choice replaces the rule's values, not settings given
    wide, light = {"width": WIDE_HIDDEN}, {"weight_decay": LIGHT_DECAYS[0]}
    chosen = resolve(SlideConfig(), **whole, choice=wide)
    assert chosen["hidden"] == [WIDE_HIDDEN]
    assert resolve(SlideConfig(), **whole, choice=light)["weight_decay"] == LIGHT_DECAYS[0]
    assert resolve(SlideConfig(weight_decay=0.5), **whole, choice=light)["weight_decay"] == 0.5
    assert resolve(SlideConfig(), **whole, choice={}) == resolve(SlideConfig(), **whole)
    low = {"lr": LOW_RATE}
    assert resolve(SlideConfig(sparsity=0.5), **whole, choice=low)["lr"] == LOW_RATE
    assert resolve(SlideConfig(sparsity=0.5, lr=5e-3), **whole, choice=low)["lr"] == 5e-3
    for bad in ({"width": 0}, {"lr": 0}, {"beta1": 0.5}, [("width", 2)]):
        with pytest.raises(ValueError, match="width|lr|choice"):
            resolve(SlideConfig(), **whole, choice=bad)
    with pytest.raises(TypeError, match="tfidf must be True or False"):
        checked_choice({"tfidf": 1})
    # the features are idf-weighted as tfidf says where it is given, else as the choice does
    assert [idf_weighted(SlideConfig(tfidf=t), c) for t in (None, False, True)
            for c in (None, {}, {"tfidf": True})] == [False, False, True] + [False] * 3 + [True] * 3
    assert choice_name({"weight_decay": 0.3, "tfidf": True}) == "decay 0.3, tf-idf"
    assert choice_name({"tfidf": True}) == "tf-idf"
    assert choice_name({"lr": LOW_RATE, "tfidf": True}) == "lr 0.001, tf-idf"


def test_settings_are_chosen_on_the_held_out_slice(tmp_path, tiny_data):
    # fit trains each choice early-stopped on the same held-out rows (the scores are those of
    # separate fits on that split), keeps the best, and refits it on every row. 1,000 rows: with
    # fewer, most non-zeros are in rare features and the decay is the rare rows' (no choice)
    X, Y = tiny_data[0][:1000], tiny_data[1][:1000]
    kw = dict(threads=1, seed=0, epochs=3, tfidf=False)  # idf: test_idf_weighting_is_tried_on_the_best_choice
    m = SlideClassifier(**kw).fit(X, Y)
    tr, va = validation_split(1000, 0.1, 0)
    settings = {"rule": (512, 1.0), "hidden 2048": (WIDE_HIDDEN, 1.0),
                **{f"decay {d:g}": (512, d) for d in LIGHT_DECAYS}}
    c = m.stopping_["choice"]
    names = list(c["validation_scores"])
    runs = {name: SlideClassifier(hidden=settings[name][:1], weight_decay=settings[name][1], **kw)
            .fit(X[tr], Y[tr], validation=(X[va], Y[va])) for name in names}
    scores = {name: run.early_stopping_.best_score for name, run in runs.items()}
    assert c["validation_scores"] == pytest.approx(scores, rel=1e-6)
    # the lighter decays follow one another while the last one tried is the best so far
    assert names[:3] == ["rule", "hidden 2048", "decay 0.3"]
    for i in range(2, len(names)):
        best_so_far = max(names[:i + 1], key=scores.get) == names[i]
        assert best_so_far == (i + 1 < len(names)) or names[i] == f"decay {LIGHT_DECAYS[-1]:g}"
    assert c["chosen"] == max(scores, key=scores.get) and m.choice_ == c["settings"]
    # the refit follows the chosen run's record, whichever run trained last
    chosen = runs[c["chosen"]]
    assert m.stopping_["kept_epoch"] == chosen.stopping_["kept_epoch"]
    assert [r["loss"] for r in m.history_[:-1]] == pytest.approx([r["loss"] for r in chosen.history_], rel=1e-6)
    assert m.resolved_ == resolve(SlideConfig(**kw), X.shape[1], m.n_outputs_fitted_, 1000 - va.size,
                                  m.rare_share_, m.choice_, m.labels_per_row_)
    assert m.stopping_["refit"]["rows"] == 1000
    assert m.history_[-1]["refit"] and len(m.history_) == m.stopping_["kept_epoch"] + 1
    # the choice travels with the model
    m.save(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["choice"] == m.choice_
    loaded = SlideClassifier.load(tmp_path / "m")
    assert loaded.resolved_ == m.resolved_
    np.testing.assert_array_equal(loaded.decision_function(X[:20]), m.decision_function(X[:20]))


def _validation_loss_as(adjust):
    """A SlideClassifier whose validation loss is ``adjust(choice_, loss)``: a run made to
    score as a test needs, whatever it learned."""
    class Adjusted(SlideClassifier):
        def evaluate(self, X, Y, k=5, loss=False, **predict_kw):
            out = super().evaluate(X, Y, k=k, loss=loss, **predict_kw)
            if loss:
                out["loss"] = adjust(self.choice_, out["loss"])
            return out
    return Adjusted


def test_without_refit_the_chosen_run_is_kept_as_trained(tiny_data):
    # with a validation set given there is no refit: the model is the best run as it was
    # trained, though two runs trained after it (one thread: runs repeat exactly)
    X, Y, Xv, Yv = tiny_data[0][:1000], tiny_data[1][:1000], tiny_data[0][1000:1200], tiny_data[1][1000:1200]
    kw = dict(threads=1, seed=0, epochs=4, tfidf=False)
    # every choice but the rule's own scores far worse
    prefers_rule = _validation_loss_as(lambda choice, loss: loss + 100.0 if choice else loss)
    m = prefers_rule(**kw).fit(X, Y, validation=(Xv, Yv))
    c = m.stopping_["choice"]
    assert list(c["validation_scores"]) == ["rule", "hidden 2048", "decay 0.3"]
    assert c["chosen"] == "rule" and m.choice_ == {} and "refit" not in m.stopping_
    # the rule's settings given, so that nothing is chosen
    alone = SlideClassifier(hidden=(512,), weight_decay=1.0, **kw).fit(X, Y, validation=(Xv, Yv))
    assert "choice" not in alone.stopping_ and alone.resolved_ == m.resolved_
    assert alone.stopping_["best_score"] == pytest.approx(c["validation_scores"]["rule"], rel=1e-6)
    assert [r["loss"] for r in m.history_] == pytest.approx([r["loss"] for r in alone.history_], rel=1e-6)
    np.testing.assert_allclose(m.decision_function(Xv), alone.decision_function(Xv), rtol=1e-5, atol=1e-6)


def test_lighter_decays_are_tried_while_each_is_the_best_so_far(tiny_data):
    # each rung of the ladder is tried only where the rung before it is the best run so far
    rungs = [c for c in CANDIDATES if "weight_decay" in c.change]
    assert [c.change["weight_decay"] for c in rungs] == list(LIGHT_DECAYS)
    assert [c.on for c in rungs] == ["rule"] + [choice_name(c.change) for c in rungs[:-1]]
    X, Y, Xv, Yv = tiny_data[0][:1000], tiny_data[1][:1000], tiny_data[0][1000:1200], tiny_data[1][1000:1200]
    kw = dict(threads=1, seed=0, epochs=2, tfidf=False)
    # the loss made to fall with the decay: every rung is tried, the lightest is kept
    lighter_is_better = _validation_loss_as(
        lambda choice, loss: loss + 10.0 * choice.get("weight_decay", 2.0 if choice else 1.0))
    m = lighter_is_better(**kw).fit(X, Y, validation=(Xv, Yv))
    c = m.stopping_["choice"]
    assert list(c["validation_scores"]) == ["rule", "hidden 2048"] + [f"decay {d:g}" for d in LIGHT_DECAYS]
    assert m.choice_ == {"weight_decay": LIGHT_DECAYS[-1]} == c["settings"]
    # 0.3 the best and 0.1 worse: the ladder stops there, and the model is the 0.3 run as it
    # was trained, though the 0.1 run trained after it
    best_at_first_rung = _validation_loss_as(
        lambda choice, loss: loss + {LIGHT_DECAYS[0]: -10.0}.get(choice.get("weight_decay"), 10.0))
    m = best_at_first_rung(**kw).fit(X, Y, validation=(Xv, Yv))
    c = m.stopping_["choice"]
    assert list(c["validation_scores"]) == ["rule", "hidden 2048", "decay 0.3", "decay 0.1"]
    assert m.choice_ == {"weight_decay": LIGHT_DECAYS[0]} and m.resolved_["weight_decay"] == LIGHT_DECAYS[0]
    alone = SlideClassifier(hidden=(512,), weight_decay=LIGHT_DECAYS[0], **kw).fit(X, Y, validation=(Xv, Yv))
    np.testing.assert_allclose(m.decision_function(Xv), alone.decision_function(Xv), rtol=1e-5, atol=1e-6)


def test_a_sampled_output_may_choose_the_lower_rate(tmp_path, tiny_data):
    # the rule's 4e-3 and the lower rate each trained early-stopped on the same slice (scored by
    # nDCG@5, a sampled output's score); the better is kept, and it is the run a model given
    # that rate trains (one thread: runs repeat exactly); 1,800 rows: 8.9 positives a label
    X, Y, Xv, Yv = tiny_data[0][:1800], tiny_data[1][:1800], tiny_data[0][2000:2200], tiny_data[1][2000:2200]
    kw = dict(hidden=(16,), sparsity=0.5, threads=1, seed=0, epochs=2, tfidf=False)

    class LowerScoresBetter(SlideClassifier):
        def evaluate(self, X, Y, k=5, loss=False, **predict_kw):
            out = super().evaluate(X, Y, k=k, loss=loss, **predict_kw)
            out["nDCG@5"] += 1.0 if self.choice_ == {"lr": LOW_RATE} else 0.0
            return out

    m = LowerScoresBetter(**kw).fit(X, Y, validation=(Xv, Yv))
    c = m.stopping_["choice"]
    assert list(c["validation_scores"]) == ["rule", f"lr {LOW_RATE:g}"]
    assert m.choice_ == {"lr": LOW_RATE} and m.resolved_["lr"] == LOW_RATE
    alone = SlideClassifier(lr=LOW_RATE, **kw).fit(X, Y, validation=(Xv, Yv))
    assert "choice" not in alone.stopping_
    assert c["validation_scores"][f"lr {LOW_RATE:g}"] == pytest.approx(alone.stopping_["best_score"] + 1.0)
    np.testing.assert_allclose(m.decision_function(Xv), alone.decision_function(Xv), rtol=1e-5, atol=1e-6)
    # the choice travels with the model; without the boost the rule's own rate may win
    m.save(tmp_path / "m")
    assert SlideClassifier.load(tmp_path / "m").resolved_["lr"] == LOW_RATE
    rule = SlideClassifier(**kw).fit(X, Y, validation=(Xv, Yv))
    scores = rule.stopping_["choice"]["validation_scores"]
    assert rule.resolved_["lr"] == (LOW_RATE if scores[f"lr {LOW_RATE:g}"] > scores["rule"] else 4e-3)


def test_idf_weighting_is_tried_on_the_best_choice(tmp_path, tiny_data):
    # once the network's choices are through, the best one is trained again on idf-weighted
    # features and kept where it scores better; the model is then that run, features and all
    X, Y, Xv, Yv = tiny_data[0][:1000], tiny_data[1][:1000], tiny_data[0][1000:1200], tiny_data[1][1000:1200]
    kw = dict(threads=1, seed=0, epochs=2)
    light = {"weight_decay": LIGHT_DECAYS[0]}
    # decay 0.3 the best of the network's choices (its next rung worse), idf weighting better still
    idf_on_light = _validation_loss_as(lambda choice, loss: loss + (
        -20.0 if choice == {**light, "tfidf": True} else -10.0 if choice == light else 10.0))
    m = idf_on_light(**kw).fit(X, Y, validation=(Xv, Yv))
    c = m.stopping_["choice"]
    assert list(c["validation_scores"]) == ["rule", "hidden 2048", "decay 0.3", "decay 0.1",
                                            "decay 0.3, tf-idf"]
    assert m.choice_ == {**light, "tfidf": True} == c["settings"] and m.preprocessor_.tfidf
    assert m.resolved_["tfidf"]
    alone = SlideClassifier(hidden=(512,), weight_decay=LIGHT_DECAYS[0], tfidf=True, **kw).fit(
        X, Y, validation=(Xv, Yv))
    assert alone.stopping_["best_score"] == pytest.approx(c["validation_scores"]["decay 0.3, tf-idf"] - 20.0,
                                                          rel=1e-6)
    np.testing.assert_allclose(m.decision_function(Xv), alone.decision_function(Xv), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.preprocessor_.idf_, alone.preprocessor_.idf_)
    # the choice and the weighting travel with the model
    m.save(tmp_path / "m")
    loaded = SlideClassifier.load(tmp_path / "m")
    assert loaded.choice_ == m.choice_ and loaded.preprocessor_.tfidf and loaded.resolved_["tfidf"]
    np.testing.assert_array_equal(loaded.decision_function(Xv), m.decision_function(Xv))
    # idf weighting worse: the best run before it is kept, as it was trained, on plain features
    idf_worse = _validation_loss_as(lambda choice, loss: loss + (10.0 if choice.get("tfidf") else 0.0))
    m = idf_worse(**kw).fit(X, Y, validation=(Xv, Yv))
    c = m.stopping_["choice"]
    assert list(c["validation_scores"])[-1] == choice_name({**m.choice_, "tfidf": True})
    assert not m.choice_.get("tfidf") and not m.preprocessor_.tfidf and not m.resolved_["tfidf"]
    settings = {"hidden": (WIDE_HIDDEN,) if "width" in m.choice_ else (512,),
                "weight_decay": m.choice_.get("weight_decay", 1.0)}
    kept = SlideClassifier(**settings, tfidf=False, **kw).fit(X, Y, validation=(Xv, Yv))
    np.testing.assert_allclose(m.decision_function(Xv), kept.decision_function(Xv), rtol=1e-5, atol=1e-6)


def test_a_run_whose_loss_diverged_is_not_chosen(tiny_data):
    X, Y, Xv, Yv = tiny_data[0][:1000], tiny_data[1][:1000], tiny_data[0][1000:1200], tiny_data[1][1000:1200]
    diverged_rule = _validation_loss_as(lambda choice, loss: float("nan") if choice == {} else loss)
    m = diverged_rule(threads=1, seed=0, epochs=2).fit(X, Y, validation=(Xv, Yv))
    scores = m.stopping_["choice"]["validation_scores"]
    assert math.isnan(scores["rule"]) and m.stopping_["choice"]["chosen"] != "rule"
    assert m.choice_ and all(np.isfinite(v).all() for v in m.params_.values())


@pytest.mark.parametrize("engine", ["slide", "dense", "hetero"])
def test_a_held_fitted_state_survives_another_fit(engine, tiny_data):
    X, Y = tiny_data[0][:300], tiny_data[1][:300]
    kw = dict(hidden=(16,), early_stopping=False, epochs=1, seed=0)
    model = SlideClassifier(threads=1, **kw) if engine != "dense" else DenseClassifier(device="cpu", **kw)
    if engine == "hetero":
        model = HeteroTrainer(model, HeteroConfig(device="cpu", cpu_batch=32, gpu_batch=64, gpu_pool=16))
    inner = model.model if engine == "hetero" else model
    model.fit(X, Y)
    params = {k: np.array(v) for k, v in inner.params_.items()}
    history = list(inner.history_)
    held = inner.fitted_state()
    inner.set_params(hidden=(8,), seed=1)
    model.fit(tiny_data[0][300:500], tiny_data[1][300:500])
    inner.restore_fitted(held)
    assert inner.history_ == history and inner.resolved_["hidden"] == [16]
    for k, v in params.items():
        np.testing.assert_array_equal(np.asarray(inner.params_[k]), v)
    assert inner.predict_topk(X[:5], 3)[0].shape == (5, 3)


def test_a_choice_too_large_for_free_memory_is_not_tried(monkeypatch, tiny_data):
    X, Y = tiny_data[0][:1000], tiny_data[1][:1000]
    need = {w: model_memory_bytes(resolve(SlideConfig(hidden=(w,)), X.shape[1], Y.shape[1], 900),
                                  X.shape[1], Y.shape[1], 1)["total"] for w in (512, WIDE_HIDDEN)}
    monkeypatch.setattr(resources, "available_memory_bytes", lambda: (need[512] + need[WIDE_HIDDEN]) // 2)
    m = SlideClassifier(threads=1, seed=0, epochs=2).fit(X, Y)
    tried = list(m.stopping_["choice"]["validation_scores"])
    assert tried[:2] == ["rule", "decay 0.3"] and "hidden 2048" not in tried
    assert m.resolved_["hidden"] == [512]
    monkeypatch.setattr(resources, "available_memory_bytes", lambda: need[512] // 2)
    with pytest.raises(resources.ModelTooLargeError):
        SlideClassifier(threads=1, seed=0, epochs=2).fit(X, Y)


def test_checkpoints_that_name_only_a_width_load_as_that_choice(tmp_path, tiny_data):
    X, Y = tiny_data[0][:300], tiny_data[1][:300]
    m = SlideClassifier(threads=1, seed=0, epochs=1, early_stopping=False, hidden=(64,)).fit(X, Y)
    m.choice_ = {"width": 64}
    m.save(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    meta = json.loads(path.read_text())
    del meta["choice"]
    meta["width"] = 64
    path.write_text(json.dumps(meta))
    assert SlideClassifier.load(tmp_path / "m").choice_ == {"width": 64}
    meta["choice"] = {"depth": 3}
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="'choice'"):
        SlideClassifier.load(tmp_path / "m")


def test_settings_are_validated_at_fit(tiny_data):
    X, Y = tiny_data[0][:50], tiny_data[1][:50]
    for bad, match in [(dict(lr=float("nan")), "lr must be finite"), (dict(threads=-1), "threads"),
                       (dict(K=0), "K"), (dict(L=0), "L"), (dict(L=4097), "L"),
                       (dict(bucket_size=0), "bucket_size"),
                       (dict(epochs=2.7), "epochs must be an integer"), (dict(lr=float("inf")), "lr"),
                       (dict(validation_fraction=0.9), "validation_fraction"),
                       (dict(norm="l1"), "norm"), (dict(early_stopping="yes"), "early_stopping"),
                       (dict(hard_negatives=-1), "hard_negatives"),
                       (dict(hard_negatives=2.5), "hard_negatives must be an integer"),
                       (dict(activation="tanh"), "activation must be one of relu, identity"),
                       (dict(hidden=(8, 8), hidden_sparsity=(1.0, 0.5), activation="identity"),
                        "activation='identity' needs every hidden layer dense")]:
        with pytest.raises((ValueError, TypeError), match=match):
            SlideClassifier(**bad).fit(X, Y)
