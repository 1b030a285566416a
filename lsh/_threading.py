"""The one place that picks numba's threading layer and thread counts.

numba's default ``workqueue`` layer aborts the process when two Python threads launch parallel
kernels at the same time, which heterogeneous CPU+GPU training does. We ask numba for a
thread-safe layer, OpenMP (gcc's libgomp) first and TBB second, so ``workqueue`` is never used.
This must run before the first parallel kernel is called; importing :mod:`lsh` does it.

While the engine runs, BLAS gets one thread (:func:`engine_threads`): its workers spin after
each small matrix product and take the cores from numba's threads (on 2 cores this halved
training throughput). The engine's matrix products run instead inside numba's parallel
kernels, one single-threaded BLAS call per thread (numba's ``np.dot`` calls scipy's BLAS, so
that library is loaded before the limits are taken).
"""
import contextlib
import functools
import os

import numba
import numpy as np
from threadpoolctl import ThreadpoolController


def configure_threading_layer() -> None:
    if "NUMBA_THREADING_LAYER" in os.environ:  # an explicit user choice wins
        return
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
    numba.config.THREADING_LAYER = "threadsafe"


def set_num_threads(threads: int | None) -> int:
    """Set numba's thread count (``None`` or 0: all cores) and return the count in force."""
    limit = numba.config.NUMBA_NUM_THREADS
    n = limit if not threads else max(1, min(int(threads), limit))
    numba.set_num_threads(n)
    return n


@functools.lru_cache(maxsize=None)
def _blas_controller() -> ThreadpoolController:
    # one for the process: building one scans every loaded library (1-2 ms), which a
    # single-row query entered twice would pay on every call (a quarter of its latency).
    # It sees only the libraries loaded by then: scipy's BLAS, which numba's np.dot calls,
    # is loaded first so that it is held too
    import scipy.linalg.cython_blas  # noqa: F401
    return ThreadpoolController()


def blas_threads(threads: int):
    """Context manager: BLAS (the libraries loaded by the first call) on ``threads`` threads
    inside the block."""
    return _blas_controller().limit(limits=threads, user_api="blas")


@contextlib.contextmanager
def engine_threads(threads: int | None):
    """numba threads for the engine's kernels, and a single-threaded BLAS, inside the block."""
    previous = numba.get_num_threads()
    n = set_num_threads(threads)
    try:
        with blas_threads(1):
            yield n
    finally:
        numba.set_num_threads(previous)


def thread_chunks(n: int) -> np.ndarray:
    """Row boundaries int64 [t + 1] splitting n rows into one contiguous chunk per numba thread:
    kernels loop ``prange`` over chunks so each chunk allocates its scratch once."""
    n = int(n)
    return _chunk_bounds(n, max(1, min(numba.get_num_threads(), n)))


@numba.njit(cache=True, nogil=True)
def _chunk_bounds(n, t):
    """``c·n // t`` for c = 0..t, int64 [t + 1]. A kernel, not numpy: between the training
    step's kernels, which leave the caches cold, ``np.arange(t + 1) * n // t`` took 70 us
    (np.linspace, before it, 40 us in a warm loop)."""
    out = np.empty(t + 1, np.int64)
    for c in range(t + 1):
        out[c] = c * n // t
    return out
