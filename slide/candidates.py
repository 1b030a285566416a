"""Each sample's hard negatives from the output layer's label clusters (``negatives_from=
"clusters"``), in place of its LSH tables.

A query of :class:`slide.clusters.LabelClusters` finds most of a hidden vector's exact top
scores where a random projection's buckets find few (docs/active-set.md): the negatives a step
learns most from are the labels the model ranks highest. The source answers the training step
as the tables do, with ``(codes, buckets, seen)``: sample r's one bucket is its own list of
candidates, so the step's selection (:func:`slide.kernels.select_active`) takes them as it takes
a table's. It follows the weights on the tables' schedule: a rehash re-indexes the layer in the
clusters it has, a rebuild moves the clusters (k-means from the last centroids).
"""
from __future__ import annotations

import numpy as np
from numba import get_num_threads

from lsh import HashTables, TableConfig
from slide.clusters import LabelClusters, cluster_count
from slide.grouped import PAIR

__all__ = ["ClusterCandidates", "output_source", "CLUSTERS_DIVISOR"]

#: a quarter of serving's clusters, each label in one: training re-indexes the layer often, and
#: this index is built in a sixth of the time for the same P@1 per sample (docs/active-set.md)
CLUSTERS_DIVISOR = 4


def output_source(resolved: dict, n_labels: int, params: dict, width: int, seed: int,
                  hash_seed: int):
    """The sampled output layer's source of hard negatives for settings ``resolved``: its LSH
    tables (seeded ``hash_seed``), or its label clusters (k-means seeded ``seed``)."""
    if resolved.get("negatives_from") == "clusters":
        return ClusterCandidates(n_labels, params, resolved["cluster_negatives"], seed=seed)
    return HashTables(width, n_labels, TableConfig(**resolved["tables"]), seed=hash_seed)


class ClusterCandidates:
    """Hard negatives of an output layer of ``n_labels`` rows from its label clusters.

    ``params``: the model's parameter dict, whose ``"b"`` the index reads beside the ``W`` it
    is given; ``ask``: candidates a sample; ``seed``: k-means' first centroids.
    """

    def __init__(self, n_labels: int, params: dict, ask: int, seed: int = 0):
        self.n_labels, self.params, self.ask, self.seed = int(n_labels), params, int(ask), seed
        self.index = None
        self.builds = 0  # times the clusters were found (k-means), as the tables count theirs

    @property
    def query_shape(self) -> tuple:
        """(tables, bucket size) of what :meth:`lookup` returns: one, of ``ask`` ids."""
        return 1, max(1, self.ask)

    @property
    def nbytes(self) -> int:
        """The index's memory beside the layer (none before the first build)."""
        return self.index.nbytes if self.index is not None and self.index.q is not None else 0

    @staticmethod
    def expected_bytes(n_labels: int, width: int) -> tuple[int, int]:
        """``(held, passing)``: the bytes the index of an output layer of ``n_labels`` rows of
        ``width`` holds (its int8 copy, clusters padded to whole pairs of groups, each entry's
        scale, bias, sum and label, each label's cluster, the centroids and their 4-bit copy),
        and those a build or refresh adds while it runs (the new index beside the old, and the
        layer's int8 rows before they are laid out)."""
        k = max(1, cluster_count(n_labels) // CLUSTERS_DIVISOR)
        depth = -(-width // 4) * 4
        entries = n_labels + (PAIR - 1) * k  # each cluster padded up to a whole pair
        held = entries * (depth + 16) + 4 * n_labels + k * (4 * (width + 1) + depth // 2 + 12)
        return held, held + n_labels * (width + 16)

    def _build(self, W) -> None:
        index = LabelClusters(clusters=max(1, cluster_count(self.n_labels) // CLUSTERS_DIVISOR),
                              seed=self.seed, spill=False)
        start = self.index if self.index is not None and self.index.n == W.shape[0] else None
        self.index = index.build(W, self.params["b"], threads=get_num_threads(), start=start)
        self.builds += 1

    def rehash(self, W) -> None:
        """Re-index the layer's current rows in the clusters it has (built where there are
        none, or where the layer has grown)."""
        if self.ask == 0:
            return
        if self.index is None or self.index.n != W.shape[0]:
            self._build(W)
        else:
            self.index.refresh(W, self.params["b"])

    def rebuild(self, W, seed: int | None = None) -> None:
        """Move the clusters to the layer's current rows (k-means from the last centroids)."""
        if self.ask:
            self._build(W)

    def arrays(self) -> dict:
        """What a checkpoint keeps of the clusters (none before the first build): a resumed
        run re-indexes its layer in the same clusters, as the run it continues does."""
        if self.index is None:
            return {}
        return {"clusters.centroids": self.index.centroids, "clusters.assign": self.index.assign}

    def restore(self, centroids: np.ndarray, assign: np.ndarray, W) -> None:
        """The layer ``W`` indexed in the clusters a checkpoint kept (:meth:`arrays`)."""
        self.index = LabelClusters(clusters=centroids.shape[0], seed=self.seed,
                                   spill=False).assigned(W, self.params["b"], centroids, assign)

    def lookup(self, h: np.ndarray):
        """``(codes, buckets, seen)`` for hidden rows ``h`` [n, hidden]: row r's code is r,
        and bucket r of the one table holds its ``ask`` best-scoring labels by the index."""
        n = h.shape[0]
        if self.ask == 0:  # no hard negatives: no table to read
            return np.zeros((n, 1), np.int32), np.zeros((0, 1, 1), np.int32), \
                np.zeros((0, 1), np.int32)
        # the step scores its candidates itself: their int8 estimates rank them
        ids, _ = self.index.query(h, self.ask, threads=get_num_threads(), rescore=False)
        # a row whose clusters hold fewer labels than it asks gets its answer padded with -1
        # at the end: its bucket's fill stops before them
        seen = (ids >= 0).sum(axis=1).astype(np.int32)[None]
        return np.arange(n, dtype=np.int32)[:, None], ids.astype(np.int32)[None], seen

