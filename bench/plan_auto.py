"""``slide train --plan auto`` against the default plan, side by side in one run.

    python -m bench.plan_auto --train ../shared/data/git_openstack/train.txt --out bench/results/plan_auto_git
    python -m bench.plan_auto --train /tmp/amz_train.txt --out bench/results/plan_auto_amazon

Each plan runs as its own ``slide train`` process (the default first, then ``--plan auto``), on
the same training file and cores, no test file (its scoring is not training time). An epoch of
the default runs first, unrecorded, so that no run pays numba's compiling. Each run's clock is
its own, from the start of training (initialisation and, for ``--plan auto``, the probes
included). ``--busy K`` keeps K other processes spinning on the machine through the runs (a
machine shared with other work). From their metrics records: the default's final validation
score (the score early stopping kept) and its training seconds; the seconds ``--plan auto``
took to first reach that score (None where it never did) and to its end; the planner's
predicted seconds to the score against the measured, and its candidates' predictions. Writes
``OUT.json`` and ``OUT.md``.

``--splits`` runs, instead of ``--plan auto``, the default against rank splits of the host's
cores (:func:`split_plans`: 2 ranks of half the threads averaging every 64 steps, ``local`` and
``delayed``, and 4 ranks of a quarter, ``local``), each under ``mpiexec``, and reads each at the
seconds to the default's final score (where it gets there) and its own best.

``--repeats N`` runs the pair N times in turn (default, auto, default, ...): two runs of one
plan differ by Hogwild's races and the early-stopping decisions they move, so one default
run's final score is a noisy target; the record adds each run's best score, the seconds to it
and the medians per plan.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np

from bench.common import machine, mpiexec, slide_train, write_json
from slide.plan import Plan
from slide.loop import EarlyStopping


def _train(train: str, extra: list, threads: int | None) -> dict:
    return slide_train(train, *extra, *(["--threads", str(threads)] if threads else []))


def compare(default: dict, auto: dict) -> dict:
    """The figures of one side-by-side run from the two metrics records."""
    metric = _metric(default)
    target = default["stopping"]["best_score"]
    curve_default, curve_auto = _curve(default), _curve(auto)
    plan = auto.get("plan") or {}
    reached = next((t for _, t, s in curve_auto if s >= target - 1e-12), None)
    chosen = plan.get("chosen", {})
    return {
        "metric": f"val_{metric}", "target": target,
        "default_seconds": default["wall_seconds"],
        "default_seconds_to_target": next(t for _, t, s in curve_default if s >= target - 1e-12),
        "auto_seconds": auto["wall_seconds"], "auto_seconds_to_target": reached,
        "auto_best": max(s for _, _, s in curve_auto),
        "probe_seconds": plan.get("probe_seconds"), "chosen": chosen.get("plan"),
        "reason": plan.get("reason"), "predicted_seconds": chosen.get("seconds"),
        "prediction_error": (chosen["seconds"] / reached - 1) if reached and chosen.get("seconds")
        else None,
        "candidates": plan.get("candidates"), "plan": plan,
        "curve_default": curve_default, "curve_auto": curve_auto,
    }


def _metric(run: dict) -> str:
    """The validation metric early stopping judged the run by."""
    return "nDCG@5" if run["resolved"]["sampled"] else "loss"


def _curve(run: dict) -> list:
    """``(epoch, seconds on the run's clock, the score early stopping keeps)`` per epoch."""
    score, key = EarlyStopping(metric=_metric(run)).score, f"val_{_metric(run)}"
    # epochs without a validation score (a refit on every row) are not on the curve
    return [(e["epoch"], t, score(e)) for e, t in zip(run["epochs"], _clock(run)) if key in e]


def _clock(run: dict) -> list:
    """Seconds from the start of training to each epoch's end: the run's own clock
    (``elapsed``: initialisation and planning included); in records that predate it, the
    planner's (``plan_elapsed``) or the epochs' training and evaluation seconds summed."""
    out, total = [], 0.0
    for e in run["epochs"]:
        total += e["train_seconds"] + e.get("eval_seconds", 0.0)
        out.append(e.get("elapsed", e.get("plan_elapsed", total)))
    return out


def best_of(run: dict) -> dict:
    """A run's best validation score (the score early stopping keeps), the seconds (probes
    included) to the first epoch that reached it, its seconds to the end, and for a planned
    run the seconds the planner predicted."""
    curve = _curve(run)
    best = max(s for _, _, s in curve)
    out = {"best": best, "seconds_to_best": next(t for _, t, s in curve if s >= best),
           "seconds": run["wall_seconds"]}
    predicted = ((run.get("plan") or {}).get("chosen") or {}).get("seconds")
    if predicted is not None:  # the planner's: to the default's final score
        out["predicted"] = predicted
    return out


def repeated(defaults: list, autos: list) -> dict:
    """Each run's :func:`best_of`, and per plan the medians of the best scores and of the
    seconds to them."""
    out = {}
    for name, runs in (("default", defaults), ("auto", autos)):
        rows = [best_of(r) for r in runs]
        out[name] = {"runs": rows,
                     "median_best": float(np.median([r["best"] for r in rows])),
                     "median_seconds_to_best": float(np.median([r["seconds_to_best"]
                                                                for r in rows]))}
    return out


def split_plans(cores: int) -> list:
    """Rank splits of one host's ``cores``, each rank its share of the threads."""
    return [Plan(ranks=2, threads=max(1, cores // 2), mode="local", every=64),
            Plan(ranks=2, threads=max(1, cores // 2), mode="delayed", every=64, delay=8),
            Plan(ranks=4, threads=max(1, cores // 4), mode="local", every=64)]


def against(default: dict, runs: dict) -> list:
    """Each run of ``runs`` (plan description: metrics record), the default's first, read at
    its :func:`best_of` and the seconds to the default's final score (None: not reached)."""
    target = default["stopping"]["best_score"]
    out = []
    for plan, run in {"default": default, **runs}.items():
        reached = next((t for _, t, s in _curve(run) if s >= target - 1e-12), None)
        out.append({"plan": plan, "target": target, "seconds_to_target": reached,
                    **best_of(run)})
    return out


def _splits_markdown(r: dict) -> str:
    rows = [f"# The default against rank splits: {r['train']}", "",
            f"Machine: {r['machine']}. Command: `{r['command']}`.", "",
            f"Target: the default's final score, {r['splits'][0]['target']:.4f}.", "",
            "| plan | seconds to the target | best score | seconds to it | seconds to the end |",
            "|---|---|---|---|---|"]
    for x in r["splits"]:
        reached = x["seconds_to_target"]
        rows.append(f"| {x['plan']} | {f'{reached:.1f}' if reached else 'not reached'} | "
                    f"{x['best']:.4f} | {x['seconds_to_best']:.1f} | {x['seconds']:.1f} |")
    return "\n".join(rows) + "\n"


def _markdown(r: dict) -> str:
    f = r["figures"]
    rows = [f"# `--plan auto` against the default: {r['train']}", "",
            f"Machine: {r['machine']}, {r['busy']} other spinning processes. "
            f"Command: `{r['command']}`.", "",
            f"Target: the default's final {f['metric']}, {f['target']:.4f}.", "",
            "| | seconds to the target | seconds to the end | best score |",
            "|---|---|---|---|",
            f"| default | {f['default_seconds_to_target']:.1f} | {f['default_seconds']:.1f} | "
            f"{f['target']:.4f} |",
            f"| --plan auto (probes {f['probe_seconds'] or 0:.1f} s) | "
            + (f"{f['auto_seconds_to_target']:.1f}" if f["auto_seconds_to_target"] else "not reached")
            + f" | {f['auto_seconds']:.1f} | {f['auto_best']:.4f} |", "",
            f"Chosen: {f['chosen']} ({f['reason']}). Predicted seconds to the target: "
            + (f"{f['predicted_seconds']:.1f}" if f["predicted_seconds"] else "none")
            + (f", off the measured by {f['prediction_error']:+.0%}." if f["prediction_error"]
               is not None else "."), "",
            "| candidate | samples/s | epochs | predicted seconds |", "|---|---|---|---|"]
    for c in f["candidates"] or []:
        rows.append(f"| {c['plan']} | {c['samples_per_second']:,.0f} | {c['epochs']} | "
                    f"{c['seconds']:.1f} |")
    rep = r.get("repeated")
    if rep:
        rows += ["", f"All {len(rep['default']['runs'])} pairs, in the order they ran (the "
                 "first is the pair above):", "",
                 "| plan | best score | seconds to it | seconds to the end | predicted |",
                 "|---|---|---|---|---|"]
        for i in range(len(rep["default"]["runs"])):
            for name in ("default", "auto"):
                x = rep[name]["runs"][i]
                pred = f"{x['predicted']:.1f}" if "predicted" in x else ""
                rows.append(f"| {name} {i + 1} | {x['best']:.4f} | {x['seconds_to_best']:.1f} | "
                            f"{x['seconds']:.1f} | {pred} |")
        for name in ("default", "auto"):
            rows.append(f"| {name}, median | {rep[name]['median_best']:.4f} | "
                        f"{rep[name]['median_seconds_to_best']:.1f} | | |")
    return "\n".join(rows) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--busy", type=int, default=0, help="spinning processes beside the runs")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs, in turn")
    ap.add_argument("--splits", action="store_true",
                    help="the default against rank splits of the cores, not --plan auto")
    a = ap.parse_args(argv)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(a.busy)]
    defaults, autos = [], []
    command = "python -m bench.plan_auto " + " ".join(argv or sys.argv[1:])
    try:
        # an epoch of the default first, not recorded: the first process compiles the kernels
        # where numba's cache is cold, and that would count as the first run's training
        _train(a.train, ["--epochs", "1"], a.threads)
        if a.splits:
            return _run_splits(a, command)
        for _ in range(max(1, a.repeats)):
            defaults.append(_train(a.train, [], a.threads))
            autos.append(_train(a.train, ["--plan", "auto"], a.threads))
    finally:
        for p in spinners:
            p.kill()
    default, auto = defaults[0], autos[0]
    r = {"machine": machine(), "train": a.train, "busy": a.busy,
         "command": command,
         "figures": compare(default, auto), "default_log": default["log"], "auto_log": auto["log"]}
    if a.repeats > 1:
        r["repeated"] = repeated(defaults, autos)
    write_json(a.out + ".json", r)
    _write_markdown(a.out, r)


def _run_splits(a, command):
    cores = a.threads or os.cpu_count() or 1
    plans = split_plans(cores)
    # the ranks' own kernels (the averaging) compile once too, before any clock
    slide_train(a.train, "--epochs", "1", *plans[0].argv(), launcher=mpiexec(2))
    default = _train(a.train, [], cores)
    runs = {p.describe(): slide_train(a.train, *p.argv(), launcher=mpiexec(p.ranks))
            for p in plans}
    r = {"machine": machine(), "train": a.train, "command": command,
         "splits": against(default, runs),
         "logs": {name: run["log"] for name, run in {"default": default, **runs}.items()}}
    write_json(a.out + ".json", r)
    with open(a.out + ".md", "w") as fh:
        fh.write(_splits_markdown(r))
    print(_splits_markdown(r))


def _write_markdown(out, r):
    with open(out + ".md", "w") as fh:
        fh.write(_markdown(r))
    print(_markdown(r))


if __name__ == "__main__":
    main()
