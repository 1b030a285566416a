"""Two versions of the engine trained side by side in one process, batch by batch.

    python -m bench.side_by_side --rev 3ee0bfb --n-train 100000 --warm-steps 480 --steps 300

On a shared machine whose speed drifts by a quarter within an hour, two processes run one after
the other measure the hour as much as the code. Here the code at git revision ``--rev`` is
loaded beside the working tree's (its packages exported with ``git archive`` and renamed
``lsh_rev`` / ``slide_rev``), a model of each is built from the same data and seed, and the two
train the same batches in alternation (which goes first swaps every batch), each with its own
weights, moments and tables. Both take ``--warm-steps`` batches first (compile, the first
rehashes); then ``--steps`` batches are timed. Reported per version: the mean step over the
timed batches (the rehash batches included), the median step of those without a rehash, the
mean rehash batch and the median of each phase, and the ratios of the two. With ``--rehashes``
both then rehash their tables whole (``begin_epoch``) that many times, in alternation.

Writes the figures as JSON to the path given with ``--out``.
"""
from __future__ import annotations

import argparse
import importlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import dataset, machine, write_json

PACKAGES = ("lsh", "slide")
#: an import line naming one of the packages, as the first word after from/import
_IMPORT = re.compile(r"^(\s*)(from|import)\s+(%s)\b" % "|".join(PACKAGES), re.MULTILINE)


def rename_imports(source: str, suffix: str) -> str:
    """``source`` with every import of the packages (``from lsh.x import y``, ``import slide``)
    pointing at the renamed ones (``lsh_rev.x``, ``slide_rev``)."""
    return _IMPORT.sub(lambda m: f"{m.group(1)}{m.group(2)} {m.group(3)}{suffix}", source)


def export_revision(repo: Path, rev: str, dest: Path, suffix: str = "_rev") -> None:
    """The packages' Python files at git revision ``rev`` of ``repo`` written under ``dest``
    with ``suffix`` on their names and imports (written beside, then moved into place)."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, *PACKAGES],
                             capture_output=True, check=True).stdout
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                package, _, rest = member.name.partition("/")
                out = staging / f"{package}{suffix}" / rest
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(rename_imports(tar.extractfile(member).read().decode(), suffix))
    staging.rename(dest)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", required=True, help="git revision to compare the working tree with")
    p.add_argument("--preset", default="amazon-670k")
    p.add_argument("--n-train", type=int, default=100000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warm-steps", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rehashes", type=int, default=0,
                   help="then time this many whole rehashes of each version's tables with its "
                        "trained weights (begin_epoch), alternating")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from slide.runtime import engine_threads
    from slide.estimator import SlideClassifier
    repo = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", args.rev], capture_output=True,
                         text=True, check=True).stdout.strip()
    # kept across runs, so that numba's cache beside it spares the revision's compile
    where = Path(tempfile.gettempdir()) / f"slide-side-by-side-{sha[:12]}"
    if not where.is_dir():
        export_revision(repo, sha, where)
    described = subprocess.run(["git", "-C", str(repo), "log", "--oneline", "-1", sha],
                               capture_output=True, text=True, check=True).stdout.strip()
    sys.path.insert(0, str(where))
    try:
        previous = importlib.import_module("slide_rev").SlideClassifier
    finally:
        sys.path.remove(str(where))
    X, Y, _, _ = dataset(args.preset, args.n_train, 10)
    models, rows_of, targets_of = {}, {}, {}
    for name, cls in ((args.rev, previous), ("working tree", SlideClassifier)):
        m = cls(threads=args.threads, early_stopping=False, seed=0)
        m.initialize(X, Y)
        models[name], rows_of[name] = m, m.preprocess(X)
        # over the output rows where the code keeps rows for the labels with positives only
        targets_of[name] = m.targets(X, Y) if hasattr(m, "targets") else Y
    B = models["working tree"].batch_size_
    need = (args.warm_steps + args.steps) * B
    if need > X.shape[0]:
        p.error(f"--warm-steps + --steps batches need {need} rows, --n-train has {X.shape[0]}")
    order = np.random.default_rng(0).permutation(X.shape[0])
    # the training step of either shape of the code: the model's own (before the training
    # state was split from the estimator), or its training state's
    steppers = {name: getattr(m, "state_", m) for name, m in models.items()}
    timings = {name: "timings" if hasattr(m, "state_") else "timings_" for name, m in models.items()}
    for name, m in steppers.items():
        m.train_rows(rows_of[name], targets_of[name], order[:args.warm_steps * B])
    steps = {n: [] for n in models}
    rehash = {n: [] for n in models}
    phases = {n: {} for n in models}
    with engine_threads(args.threads):
        for k in range(args.warm_steps, args.warm_steps + args.steps):
            batch = order[k * B:(k + 1) * B]
            for name in (list(models) if k % 2 else list(models)[::-1]):
                m = steppers[name]
                Xb = rows_of[name][batch]
                setattr(m, timings[name], {})
                t0 = time.perf_counter()
                m.train_step(Xb, targets_of[name][batch])
                dt = time.perf_counter() - t0
                steps[name].append(dt)
                spent = getattr(m, timings[name])
                rehash[name].append(spent.get("rehash", 0.0) > 0.01)
                for ph, sec in spent.items():
                    phases[name].setdefault(ph, []).append(sec)
        rehashes = {n: [] for n in models}
        for k in range(args.rehashes):
            for name in (list(models) if k % 2 else list(models)[::-1]):
                t0 = time.perf_counter()
                steppers[name].begin_epoch()
                rehashes[name].append(time.perf_counter() - t0)
    per = {}
    for name in models:
        s, r = np.array(steps[name]), np.array(rehash[name])
        per[name] = {"mean_step_us_per_sample": s.mean() / B * 1e6,
                     "samples_per_second": B / s.mean(),
                     "median_step_without_rehash_us_per_sample": float(np.median(s[~r])) / B * 1e6,
                     "rehash_batches": int(r.sum()),
                     "mean_rehash_batch_ms": float(s[r].mean() * 1e3) if r.any() else None,
                     "phase_median_us_per_sample": {ph: float(np.median(v)) / B * 1e6
                                                    for ph, v in phases[name].items()},
                     "median_rehash_ms": (float(np.median(rehashes[name])) * 1e3
                                          if args.rehashes else None)}
        q = per[name]
        each = "" if q["mean_rehash_batch_ms"] is None else f", {q['mean_rehash_batch_ms']:.0f} ms each"
        print(f"{name:14s} {q['samples_per_second']:7.0f} samples/s (mean step "
              f"{q['mean_step_us_per_sample']:.1f} us a sample); without a rehash "
              f"{q['median_step_without_rehash_us_per_sample']:.1f}; {q['rehash_batches']} rehash "
              f"batches{each}")
        print(" " * 15 + "  ".join(f"{ph} {v:.1f}" for ph, v in q["phase_median_us_per_sample"].items()))
        if args.rehashes:
            print(" " * 15 + f"whole rehash (median of {args.rehashes}): {q['median_rehash_ms']:.1f} ms")
    old, new = (np.array(steps[n]) for n in models)
    ratios = {"mean_step": float(old.mean() / new.mean()),
              "median_per_batch": float(np.median(old / new))}
    if args.rehashes:
        old_r, new_r = (np.array(rehashes[n]) for n in models)
        ratios["median_rehash"] = float(np.median(old_r) / np.median(new_r))
    print(f"working tree against {described}: {ratios['mean_step']:.3f}x the samples/s (mean "
          f"step), median of the per-batch ratios {ratios['median_per_batch']:.3f}"
          + (f"; whole rehash {ratios['median_rehash']:.3f}x" if args.rehashes else ""))
    if args.out:
        write_json(args.out, {"machine": machine(), "args": vars(args), "revision": described,
                              "batch_size": B, "versions": per, "ratios": ratios})


if __name__ == "__main__":
    main()
