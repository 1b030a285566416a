"""Where a training step's time goes, call by call.

    python -m bench.step_kernels --threads 2 --n-train 100000 --warm-steps 1200 --steps 240

The engine's profile (``timings_``) splits a step into phases, and a phase may hold several
calls: ``select+output`` is the LSH query of every sample (``select_active``), the marking of the
rows the batch touches (``mark_rows``, on one thread) and the output layer's step
(``output_step``). Here, for the timed batches only, every public kernel of :mod:`slide.kernels`,
the sampling helpers the step calls through ``slide.step``'s names and the output tables'
``hash_dense``, ``rehash`` and ``rebuild`` are wrapped in a timer: per call, its share of the
step in µs a sample, its calls a batch and its median call, and what is left between the calls
(Python, and numpy between the kernels). A call made inside another timed call (the hashing of
a rehash) counts in the outer one. On several cores this shows what one thread runs alone and
what each call costs whatever its work, which the phases cannot.

The timer adds 0.3 µs a call with warm caches (a wrapped no-op against a plain one), more
between the step's kernels, which leave the caches cold; about 21 calls a batch: well under a
µs a sample at a batch of 128. Compile and the first rehashes are in the ``--warm-steps``
batches before the window. Writes the figures as JSON to the path given with ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import defaultdict

import numpy as np

from bench.common import machine, write_json
from bench.roofline import warmed_model

#: the functions outside :mod:`slide.kernels` that the training step calls through
#: ``slide.step``'s module names: the shared negatives' draw and the threads' chunks
_STEP_CALLS = ("shared_negatives", "draw_key", "thread_chunks")


class CallTimer:
    """Wall seconds of every call of the functions it wraps (:meth:`wrap`), the outermost call
    only where one wrapped function runs inside another."""

    def __init__(self):
        self.seconds = defaultdict(list)
        self._depth = 0

    def timed(self, name, fn):
        def call(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name].append(time.perf_counter() - t0)
                self._depth -= 1
        return call

    @contextlib.contextmanager
    def wrap(self, targets):
        """Inside the block, each ``(owner, attribute, name)`` of ``targets`` is timed as
        ``name``; on leaving, the attributes are as they were (a method wrapped on an instance
        is its class's again)."""
        saved = [(owner, attr, getattr(owner, attr), attr in vars(owner))
                 for owner, attr, _ in targets]
        try:
            for (owner, attr, name), (_, _, fn, _) in zip(targets, saved):
                setattr(owner, attr, self.timed(name, fn))
            yield self
        finally:
            for owner, attr, fn, own in saved:
                if own:
                    setattr(owner, attr, fn)
                else:
                    delattr(owner, attr)


def step_targets(model) -> list:
    """``(owner, attribute, name)`` of every call of a training step to time: the kernels,
    the sampling helpers and the output layer's source of hard negatives (its lookups and upkeep)."""
    import slide.kernels as kernels
    import slide.step as step_module
    # the module's own public kernels that have run (numba's dispatchers with a compiled
    # signature): a kernel compiled inside the window would find a wrapper where it looks up
    # the kernels it calls
    targets = [(kernels, name, name) for name, fn in sorted(vars(kernels).items())
               if not name.startswith("_") and getattr(fn, "signatures", None)
               and fn.py_func.__module__ == kernels.__name__]
    targets += [(step_module, name, name) for name in _STEP_CALLS]
    if model.tables_ is not None:  # the tables' or the label clusters' lookup and upkeep
        tables = model.tables_
        hashing = getattr(tables, "family", None)  # the clusters have no hash family
        targets += [(hashing, "hash_dense", "hash_dense") if hashing is not None else
                    (tables, "lookup", "lookup"), (tables, "rehash", "rehash"),
                    (tables, "rebuild", "rebuild")]
    return targets


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="amazon-670k")
    p.add_argument("--n-train", type=int, default=100000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warm-steps", type=int, default=1200,
                   help="batches before the timed ones (compile, the first rehashes)")
    p.add_argument("--steps", type=int, default=240, help="timed batches")
    p.add_argument("--config", default="{}", help="JSON overrides of the engine's settings")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    try:
        _, Y, Xp, model, timed = warmed_model(args.preset, args.n_train, args.threads,
                                              json.loads(args.config), args.warm_steps,
                                              args.steps)
    except ValueError as e:
        p.error(str(e))
    B = model.batch_size_
    model.state_.timings = {}
    timer = CallTimer()
    with timer.wrap(step_targets(model)):
        t0 = time.perf_counter()
        model.state_.train_rows(Xp, Y, timed)
        seconds = time.perf_counter() - t0
    n = timed.size
    calls = {name: {"calls_per_batch": len(s) / args.steps,
                    "us_per_sample": 1e6 * sum(s) / n,
                    "median_call_us": 1e6 * float(np.median(s))}
             for name, s in timer.seconds.items()}
    in_calls = sum(sum(s) for s in timer.seconds.values())
    phases = {k: 1e6 * v / n for k, v in model.timings_.items()}
    print(f"{args.preset}, {args.n_train} rows, batch {B}, {args.threads} threads; batches "
          f"{args.warm_steps} to {args.warm_steps + args.steps} timed: "
          f"{n / seconds:.0f} samples/s, {1e6 * seconds / n:.1f} us a sample")
    print(f"{'call':18s} {'us/sample':>10s} {'calls/batch':>12s} {'median call us':>15s}")
    for name, c in sorted(calls.items(), key=lambda kv: -kv[1]["us_per_sample"]):
        print(f"{name:18s} {c['us_per_sample']:10.1f} {c['calls_per_batch']:12.1f} "
              f"{c['median_call_us']:15.1f}")
    outside = 1e6 * (seconds - in_calls) / n
    print(f"{'(between calls)':18s} {outside:10.1f}")
    print("phases (us a sample): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    if args.out:
        write_json(args.out, {"machine": machine(), "args": vars(args),
                              "resolved": model.resolved_,
                              "samples_per_second": n / seconds, "calls": calls,
                              "between_calls_us_per_sample": outside,
                              "phases_us_per_sample": phases})


if __name__ == "__main__":
    main()
