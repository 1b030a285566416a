"""Array arguments for the kernels, and the copy they use between arrays."""
import numpy as np
from numba import njit

__all__ = ["as_rows", "leading_rows", "copy_into"]


@njit(cache=True, nogil=True, inline="always")
def copy_into(dst, src):
    """``dst[:] = src`` for 1-D arrays of one length, as a loop, inside numba kernels. numba's
    array assignment runs several times slower (numba 0.68, one thread: 128 floats 76 against
    9 ns, 1,548 floats 879 against 115), and compiles a shape check with its error message,
    about 2 s of a first run's compile in each kernel that holds one."""
    for j in range(dst.size):
        dst[j] = src[j]


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
    """The C-contiguous rows [n, D] whose first d entries ``a`` [n, d] is, where ``a`` is the
    leading columns of a run of rows of a C-contiguous matrix (a training model's weights in
    their row block, :mod:`slide.kernels`); ``a`` itself otherwise. A kernel given these rows
    reads the first d entries of each.

    numba compiles a kernel once for each layout of its arrays, and such a column block has
    another layout ("A") than a plain matrix ("C"): the weights of a rehash and a batch's
    hidden rows compiled the hashing kernel twice (:class:`lsh.families.WTA`)."""
    if a.flags.c_contiguous:  # a plain matrix (a batch's rows): at once
        return a
    base = a.base
    if not (a.ndim == 2 and isinstance(base, np.ndarray) and base.ndim == 2
            and base.flags.c_contiguous and base.dtype == a.dtype
            and a.strides == (base.strides[0], a.itemsize) and a.shape[1] <= base.shape[1]):
        return a
    offset = a.ctypes.data - base.ctypes.data
    if offset < 0 or offset % base.strides[0]:
        return a
    first = offset // base.strides[0]
    return base[first:first + a.shape[0]]
