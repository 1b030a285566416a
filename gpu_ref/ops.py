"""The dense step's fused operations: cupy kernels on a GPU, the same float32 arithmetic in
numpy otherwise.

Each public function takes the array module ``xp`` first and works in place where it says so.
On cupy the elementwise parts are single ``ElementwiseKernel`` launches (one pass over memory
each, in place, no temporaries the size of the operands) between cupy's own row reductions; on numpy they are the
equivalent array expressions. The GPU tests check that both give the same numbers.
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np

__all__ = ["softmax_xent_", "adam_", "adam_rows_", "matmul_precision", "PRECISIONS"]

PRECISIONS = ("fp32", "tf32")


@functools.lru_cache(maxsize=None)
def _kernels():
    """The cupy kernels, compiled on first use (cupy is imported only here)."""
    import cupy
    # z ← exp(z - row max), in place: one read and one write of the logits
    exp_shifted = cupy.ElementwiseKernel("T zmax", "T z", "z = exp(z - zmax)", "slide_exp_shifted")
    # Adam with decoupled weight decay, one pass over w, m, v, g
    adam = cupy.ElementwiseKernel(
        "T g, T lr, T b1, T b2, T eps, T c1, T c2, T decay", "T w, T m, T v",
        """
        m = b1 * m + (1 - b1) * g;
        v = b2 * v + (1 - b2) * g * g;
        w -= lr * (m * c1) / (sqrt(v * c2) + eps) + lr * decay * w;
        """, "slide_adam")
    # the same on the rows ``rows`` of w, m, v (row-major, ``width`` columns) with g [rows, width]
    adam_rows = cupy.ElementwiseKernel(
        "T g, raw I rows, int64 width, T lr, T b1, T b2, T eps, T c1, T c2, T decay",
        "raw T w, raw T m, raw T v",
        """
        const long long j = (long long)rows[i / width] * width + i % width;
        const T mj = b1 * m[j] + (1 - b1) * g;
        const T vj = b2 * v[j] + (1 - b2) * g * g;
        m[j] = mj;
        v[j] = vj;
        w[j] -= lr * (mj * c1) / (sqrt(vj * c2) + eps) + lr * decay * w[j];
        """, "slide_adam_rows")
    return {"exp_shifted": exp_shifted, "adam": adam, "adam_rows": adam_rows}


def softmax_xent_(xp, z, rows, cols, weights):
    """Softmax cross-entropy of logits ``z`` against sparse targets, turning ``z`` into its
    gradient in place.

    z : float32 [n, m] logits (overwritten with d loss / d z of the *mean* loss over the n rows;
        a row without target entries has no loss and a zero gradient).
    rows, cols : int arrays [nnz], the target entries; weights : float32 [nnz] (each row's sum to 1).
    Returns the *summed* loss over rows as a 0-d float32 array on ``xp``'s device (no host sync).
    """
    n = z.shape[0]
    zmax = z.max(axis=1, keepdims=True)
    picked = z[rows, cols]                      # the targets' logits, before z is overwritten
    if xp is np:                                # z ← exp(z - max), one pass in place
        np.subtract(z, zmax, out=z)
        np.exp(z, out=z)
    else:
        _kernels()["exp_shifted"](zmax, z)
    total = z.sum(axis=1, keepdims=True)
    loss = (weights * (zmax[rows, 0] + xp.log(total[rows, 0]) - picked)).sum()
    inv_n = np.float32(1.0 / max(n, 1))
    scale = xp.zeros((n, 1), xp.float32)
    scale[rows, 0] = inv_n                      # rows with targets: 1/n; the others: 0
    scale /= total
    z *= scale                                  # softmax / n
    xp.add.at(z, (rows, cols), -weights * inv_n)
    return loss


def _adam_scalars(lr, beta1, beta2, eps, step, decay):
    f = np.float32
    return (f(lr), f(beta1), f(beta2), f(eps), f(1.0 / (1.0 - beta1 ** step)),
            f(1.0 / (1.0 - beta2 ** step)), f(decay))


def adam_(xp, w, m, v, g, lr, beta1, beta2, eps, step, decay=0.0):
    """Adam with decoupled weight decay (``decay`` × lr × w) on whole arrays, in place; the same
    float32 arithmetic as the engine's kernels."""
    lr_, b1, b2, eps_, c1, c2, dec = _adam_scalars(lr, beta1, beta2, eps, step, decay)
    if xp is not np:
        _kernels()["adam"](g, lr_, b1, b2, eps_, c1, c2, dec, w, m, v)
        return
    m *= b1
    m += (np.float32(1) - b1) * g
    v *= b2
    v += (np.float32(1) - b2) * g * g
    w -= lr_ * (m * c1) / (np.sqrt(v * c2) + eps_) + lr_ * dec * w


def adam_rows_(xp, w, m, v, g, rows, lr, beta1, beta2, eps, step, decay=0.0):
    """:func:`adam_` on the rows ``rows`` (unique int32/int64 [r]) of 2-D ``w``, ``m``, ``v``
    [R, width] with gradient rows ``g`` [r, width], in place, without gathering copies on a GPU."""
    lr_, b1, b2, eps_, c1, c2, dec = _adam_scalars(lr, beta1, beta2, eps, step, decay)
    if xp is not np:
        width = w.shape[1] if w.ndim == 2 else 1
        _kernels()["adam_rows"](g, rows, width, lr_, b1, b2, eps_, c1, c2, dec, w, m, v)
        return
    wr, mr, vr = w[rows], m[rows], v[rows]
    adam_(np, wr, mr, vr, g, lr, beta1, beta2, eps, step, decay)
    w[rows], m[rows], v[rows] = wr, mr, vr


@contextlib.contextmanager
def matmul_precision(xp, precision: str):
    """Matrix products inside the block run in ``precision``: "fp32", or "tf32" (the tensor
    cores' float32 mode, about 10 mantissa bits in the products, float32 sums; Ampere and later).
    A no-op on numpy."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if xp is np:
        yield
        return
    from cupy._core import _routines_linalg as linalg  # cupy's documented switch is CUPY_TF32
    before = linalg.get_compute_type(np.float32)
    tf32 = precision == "tf32" and int(xp.cuda.Device().compute_capability) >= 80
    wanted = linalg.COMPUTE_TYPE_TF32 if tf32 else linalg.COMPUTE_TYPE_DEFAULT
    linalg.set_compute_type(np.float32, wanted)
    try:
        yield
    finally:
        linalg.set_compute_type(np.float32, before)
