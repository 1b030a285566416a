"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM.

Inside :func:`stop_on_signals` the first such signal only marks a request; training sees it
at its next batch boundary (:func:`check`, from the epoch's progress sink), where the model is
whole, and raises :class:`TrainingStopped` with the run's position recorded, so that the caller
can save a checkpoint of it. A second SIGINT exits at once: the checkpoint already on disk
stays intact, because every write of one is atomic. Under data parallelism the ranks agree on
the batch to stop after, so that none waits in a collective for another that has left.
Outside the block signals behave as Python's defaults (``KeyboardInterrupt``).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

__all__ = ["TrainingStopped", "stop_on_signals", "check", "request_stop", "EXIT_STATUS"]

#: the exit status of a process stopped by the signal: 128 + its number
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


class TrainingStopped(Exception):
    """Training stopped at a batch boundary because of signal ``signum``."""

    def __init__(self, signum: int, resumable: bool = True):
        self.signum = int(signum)
        #: whether the model as it stands is a position to save and resume from (not a refit
        #: half done: the checkpoint before it is the one to keep)
        self.resumable = resumable
        #: set by whoever handles it: whether a checkpoint of the position was written, and the
        #: position (epochs done, samples into the next)
        self.saved, self.position = False, None
        super().__init__(f"stopped by {signal.Signals(self.signum).name}")


class _Request:
    """The process's stop request: the signal that asked (None: none)."""

    def __init__(self):
        self.signum = None

    def clear(self):
        self.signum = None


_REQUEST = _Request()


def request_stop(signum: int = signal.SIGINT) -> None:
    """Ask the run to stop at its next batch boundary (what the signal handler does)."""
    _REQUEST.signum = int(signum)


def check(distributed=None) -> None:
    """Raise :class:`TrainingStopped` where a stop was asked for. With ``distributed``, every
    rank calls this after each of its batches and they stop after the same one
    (:meth:`slide.distributed.DataParallel.agree_stop`)."""
    if distributed is None or distributed.size == 1:
        if _REQUEST.signum is not None:
            raise TrainingStopped(_REQUEST.signum)
        return
    agreed = distributed.agree_stop(_REQUEST.signum or 0)
    if agreed:
        raise TrainingStopped(agreed)


@contextlib.contextmanager
def stop_on_signals(log=None):
    """SIGINT and SIGTERM ask the run to stop (see the module docstring) inside the block; a
    second SIGINT exits the process at once. ``log(message)`` says so when the first comes
    (default: a line on stderr). Installs nothing off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))

    def handler(signum, frame):
        if _REQUEST.signum is not None and signum == signal.SIGINT:
            say("interrupted again: exiting now (the last complete checkpoint is intact)")
            os._exit(EXIT_STATUS[signal.SIGINT])
        if _REQUEST.signum is None:
            say(f"{signal.Signals(signum).name}: stopping after this batch "
                f"(Ctrl-C again to exit at once)")
        _REQUEST.signum = _REQUEST.signum or signum

    previous = {s: signal.signal(s, handler) for s in EXIT_STATUS}
    _REQUEST.clear()
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _REQUEST.clear()
