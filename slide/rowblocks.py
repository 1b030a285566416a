"""The memory layout the wide layers train in: one row block per layer.

A row block of ``W`` [n, H] is float32 [n, 3·H]: row i holds the weights of row i, then its
Adam first and second moments, so that a step touching a row reads and writes one contiguous
stretch of memory. The parameter and moment dicts hold views of the blocks; a block is made
again (a copy) when one of those arrays was replaced from outside.
"""
from __future__ import annotations

import numpy as np

from slide.runtime import aligned_empty

__all__ = ["RowBlocks", "BLOCKED"]

#: the layers that train in row blocks: the output layer and the input layer
BLOCKED = ("W", "W0")


class RowBlocks:
    """Row blocks over a parameter dict and a moment dict (``params[name]``,
    ``moments[name + ".m"]`` and ``moments[name + ".v"]``)."""

    def __init__(self, params: dict, moments: dict):
        self.params, self.moments = params, moments
        self._blocks = {}  # name: (block, its three views as made)

    def parts(self, name: str) -> tuple:
        """(dict, key) of the weights and the two moments a block of ``name`` holds."""
        return ((self.params, name), (self.moments, name + ".m"), (self.moments, name + ".v"))

    def make(self, name: str, shape: tuple, fill) -> None:
        """Make ``name``'s block for its [n, H] ``shape``: ``fill(part, d, key)`` writes each of
        its three column blocks, which then replaces ``d[key]``."""
        n, H = shape
        # on a cache line, so that a row of weights spans as few lines as it can
        B = aligned_empty((n, 3 * H), np.float32)
        views = []
        for j, (d, key) in enumerate(self.parts(name)):
            part = B[:, j * H:(j + 1) * H]
            fill(part, d, key)
            d[key] = part
            views.append((d, key, part))
        self._blocks[name] = (B, tuple(views))

    def live(self, name: str):
        """``name``'s block if the weights and both moments are still the views of it that
        :meth:`make` made, else None. Checked by identity: asking numpy where each view's
        memory starts costs more than a single row's query can spare."""
        held = self._blocks.get(name)
        if held is None:
            return None
        for d, key, part in held[1]:
            if d[key] is not part:
                return None
        return held[0]

    def ensure(self) -> dict:
        """Every layer's block, made (from the current arrays) where it is not live."""
        for name in BLOCKED:
            if self.live(name) is None:
                self.make(name, self.params[name].shape, lambda part, d, key: np.copyto(part, d[key]))
        return {name: self._blocks[name][0] for name in BLOCKED}

    def weight_rows(self, name: str) -> np.ndarray:
        """C-contiguous rows led by the weights of ``name``, for kernels that only read them:
        the block where the model trains, the plain matrix otherwise."""
        B = self.live(name)
        return self.params[name] if B is None else B

    def forget(self) -> None:
        """Drop the record of the blocks: the arrays stay, and the next :meth:`ensure` makes
        blocks of its own (a copied model must not train in its original's memory)."""
        self._blocks = {}
