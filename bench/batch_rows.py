"""A batch's rows taken between training steps: into new scipy matrices, or into the last batch's.

    python -m bench.batch_rows --n-train 100000 --warm-steps 300 --steps 300

The training loop takes each batch's rows of X and Y (``slide.data.take_rows``) between two
training steps, which leave the caches (Python's among them) cold. Both ways are timed at every
batch, in alternating order, and the step then trains on the batch, so that each call sees the
cache a real loop leaves. Medians over the batches; the warm-up batches (compile, first
rehashes) are not timed.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import dataset, machine, write_json


def main(argv=None):
    from slide.runtime import engine_threads
    from slide.data import take_rows
    from slide.estimator import SlideClassifier
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="amazon-670k")
    p.add_argument("--n-train", type=int, default=100000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warm-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    X, Y, _, _ = dataset(args.preset, args.n_train, 10)
    model = SlideClassifier(threads=args.threads, early_stopping=False, seed=0)
    model.initialize(X, Y)
    Y = model.targets(X, Y)  # over the output rows
    B = model.batch_size_
    if (args.warm_steps + args.steps) * B > X.shape[0]:
        p.error(f"--warm-steps + --steps batches need {(args.warm_steps + args.steps) * B} rows")
    order = np.random.default_rng(0).permutation(X.shape[0])
    Xp = model.preprocess(X)
    model.state_.train_rows(Xp, Y, order[:args.warm_steps * B])
    times = {"new": [], "reused": []}
    Xb = Yb = None
    with engine_threads(args.threads):
        for k in range(args.warm_steps, args.warm_steps + args.steps):
            idx = np.sort(order[k * B:(k + 1) * B])
            for way in (("new", "reused") if k % 2 else ("reused", "new")):
                t0 = time.perf_counter()
                if way == "new":
                    take_rows(Xp, idx), take_rows(Y, idx)
                else:
                    Xb, Yb = take_rows(Xp, idx, out=Xb), take_rows(Y, idx, out=Yb)
                times[way].append(time.perf_counter() - t0)
            model.state_.train_step(Xb, Yb)
    med = {way: float(np.median(t)) * 1e6 for way, t in times.items()}
    print(f"X and Y rows of a batch of {B}, between training steps (median of {args.steps}): "
          f"{med['new']:.0f} us into new matrices, {med['reused']:.0f} us into the last batch's "
          f"({med['new'] / med['reused']:.2f}x)")
    if args.out:
        write_json(args.out, {"machine": machine(), "args": vars(args), "batch_size": B,
                              "median_us_a_batch": med})


if __name__ == "__main__":
    main()
