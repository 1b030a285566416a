"""Choosing the plan that reaches the default plan's accuracy soonest, on the data and the
machine at hand (after Omnivore: Hadjis, Zhang, Mitliagkas and Ré, 2016).

A plan's time to a validation score is its hardware efficiency (samples a second) times its
statistical efficiency (samples to the score). Short probes measure both: each candidate
(:func:`candidates`) trains the first samples of its own run on the same rows, from the same
start, and is scored on the held-out slice as it goes. The model (docs/planner.md):

* the default plan reaches its final score at the end of its planned epochs, ``E`` epochs of
  ``n`` rows;
* a plan whose probe reached a score the default reaches only after ``κ`` times the samples
  (:func:`efficiency`, the default's curve fitted as ``a + b·ln(samples)``) keeps that lead, so
  it needs ``E·n/κ`` samples, and plans that many epochs;
* its time is then the probes' seconds, its remaining samples at its probe's rate, and one
  evaluation of the held-out slice an epoch (:func:`predict`).

The plan predicted soonest runs on from its probe, whose samples are the start of its first
epoch; another plan than the default must be predicted sooner by :data:`MARGIN`, since probes
are short and noisy (:func:`choose`). After each epoch the run re-checks the prediction and
re-plans its remaining time where it is off by more than :data:`RECHECK`.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from sklearn.base import clone

from slide.data import shuffle_rows
from slide.loop import (MAX_VALIDATION_ROWS, EarlyStopping, epoch_learning_rate, epoch_order,
                        validation_split)
from slide.plan import Plan
from slide.selection import offered

__all__ = ["Probe", "Prediction", "Planner", "candidates", "efficiency", "predict", "choose",
           "PROBE_SHARE", "MARGIN", "RECHECK", "PROBE_POINTS", "PROBE_VALIDATION_ROWS"]

#: the share of the default plan's predicted run that all probes together may take
PROBE_SHARE = 0.12
#: a plan other than the default is chosen only where it is predicted this much sooner: a
#: probe's score on a few thousand rows moves by about this much between seeds
MARGIN = 0.1
#: the run re-plans where the time it has taken is off the prediction by more than this share
RECHECK = 0.25
#: validation scores along a probe: the default's curve is fitted through them
PROBE_POINTS = 4
#: held-out rows a probe is scored on (a seeded subset of the validation slice)
PROBE_VALIDATION_ROWS = 2000
#: a probe trains at least this many batches between evaluations
MIN_PROBE_BATCHES = 8
#: efficiencies outside [1/MAX_EFFICIENCY, MAX_EFFICIENCY] are clipped: a probe sees the start
#: of training, whose lead is not kept in full to the end
MAX_EFFICIENCY = 2.0


@dataclass
class Probe:
    """What a short run of a plan measured.

    samples, scores : samples trained and the validation score (higher is better) at each
        evaluation. timed_samples, train_seconds : the samples and training seconds after the
        first evaluation (the first stretch may compile kernels). eval_seconds : one scoring
        of the whole validation slice, scaled from the probe's. seconds : the probe's wall
        time. epochs, rows : the plan's planned epochs and the epoch's rows.
    """
    plan: Plan
    samples: list
    scores: list
    timed_samples: int
    train_seconds: float
    eval_seconds: float
    seconds: float
    epochs: int
    rows: int

    @property
    def samples_per_second(self) -> float:
        return self.timed_samples / max(self.train_seconds, 1e-9)

    def to_json(self) -> dict:
        d = asdict(self)
        d["plan"] = self.plan.to_json()
        d["samples_per_second"] = self.samples_per_second
        return d


@dataclass
class Prediction:
    """A plan's predicted run: ``efficiency`` (samples the default needs for the probe's
    score, over the probe's), ``epochs`` planned, ``seconds`` from the start of planning to the
    default plan's final score (probes included)."""
    plan: Plan
    efficiency: float
    epochs: int
    seconds: float
    samples_per_second: float

    def to_json(self, base: Plan | None = None) -> dict:
        return {"plan": self.plan.describe(base), "settings": self.plan.to_json(),
                "efficiency": self.efficiency, "epochs": self.epochs, "seconds": self.seconds,
                "samples_per_second": self.samples_per_second}


def efficiency(ref: Probe, probe: Probe) -> float:
    """Samples the reference (default) plan needs to reach ``probe``'s last score, over the
    samples ``probe`` took. The reference's curve is ``a + b·ln(samples)`` fitted through its
    scores from a quarter of its probe on (the stretch every probe covers; its first points
    are too early to say where it is heading). 1 where the reference did not improve there."""
    s = np.log(np.asarray(ref.samples, np.float64))
    y = np.asarray(ref.scores, np.float64)
    late = s >= s[-1] - math.log(PROBE_POINTS) - 1e-9
    s, y = s[late], y[late]
    if s.size < 2 or np.ptp(s) == 0:
        return 1.0
    b, a = np.polyfit(s, y, 1)
    if not b > 0:
        return 1.0
    needed = math.exp((probe.scores[-1] - a) / b)
    return float(np.clip(needed / probe.samples[-1], 1 / MAX_EFFICIENCY, MAX_EFFICIENCY))


def predict(ref: Probe, probe: Probe, spent: float) -> Prediction:
    """``probe``'s plan run on from its probe to the default plan's final score (the end of
    its planned epochs), ``spent`` seconds of probing before it."""
    kappa = 1.0 if probe is ref else efficiency(ref, probe)
    need = ref.epochs * ref.rows / kappa
    epochs = max(1, math.ceil(need / probe.rows - 1e-9))
    rate = probe.samples_per_second
    seconds = spent + max(0.0, need - probe.samples[-1]) / rate + epochs * probe.eval_seconds
    return Prediction(probe.plan, kappa, epochs, seconds, rate)


def choose(predictions: list, margin: float = MARGIN) -> tuple[Prediction, str]:
    """The prediction to follow (the first is the default's) and why."""
    default = predictions[0]
    best = min(predictions, key=lambda p: p.seconds)
    if best is default or best.seconds > (1 - margin) * default.seconds:
        why = ("no plan is predicted to reach the default's final score more than "
               f"{margin:.0%} sooner than the default ({default.seconds:.0f} s)")
        return default, why
    return best, (f"predicted to reach the default's final score in {best.seconds:.0f} s, "
                  f"against the default's {default.seconds:.0f} s ({best.efficiency:.2f}x its "
                  f"progress a sample at {best.samples_per_second / default.samples_per_second:.2f}x "
                  "its samples a second)")


def candidates(resolved: dict, default: Plan | None = None) -> list:
    """The plans probed on one process, the default first: the rule's learning rate halved
    and doubled, and the batch doubled with the rate scaled by √2 (the same noise a sample)."""
    d = default or Plan.default()
    return [d,
            d.scaled(resolved, lr=2.0),
            d.scaled(resolved, lr=0.5),
            d.scaled(resolved, batch=2.0, lr=math.sqrt(2.0))]


@dataclass
class _Run:
    """The state a probe leaves: the model, trained on the first samples of its first epoch."""
    model: object
    probe: Probe


class Planner:
    """Probe candidate plans, choose the one predicted to reach the default's final validation
    score soonest, and train it (``slide train --plan auto``).

    ``planner.fit(model, X, Y, **train_kw)`` trains ``model`` (a :class:`SlideClassifier`,
    its settings the default plan's) by the chosen plan; ``model.plan_`` then holds the
    candidates' probes and predictions, the choice and the reason, and the re-checks.
    ``prepare`` + ``model.train(..., continue_training=True, until_epoch=...)`` split it for
    callers that run the epochs themselves (:func:`slide.train.run_training`).
    """

    def __init__(self, share: float = PROBE_SHARE, margin: float = MARGIN,
                 recheck: float = RECHECK, plans=None, log=print):
        if not 0 < share < 1:
            raise ValueError(f"share must be in (0, 1), got {share!r}")
        self.share, self.margin, self.recheck = float(share), float(margin), float(recheck)
        self.plans, self.log = plans, log

    # -- the whole run -----------------------------------------------------------------------
    def fit(self, model, X, Y, *, on_epoch=None, **train_kw):
        """Plan and train ``model`` on ``X``, ``Y`` (``train_kw``: those of
        :meth:`SlideClassifier.train` but ``continue_training`` and ``until_epoch``)."""
        report = self.prepare(model, X, Y)
        model.train(X, Y, continue_training=report["chosen"]["epochs"] is not None,
                    until_epoch=report["chosen"]["epochs"], on_epoch=self.watch(report, on_epoch),
                    **train_kw)
        model.record_.plan = report
        return model

    def prepare(self, model, X, Y) -> dict:
        """Probe, choose, and leave ``model`` as the chosen plan's probe left it (or untouched
        where planning does not apply: ``report["chosen"]["epochs"]`` is then None and the
        model trains as usual). Returns the report."""
        t0 = time.perf_counter()
        s = model.fit_settings()
        if not s["early_stopping"]:
            raise ValueError("planning compares plans on the held-out slice: it needs "
                             "early_stopping (the default)")
        X, Y = model.check_data(X, Y, where="fit", fitted=False)
        tr, va = validation_split(X.shape[0], s["validation_fraction"], s["seed"])
        Xt, Yt, Xv, Yv = X[tr], Y[tr], X[va], Y[va]
        first = clone(model)
        first.initialize(Xt, Yt)
        resolved = first.resolved_
        skip = self._not_planned(first, Xt)
        self.started_ = t0  # the clock the re-checks read
        report = {"checks": [], "candidates": [], "probes": []}
        if skip:
            self.log(f"plan: the default ({skip})")
            report.update(chosen={"plan": "default", "epochs": None, "seconds": None},
                          reason=skip)
            return report
        n_val = min(Xv.shape[0], PROBE_VALIDATION_ROWS)
        val = shuffle_rows(Xv, Yv, seed=s["seed"], n=n_val)
        scale = min(Xv.shape[0], MAX_VALIDATION_ROWS) / n_val
        plans = self.plans or candidates(resolved, Plan.of(model.get_params()))
        probes, runs, samples = [], {}, None
        for i, plan in enumerate(plans):
            m = first if i == 0 else _with_plan(clone(model), plan)
            run = self._probe(m, plan, Xt, Yt, val, scale, samples, s["seed"],
                              budget=None if i else (self.share, len(plans)))
            samples = run.probe.samples[-1]  # the default's probe sizes every other: equal samples
            probes.append(run.probe)
            pred = predict(probes[0], run.probe, 0.0)
            self.log(f"plan probe {i + 1}/{len(plans)}: {plan.describe(plans[0])}: "
                     f"{run.probe.samples_per_second:,.0f} samples/s, score "
                     f"{run.probe.scores[-1]:.4f} after {samples:,} samples, "
                     f"efficiency {pred.efficiency:.2f}, {run.probe.seconds:.1f} s")
            # models held: the default's and the best other probe's (each is a whole model)
            if i == 0 or "other" not in runs or pred.seconds < runs["other"][1].seconds:
                runs["default" if i == 0 else "other"] = (run, pred)
        spent = time.perf_counter() - t0
        predictions = [predict(probes[0], p, spent) for p in probes]
        chosen, why = choose(predictions, self.margin)
        base = plans[0]
        report.update(candidates=[p.to_json(base) for p in predictions],
                      probes=[p.to_json() for p in probes], probe_seconds=spent,
                      probe_samples=samples,
                      chosen=chosen.to_json(base), reason=why)
        self.log(_table(predictions, chosen, base))
        self.log(f"plan: {chosen.plan.describe(base)}: {why}")
        run = runs["default" if chosen is predictions[0] else "other"][0]
        assert run.probe.plan == chosen.plan
        _with_plan(run.model, chosen.plan.but(epochs=chosen.epochs))
        model.restore_fitted(run.model.fitted_state())
        model.record_.plan = report
        return report

    @staticmethod
    def _not_planned(model, X) -> str:
        """Why planning does not apply to this run ('' where it does): the run chooses
        settings on the held-out slice or trains again on every row (both restart training,
        which a probe cannot continue; such runs are short)."""
        if model.resolved_["refit"]:
            return "the run trains again on every row once early stopping has chosen its epochs"
        if offered(model.config_, model.resolved_, X.shape[1], model.n_outputs_fitted_,
                   model.n_train_):
            return "the run chooses settings on the held-out slice"
        return ""

    def _probe(self, model, plan, X, Y, val, scale, samples, seed, budget=None) -> _Run:
        """Train ``model`` (initialised here unless it is) on the first samples of its first
        epoch, scoring ``val`` along the way. ``samples``: how many (the default's probe,
        ``budget`` = (share, plans), sizes itself from its measured rate instead)."""
        t0 = time.perf_counter()
        if "state_" not in vars(model):
            model.initialize(X, Y)
        Yr = model.targets(X, Y)
        Xp = model.preprocess(X)
        n = Xp.shape[0]
        batch = model.batch_size_
        order = epoch_order(seed, 0, n)
        metric = EarlyStopping(metric=model.validation_metric())
        rate = epoch_learning_rate(model.resolved_["lr"], 0, model.resolved_["epochs"])
        step = MIN_PROBE_BATCHES * batch if samples is None else \
            max(batch, math.ceil(samples / PROBE_POINTS / batch) * batch)
        done, seen, scores = 0, [], []
        timed = [0, 0.0]
        eval_seconds = 0.0
        model.state_.learning_rate = rate
        model.state_.begin_epoch()
        while True:
            stop = min(n, done + step if samples is None else min(samples, done + step))
            t1 = time.perf_counter()
            model.state_.train_rows(Xp, Yr, order[done:stop])
            if seen:  # the first stretch may compile kernels
                timed[0] += stop - done
                timed[1] += time.perf_counter() - t1
            done = stop
            t1 = time.perf_counter()
            scores.append(metric.score({f"val_{k}": v for k, v in model.evaluate(
                *val, loss=metric.metric == "loss").items()}))
            eval_seconds = time.perf_counter() - t1
            seen.append(done)
            if samples is None and len(seen) == 2:
                # the default plan's predicted run at this rate sizes the probes
                per_second = timed[0] / max(timed[1], 1e-9)
                total = model.resolved_["epochs"] * (n / per_second + eval_seconds * scale)
                share, plans = budget
                each = share * total / plans
                samples = int(np.clip(each * per_second * (1 - eval_seconds * PROBE_POINTS / each),
                                      2 * step, n))
                step = max(batch, math.ceil(samples / PROBE_POINTS / batch) * batch)
            if done >= n or (samples is not None and done >= samples):
                break
        model.record_.epoch_position = done
        if not timed[0]:  # a probe of one stretch: its time, compile and all
            timed = [done, time.perf_counter() - t0 - eval_seconds]
        probe = Probe(plan, seen, scores, int(timed[0]), float(timed[1]),
                      eval_seconds * scale, time.perf_counter() - t0,
                      int(model.resolved_["epochs"]), int(n))
        return _Run(model, probe)

    # -- the re-check ------------------------------------------------------------------------
    def watch(self, report: dict, on_epoch=None):
        """An ``on_epoch`` callback that compares each epoch's end with the prediction and
        re-plans the remaining time where it is off by more than ``recheck``."""
        pred = report.get("chosen") or {}
        if pred.get("epochs") is None:
            return on_epoch
        rate = pred["samples_per_second"]
        eval_s = next(p["eval_seconds"] for p in report["probes"]
                      if Plan.from_json(p["plan"]) == Plan.from_json(pred["settings"]))
        rows = report["probes"][0]["rows"]

        outside = [0.0]  # seconds the caller's on_epoch took: not training

        def check(model, entry):
            now = time.perf_counter() - self.started_ - outside[0]
            done = entry["epoch"] * rows - report["probe_samples"]
            expected = report["probe_seconds"] + done / rate + entry["epoch"] * eval_s
            check = {"epoch": entry["epoch"], "elapsed": now, "predicted": expected}
            off = now / max(expected, 1e-9) - 1
            if abs(off) > self.recheck:
                # re-plan: the remaining epochs at the rate and evaluation cost measured so far
                left = pred["epochs"] - entry["epoch"]
                per_epoch = (now - report["probe_seconds"]) / entry["epoch"]
                check["replanned_seconds"] = now + left * per_epoch
                self.log(f"plan: epoch {entry['epoch']} ended at {now:.0f} s, predicted "
                         f"{expected:.0f} s ({off:+.0%}); the run now ends at about "
                         f"{check['replanned_seconds']:.0f} s")
            report["checks"].append(check)
            entry["plan_elapsed"] = now
            if on_epoch is not None:
                t0 = time.perf_counter()
                on_epoch(model, entry)
                outside[0] += time.perf_counter() - t0
        return check


def _with_plan(model, plan: Plan):
    """``model`` with ``plan``'s settings (those it leaves to the rule kept as they are)."""
    return model.set_params(**{k: v for k, v in plan.params().items() if v is not None})


def _table(predictions, chosen, base) -> str:
    rows = [f"{'plan':<32} {'samples/s':>10} {'efficiency':>10} {'epochs':>6} {'seconds':>8}"]
    for p in predictions:
        mark = " <" if p is chosen else ""
        rows.append(f"{p.plan.describe(base):<32} {p.samples_per_second:>10,.0f} {p.efficiency:>10.2f} "
                    f"{p.epochs:>6} {p.seconds:>8.0f}{mark}")
    return "\n".join(rows)
