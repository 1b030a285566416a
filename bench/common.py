"""Shared helpers for the benchmarks: datasets, machine description, JSON output, ``slide
train`` in a process of its own, the kernel suites' output layer."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import queue
import subprocess
import sys
import tempfile
import time

import numba
import numpy as np

from slide.synthetic import make_dataset


def machine() -> dict:
    """The machine, and the instruction set the kernels were compiled for: a run with
    ``NUMBA_CPU_NAME=haswell`` (and AVX-512 features off in ``NUMBA_CPU_FEATURES``,
    ``OPENBLAS_CORETYPE=Haswell``, ``FAISS_OPT_LEVEL=avx2``) stands for a CPU without AVX-512."""
    from slide.screen import has_int8_dot
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "numba_threads": numba.config.NUMBA_NUM_THREADS, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"), "numba_cpu": numba.config.CPU_NAME or "host",
            "int8_dot": has_int8_dot(),
            **{v.lower(): os.environ[v] for v in ("OPENBLAS_CORETYPE", "FAISS_OPT_LEVEL")
               if v in os.environ}}


def dataset(preset: str, n_train: int, n_test: int, seed: int = 0):
    """The synthetic preset, with a fixed shuffled test sample (the generator's test rows are
    already in random order)."""
    return make_dataset(preset, n_train=n_train, n_test=n_test, seed=seed)


def mpiexec(ranks: int) -> list:
    """The command line that starts ``ranks`` ranks: the mpiexec beside this Python (the mpich
    wheel's), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return [beside if os.path.exists(beside) else "mpiexec", "-n", str(ranks)]


def write_json(path, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, default=float)
    os.replace(tmp, path)


def slide_train(train: str, *args: str, launcher=()) -> dict:
    """``slide train TRAIN ARGS`` in a process of its own (after ``launcher``, e.g.
    :func:`mpiexec`), without progress bars; returns its metrics record, with the last 40
    lines it printed under ``"log"``."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.json")
        cmd = [*launcher, sys.executable, "-m", "slide.cli", "train", train, "--no-progress",
               "--metrics-json", metrics, *args]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        with open(metrics) as fh:
            doc = json.load(fh)
    doc["log"] = out.stdout.splitlines()[-40:]
    return doc


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


def output_layer(n_labels: int, hidden: int, batch: int, seed: int = 0) -> dict:
    """An output layer for the kernel suites, held as the row block it trains in: ``block``
    float32 [n_labels, 3·hidden] (small random weights, then both Adam moments at zero), its
    biases ``b`` and their moments ``bM``, ``bV``, a batch's last hidden layer ``h`` float32
    [batch, hidden] (ReLU-like, non-negative), every row's mark ``owners`` UNTOUCHED and slot
    ``slots``, and the generator ``rng`` that drew them, for the rounds' own draws."""
    rng = np.random.default_rng(seed)
    block = np.zeros((n_labels, 3 * hidden), np.float32)  # weights, then both moments, per row
    block[:, :hidden] = rng.standard_normal((n_labels, hidden), np.float32) * 0.01
    return {"block": block, "b": np.zeros(n_labels, np.float32),
            "bM": np.zeros(n_labels, np.float32), "bV": np.zeros(n_labels, np.float32),
            "h": np.abs(rng.standard_normal((batch, hidden), np.float32)),
            "owners": np.zeros(n_labels, np.uint8), "slots": np.zeros(n_labels, np.int32),
            "rng": rng}
