"""The linear XMC peers, XR-Linear (PECOS) and Parabel (omikuji), trained and applied by their
worker scripts in the peers environment.

libpecos pins older numpy and scipy than this project, so the peers live in a virtual
environment of their own (``python -m venv .peers && .peers/bin/pip install libpecos omikuji``)
and run as subprocesses: :func:`run` writes the rows for a worker (:mod:`bench.peer_io`; L2-
normalised, as both peers expect, by the engine's own :class:`slide.preprocess.Preprocessor`),
runs it there and reads back its top-k, its training seconds and its peak memory.
"""
from __future__ import annotations

import os
import subprocess
import tempfile

import numpy as np

from bench.peer_io import save_problem
from slide.data import write_xmc
from slide.preprocess import Preprocessor

__all__ = ["WORKERS", "NAMES", "FROM_FILE", "default_python", "prepare", "run"]

#: each peer's worker script, beside this file
WORKERS = {"xr-linear": "xr_linear_worker.py", "parabel": "parabel_worker.py"}
NAMES = {"xr-linear": "XR-Linear", "parabel": "Parabel"}
#: the peers that train from a file in the Extreme Classification Repository's format (omikuji)
FROM_FILE = {"parabel"}


def default_python() -> str | None:
    """The peers environment's interpreter: ``$SLIDE_PEERS_PYTHON``, else ``.peers/bin/python``
    where it exists, else None."""
    env = os.environ.get("SLIDE_PEERS_PYTHON")
    if env:
        return env
    local = os.path.join(".peers", "bin", "python")
    return local if os.path.exists(local) else None


def prepare(engine: str, X_train, Y_train, X_test, folder) -> list:
    """Write what worker ``engine`` reads into ``folder``: the rows, L2-normalised, as
    ``in.npz``, and for a peer of :data:`FROM_FILE` the training rows as ``train.txt``; returns
    the worker's input arguments (``in.npz``'s path first)."""
    pre = Preprocessor().fit(X_train)
    X_train, X_test = pre.transform(X_train), pre.transform(X_test)
    inp = os.path.join(folder, "in.npz")
    save_problem(inp, X_train=X_train, Y_train=Y_train, X_test=X_test)
    if engine not in FROM_FILE:
        return [inp]
    train = os.path.join(folder, "train.txt")
    write_xmc(train, X_train, Y_train)
    return [inp, "--train-file", train]


def run(engine: str, X_train, Y_train, X_test, python: str, threads: int, k: int = 5) -> dict:
    """Train peer ``engine`` (a key of :data:`WORKERS`) on CSR ``X_train`` [n, d] / ``Y_train``
    [n, L] with its default settings and predict ``X_test``: ``{"top": int64 [m, k] label ids,
    -1 padded, "train_seconds", "predict_seconds", "peak_rss_mb"}`` (the worker process's peak).
    Raises RuntimeError with the end of the worker's output if it writes no answer."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), WORKERS[engine])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.npz")
        inputs = prepare(engine, X_train, Y_train, X_test, tmp)
        # its output to a file, not a pipe: a peer's progress bars would fill a pipe that no one
        # reads while this process waits for the worker's resource usage
        with open(os.path.join(tmp, "log.txt"), "w+") as log:
            proc = subprocess.Popen([python, worker, inputs[0], out, *inputs[1:], "--k", str(k),
                                     "--threads", str(threads)], stdout=log, stderr=subprocess.STDOUT)
            _, rusage = os.wait4(proc.pid, 0)[1:]
            log.seek(0)
            err = log.read()
        if not os.path.exists(out):
            raise RuntimeError(f"{NAMES[engine]} failed: {err[-2000:]}")
        z = np.load(out)
        return {"top": z["ids"], "train_seconds": float(z["train_seconds"]),
                "predict_seconds": float(z["predict_seconds"]), "peak_rss_mb": rusage.ru_maxrss / 1024}
