import numpy as np
import pytest
from scipy import stats

from slide.sampling import draw_key, shared_negatives


@pytest.mark.parametrize("n_labels", [1, 63, 64, 65, 200])
def test_drawing_every_label_gives_them_all_in_order(n_labels):
    """All n ids of a draw of n (and of more): every bit of every word of the set read back in
    order, the last word's unused bits left out."""
    for size in (n_labels, n_labels + 5):
        got = shared_negatives(draw_key(0, 1, 2), n_labels, size, np.zeros(0, np.int32))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.arange(n_labels))


@pytest.mark.parametrize("size", [5, 30, 45])  # the draw, then the ids left out (over half)
def test_draw_is_sorted_distinct_joined_with_the_labels_and_a_function_of_its_key(size):
    labels = np.array([3, 49, 3, 17], np.int32)
    got = shared_negatives(draw_key(7, 1, 0), 50, size, labels)
    assert (np.diff(got) > 0).all() and got.min() >= 0 and got.max() < 50
    assert set(labels) <= set(got)
    alone = shared_negatives(draw_key(7, 1, 0), 50, size, np.zeros(0, np.int32))
    assert alone.size == size  # exactly size ids drawn
    np.testing.assert_array_equal(got, np.union1d(alone, labels))
    np.testing.assert_array_equal(got, shared_negatives(draw_key(7, 1, 0), 50, size, labels))
    others = [shared_negatives(draw_key(7, 1, s), 50, size, labels) for s in range(1, 6)]
    assert any(not np.array_equal(got, o) for o in others)


@pytest.mark.parametrize("size", [6, 34])
def test_draw_is_uniform_over_the_labels(size):
    """Each of 40 ids drawn size/40 of the time over 3,000 keys (chi-square), the inverted
    draw's too."""
    counts = np.zeros(40)
    for step in range(3000):
        counts[shared_negatives(draw_key(1, 1, step), 40, size, np.zeros(0, np.int32))] += 1
    assert counts.sum() == 3000 * size
    _, p = stats.chisquare(counts)
    assert p > 0.001, p


def test_labels_out_of_range_are_refused():
    """A batch label below 0 or past the last label is a clear error, not a write outside the
    bit set."""
    with pytest.raises(ValueError, match="batch labels"):
        shared_negatives(1, 10, 3, np.array([10]))
    for bad in ([3, -1], [3, 50]):
        with pytest.raises(ValueError, match=r"batch labels must be in \[0, 50\)"):
            shared_negatives(draw_key(7, 1, 0), 50, 5, np.array(bad, np.int32))


def test_keys_of_different_words_differ():
    keys = {draw_key(s, stream, step) for s in range(3) for stream in (1, 7) for step in range(50)}
    assert len(keys) == 300 and all(0 <= k < 2**64 for k in keys)


def test_labels_of_any_integer_dtype_draw_the_same():
    """int32, int64 and unsigned labels join the same draw."""
    draws = [shared_negatives(draw_key(7, 1, 0), 50, 5, np.array([3, 49], dtype))
             for dtype in (np.int32, np.int64, np.uint16)]
    for got in draws[1:]:
        np.testing.assert_array_equal(got, draws[0])
    assert {3, 49} <= set(draws[0])
