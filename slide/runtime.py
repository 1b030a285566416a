"""The runtime floor: numba helpers that every package's kernels share.

Nothing of the project is imported here; :mod:`lsh`, :mod:`slide` and :mod:`gpu_ref` import it.

* threads: the threading layer, chosen explicitly once (:func:`configure_threading`, called by
  the first :func:`set_num_threads`, :func:`thread_count`, :func:`engine_threads` or
  :func:`thread_chunks`), thread counts read and set without numba's locks, and a
  single-threaded BLAS while the engine runs;
* arrays on cache lines (:func:`aligned_empty`), array arguments for the kernels
  (:func:`as_rows`, :func:`leading_rows`) and a copy loop for inside them (:func:`copy_into`);
* LLVM intrinsics for kernels: software prefetch, an atomic counter, a 16 x 16 tile transpose;
* scratch lent to one query at a time (:func:`borrowed`).

The evidence behind each choice is in ``docs/runtime.md``.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["configure_threading", "set_num_threads", "thread_count", "engine_threads",
           "blas_threads", "thread_chunks", "CACHE_LINE", "aligned_empty", "aligned_zeros", "as_rows",
           "leading_rows", "copy_into", "prefetch", "prefetch_l2", "prefetch_w", "fetch_add",
           "TILE", "transpose_tile", "borrowed"]


# --------------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------------
_LAYER_LOCK = threading.Lock()
_layer_chosen = False


def configure_threading() -> None:
    """Choose numba's threading layer: OpenMP, else TBB, never ``workqueue``, which aborts the
    process when two Python threads launch parallel kernels at once (the heterogeneous trainer
    does). An explicit ``NUMBA_THREADING_LAYER`` wins. Idempotent; it must run before the first
    parallel kernel, so every helper below that starts threads calls it first."""
    global _layer_chosen
    if _layer_chosen:
        return
    with _LAYER_LOCK:
        if not _layer_chosen and "NUMBA_THREADING_LAYER" not in os.environ:
            numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
            numba.config.THREADING_LAYER = "threadsafe"
        _layer_chosen = True


_launched = False


def _launch() -> None:
    # numba starts its threads, and registers the symbols that _get_threads and _set_threads
    # call, at its first thread-count call
    global _launched
    configure_threading()
    numba.get_num_threads()
    _launched = True


def set_num_threads(threads: int | None) -> int:
    """Set numba's thread count for the calling thread (``None`` or 0: all cores) and return
    the count in force."""
    if not _launched:
        _launch()
    limit = numba.config.NUMBA_NUM_THREADS
    n = limit if not threads else max(1, min(int(threads), limit))
    # in a kernel: numba's own getter and setter take its locks, 5 µs of a single-row query
    _sync_threads(n)
    return n


def thread_count() -> int:
    """numba's thread count for the calling thread (``numba.get_num_threads()``, without its
    locks: a single-row query asks more than once)."""
    if not _launched:
        _launch()
    return _threads_now()


@intrinsic
def _get_threads(typingctx):
    # numba's C function, called by name as its parallel kernels call it, so that a kernel
    # that calls it can be cached (numba's jitted getter holds a ctypes pointer)
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []),
                                            "get_num_threads")
        return builder.sext(builder.call(fn, []), ir.IntType(64))
    return types.int64(), codegen


@intrinsic
def _set_threads(typingctx, n):
    if not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(32)]), "set_num_threads")
        builder.call(fn, [builder.trunc(context.cast(builder, args[0], signature.args[0],
                                                     types.int64), ir.IntType(32))])
        return context.get_dummy_value()
    return types.void(n), codegen


@njit(cache=True, nogil=True)
def _threads_now():
    return _get_threads()


@njit(cache=True, nogil=True)
def _sync_threads(n):
    if _get_threads() != n:
        _set_threads(n)


@functools.lru_cache(maxsize=None)
def _blas_controller():
    # one for the process: building one scans every loaded library, which a single-row query
    # would pay on every call. scipy's BLAS, which numba's np.dot calls, is loaded first so that
    # it is among the libraries held
    import scipy.linalg.cython_blas  # noqa: F401
    from threadpoolctl import ThreadpoolController
    return ThreadpoolController()


def blas_threads(threads: int):
    """Context manager: BLAS on ``threads`` threads inside the block."""
    return _blas_controller().limit(limits=threads, user_api="blas")


@contextlib.contextmanager
def engine_threads(threads: int | None):
    """numba threads for the engine's kernels, and a single-threaded BLAS, inside the block.
    BLAS workers spin after each small product and would take the cores from numba's threads;
    the engine's products run inside numba's kernels, one single-threaded call per thread."""
    previous = thread_count()
    n = set_num_threads(threads)
    try:
        with blas_threads(1):
            yield n
    finally:
        set_num_threads(previous)


def thread_chunks(n: int) -> np.ndarray:
    """Row boundaries int64 [t + 1] splitting n rows into one contiguous chunk per numba thread:
    kernels loop ``prange`` over chunks so each chunk allocates its scratch once."""
    n = int(n)
    return _chunk_bounds(n, max(1, min(thread_count(), n)))


@njit(cache=True, nogil=True)
def _chunk_bounds(n, t):
    # a kernel, not numpy: between the step's kernels, which leave the caches cold, numpy's
    # small-array calls cost tens of microseconds
    out = np.empty(t + 1, np.int64)
    for c in range(t + 1):
        out[c] = c * n // t
    return out


# --------------------------------------------------------------------------------------------
# Arrays
# --------------------------------------------------------------------------------------------
#: bytes in a cache line, where the arrays whose rows kernels read at random start
CACHE_LINE = 64


@njit(cache=True, nogil=True, inline="always")
def copy_into(dst, src):
    """``dst[:] = src`` for 1-D arrays of one length, as a loop, inside numba kernels: numba's
    array assignment is several times slower and compiles a shape check into every kernel."""
    for j in range(dst.size):
        dst[j] = src[j]


def aligned_empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous array whose first element starts a cache line, so that a
    row of 512 bytes spans 8 lines, not 9 (numpy's large arrays start 16 bytes into one). The
    array is a view of a byte buffer (its ``base``)."""
    return _aligned(np.empty, shape, dtype)


def aligned_zeros(shape, dtype=np.float32) -> np.ndarray:
    """:func:`aligned_empty` filled with zeros, whose pages take memory only once written."""
    return _aligned(np.zeros, shape, dtype)


def _aligned(make, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    shape = (shape,) if np.isscalar(shape) else tuple(shape)
    n_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = make(n_bytes + CACHE_LINE, np.uint8)
    start = -buf.ctypes.data % CACHE_LINE
    return buf[start:start + n_bytes].view(dtype).reshape(shape)


def as_rows(a, dtype=np.float32) -> np.ndarray:
    """``a`` as an array of ``dtype`` whose rows are each contiguous, copied only where they are
    not. A matrix whose rows lie apart in a wider array (a training model's weights inside its
    row block) goes to the kernels as it is: a copy would cost a pass over all of it."""
    a = np.asarray(a, dtype=dtype)
    if a.ndim == 2 and a.shape[1] > 1 and a.strides[1] != a.itemsize:
        a = np.ascontiguousarray(a)
    return a


def leading_rows(a: np.ndarray) -> np.ndarray:
    """The C-contiguous rows [n, D] whose first d entries ``a`` [n, d] is, where ``a``'s rows
    are each contiguous and lie ``D`` elements apart in memory that holds all of them (the
    leading columns of a row block); ``a`` itself otherwise. numba compiles a kernel once per
    array layout, and a column block's layout ("A") differs from a plain matrix's ("C"): this
    keeps one compiled kernel for both."""
    if a.flags.c_contiguous:
        return a
    if not (a.ndim == 2 and a.shape[0] > 0 and a.strides[1] == a.itemsize
            and a.strides[0] % a.itemsize == 0 and a.strides[0] >= a.shape[1] * a.itemsize):
        return a
    owner = a
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    if not owner.flags.c_contiguous:
        return a
    start, end = a.ctypes.data, owner.ctypes.data + owner.nbytes
    if start < owner.ctypes.data or start + a.shape[0] * a.strides[0] > end:
        return a  # the last row, widened, would run past the memory
    return np.lib.stride_tricks.as_strided(
        a, shape=(a.shape[0], a.strides[0] // a.itemsize), strides=(a.strides[0], a.itemsize))


# --------------------------------------------------------------------------------------------
# Software prefetch
# --------------------------------------------------------------------------------------------
def _prefetcher(write: int, locality: int = 3):
    @intrinsic
    def prefetcher(typingctx, a):
        if not (isinstance(a, types.Array) and a.ndim == 1):
            return None

        def codegen(context, builder, signature, args):
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            i64, i32 = ir.IntType(64), ir.IntType(32)
            start = builder.ptrtoint(arr.data, i64)
            itemsize = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
            n_bytes = builder.mul(cgutils.unpack_tuple(builder, arr.shape, 1)[0],
                                  ir.Constant(i64, itemsize))
            # every line the bytes [start, start + n_bytes) touch
            first = builder.and_(start, ir.Constant(i64, -CACHE_LINE))
            n_lines = builder.udiv(
                builder.add(builder.sub(builder.add(start, n_bytes), first),
                            ir.Constant(i64, CACHE_LINE - 1)), ir.Constant(i64, CACHE_LINE))
            ptr = ir.PointerType()
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [ptr, i32, i32, i32]),
                "llvm.prefetch.p0")
            # (address, read 0 / write 1, locality: 3 every cache level (prefetcht0), 2 not L1
            # (prefetcht1), data)
            with cgutils.for_range(builder, n_lines) as loop:
                p = builder.add(first, builder.mul(loop.index, ir.Constant(i64, CACHE_LINE)))
                builder.call(fn, [builder.inttoptr(p, ptr), ir.Constant(i32, write),
                                  ir.Constant(i32, locality), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.void(a), codegen
    return prefetcher


prefetch = _prefetcher(0)
prefetch.__doc__ = """Prefetch the cache lines of the 1-D contiguous array ``a`` (a row, a
bucket, an entry), to be read, into every cache level. A hint: it never faults."""
prefetch_l2 = _prefetcher(0, locality=2)
prefetch_l2.__doc__ = """Prefetch the cache lines of ``a`` into L2, not L1: for rows wanted dozens
of iterations later, which in L1 would evict the lines wanted sooner."""
prefetch_w = _prefetcher(1)
prefetch_w.__doc__ = """Prefetch the cache lines of ``a`` to be written (taken exclusive, so that
the write does not ask for them again)."""


# --------------------------------------------------------------------------------------------
# Atomics
# --------------------------------------------------------------------------------------------
@intrinsic
def fetch_add(typingctx, counter, value):
    """Atomically add ``value`` to ``counter[0]`` (int64 [>= 1], contiguous) and return the old
    value: among threads that call it at once, each gets a distinct old value. Threads whose
    items vary in cost claim the next item as they finish one, instead of a fixed chunk each."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64
            and counter.ndim == 1 and isinstance(value, types.Integer)):
        return None
    sig = types.int64(counter, value)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        v = context.cast(builder, args[1], signature.args[1], types.int64)
        # monotonic: the claimed index carries no data between threads, only which item is whose
        return builder.atomic_rmw("add", arr.data, v, "monotonic")

    return sig, codegen


# --------------------------------------------------------------------------------------------
# A 16 x 16 float32 tile transposed in vector registers (the WTA families' block hashing)
# --------------------------------------------------------------------------------------------
#: the tile's side: 16 float32 lanes, one 64-byte vector
TILE = 16


def _is_rows(t) -> bool:
    return isinstance(t, types.Array) and t.ndim == 2 and t.dtype == types.float32


@intrinsic
def transpose_tile(typingctx, src, r, d, dst, i, zeros_to_neg_inf):
    """``dst[d + k, i + m] = src[r + m, d + k]`` for k, m in ``0..15``, with each 0.0 written
    as -inf where ``zeros_to_neg_inf`` is true (DWTA: no bin's argmax may land on a zero).

    Each row of the tile is one vector load, the tile is transposed by a network of two-source
    shuffles and each column goes out as one vector store (element by element the transpose
    took as long as the hashing). ``src`` and ``dst`` are float32 arrays or views whose
    elements within a row are contiguous; the tile must lie inside both, which is not checked."""
    if not (_is_rows(src) and _is_rows(dst) and isinstance(r, types.Integer)
            and isinstance(d, types.Integer) and isinstance(i, types.Integer)):
        return None
    sig = types.void(src, r, d, dst, i, zeros_to_neg_inf)

    def codegen(context, builder, signature, args):
        s_ty, r_ty, d_ty, t_ty, i_ty, z_ty = signature.args
        a_src = context.make_array(s_ty)(context, builder, args[0])
        a_dst = context.make_array(t_ty)(context, builder, args[3])
        i64 = ir.IntType(64)
        f32 = ir.FloatType()
        vec = ir.VectorType(f32, TILE)
        i8p = ir.IntType(8).as_pointer()

        def idx(k):
            return context.cast(builder, args[k], signature.args[k], types.int64)

        r0, d0, i0 = idx(1), idx(2), idx(4)
        zeros = builder.icmp_unsigned("!=", context.cast(builder, args[5], z_ty, types.boolean),
                                      ir.Constant(ir.IntType(1), 0))

        def row_ptr(arr, row, col):
            stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
            offset = builder.add(builder.mul(row, stride), builder.mul(col, ir.Constant(i64, 4)))
            base = builder.bitcast(arr.data, i8p)
            return builder.bitcast(builder.gep(base, [offset]), vec.as_pointer())

        zero = ir.Constant(vec, [0.0] * TILE)
        neg = ir.Constant(vec, [float("-inf")] * TILE)
        rows = []
        for m in range(TILE):
            v = builder.load(row_ptr(a_src, builder.add(r0, ir.Constant(i64, m)), d0), align=4)
            v = builder.select(zeros, builder.select(builder.fcmp_ordered("==", v, zero), neg, v), v)
            rows.append(v)
        # round b swaps, for each pair of rows (j, j + b) with bit b of j clear, the elements of
        # row j whose column has bit b set with those of row j + b whose column has it clear;
        # after the rounds for 8, 4, 2 and 1, row k holds column k
        i32 = ir.IntType(32)
        for b in (8, 4, 2, 1):
            low = ir.Constant(ir.VectorType(i32, TILE),
                              [c if not c & b else TILE + c - b for c in range(TILE)])
            high = ir.Constant(ir.VectorType(i32, TILE),
                               [c + b if not c & b else TILE + c for c in range(TILE)])
            for j in range(TILE):
                if not j & b:
                    a, c = rows[j], rows[j + b]
                    rows[j] = builder.shuffle_vector(a, c, low)
                    rows[j + b] = builder.shuffle_vector(a, c, high)
        for k in range(TILE):
            builder.store(rows[k], row_ptr(a_dst, builder.add(d0, ir.Constant(i64, k)), i0), align=4)
        return context.get_dummy_value()

    return sig, codegen


# --------------------------------------------------------------------------------------------
# Scratch lent to one query at a time
# --------------------------------------------------------------------------------------------
#: guards the lists of free scratch, not the queries
_SCRATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def borrowed(free: list, fits, make):
    """A scratch set from the list ``free`` for which ``fits(s)`` holds, or ``make()``'s where
    none is free, given back to ``free`` after the block.

    A table's query marks ids in scratch and clears them before it returns; two queries in one
    set at once (two Python threads: the kernels release the GIL) would read each other's marks.
    Sets that no longer fit (another thread count, a rebuild) are dropped as they are met, and
    so is one whose block raised, since its marks may be left set."""
    scratch = None
    with _SCRATCH_LOCK:
        while free and scratch is None:
            s = free.pop()
            if fits(s):
                scratch = s
    if scratch is None:
        scratch = make()
    yield scratch
    with _SCRATCH_LOCK:
        free.append(scratch)
