"""Array arguments for the kernels, and the copy they use between arrays."""
import numpy as np
from numba import njit

__all__ = ["CACHE_LINE", "aligned_empty", "aligned_zeros", "as_rows", "leading_rows", "copy_into"]

#: bytes in a cache line, where the arrays whose rows kernels read at random start
CACHE_LINE = 64


@njit(cache=True, nogil=True, inline="always")
def copy_into(dst, src):
    """``dst[:] = src`` for 1-D arrays of one length, as a loop, inside numba kernels. numba's
    array assignment runs several times slower (numba 0.68, one thread: 128 floats 76 against
    9 ns, 1,548 floats 879 against 115), and compiles a shape check with its error message,
    about 2 s of a first run's compile in each kernel that holds one."""
    for j in range(dst.size):
        dst[j] = src[j]


def aligned_empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous array whose first element starts a cache line.

    numpy's large arrays start 16 bytes into one (glibc's header before a mapped chunk), so a
    row of 512 bytes (128 float32 weights) spans 9 lines and a bucket of 64 int32 ids 5, where
    8 and 4 would do. The kernels that walk such rows at random pay a line a row for it: the
    output step on a batch at Amazon-670K shape took 41.6 µs a sample against 38.4 with its row
    block aligned (bench/README.md). The array is a view of a byte buffer (its ``base``), so
    whether another array shares its memory is asked of the memory, not of ``base``."""
    return _aligned(np.empty, shape, dtype)


def aligned_zeros(shape, dtype=np.float32) -> np.ndarray:
    """:func:`aligned_empty` filled with zeros, whose pages (as ``np.zeros``') take memory only
    once written."""
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
    row block, :mod:`slide.kernels`) goes to the kernels as it is: a copy would cost a pass over
    all of it (343 MB at 670K x 128) on every rehash and every exact query."""
    a = np.asarray(a, dtype=dtype)
    if a.ndim == 2 and a.shape[1] > 1 and a.strides[1] != a.itemsize:
        a = np.ascontiguousarray(a)
    return a


def leading_rows(a: np.ndarray) -> np.ndarray:
    """The C-contiguous rows [n, D] whose first d entries ``a`` [n, d] is, where ``a``'s rows
    are each contiguous and lie ``D`` elements apart in memory that holds all of them (a
    training model's weights, the leading columns of their row block, :mod:`slide.kernels`);
    ``a`` itself otherwise. A kernel given these rows reads the first d entries of each.

    numba compiles a kernel once for each layout of its arrays, and such a column block has
    another layout ("A") than a plain matrix ("C"): the weights of a rehash and a batch's
    hidden rows compiled the hashing kernel twice (:class:`lsh.families.WTA`). The memory is
    asked of the array that owns it, whatever lies between (a row block of
    :func:`aligned_empty` is itself a view of a byte buffer)."""
    if a.flags.c_contiguous:  # a plain matrix (a batch's rows): at once
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
