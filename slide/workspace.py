"""The training step's scratch: buffers made once and grown when a batch needs more.

The kernels of :mod:`slide.kernels` allocate nothing per sample; everything they write between
steps lives here: the marks and slots of the rows a step touches, the step's compact gradients,
the active sets, per-thread logits and the shared pool's blocks.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from lsh.tables import QueryScratch
from slide.runtime import aligned_empty, aligned_zeros, thread_count

__all__ = ["StepWorkspace"]


class StepWorkspace:
    """Scratch of one model's training step.

    Between steps the row marks (``owners``, ``owners_in``) are 0, the pool positions -1 and
    its bits 0, and the compact gradients zero: the kernels that set them clear them.
    ``grads`` holds the small dense parameters' gradients (``b0``, ``Wh``, ``bh``, full size)
    and the compact ones: ``W`` [S, H] and ``b`` [S], row k for the k-th output row a step adds
    gradients to (its slot, :func:`slide.kernels.mark_rows`), and ``W0`` [S0, H0] likewise. A
    full-size accumulator would hold a row for every label, and its pages, written at random
    rows, would all come back within an epoch.
    """

    def __init__(self, params: dict, n_labels: int, lsh_cap: int, pool: int, query_shape,
                 widest: int):
        n_features = params["W0"].shape[0]
        self.n_labels, self.lsh_cap, self.pool = n_labels, lsh_cap, pool
        self.query_shape, self.widest = query_shape or (1, 1), widest
        self.H, self.H0 = params["W"].shape[1], params["W0"].shape[1]
        self.grads = {k: np.zeros(params[k].shape, np.float32) for k in ("b0", "Wh", "bh")}
        # kernels.mark_rows' marks of the output rows and mark_ids' of the input rows, and the
        # rows' slots in a step's compact gradients
        self.owners = np.zeros(n_labels, np.uint8)
        self.owners_in = np.zeros(n_features, np.uint8)
        self.slots = np.zeros(n_labels, np.int32)
        self.slots_in = np.zeros(n_features, np.int32)
        # a label's place in the step's pool, and its membership bit
        self.pool_pos = np.full(n_labels, -1, np.int32)
        self.pool_bits = np.zeros((n_labels + 7) // 8, np.uint8)
        self.in_lists = np.empty((3, 0), np.int32)
        self.pairs = (np.zeros(1, np.int64), np.empty(0, np.int32), np.empty(0, np.float32))
        self._numbers = np.arange(0, dtype=np.int32)
        #: output_step's normaliser where the softmax is over this layer alone: none given
        self.no_norm = np.zeros((0, 3), np.float32)
        self.no_logits = np.zeros((0, 1), np.float32)
        self._key = None
        self._pool_buf = None

    def fit(self, n_rows: int, max_labels: int, nnz: int) -> None:
        """Grow the buffers for a batch of ``n_rows`` rows, at most ``max_labels`` labels a row
        and ``nnz`` non-zero features."""
        t = thread_count()
        width = self.lsh_cap + max_labels
        n_features = self.owners_in.size
        need = min(nnz, n_features)  # the batch's distinct features, at most
        if "W0" not in self.grads or self.grads["W0"].shape[0] < need:
            # a quarter more room, so that a slightly fuller batch does not allocate again
            self.grads["W0"] = aligned_zeros((min(need + need // 4, n_features), self.H0), np.float32)
        if self.in_lists.shape[1] < nnz:
            room = nnz + nnz // 4
            self.in_lists = np.empty((3, room), np.int32)  # kernels.mark_ids' lists
            # kernels.backward_hidden's entries of the shared input rows, grouped by row
            self.pairs = (np.empty(room + 1, np.int64), np.empty(room, np.int32),
                          np.empty(room, np.float32))
        old = self._key
        if old is None or old[0] != t or old[1] < width or old[2] < n_rows:
            width = max(width, old[1] if old else 0)
            n_rows = max(n_rows, old[2] if old else 0)
            self.query = QueryScratch(t, *self.query_shape, width, self.n_labels)
            self.active = np.zeros((n_rows, width), np.int32)
            self.n_active = np.zeros(n_rows, np.int64)
            self.logits = np.zeros((t, width), np.float32)
            self.dbuf = np.zeros((t, 2 * self.widest), np.float32)
            self.dH = np.empty((n_rows, self.H), np.float32)
            self.d_first = np.empty((n_rows, self.H0), np.float32)
            self.losses = np.empty(n_rows, np.float32)
            # a label shard's softmax parts and its samples' own logits
            self.stats = np.empty((n_rows, 2), np.float32)
            self.own_logits = np.empty((n_rows, width), np.float32)
            self.touched = np.zeros(n_rows * width + self.pool, np.int32)
            self.shared = np.zeros_like(self.touched)
            self.in_place = np.zeros_like(self.touched)
            rows = min(self.touched.size, self.n_labels)  # the step's distinct rows, at most
            self.grads["W"] = aligned_zeros((rows, self.H), np.float32)
            self.grads["b"] = np.zeros(rows, np.float32)
            self._key = (t, width, n_rows)

    def pool_blocks(self, n_rows: int, n_pool: int, width: int, threads: int):
        """Contiguous float32 blocks for the shared pool's step, cut from one buffer kept across
        batches (fresh megabyte arrays page-fault on every batch): its weight rows [P, H], its
        logits (then logit gradients) [n, P], its weight gradients [P, H], a vector over it [P]
        (biases, then column sums) and the threads' shares of the hidden gradient [T, n, H]."""
        shapes = ((n_pool, width), (n_rows, n_pool), (n_pool, width), (n_pool,),
                  (threads, n_rows, width))
        # plain integers: numpy's prod and cumsum on small tuples cost more than the step spares
        ends = list(itertools.accumulate((math.prod(shape) for shape in shapes), initial=0))
        if self._pool_buf is None or self._pool_buf.size < ends[-1]:
            self._pool_buf = aligned_empty(ends[-1], np.float32)  # the gathered rows on lines
        return tuple(self._pool_buf[lo:hi].reshape(shape)
                     for lo, hi, shape in zip(ends[:-1], ends[1:], shapes))

    def first_numbers(self, n: int) -> np.ndarray:
        """0, 1, ..., n - 1 (int32; the rows of a compact gradient), cut from one array kept
        across steps rather than made by ``np.arange`` between kernels that leave caches cold."""
        if self._numbers.size < n:
            self._numbers = np.arange(n + n // 4, dtype=np.int32)
        return self._numbers[:n]
