"""Shared helpers for the benchmarks: datasets, machine description, JSON output."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import queue
import time

import numba

from slide.synthetic import make_dataset


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "numba_threads": numba.config.NUMBA_NUM_THREADS, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}


def dataset(preset: str, n_train: int, n_test: int, seed: int = 0):
    """The synthetic preset, with a fixed shuffled test sample (the generator's test rows are
    already in random order)."""
    return make_dataset(preset, n_train=n_train, n_test=n_test, seed=seed)


def write_json(path, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, default=float)
    os.replace(tmp, path)


def run_isolated(target, *args):
    """``target(*args, queue)`` in a fresh process (its own peak RSS, no shared numba state);
    returns what it put on the queue, or raises if the process died without an answer."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, q))
    proc.start()
    while True:
        try:
            result = q.get(timeout=5)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"benchmark process for {args[0]!r} exited with code {proc.exitcode}") from None
    proc.join()
    return result
