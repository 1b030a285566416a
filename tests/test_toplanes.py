"""The lanes that hold a row's best entries sorted (slide.toplanes) against Python's sort."""
import numpy as np
import pytest
from numba import njit

from slide.toplanes import LANES, lanes_for, new_tops, top_held, top_offer, trailing_zeros


@njit(cache=True)
def _offer_all(scores, ids, S, J):
    for i in range(S.size):
        top_offer(scores, ids, S[i], J[i])


@njit(cache=True)
def _lowest(bits):
    return trailing_zeros(bits)


@pytest.mark.parametrize("keep", [1, 5, 12, LANES, LANES + 1, 40])
def test_lanes_hold_the_best_distinct_entries_in_order(keep):
    """Scores drawn from few values (ties) and ids from few labels, a label's repeats carrying
    its score as a label in two clusters does: the lanes end with the best ``keep`` distinct
    ids, by score then the lower id, and empty lanes after them."""
    rng = np.random.default_rng(keep)
    for _ in range(100):
        n = int(rng.integers(1, 4 * keep + 8))
        J = rng.integers(0, 3 * keep + 2, n).astype(np.int32)
        first = dict(zip(J[::-1].tolist(), rng.integers(0, 6, n)[::-1].tolist()))
        S = np.array([first[j] for j in J.tolist()], np.float32)
        scores, ids = new_tops(1, keep)
        assert scores.shape == (1, lanes_for(keep)) and lanes_for(keep) % LANES == 0
        _offer_all(scores[0], ids[0], S, J)
        want = sorted(set(zip(S.tolist(), J.tolist())), key=lambda e: (-e[0], e[1]))[:keep]
        m = top_held(ids[0], keep)
        assert list(zip(scores[0, :m].tolist(), ids[0, :m].tolist())) == want
        assert np.all(ids[0, m:keep] == -1) and np.all(scores[0, m:keep] == -np.inf)


def test_an_entry_below_every_lane_changes_nothing():
    scores, ids = new_tops(1, LANES)
    _offer_all(scores[0], ids[0], np.arange(LANES, 0, -1, dtype=np.float32),
               np.arange(LANES, dtype=np.int32))
    before = scores.copy(), ids.copy()
    _offer_all(scores[0], ids[0], np.array([0.5, -np.inf], np.float32),
               np.array([99, 98], np.int32))
    assert np.array_equal(scores, before[0]) and np.array_equal(ids, before[1])


def test_trailing_zeros():
    for bit in (0, 1, 7, 15, 31, 62):
        assert _lowest(np.int64(1) << bit | np.int64(1) << 63 if bit < 62 else
                       np.int64(1) << bit) == bit
