"""Choosing the plan that reaches the default plan's final score soonest, on the data and the
machine at hand (after Omnivore: Hadjis, Zhang, Mitliagkas and Ré, 2016).

A plan's time to a validation score is its hardware efficiency (samples a second) times its
statistical efficiency (samples to the score). The model (docs/planner.md):

* the final score is set by the learning-rate plan's optimizer steps: a plan takes the rule's
  planned epochs for its batch size (the same steps as the default) and reaches the default's
  final score where its last halving begins (:data:`TARGET_SHARE`). (A plan whose probe leads the default at the start does not keep
  the lead: measured on real data, docs/planner.md.)
* so plans that keep the optimizer's settings differ in hardware efficiency alone, which short
  probes measure: the candidates (:func:`candidates`: thread counts) train stretches of
  the default's own first epoch in turn, on the default's own model, so no probe's samples are
  lost;
* a plan's time is the probes' seconds, its remaining samples at its probe's rate and one
  evaluation of the held-out slice an epoch (:func:`predict`).

The plan predicted soonest, by more than :data:`MARGIN` (the default otherwise), then trains on
from where the probes left the model. After each epoch the run re-checks the prediction and
re-plans its remaining time where it is off by more than :data:`RECHECK`.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

from slide.config import planned_epochs
from slide.data import shuffle_rows
from slide.fitting import hold_out
from slide.loop import (MAX_VALIDATION_ROWS, EarlyStopping, epoch_learning_rate, epoch_order,
                        first_cycle)
from slide.plan import Plan
from slide.selection import offered_to

__all__ = ["Probe", "Prediction", "Planner", "candidates", "predict", "seconds_to", "choose",
           "PROBE_SHARE", "MARGIN", "RECHECK", "TARGET_SHARE", "PROBE_VALIDATION_ROWS"]

#: the share of the default plan's predicted run that the probes take (every probed sample is
#: a sample of the run: only the slower plans' extra seconds are lost)
PROBE_SHARE = 0.05
#: rounds over the candidates, each a stretch per plan
PROBE_ROUNDS = 4
#: another plan than the default is chosen only where it is predicted this much sooner: a
#: probe's rate is that of a stretch of seconds, which the machine's noise moves by a few
#: percent
MARGIN = 0.1
#: the run re-plans where the time it has taken is off the prediction by more than this share
RECHECK = 0.25
#: the share of its planned epochs after which a run has its final score: where the
#: learning-rate plan's last halving begins (the best epochs measured: 17-20 of 20 on
#: git_openstack, 9-12 of 14 on the Amazon preset; docs/planner.md)
TARGET_SHARE = 5 / 6
#: held-out rows the probes' evaluation is timed on (scaled to the whole slice)
PROBE_VALIDATION_ROWS = 1000
#: batches of each plan's stretch in the first round, whose rates size the other rounds
FIRST_PROBE_BATCHES = 4


@dataclass
class Probe:
    """A stretch of training at a plan's threads and batch size: ``samples`` in ``seconds``
    (the step's own time: no evaluation, no compile). ``batch_size`` and ``epochs``: the plan's
    (the rule's epochs for its batch where the plan sets none)."""
    plan: Plan
    samples: int
    seconds: float
    batch_size: int
    epochs: int

    @property
    def samples_per_second(self) -> float:
        return self.samples / max(self.seconds, 1e-9)

    def to_json(self) -> dict:
        d = asdict(self)
        d["plan"] = self.plan.to_json()
        d["samples_per_second"] = self.samples_per_second
        return d


@dataclass
class Prediction:
    """A plan's predicted run: ``epochs`` planned, ``seconds`` from the start of planning to
    the default's final score."""
    plan: Plan
    epochs: int
    seconds: float
    samples_per_second: float

    def to_json(self, base: Plan | None = None) -> dict:
        return {"plan": self.plan.describe(base), "settings": self.plan.to_json(),
                "epochs": self.epochs, "seconds": self.seconds,
                "samples_per_second": self.samples_per_second}


def seconds_to(epoch: int, rows: int, done: int, spent: float, rate: float,
               eval_seconds: float) -> float:
    """Seconds from the start of planning to the end of epoch ``epoch`` of ``rows`` rows, at
    ``rate`` samples a second and one evaluation an epoch, ``done`` samples of the first
    epoch trained when ``spent`` seconds had gone."""
    return spent + max(0.0, epoch * rows - done) / rate + epoch * eval_seconds


def predict(probe: Probe, rows: int, done: int, spent: float, eval_seconds: float,
            metric: str = "nDCG@5") -> Prediction:
    """``probe``'s plan run on until it has its final score (:data:`TARGET_SHARE` of its
    planned epochs of ``rows`` rows), ``done`` samples of the first epoch trained and ``spent``
    seconds gone (probes, evaluation); ``metric``: the run's early-stopping score."""
    # the share is of the plan's second cycle where it has two (slide.loop.first_cycle)
    first = first_cycle(metric, probe.epochs)
    target = first + max(1, math.ceil(TARGET_SHARE * (probe.epochs - first) - 1e-9))
    seconds = seconds_to(target, rows, done, spent, probe.samples_per_second, eval_seconds)
    return Prediction(probe.plan, probe.epochs, seconds, probe.samples_per_second)


def choose(predictions: list, margin: float = MARGIN) -> tuple[Prediction, str]:
    """The prediction to follow (the first is the default's) and why."""
    default = predictions[0]
    best = min(predictions, key=lambda p: p.seconds)
    if best is default or best.seconds > (1 - margin) * default.seconds:
        return default, ("no plan is predicted to reach the default's final score more than "
                         f"{margin:.0%} sooner than the default ({default.seconds:.0f} s)")
    return best, (f"predicted to reach the default's final score in {best.seconds:.0f} s, "
                  f"against the default's {default.seconds:.0f} s "
                  f"({best.samples_per_second / default.samples_per_second:.2f}x its samples "
                  f"a second over {best.epochs} epochs against {default.epochs})")


def candidates(resolved: dict, default: Plan | None = None, cores: int | None = None) -> list:
    """The plans probed in one process, the default first: every core, and half of them (a
    machine busy with other work can make fewer threads faster). Not a larger batch: at the
    rule's steps it plans as many more epochs, and no step has run at twice the rate on twice
    the batch (docs/planner.md)."""
    d = default or Plan.default()
    threads = d.threads or cores or os.cpu_count() or 1
    return [d] + ([d.but(threads=threads // 2)] if threads > 1 else [])


class Planner:
    """Probe candidate plans, choose the one predicted to reach the default's final validation
    score soonest, and train by it (``slide train --plan auto``).

    ``planner.fit(model, X, Y, **train_kw)`` trains ``model`` (a :class:`SlideClassifier`, its
    settings the default plan's) by the chosen plan; ``model.plan_`` then holds the probes,
    every candidate's prediction, the choice and why, and the re-checks after each epoch.
    ``prepare`` + ``model.train(..., continue_training=True, until_epoch=...)`` split it for
    callers that run the epochs themselves (:func:`slide.train.run_training`).
    """

    def __init__(self, share: float = PROBE_SHARE, margin: float = MARGIN,
                 recheck: float = RECHECK, plans=None, log=print):
        if not 0 < share < 1:
            raise ValueError(f"share must be in (0, 1), got {share!r}")
        self.share, self.margin, self.recheck = float(share), float(margin), float(recheck)
        self.plans, self.log = plans, log

    def fit(self, model, X, Y, *, on_epoch=None, **train_kw):
        """Plan and train ``model`` on ``X``, ``Y`` (``train_kw``: those of
        :meth:`SlideClassifier.train` but ``continue_training`` and ``until_epoch``)."""
        report = self.prepare(model, X, Y, validation=train_kw.get("validation"))
        model.train(X, Y, continue_training=report["chosen"]["epochs"] is not None,
                    until_epoch=report["chosen"]["epochs"], on_epoch=self.watch(report, on_epoch),
                    **train_kw)
        model.record_.plan = report
        return model

    def prepare(self, model, X, Y, validation=None) -> dict:
        """Initialise ``model`` on the training rows (the held-out slice as ``fit`` holds it
        out), probe, choose, and leave ``model`` with the chosen plan's settings and the
        probes' samples trained: the start of its first epoch. ``validation``: as ``fit``'s
        (None: the slice ``fit`` holds out). Where planning does not apply
        ``report["chosen"]["epochs"]`` is None and the model is left unfitted, to train as
        usual. Returns the report."""
        t0 = self.started_ = time.perf_counter()  # the clock the re-checks read
        s = model.fit_settings()
        if not s["early_stopping"]:
            raise ValueError("planning compares plans on the held-out slice: it needs "
                             "early_stopping (the default)")
        X, Y = model.check_data(X, Y, where="fit", fitted=False)
        if validation is not None:
            validation = model.check_data(*validation, where="validation", fitted=False)
        # the rows and the held-out slice ``fit`` will train and score on
        Xt, Yt, (Xv, Yv), _ = hold_out(X, Y, s, validation)
        default = Plan.of(model.get_params())
        model.initialize(Xt, Yt)
        report = {"checks": [], "candidates": [], "probes": []}
        skip = self._not_planned(model)
        if skip:
            self.log(f"plan: the default ({skip})")
            model.__dict__.pop("state_", None)  # unfitted again: fit starts as without a plan
            report.update(chosen={"plan": "default", "epochs": None, "seconds": None},
                          reason=skip)
            return report
        Yr = model.targets(Xt, Yt)
        Xp = model.preprocess(Xt)
        n = Xp.shape[0]
        order = epoch_order(s["seed"], 0, n)
        resolved = model.resolved_
        model.state_.learning_rate = epoch_learning_rate(resolved["lr"], 0, resolved["epochs"])
        model.state_.begin_epoch()
        state = model.state_
        # not timed: the first batch compiles the kernels (where they are not cached), and
        # until the first rehash the tables hold the initial weights' codes, whose candidates
        # cost a step more than the trained ones'
        done = warmup = min(max(resolved["batch_size"], resolved["rehash_every"]), n // 4)
        state.train_rows(Xp, Yr, order[:done])
        # one evaluation of the held-out slice an epoch: timed on a subset, scaled
        metric = EarlyStopping(metric=model.validation_metric())
        val = shuffle_rows(Xv, Yv, seed=s["seed"], n=min(Xv.shape[0], PROBE_VALIDATION_ROWS))
        t1 = time.perf_counter()
        model.evaluate(*val, loss=metric.metric == "loss")
        eval_seconds = (time.perf_counter() - t1) * min(Xv.shape[0], MAX_VALIDATION_ROWS) \
            / val[0].shape[0]
        plans = self.plans or candidates(resolved, default)
        probes, done = self._probe(plans, default, state, Xp, Yr, order, done, eval_seconds)
        model.record_.epoch_position = done
        spent = time.perf_counter() - t0
        predictions = [predict(p, n, done, spent, eval_seconds, metric.metric) for p in probes]
        chosen, why = choose(predictions, self.margin)
        report.update(candidates=[p.to_json(default) for p in predictions],
                      probes=[p.to_json() for p in probes], probe_seconds=spent,
                      probe_samples=done, warmup_samples=warmup, eval_seconds=eval_seconds,
                      rows=n,
                      chosen=chosen.to_json(default), reason=why)
        self.log(_table(predictions, chosen, default))
        self.log(f"plan: {chosen.plan.describe(default)}: {why}")
        model.set_params(**{k: v for k, v in chosen.plan.but(epochs=chosen.epochs).params().items()
                            if v is not None})
        model.record_.plan = report
        return report

    def _probe(self, plans, default, state, Xp, Y, order, done, eval_seconds):
        """Time each plan's stretches of the epoch ``order`` from sample ``done`` on, round
        robin (the rate drifts along an epoch, and so every plan sees the same stretch of it):
        a first round of :data:`FIRST_PROBE_BATCHES` batches each, whose rates size the other
        rounds to ``share`` of the default's predicted run. Returns the probes and the samples
        of the epoch done."""
        resolved, n = state.resolved, Xp.shape[0]
        batches = [plan.batch_size or resolved["batch_size"] for plan in plans]
        samples, seconds = [0] * len(plans), [0.0] * len(plans)
        size = [FIRST_PROBE_BATCHES * b for b in batches]
        for r in range(PROBE_ROUNDS):
            for i, plan in enumerate(plans):
                stop = min(n, done + size[i])
                t1 = time.perf_counter()
                state.train_rows(Xp, Y, order[done:stop], batch_size=batches[i],
                                 threads=plan.threads or default.threads)
                seconds[i] += time.perf_counter() - t1
                samples[i] += stop - done
                done = stop
            if r == 0:
                rate = samples[0] / max(seconds[0], 1e-9)
                total = resolved["epochs"] * (n / rate + eval_seconds)
                budget = self.share * total / (PROBE_ROUNDS - 1) / len(plans)
                size = [max(b, int(budget * samples[i] / max(seconds[i], 1e-9) / b) * b)
                        for i, b in enumerate(batches)]
        probes = []
        for i, plan in enumerate(plans):
            if not samples[i]:  # the epoch ran out first
                continue
            # the rule's epochs for the plan's batch: the same optimizer steps as the default
            epochs = plan.epochs or (resolved["epochs"] if batches[i] == resolved["batch_size"]
                                     else planned_epochs(n, batches[i]))
            probes.append(Probe(plan, samples[i], seconds[i], batches[i], epochs))
            self.log(f"plan probe {i + 1}/{len(plans)}: {plan.describe(default)}: "
                     f"{probes[-1].samples_per_second:,.0f} samples/s over {samples[i]:,} samples")
        return probes, done

    @staticmethod
    def _not_planned(model) -> str:
        """Why planning does not apply to this run ('' where it does): the run chooses
        settings on the held-out slice or trains again on every row (both restart training,
        which the probes cannot be the start of; such runs are short)."""
        if model.resolved_["refit"]:
            return "the run trains again on every row once early stopping has chosen its epochs"
        if offered_to(model):
            return "the run chooses settings on the held-out slice"
        return ""

    def watch(self, report: dict, on_epoch=None):
        """An ``on_epoch`` callback that compares each epoch's end with the prediction and
        re-plans the remaining time where it is off by more than ``recheck``."""
        pred = report.get("chosen") or {}
        if pred.get("epochs") is None:
            return on_epoch
        rate, rows = pred["samples_per_second"], report["rows"]
        outside = [0.0]  # seconds the caller's on_epoch took: not training
        planned = [pred["epochs"]]  # the loop may cut the plan (slide.loop.FLAT_GAIN)

        def check(model, entry):
            now = time.perf_counter() - self.started_ - outside[0]
            expected = seconds_to(entry["epoch"], rows, report["probe_samples"],
                                  report["probe_seconds"], rate, report["eval_seconds"])
            check = {"epoch": entry["epoch"], "elapsed": now, "predicted": expected}
            off = now / max(expected, 1e-9) - 1
            cut = entry.get("planned_epochs")
            if cut:
                planned[0] = cut
            if abs(off) > self.recheck or cut:
                # re-plan: the remaining epochs at the rate and evaluation cost measured so far
                left = planned[0] - entry["epoch"]
                per_epoch = (now - report["probe_seconds"]) / entry["epoch"]
                check["replanned_seconds"] = now + left * per_epoch
                why = (f"the validation score flattened: the plan is cut to {cut} epochs"
                       if cut else f"predicted {expected:.0f} s ({off:+.0%})")
                self.log(f"plan: epoch {entry['epoch']} ended at {now:.0f} s, {why}; the run "
                         f"now ends at about {check['replanned_seconds']:.0f} s")
            report["checks"].append(check)
            entry["plan_elapsed"] = now
            if on_epoch is not None:
                t0 = time.perf_counter()
                on_epoch(model, entry)
                outside[0] += time.perf_counter() - t0
        return check


def _table(predictions, chosen, base) -> str:
    rows = [f"{'plan':<36} {'samples/s':>10} {'epochs':>6} {'seconds':>8}"]
    for p in predictions:
        mark = " <" if p is chosen else ""
        rows.append(f"{p.plan.describe(base):<36} {p.samples_per_second:>10,.0f} "
                    f"{p.epochs:>6} {p.seconds:>8.0f}{mark}")
    return "\n".join(rows)
