"""float32 math that LLVM vectorises inside numba kernels: the softmax's max, exp and sum.

numba compiles ``np.exp`` on float32 to a call of libm's scalar ``expf`` per element (no vector
math library ships with PyPI's llvmlite), and a float sum or max written as a loop is kept in
strict order, which cannot be split across SIMD lanes. The output step takes the max of,
exponentiates and sums thousands of logits a sample; these do it in SIMD lanes, several times
faster than the scalar loops (docs/runtime.md).
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["exp_nonpositive", "fsum", "fmax", "dot", "MAX_LANES", "REASSOC"]


@intrinsic
def _float_from_bits(typingctx, bits):
    """The float32 whose IEEE-754 bit pattern is the low 32 bits of the integer ``bits``."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if value.type.width != 32:
            value = builder.trunc(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


#: below this, expf's result is under float32's smallest normal number: returned as exactly 0
_EXP_MIN = np.float32(-87.33654)


@njit(cache=True, nogil=True, inline="always")
def exp_nonpositive(x):
    """exp(x) for float32 x <= 0 (a softmax's logits less their maximum), within 1.4 ulp of the
    exact value; exactly 0 for x below -87.34 (-inf included), 1 at 0.

    Cephes' expf: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 split in two parts so that r is
    exact), e^r by a degree-7 polynomial, 2^n built in the exponent bits. Branch-free, so a loop
    over it vectorises."""
    xc = min(max(x, _EXP_MIN), np.float32(0.0))
    n = np.floor(xc * np.float32(1.44269504088896341) + np.float32(0.5))
    r = xc - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    scale = _float_from_bits((np.int32(n) + np.int32(127)) << 23)  # 2^n, n in -126..0
    return p * scale if x >= _EXP_MIN else np.float32(0.0)


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def fsum(a):
    """Σ a[j] over a float32 vector, in any order (so in SIMD lanes); float32 result. The order
    is fixed by the compiled code, so one thread still repeats exactly."""
    s = np.float32(0.0)
    for j in range(a.size):
        s += a[j]
    return s


#: lanes of :func:`fmax`'s running maxima
MAX_LANES = 16


@njit(cache=True, nogil=True)
def fmax(a, lanes):
    """max(a) over a float32 vector (-inf if empty; NaNs are not looked for), with ``lanes``
    float32 [MAX_LANES] as scratch: MAX_LANES running maxima, one per SIMD lane, then their
    max."""
    lanes[:] = -np.inf
    whole = a.size - a.size % MAX_LANES
    for j0 in range(0, whole, MAX_LANES):
        for lane in range(MAX_LANES):
            x = a[j0 + lane]
            lanes[lane] = x if x > lanes[lane] else lanes[lane]
    m = np.float32(-np.inf)
    for lane in range(MAX_LANES):
        m = max(m, lanes[lane])
    for j in range(whole, a.size):
        m = max(m, a[j])
    return m


#: the dot products may be summed in any order: LLVM then vectorises the reduction, which a
#: strict left-to-right float sum forbids. The order is fixed by the compiled code, so one
#: thread still repeats exactly.
REASSOC = {"reassoc", "contract"}


@njit(cache=True, nogil=True, fastmath=REASSOC)
def dot(a, b):
    """Σ a[j]·b[j] over two float32 vectors of equal length (float32 result)."""
    s = np.float32(0.0)
    for j in range(a.size):
        s += a[j] * b[j]
    return s
