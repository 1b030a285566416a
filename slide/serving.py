"""Serving a fitted network's top-k: the exact mode through an int8 screen, and the sub-linear
mode through hash tables that store every label.

A :class:`Server` answers for one :class:`slide.step.TrainingState`. What it builds on first use
(the int8 copies of the output layer, the serving tables) is built once however many query
threads ask at the same moment, and again after the weights move (it compares the state's
``version``). Queries may come from several threads; training must not run meanwhile.
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np

from lsh import CompactTables, TableConfig
from slide.ann import (DEFAULT_M, DEFAULT_RECALL, EF_CONSTRUCTION, calibrate, checked_recall,
                       make_index)
from slide.config import checked_setting
from slide.runtime import set_num_threads, thread_count
from slide.metrics import topk_product
from slide.screen import (SCREEN_MIN_LABELS, has_int8_dot, quantize_labels, quantize_rows,
                          screened_candidates, screened_topk)

__all__ = ["Server", "ServingSettings", "EXACT_BLOCK_ROWS", "CANDIDATES_PER_SLOT"]

#: rows per block of exact top-k (its kernel holds a tile of scores, not a block's matrix)
EXACT_BLOCK_ROWS = 1024
#: exact top-k of at most this many rows at a time goes through the int8 screen by label where
#: the tiled screen is not used (docs/serving.md: 1.7-10× faster up to here, slower at 16 rows
#: at 670K labels)
FEW_ROWS = 8
#: LSH serving's default candidates a row, per slot of training's bounded tables (tables ×
#: bucket size): a budget that does not grow with the serving tables, so that more tables find
#: better candidates within it (docs/serving.md)
CANDIDATES_PER_SLOT = 4

#: guards what serving builds on first use: two rehashes of the same tables at once would
#: corrupt them
_LOCK = threading.RLock()


class Server:
    """Top-k queries over a training state's output layer (see the module docstring).

    ``tables`` and ``candidates``: the serving tables and the candidates a row, None until
    :meth:`configure` or the first LSH query.
    """

    def __init__(self, state):
        self.state = state
        self.tables = None
        self.candidates = None
        self._built = {}  # name: (state version, object)
        self._tables_version = None
        self.ann = {}  # the settings of mode="ann"'s index (configure_ann)

    def restarted(self) -> "Server":
        """A server over the state as it is now (its output rows changed), with this one's
        serving settings."""
        out = Server(self.state)
        if self.tables is not None:
            out.configure(self.tables.config.L, self.candidates, self.tables.center)
        out.ann = dict(self.ann)
        if "ann" in self._built:  # not current (no version is None), but clusters start from it
            out._built["ann"] = (None, self._built["ann"][1])
        return out

    def current(self) -> None:
        """Bring the training tables (and serving tables) up to the weights, once."""
        s = self.state
        if s.tables_stale or (self.tables is not None and self._tables_version != s.version):
            with _LOCK:
                if s.tables_stale:
                    s.refresh_tables()
                if self.tables is not None and self._tables_version != s.version:
                    self.tables.rehash(s.params["W"])
                    self._tables_version = s.version

    def _once(self, name: str, build):
        """``build()``, made once for the state's version, however many threads ask."""
        version = self.state.version
        held = self._built.get(name)
        if held is None or held[0] != version:
            with _LOCK:
                held = self._built.get(name)
                if held is None or held[0] != version:
                    held = (version, build())
                    self._built[name] = held
        return held[1]

    def bias(self) -> np.ndarray:
        """The biases queries score with: the state's, plus its ``bias_shift`` (the prior
        correction) where it has one."""
        s = self.state
        if s.bias_shift is None:
            return s.params["b"]
        return self._once("bias", lambda: (s.params["b"] + s.bias_shift).astype(np.float32))

    def exact_screen(self):
        """The int8 copy of the output layer for exact top-k (:mod:`slide.screen`), or None
        where the float32 kernel is as fast (fewer than ``SCREEN_MIN_LABELS`` labels) or the
        CPU has no int8 dot product."""
        s = self.state
        if s.n_labels < SCREEN_MIN_LABELS or not has_int8_dot():
            return None
        return self._once("rows", lambda: quantize_rows(s.params["W"], self.bias()))

    def candidate_screen(self):
        """The int8 copy of the output layer by label that LSH serving scores its candidates
        from (:func:`slide.screen.screened_candidates`)."""
        s = self.state
        return self._once("labels", lambda: quantize_labels(s.params["W"], self.bias()))

    def _every_label(self, h, ids, scores) -> None:
        """The exact top-k of a few rows ``h``: every label a candidate of the int8 screen by
        label (:func:`slide.screen.screened_candidates`), which reads a quarter of the float32
        layer's bytes and rescores only what its bounds cannot rule out."""
        s = self.state
        labels = self._once("every", lambda: np.arange(s.n_labels, dtype=np.int32)[None])
        n = h.shape[0]
        parts = max(1, thread_count() // n)
        screened_candidates(h, s.weight_rows("W"), self.bias(), self.candidate_screen(), labels,
                            np.full(n, labels.shape[1], np.int64), parts, ids, scores)

    def configure(self, tables: int | None = None, candidates: int | None = None,
                  center: bool = True) -> None:
        """Build the serving tables (see :meth:`slide.SlideClassifier.set_serving`)."""
        s = self.state
        if s.tables is None:
            raise ValueError("every output is computed for this model: there are no tables to "
                             "serve from")
        # the training tables' shape, whichever source found the training's hard negatives
        config = TableConfig(**s.resolved["tables"])
        for name, value in (("tables", tables), ("candidates", candidates)):
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, (int, np.integer)) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        cfg = dataclasses.replace(config, L=int(tables or config.L))
        serving = CompactTables(int(s.sizes[-1]), s.n_labels, cfg, seed=s.hash_seed + 0x5EED,
                                center=center)
        version = s.version
        serving.build(s.params["W"])
        slots = config.L * config.bucket_size
        self.candidates = int(candidates or min(s.n_labels, CANDIDATES_PER_SLOT * slots))
        # the tables last, once built: a query on another thread takes them as they are set
        self._tables_version = version
        self.tables = serving

    def configure_ann(self, recall: float = DEFAULT_RECALL, **settings) -> None:
        """Settings of mode="ann"'s index (:func:`slide.ann.make_index`; ``recall``: what
        :func:`slide.ann.calibrate` aims at where the probe or beam is None), checked now; the
        index is built at the next such query."""
        make_index(**settings)  # checks them, and that the backend is installed
        self.ann = dict(settings, recall=checked_recall(recall))
        self._built.pop("ann", None)

    def label_index(self, held_out=None):
        """mode="ann"'s index of the output layer: built at the first such query, and again at
        the first after the weights move (clusters from the last ones' centroids, or a new
        graph: hnswlib's updates of moved points cost about as much as inserting them). Where
        its probe or beam was left to choose and ``held_out()`` gives hidden vectors of rows
        held out of training, each build chooses it for them (:func:`slide.ann.calibrate`;
        the index's ``calibration`` says what it found, else None)."""
        s = self.state
        held = self._built.get("ann")  # the index of an earlier state: clusters start from it

        def build():
            settings = dict(self.ann)
            recall = settings.pop("recall", DEFAULT_RECALL)
            W, b = s.params["W"], self.bias()
            index = make_index(**settings).build(W, b, thread_count(),
                                                 start=None if held is None else held[1])
            H = held_out() if held_out is not None and settings.get(index.knob) is None else None
            if H is not None and H.shape[0]:
                index.calibration = calibrate(index, W, b, H, recall, thread_count())
            return index
        return self._once("ann", build)

    def topk(self, hidden_blocks, n: int, k: int, mode: str, block: int | None, threads: int,
             held_out=None):
        """Top-k ``(ids int64 [n, k], scores float32 [n, k])`` of the rows whose last hidden
        layer ``hidden_blocks(block)`` yields as ``(lo, hi, h)``, on numba's ``threads`` (the
        count in force); ``held_out``: see :meth:`label_index`."""
        s = self.state
        if mode == "ann":
            index = self.label_index(held_out)
            parts = [index.query(h, k, threads)
                     for _, _, h in hidden_blocks(block or EXACT_BLOCK_ROWS)]
            if len(parts) == 1:  # a single row's query: no copy
                return parts[0]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        ids = np.empty((n, k), np.int64)
        scores = np.empty((n, k), np.float32)
        W, b = s.params["W"], self.bias()
        if mode == "exact" or s.tables is None:
            # the fused kernels never form a block's score matrix, so blocks can be larger
            screen = self.exact_screen()
            for lo, hi, h in hidden_blocks(block or EXACT_BLOCK_ROWS):
                if screen is not None:
                    ids[lo:hi], scores[lo:hi] = screened_topk(h, W, b, k, screen)
                elif hi - lo <= FEW_ROWS:
                    self._every_label(h, ids[lo:hi], scores[lo:hi])
                else:
                    ids[lo:hi], scores[lo:hi] = topk_product(h, W, b, k)
            return ids, scores
        if self.tables is None:
            with _LOCK:
                if self.tables is None:
                    self.configure()
        tables, n_cand = self.tables, self.candidates
        screen = self.candidate_screen()
        # a block's candidates take 8 bytes each (their ids, their int8 bounds): about 64 MB
        block = block or max(1, min(4096, (1 << 23) // n_cand))
        for lo, hi, h in hidden_blocks(block):
            cand, n_c = tables.query(h, n_cand)
            # fewer rows than threads: each row's candidates split among them
            parts = max(1, threads // h.shape[0])
            screened_candidates(h, s.weight_rows("W"), b, screen, cand, n_c, parts,
                                ids[lo:hi], scores[lo:hi])
        return ids, scores


class ServingSettings:
    """The estimator's serving settings and the checks every query starts with, over its
    ``server_`` (a :class:`Server`) and its ``threads`` parameter."""

    def set_serving(self, tables: int | None = None, candidates: int | None = None,
                    center: bool = True):
        """The hash tables of ``predict_topk(mode="lsh")``, apart from training's.

        ``tables``: how many tables to query (default: as many as training's), with training's
        hash family, K and buckets; they store every label, at ``tables × n_labels × 4`` bytes.
        More tables find more of the exact top-k at a higher cost per query. ``candidates``:
        the most labels scored a row, those found in the most tables (default: four times the
        most training's bounded tables could return, tables × bucket size; at most every
        label). ``center``: hash the output rows less their mean row, which ranks the labels as
        the rows do while the large mean that trained rows share no longer gives most of them
        the same codes (docs/serving.md). Built at the first LSH query where this was not
        called, and rehashed as the weights move; not saved with the model.
        """
        self._require_current()
        self.server_.configure(tables, candidates, center)
        return self

    def set_ann(self, backend: str | None = None, probe: float | None = None,
                clusters: int | None = None, ef: int | None = None, M: int = DEFAULT_M,
                ef_construction: int = EF_CONSTRUCTION, recall: float = DEFAULT_RECALL):
        """The index of ``predict_topk(mode="ann")`` (:mod:`slide.ann`).

        ``backend="clusters"`` (the default) is the engine's own: k-means clusters of the label
        vectors (output rows with their biases), each label in two; a query scores
        the ``probe`` share of the entries (two a label) in the clusters whose centroids score
        best, from an int8 copy, and rescores the best of them in float32. ``clusters``: how
        many (default 8 √labels, a power of two).
        ``"hnswlib"`` or ``"faiss"``: an HNSW graph from that library (the ``ann`` extra), with
        ``ef`` the query beam and ``M``, ``ef_construction`` the graph's degree and build beam.
        More ``probe`` or ``ef`` finds more of the exact top-k, slower. Left None, it is chosen
        at each build as the least that finds ``recall`` of the exact top-10 of the rows held
        out of training (``held_out_``: up to 512 of the validation rows, kept where ``fit``
        had them and did not train on them, and saved with the model unless set to None
        first; the index's ``calibration`` says what it chose and found); without such rows,
        probe 0.05 or ef 64. Built at the first such query, and again at the first after the
        weights change; not saved with the model."""
        self._require_fitted()
        self.server_.configure_ann(backend=backend, ef=ef, M=M, ef_construction=ef_construction,
                                   probe=probe, clusters=clusters, recall=recall)
        return self

    def _query_threads(self) -> int:
        """numba's threads for a query from the ``threads`` parameter as it is now:
        ``set_params(threads=N)`` on a fitted model takes effect at its next query."""
        return set_num_threads(checked_setting("threads", self.threads))

    def _require_current(self) -> int:
        """Serving starts here: the model exists, and its tables reflect its weights; returns
        numba's thread count for the query."""
        self._require_fitted()
        threads = self._query_threads()
        self.server_.current()
        return threads
