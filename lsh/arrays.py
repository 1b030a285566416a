"""Array arguments for the kernels."""
import numpy as np

__all__ = ["as_rows"]


def as_rows(a, dtype=np.float32) -> np.ndarray:
    """``a`` as an array of ``dtype`` whose rows are each contiguous, copied only where they are
    not. A matrix whose rows lie apart in a wider array (a training model's weights inside its
    row block, :mod:`slide.kernels`) goes to the kernels as it is: a copy would cost a pass over
    all of it (343 MB at 670K x 128) on every rehash and every exact query."""
    a = np.asarray(a, dtype=dtype)
    if a.ndim == 2 and a.shape[1] > 1 and a.strides[1] != a.itemsize:
        a = np.ascontiguousarray(a)
    return a
