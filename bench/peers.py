"""The linear XMC peers, XR-Linear (PECOS) and Parabel (omikuji), trained and applied by their
worker scripts in the peers environment.

libpecos pins older numpy and scipy than this project, so the peers live in a virtual
environment of their own (``python -m venv .peers && .peers/bin/pip install libpecos omikuji``)
and run as subprocesses: :func:`run` writes the rows for a worker (:mod:`bench.peer_io`), runs
it there and reads back its top-k, its training seconds and its peak memory.
"""
from __future__ import annotations

import os
import subprocess
import tempfile

import numpy as np

from bench.peer_io import save_problem

__all__ = ["WORKERS", "NAMES", "default_python", "run"]

#: each peer's worker script, beside this file
WORKERS = {"xr-linear": "xr_linear_worker.py", "parabel": "parabel_worker.py"}
NAMES = {"xr-linear": "XR-Linear", "parabel": "Parabel"}


def default_python() -> str | None:
    """The peers environment's interpreter: ``$SLIDE_PEERS_PYTHON``, else ``.peers/bin/python``
    where it exists, else None."""
    env = os.environ.get("SLIDE_PEERS_PYTHON")
    if env:
        return env
    local = os.path.join(".peers", "bin", "python")
    return local if os.path.exists(local) else None


def run(engine: str, X_train, Y_train, X_test, python: str, threads: int, k: int = 5) -> dict:
    """Train peer ``engine`` (a key of :data:`WORKERS`) on CSR ``X_train`` [n, d] / ``Y_train``
    [n, L] with its default settings and predict ``X_test``: ``{"top": int64 [m, k] label ids,
    -1 padded, "train_seconds", "predict_seconds", "peak_rss_mb"}`` (the worker process's peak).
    Raises RuntimeError with the end of the worker's output if it writes no answer."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), WORKERS[engine])
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
        save_problem(inp, X_train=X_train, Y_train=Y_train, X_test=X_test)
        # its output to a file, not a pipe: a peer's progress bars would fill a pipe that no one
        # reads while this process waits for the worker's resource usage
        with open(os.path.join(tmp, "log.txt"), "w+") as log:
            proc = subprocess.Popen([python, worker, inp, out, "--k", str(k), "--threads", str(threads)],
                                    stdout=log, stderr=subprocess.STDOUT)
            _, rusage = os.wait4(proc.pid, 0)[1:]
            log.seek(0)
            err = log.read()
        if not os.path.exists(out):
            raise RuntimeError(f"{NAMES[engine]} failed: {err[-2000:]}")
        z = np.load(out)
        return {"top": z["ids"], "train_seconds": float(z["train_seconds"]),
                "predict_seconds": float(z["predict_seconds"]), "peak_rss_mb": rusage.ru_maxrss / 1024}
