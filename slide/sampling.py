"""Negatives shared by a batch: the one rule every sampled softmax here uses (the engine's pool,
the dense reference's ``negatives``, the heterogeneous trainer's GPU worker)."""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["draw_key", "shared_negatives"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK = (1 << 64) - 1
#: de Bruijn sequence and table: the position of a word's lowest set bit from one multiply
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_LOWEST_BIT = np.array([0, 1, 48, 2, 57, 49, 28, 3, 61, 58, 50, 42, 38, 29, 17, 4, 62, 55, 59, 36,
                        53, 51, 43, 22, 45, 39, 33, 30, 24, 18, 12, 5, 63, 47, 56, 27, 60, 41, 37,
                        16, 54, 35, 52, 21, 44, 32, 23, 11, 46, 26, 40, 15, 34, 20, 31, 10, 25, 14,
                        19, 9, 13, 8, 7, 6], np.int64)


@njit(cache=True, nogil=True, inline="always")
def _splitmix(state):
    """splitmix64's output for ``state`` (uint64) advanced by one step: the draws' stream, and
    the mixing of a key's words."""
    x = state + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def draw_key(*words: int) -> int:
    """A 64-bit key for :func:`shared_negatives` from non-negative integers (a seed, a stream,
    a step): each word mixed into the key in turn by splitmix64, so that keys of different
    words are unrelated."""
    key = 0
    for w in words:
        key = int(_splitmix(np.uint64(key ^ (int(w) & _MASK))))
    return key


@njit(cache=True, nogil=True)
def _draw(key, n_labels, size, labels, out):
    """Mark ``size`` ids of [0, n_labels) drawn uniformly without replacement (rejection: a
    drawn id already marked is drawn again; where more than half are wanted, the ids left out
    are drawn instead) and every id of ``labels`` in a bit set, then write the marked ids in
    increasing order into ``out``; returns their count, or -1 (nothing drawn) where a label lies
    outside [0, n_labels)."""
    for i in labels:
        if i < 0 or i >= n_labels:
            return -1
    n_words = (n_labels + 63) // 64
    bits = np.zeros(n_words, np.uint64)
    state = np.uint64(key)
    invert = 2 * size > n_labels
    want = n_labels - size if invert else size
    if invert:
        bits[:] = ~np.uint64(0)
        if n_labels % 64:  # no ids past the last
            bits[-1] = (np.uint64(1) << np.uint64(n_labels % 64)) - np.uint64(1)
    scale = float(n_labels) / 9007199254740992.0  # 53 random bits to [0, n_labels)
    m = 0
    while m < want:
        i = np.int64(float(_splitmix(state) >> np.uint64(11)) * scale)
        state += _GOLDEN
        w, b = i >> 6, np.uint64(1) << np.uint64(i & 63)
        if (bits[w] & b != 0) != invert:  # taken already (or, inverted, left out already)
            continue
        bits[w] ^= b
        m += 1
    for i in labels:
        bits[i >> 6] |= np.uint64(1) << np.uint64(i & 63)
    k = 0
    for w in range(n_words):
        x = bits[w]
        while x:
            lowest = x & (~x + np.uint64(1))
            out[k] = w * 64 + _LOWEST_BIT[(lowest * _DEBRUIJN) >> np.uint64(58)]
            k += 1
            x ^= lowest
    return k


def shared_negatives(key: int, n_labels: int, size: int,
                     batch_labels: np.ndarray) -> np.ndarray:
    """``size`` label ids drawn uniformly without replacement, joined with every label of the
    batch: sorted unique int32 ids. The draw is a function of ``key`` (uint64, see
    :func:`draw_key`) alone.

    The batch's labels make each sample's negatives include the other samples' labels, drawn as
    often as labels occur (docs/active-set.md). One pass of a numba kernel over a bit set of the
    labels, rather than numpy's draw without replacement, a sort and a mask; the labels' range
    is checked in that pass too, rather than by numpy's ``min`` and ``max`` between the step's
    kernels, which leave the caches cold.
    """
    size = min(int(size), n_labels)
    labels = np.asarray(batch_labels)
    if labels.dtype.kind != "i":
        labels = labels.astype(np.int64)
    out = np.empty(size + labels.size, np.int32)
    k = _draw(np.uint64(int(key) & _MASK), n_labels, size, labels, out)
    if k < 0:
        raise ValueError(f"batch labels must be in [0, {n_labels})")
    return out[:k]
