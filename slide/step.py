"""The training state and its step: what the loop, data parallelism and the heterogeneous
trainer drive.

:class:`TrainingState` holds a fitted network's arrays (parameters, Adam moments, in row blocks
for the wide layers), the hash tables of its sampled layers and their rehash schedule, the
step's scratch, and the counters a checkpoint keeps. Its API is small:

* :meth:`TrainingState.fresh` / :meth:`TrainingState.from_checkpoint` make one;
* :meth:`train_epoch` (a rehash, then batches), :meth:`train_rows` (batches only, for streams)
  and :meth:`train_step` (one batch of preprocessed rows);
* :meth:`apply_gradients`: one Adam step from compact gradients computed elsewhere (the GPU
  worker), the same update the step makes;
* :meth:`params_changed`: the weights moved outside a step (averages across ranks, a restore);
  serving compares :attr:`version` to know its copies are stale;
* :meth:`forward`, :meth:`snapshot` / :meth:`restore`, :meth:`counters` for checkpoints.
"""
from __future__ import annotations

import time

import numba
import numpy as np
import scipy.sparse as sp

from lsh import HashTables, TableConfig
from slide import kernels
from slide.candidates import ClusterCandidates, output_source
from slide.config import hidden_block, hidden_blocks, init_parameters, parameter_shapes
from slide.data import take_rows
from slide.preprocess import UNWEIGHED
from slide.rowblocks import BLOCKED, RowBlocks
from slide.runtime import engine_threads, thread_chunks
from slide.sampling import draw_key, shared_negatives
from slide.workspace import StepWorkspace

__all__ = ["TrainingState", "run_batches"]


class TrainingState:
    """A network's training state (see the module docstring).

    Attributes: ``config`` (:class:`slide.config.SlideConfig`), ``resolved`` (its concrete
    settings), ``n_features``, ``n_labels``, ``params`` and ``moments`` (dicts of float32
    arrays; ``W``, ``W0`` and their moments are views of :meth:`row_blocks` once it trains),
    ``tables`` (the output layer's, None where every output is computed) and ``hidden_tables``,
    ``step``, ``samples_seen``, ``learning_rate``, ``hash_seed``, ``timings`` (seconds per
    phase), ``distributed`` (a :class:`slide.distributed.DataParallel` while one drives it).
    """

    def __init__(self, config, resolved: dict, n_features: int, n_labels: int, params: dict,
                 moments: dict, counters: dict | None = None):
        self.config, self.resolved = config, resolved
        self.n_features, self.n_labels = int(n_features), int(n_labels)
        self.params, self.moments = params, moments
        c = counters or {}
        r = resolved
        self.step = int(c.get("step", 0))
        self.samples_seen = int(c.get("samples_seen", 0))
        self.learning_rate = float(c.get("learning_rate", r["lr"]))
        self.hash_seed = int(c.get("hash_seed", config.seed))
        self.next_rehash = int(c.get("next_rehash", r["rehash_every"]))
        self.rehash_interval = float(c.get("rehash_interval", r["rehash_every"]))
        self.next_rebuild = int(c.get("next_rebuild", r["rebuild_every"]))
        self.blocks = RowBlocks(self.params, self.moments)
        self.timings = {}
        self.distributed = None
        self.version = 0
        self.tables_stale = False
        #: what prediction adds to the biases (the estimator's prior correction), or None
        self.bias_shift = None
        self.sizes = sizes = np.array(r["hidden"], np.int64)
        self.n_acts = int(sizes.sum())  # every hidden layer's activations side by side
        self.layers = hidden_blocks(r["hidden"])
        # the kernels take the offsets as arrays (at least one entry, even with no stack)
        self.h_off = np.array([b[0] for b in self.layers] or [0], np.int64)
        self.b_off = np.array([b[1] for b in self.layers] or [0], np.int64)
        self.tables = output_source(r, self.n_labels, params, int(sizes[-1]), config.seed,
                                    self.hash_seed) if r["sampled"] else None
        self.hidden_tables = [None] * sizes.size
        for l, layer in enumerate(r["hidden_layers"]):
            if layer is not None:
                self.hidden_tables[l] = HashTables(int(sizes[l - 1]), int(sizes[l]),
                                                   TableConfig(**layer["tables"]),
                                                   seed=self.layer_seed(l))
        self.work = StepWorkspace(params, self.n_labels, r["lsh_cap"], r["pool"],
                                  self.tables.query_shape if self.tables is not None else None,
                                  int(sizes.max()))

    # -- making one ----------------------------------------------------------------------------
    @classmethod
    def fresh(cls, config, resolved: dict, n_features: int, n_labels: int, seen_features,
              first_row: int = 0):
        """Initial parameters for ``config.seed``, zero moments, the tables hashed from them
        (``first_row``: the output rows are a label shard's, from that row of the whole
        layer's, :func:`slide.config.init_parameters`)."""
        params = init_parameters(resolved["hidden"], n_features, n_labels, config.seed,
                                 seen_features, resolved["input_init"], first_row)
        # np.zeros maps zero pages lazily: the moments take no memory before the row blocks
        # copy them (np.zeros_like writes every page)
        moments = {f"{k}.{s}": np.zeros(v.shape, v.dtype) for k, v in params.items() for s in "mv"}
        state = cls(config, resolved, n_features, n_labels, params, moments)
        # its weights go into their row blocks now, so that the tables are first hashed from
        # them (a rehash in a timed step then compiles nothing)
        state.row_blocks()
        state.refresh_tables()
        return state

    @classmethod
    def from_checkpoint(cls, ck, config, resolved: dict):
        """The state a :class:`slide.checkpoint.Checkpoint` holds (shapes validated). A
        checkpoint with moments was saved to train on: its ``W`` and ``W0`` are read straight
        into their row blocks (read whole and then copied, they would be held beside their
        blocks, above the peak of training itself)."""
        shapes = parameter_shapes(resolved["hidden"], ck.n_features, ck.labels.size)
        blocked = [k for k in BLOCKED if f"adam.{k}.m" in ck and f"adam.{k}.v" in ck]
        rest = {k: v for k, v in shapes.items() if k not in blocked}
        params = ck.arrays_like(rest)
        moments = ck.arrays_like(rest, prefix="adam.", suffixes=(".m", ".v"), zeros=True)
        blocks = RowBlocks(params, moments)
        for name in blocked:
            blocks.make(name, shapes[name], lambda part, d, key, name=name: ck.read_into(
                key if key == name else f"adam.{key}", part))
        # the order saved and exchanged
        ordered_p = {k: params[k] for k in shapes}
        ordered_m = {f"{k}.{s}": moments[f"{k}.{s}"] for k in shapes for s in "mv"}
        params.clear(), params.update(ordered_p)
        moments.clear(), moments.update(ordered_m)
        r = resolved
        counters = {"step": ck.step, "samples_seen": ck.int("samples_seen", 0, minimum=0),
                    "learning_rate": ck.float("learning_rate", r["lr"], positive=True),
                    "hash_seed": ck.int("hash_seed", config.seed, minimum=0, maximum=2 ** 32 - 1),
                    "next_rehash": ck.int("next_rehash", r["rehash_every"], minimum=0),
                    "rehash_interval": ck.float("rehash_interval", r["rehash_every"], positive=True),
                    "next_rebuild": ck.int("next_rebuild", r["rebuild_every"], minimum=0)}
        state = cls(config, resolved, ck.n_features, ck.labels.size, params, moments, counters)
        state.blocks = blocks
        kept = ck.label_clusters(state.n_labels, int(state.sizes[-1]))
        if kept is not None and isinstance(state.tables, ClusterCandidates):
            state.tables.restore(*kept, state.params["W"])
        state.refresh_tables()
        return state

    def add_outputs(self, W_new: np.ndarray, b_new: np.ndarray) -> None:
        """Append output rows ``W_new`` [m, H] with biases ``b_new`` [m] (zero moments): the
        output layer's row block is made again (a copy of the layer), its tables and the step's
        scratch are sized for the new count, and the rows are hashed in."""
        p, m = self.params, self.moments
        grown = {"W": np.concatenate((p["W"], W_new.astype(np.float32))),
                 "b": np.concatenate((p["b"], b_new.astype(np.float32)))}
        zeros = {f"{k}.{s}": np.concatenate((m[f"{k}.{s}"], np.zeros(v.shape, np.float32)))
                 for k, v in (("W", W_new), ("b", b_new)) for s in "mv"}
        # the new arrays replace the block's views; the next row_blocks() copies them into one
        p.update(grown), m.update(zeros)
        self.n_labels += int(b_new.size)
        self.row_blocks()
        if self.tables is not None:
            self.tables = output_source(self.resolved, self.n_labels, p, int(self.sizes[-1]),
                                        self.config.seed, self.hash_seed)
        w = self.work
        self.work = StepWorkspace(p, self.n_labels, w.lsh_cap, w.pool, w.query_shape, w.widest)
        self.params_changed()
        self.refresh_tables()

    def counters(self) -> dict:
        """What a checkpoint keeps besides the arrays (:meth:`from_checkpoint` reads it)."""
        return {"step": self.step, "samples_seen": self.samples_seen,
                "learning_rate": self.learning_rate, "hash_seed": self.hash_seed,
                "next_rehash": self.next_rehash, "rehash_interval": self.rehash_interval,
                "next_rebuild": self.next_rebuild}

    def __getstate__(self):
        # a copy (pickle, deepcopy) makes row blocks of its own when it trains: copied blocks
        # and copied views would pass the identity check, and the copy would train one block
        # and predict from another
        state = dict(vars(self))
        state["blocks"] = RowBlocks(state["params"], state["moments"])
        state["distributed"] = None
        return state

    # -- memory layout ---------------------------------------------------------------------------
    def row_blocks(self) -> dict:
        """The row blocks ``W`` and ``W0`` train in (:mod:`slide.rowblocks`), made where the
        arrays are not their views (a model loaded to serve keeps plain arrays until it
        trains: its moments are zeros that take no memory until written)."""
        return self.blocks.ensure()

    def weight_rows(self, name: str) -> np.ndarray:
        """C-contiguous rows led by the weights of ``W`` or ``W0`` (see :class:`RowBlocks`)."""
        return self.blocks.weight_rows(name)

    def snapshot(self, out: dict | None = None) -> dict:
        """A copy of the parameters; with ``out``, an earlier snapshot of the same arrays, copied
        into its arrays instead of new ones (early stopping's best weights: a second copy beside
        the first would set the peak memory of a whole run)."""
        return copy_params(self.params, out)

    def restore(self, params: dict) -> None:
        """Put parameters from :meth:`snapshot` back in place."""
        for k, v in params.items():
            self.params[k][...] = v
        self.params_changed()

    def params_changed(self) -> None:
        """The weights moved: the tables are stale, and serving's copies with them."""
        self.tables_stale = True
        self.version += 1

    # -- forward ---------------------------------------------------------------------------------
    def layer_seed(self, l: int) -> int:
        """Hash seed of hidden layer l's tables (the output layer's is ``hash_seed``)."""
        return self.hash_seed + 7919 * l

    def hidden_layer(self, l: int):
        """Weights [H_l, H_{l-1}] and bias [H_l] of hidden layer l >= 1 (views into Wh, bh)."""
        return hidden_block(self.params, self.layers[l - 1])

    def forward(self, X: sp.csr_matrix, weighing=None) -> np.ndarray:
        """Activations of every hidden layer, float32 [n, Σ hidden], of preprocessed rows, or
        of raw rows weighed as read by ``weighing`` (:meth:`Preprocessor.weighing`)."""
        p, sizes = self.params, self.sizes
        acts = np.empty((X.shape[0], self.n_acts), np.float32)
        relu = self.resolved["activation"] == "relu"
        kernels.forward_input(X.indptr.astype(np.int64), X.indices, X.data,
                              *(weighing or UNWEIGHED), self.weight_rows("W0"), p["b0"], relu, acts)
        lo = 0
        for l in range(1, sizes.size):
            W, b = self.hidden_layer(l)
            tables = self.hidden_tables[l]
            if tables is None:
                active = np.zeros((X.shape[0], 0), np.int32)
                n_active = np.zeros(X.shape[0], np.int64)
            else:
                codes = tables.family.hash_dense(acts[:, lo:lo + int(sizes[l - 1])])
                active, n_active = tables.query_codes(
                    codes, self.resolved["hidden_layers"][l]["target"], rank=True)
            kernels.forward_layer(acts, lo, lo + int(sizes[l - 1]), W, b, active, n_active, relu)
            lo += int(sizes[l - 1])
        return acts

    def last(self, acts: np.ndarray) -> np.ndarray:
        """The last hidden layer's columns of :meth:`forward`'s activations (unsliced alone)."""
        return acts if self.sizes.size == 1 else acts[:, acts.shape[1] - int(self.sizes[-1]):]

    # -- training --------------------------------------------------------------------------------
    def _tick(self, name, t0):
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0
        return time.perf_counter()

    def begin_epoch(self) -> None:
        """Rehash the tables with the current weights. Every epoch starts with it, so a run
        resumed from a checkpoint (whose tables are rebuilt on load) continues exactly."""
        self.refresh_tables()

    def threads(self) -> int | None:
        """The numba threads a step runs on: the setting, else the host's share of a rank."""
        if self.config.threads is None and self.distributed is not None:
            return self.distributed.threads  # ranks on one host share its cores
        return self.config.threads

    def train_epoch(self, Xp, Y, order, progress=None, learning_rate: float | None = None) -> dict:
        """One epoch at ``learning_rate`` (None: the current one): a rehash
        (:meth:`begin_epoch`), then :meth:`train_rows`."""
        if learning_rate is not None:
            self.learning_rate = float(learning_rate)
        self.begin_epoch()
        return self.train_rows(Xp, Y, order, progress)

    def train_rows(self, Xp, Y, order, progress=None, batch_size=None, threads=None) -> dict:
        """One pass in ``order`` over preprocessed rows, in batches of ``batch_size`` (default:
        the resolved) on ``threads`` (the model's); the tables rehash on their schedule only."""
        with engine_threads(threads or self.threads()):
            batch = batch_size or self.resolved["batch_size"]
            return run_batches(self.train_step, Xp, Y, order, batch, progress, "slide")

    def updates_in_place(self) -> bool:
        """Whether rows with one source of gradient get their Adam step in the kernel that
        computes it: not where ranks sum their gradients before the update."""
        return self.distributed is None or not self.distributed.sums_gradients

    def train_step(self, Xb: sp.csr_matrix, Yb: sp.csr_matrix) -> float:
        """One optimizer step on a batch of preprocessed rows ``Xb`` (float32 CSR, sorted
        indices) with labels ``Yb`` (CSR indicator); returns the batch's mean loss. Call it
        inside :func:`slide.runtime.engine_threads` for the model's thread count."""
        p, w = self.params, self.work
        blocks = self.row_blocks()
        n = Xb.shape[0]
        w.fit(n, kernels.longest_row(Yb.indptr), Xb.indices.size)
        g = w.grads
        n_threads = numba.get_num_threads()  # the per-sample kernels' loops, one per thread
        y_indptr = Yb.indptr.astype(np.int64)
        t0 = time.perf_counter()
        acts = self.forward(Xb)
        h = self.last(acts)
        t0 = self._tick("forward_hidden", t0)
        if self.tables is not None:
            codes, buckets, seen = self.tables.lookup(h)
            pool = shared_negatives(draw_key(self.config.seed, 1, self.step), self.n_labels,
                                    self.resolved["pool"], Yb.indices)
        else:  # every neuron active: the pool is all of them
            codes = np.zeros((n, 1), np.int32)
            buckets, seen = np.zeros((0, 1, 1), np.int32), np.zeros((0, 1), np.int32)
            pool = np.arange(self.n_labels, dtype=np.int32)
        t0 = self._tick("hash", t0)
        # the shared pool is a dense block: its logits and gradients are matrix products
        pool_bounds = thread_chunks(pool.size)  # each thread's block of the pool
        W_pool, z_pool, g_pool, pool_vec, dH_parts = w.pool_blocks(n, pool.size, h.shape[1],
                                                                   pool_bounds.size - 1)
        h_pool = np.ascontiguousarray(h)  # a view into acts' columns when there are 2+ layers
        kernels.pool_logits(h_pool, blocks["W"], p["b"], pool, W_pool, z_pool, pool_vec,
                            pool_bounds, kernels.POOL_CHUNK)
        t0 = self._tick("pool_matmul", t0)
        qs = w.query
        kernels.select_active(y_indptr, Yb.indices, codes, buckets, seen, qs.slots, qs.where,
                              qs.cand, qs.hits, qs.hist, self.resolved["lsh_cap"], pool,
                              w.pool_pos, w.pool_bits, z_pool, w.active, w.n_active, n_threads)
        dp = self.distributed
        sharded = dp is not None and dp.mode == "labels"
        norm, own_logits = w.no_norm, w.no_logits
        if sharded:  # the softmax is normalised over every shard
            stats, own_logits = w.stats[:n], w.own_logits
            kernels.logit_stats(acts, h.shape[1], blocks["W"], p["b"], z_pool, w.active,
                                w.n_active, stats, own_logits)
            t0 = self._tick("logit_stats", t0)
            norm = dp.normaliser(stats, Yb)
            t0 = self._tick("exchange", t0)
        # a row whose whole gradient one kernel computes gets its Adam step there
        in_place = self.updates_in_place()
        n_touched, n_shared = kernels.mark_rows(pool, w.active[:n], w.n_active[:n], w.owners,
                                                in_place, w.touched, w.slots, w.shared)
        hyper = (*self.adam_hyper(self.step + 1), self.resolved["weight_decay"])
        dH, losses = w.dH[:n], w.losses[:n]
        m = self.moments
        loss = kernels.output_step(y_indptr, acts, blocks["W"], p["b"], g["W"], g["b"], m["b.m"],
                                   m["b.v"], w.owners, w.slots, z_pool, w.active, w.n_active,
                                   n_threads, w.logits, dH, losses, norm, own_logits, *hyper)
        t0 = self._tick("select+output", t0)
        kernels.pool_gradients(h_pool, W_pool, z_pool, pool, dH, blocks["W"], p["b"], g["W"],
                               g["b"], m["b.m"], m["b.v"], w.owners, w.slots, g_pool, pool_vec,
                               dH_parts, pool_bounds, kernels.POOL_CHUNK, *hyper)
        t0 = self._tick("pool_matmul", t0)
        if sharded:  # every shard's share of the hidden gradient, and of the loss
            loss = dp.sum_shards(dH, loss)
            t0 = self._tick("exchange", t0)
        # the batch's input rows: a feature in one sample's row only (most of them) gets its
        # Adam step in that sample's backward pass
        in_touched, in_rows, in_alone = w.in_lists[:, :Xb.indices.size]
        n_in, n_in_shared = kernels.mark_ids(Xb.indices, w.owners_in, in_place, in_touched,
                                             w.slots_in, in_rows)
        kernels.backward_hidden(Xb.indptr.astype(np.int64), Xb.indices, Xb.data, acts, dH,
                                blocks["W0"], w.owners_in, w.slots_in, n_in_shared, p["Wh"],
                                self.h_off, self.sizes, g["W0"], g["b0"], g["Wh"], g["bh"],
                                self.b_off, n_threads, w.dbuf, w.d_first[:n], *w.pairs,
                                self.resolved["activation"] == "relu", *hyper)
        t0 = self._tick("backward_hidden", t0)
        # the rows updated in place are listed only for data parallelism's averages
        listed = dp is not None
        n_in_place = kernels.clear_marks(w.owners, w.touched[:n_touched],
                                         w.in_place if listed else w.in_place[:0])
        n_in_alone = kernels.clear_marks(w.owners_in, in_touched[:n_in],
                                         in_alone if listed else in_alone[:0])
        out_rows, in_rows = w.shared[:n_shared], in_rows[:n_in_shared]
        in_alone = in_alone[:n_in_alone]
        # the rows' gradients, row t for out_rows[t] / in_rows[t] (their slots)
        grads = {"W": g["W"][:n_shared], "b": g["b"][:n_shared], "W0": g["W0"][:n_in_shared],
                 "b0": g["b0"], "Wh": g["Wh"], "bh": g["bh"]}
        if dp is not None:  # sync: the ranks' gradients averaged over the rows any rank touched
            out_rows, in_rows, grads = dp.before_update(self, out_rows, in_rows, grads)
            t0 = self._tick("exchange", t0)
        self.apply_gradients(out_rows, in_rows, grads)
        t0 = self._tick("adam", t0)
        self.samples_seen += n
        if dp is not None:  # local/delayed: parameter averages on their schedule
            dp.after_update(self, np.concatenate((out_rows, w.in_place[:n_in_place])),
                            np.concatenate((in_rows, in_alone)))
            t0 = self._tick("exchange", t0)
        self.maybe_rehash()
        self._tick("rehash", t0)
        return loss

    def adam_hyper(self, step: int) -> tuple:
        """Adam's (lr, beta1, beta2, eps, step) for the kernels."""
        c = self.config
        return self.learning_rate, c.beta1, c.beta2, c.eps, step

    def apply_gradients(self, out_rows, in_rows, grads) -> None:
        """One Adam step on output rows ``out_rows`` (and their biases), input rows ``in_rows``
        and the small dense parameters, from compact gradients: ``grads["W"]``
        [len(out_rows), H] and ``grads["b"]`` [len(out_rows)], ``grads["W0"]``
        [len(in_rows), H0], and full ``b0``, ``Wh``, ``bh`` (float32 host arrays, zeroed on
        return). Weight decay applies to weights, not biases."""
        out_rows = np.asarray(out_rows, np.int32)
        in_rows = np.asarray(in_rows, np.int32)
        p, m = self.params, self.moments
        blocks = self.row_blocks()
        self.step += 1
        hp = self.adam_hyper(self.step)
        wd = self.resolved["weight_decay"]
        g_out = self.work.first_numbers(out_rows.size)
        g_in = self.work.first_numbers(in_rows.size)
        kernels.adam_rows(out_rows, g_out, blocks["W"], grads["W"], *hp, wd)
        kernels.adam_entries(out_rows, g_out, p["b"], m["b.m"], m["b.v"], grads["b"], *hp, 0.0)
        kernels.adam_rows(in_rows, g_in, blocks["W0"], grads["W0"], *hp, wd)
        for k, decay in (("b0", 0.0), ("Wh", wd), ("bh", 0.0)):
            if p[k].size:
                kernels.adam_dense(p[k], m[k + ".m"], m[k + ".v"], grads[k], *hp, decay)
        self.params_changed()

    # -- the tables ------------------------------------------------------------------------------
    def sampled_layers(self):
        """(tables, weights, seed) of every sampled layer: hidden ones, then the output."""
        out = [(t, self.hidden_layer(l)[0], self.layer_seed(l))
               for l, t in enumerate(self.hidden_tables) if t is not None]
        if self.tables is not None:
            out.append((self.tables, self.params["W"], self.hash_seed))
        return out

    def maybe_rehash(self) -> None:
        """Rehash or rebuild the tables where the schedule says so."""
        r = self.resolved
        if self.samples_seen >= self.next_rebuild:
            self.hash_seed += 1
            for tables, W, seed in self.sampled_layers():
                tables.rebuild(W, seed=seed)
            self.tables_stale = False
            self.next_rebuild = self.samples_seen + r["rebuild_every"]
            self.next_rehash = self.samples_seen + int(self.rehash_interval)
        elif self.samples_seen >= self.next_rehash:
            for tables, W, _ in self.sampled_layers():
                tables.rehash(W)
            self.tables_stale = False
            self.rehash_interval *= self.config.rehash_growth
            self.next_rehash = self.samples_seen + int(self.rehash_interval)

    def refresh_tables(self) -> None:
        """Rehash every sampled layer's tables with the current weights."""
        for tables, W, _ in self.sampled_layers():
            tables.rehash(W)
        self.tables_stale = False


def copy_params(params: dict, out: dict | None = None) -> dict:
    """A copy of the arrays of ``params``, into ``out``'s arrays where they match (numpy or
    cupy arrays; device arrays stay on their device)."""
    if out is None or out.keys() != params.keys() or \
            any(out[k].shape != v.shape for k, v in params.items()):
        return {k: v.copy() for k, v in params.items()}
    for k, v in params.items():
        out[k][...] = v
    return out


#: engines whose kernels this process has already compiled (progress bars say so once)
_WARM: set = set()


def run_batches(step, Xp, Y, order, batch_size: int, progress=None, engine: str = "") -> dict:
    """``step(X_batch, Y_batch) -> loss`` over consecutive batches of ``order``'s rows of
    preprocessed ``Xp`` / ``Y``; returns the mean ``loss``, and ``first_batch_seconds`` where
    the first batch compiled ``engine``'s kernels (the rate then leaves it out)."""
    total = 0.0
    compiling = engine not in _WARM
    compile_seconds = 0.0
    if compiling and progress is not None:  # numba compiles inside the first batch
        progress.set_postfix_str("compiling kernels (first run only)")
    Xb = Yb = None  # each batch's rows go into the matrices of the batch before
    for lo in range(0, order.size, batch_size):
        idx = np.sort(order[lo:lo + batch_size])
        t0 = time.perf_counter()
        Xb, Yb = take_rows(Xp, idx, out=Xb), take_rows(Y, idx, out=Yb)
        loss = step(Xb, Yb)
        total += loss * idx.size
        if compiling:
            _WARM.add(engine)
            compiling = False
            compile_seconds = time.perf_counter() - t0
            if progress is not None:
                progress.reset(total=progress.total)  # rate and time left start after compile
        if progress is not None:
            progress.update(idx.size)
            progress.set_postfix(batch_loss=f"{loss:.3f}", refresh=False)
    if compile_seconds:
        return {"loss": total / max(order.size, 1), "first_batch_seconds": compile_seconds}
    return {"loss": total / max(order.size, 1)}
