import numpy as np
import pytest
from numba import njit

from slide.blas import gemm


@njit(cache=True)
def _gemm(A, trans_a, B, trans_b, C, beta):
    gemm(A, trans_a, B, trans_b, C, beta)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_gemm_on_strided_views_writes_only_its_block(trans_a, trans_b):
    """Operands and result are blocks of larger row-major arrays (row strides other than their
    widths); C = op(A) op(B) + beta C lands in the block, everything around it untouched."""
    rng = np.random.default_rng(0)
    big = rng.standard_normal((40, 90)).astype(np.float32)
    A = big[10:19, 20:27] if trans_a else big[:7, 3:12]      # op(A): [7, 9]
    B = big[30:35, 50:59] if trans_b else big[20:29, 30:35]  # op(B): [9, 5]
    C0 = rng.standard_normal((30, 80)).astype(np.float32)
    C = C0.copy()
    _gemm(A, trans_a, B, trans_b, C[5:12, 60:65], 0.5)
    want = C0.copy()
    want[5:12, 60:65] = (A.T if trans_a else A) @ (B.T if trans_b else B) + 0.5 * C0[5:12, 60:65]
    np.testing.assert_allclose(C, want, rtol=1e-5, atol=1e-5)
