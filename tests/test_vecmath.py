import math

import numpy as np
from numba import njit

from slide.vecmath import MAX_LANES, exp_nonpositive, fmax, fsum


@njit
def _exp_all(x):
    out = np.empty_like(x)
    for j in range(x.size):
        out[j] = exp_nonpositive(x[j])
    return out


def test_exp_nonpositive_is_within_two_ulp_and_zero_below_the_normal_range():
    x = np.concatenate([np.linspace(-87.3, 0.0, 400_001, dtype=np.float32),
                        -np.logspace(-30, 1.9, 2_001).astype(np.float32),
                        np.array([0.0, -0.0, -1e-38], np.float32)])
    got = _exp_all(x).astype(np.float64)
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (np.abs(got - exact) / ulp).max() <= 2.0
    assert _exp_all(np.zeros(1, np.float32))[0] == 1.0
    # below float32's smallest normal result, and -inf (a logit cut from the softmax): exactly 0
    low = np.array([-np.inf, -1e30, -104.0, -87.34], np.float32)
    assert (_exp_all(low) == 0).all()
    assert (_exp_all(np.array([-87.336], np.float32)) > 0).all()


def test_fsum_sums_in_any_order_to_float32_accuracy():
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 16, 1001):
        a = rng.standard_normal(n).astype(np.float32)
        assert abs(fsum(a) - math.fsum(a.astype(np.float64))) <= 1e-5 * max(1.0, np.abs(a).sum())


def test_fmax_finds_the_max_wherever_it_is():
    rng = np.random.default_rng(1)
    lanes = np.empty(MAX_LANES, np.float32)
    for n in (0, 1, 15, 16, 17, 3095):
        a = rng.standard_normal(n).astype(np.float32)
        assert fmax(a, lanes) == (a.max() if n else -np.inf)
        for where in {0, n // 2, n - 1} if n else ():  # in the lanes, and in the tail
            b = a.copy()
            b[where] = 100.0
            assert fmax(b, lanes) == 100.0
    assert fmax(np.full(40, -np.inf, np.float32), lanes) == -np.inf
