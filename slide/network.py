"""The SLIDE model: sparse input → dense hidden layers → LSH-sampled output layer.

:class:`SlideConfig` holds every hyperparameter; :class:`SlideClassifier` holds the arrays and
follows scikit-learn's conventions (``fit``, ``partial_fit``, ``predict``, ``predict_topk``,
``score``, ``get_params``/``set_params``), so it drops into a Pipeline after a vectorizer.
The Python layer validates at the boundary and orchestrates one batch at a time; all per-sample
work happens in :mod:`slide.kernels`.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numba
import numpy as np
import scipy.sparse as sp

from lsh import HashTables, TableConfig, autotune, engine_threads, set_num_threads, thread_chunks
from lsh.tables import QueryScratch
from slide import kernels
from slide.checkpoint import join_arrays, read_checkpoint, split_arrays, write_checkpoint
from slide.data import check_xy
from slide.metrics import evaluate, topk

__all__ = ["SlideConfig", "SlideClassifier", "init_parameters", "hidden_blocks", "hidden_block",
           "default_batch_size", "default_epochs"]

@dataclass(frozen=True)
class SlideConfig:
    """Hyperparameters of a :class:`SlideClassifier`.

    ``None`` means "derive from the data" (see :meth:`SlideClassifier.resolved_config`).

    Attributes
    ----------
    hidden : ReLU hidden layer sizes, input side first.
    hidden_sparsity : per hidden layer, the fraction of its neurons computed per sample (1.0:
        dense; ``None``: all dense). A sampled layer computes only the neurons its LSH tables
        return for the previous layer's activation, ranked by hit count; the first hidden
        layer reads the sparse input and is always dense.
    sparsity : fraction of output neurons active per sample (labels + LSH candidates + random
        negatives shared by the batch). 1.0 computes every neuron (exact softmax). ``None``:
        ``max(1024, 0.005 · n_labels)`` active neurons, all of them when there are fewer labels.
    hash_family, K, L, range_pow, bucket_size, bucket_policy : the output layer's LSH tables
        (``None``: :func:`lsh.autotune` from the sparsity).
    rehash_every : samples between rehashes (same functions, current weights); it is multiplied
        by ``rehash_growth`` after each one. ``rebuild_every``: samples between draws of new
        hash functions. ``None``: 64 batches, and 16 times that.
    lr, beta1, beta2, eps : Adam. batch_size : samples per step (``None``: from the training
        set's size, :func:`default_batch_size`). threads : numba threads (``None``: all cores).
    seed : fixes initialisation, data order and sampling.
    """
    hidden: tuple = (128,)
    hidden_sparsity: tuple | None = None
    sparsity: float | None = None
    hash_family: str = "dwta"
    K: int | None = None
    L: int | None = None
    range_pow: int | None = None
    bucket_size: int | None = None
    bucket_policy: str = "reservoir"
    rehash_every: int | None = None
    rehash_growth: float = 1.25
    rebuild_every: int | None = None
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    batch_size: int | None = None
    threads: int | None = None
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.hidden, tuple) and all(type(h) is int for h in self.hidden)):
            object.__setattr__(self, "hidden", tuple(int(h) for h in np.atleast_1d(self.hidden)))
        if not self.hidden or min(self.hidden) < 1:
            raise ValueError(f"hidden must list positive layer sizes, got {self.hidden}")
        if self.hidden_sparsity is not None:
            if not isinstance(self.hidden_sparsity, tuple):
                object.__setattr__(self, "hidden_sparsity", tuple(float(v) for v in self.hidden_sparsity))
            hs = self.hidden_sparsity
            if len(hs) != len(self.hidden) or not all(0 < v <= 1 for v in hs):
                raise ValueError(f"hidden_sparsity needs one value in (0, 1] per hidden layer, got {hs}")
            if hs[0] != 1:
                raise ValueError("the first hidden layer reads the sparse input and must be dense "
                                 "(hidden_sparsity[0] = 1.0)")
        if self.sparsity is not None and not 0 < self.sparsity <= 1:
            raise ValueError(f"sparsity must be in (0, 1], got {self.sparsity}")
        if (self.batch_size is not None and self.batch_size < 1) or self.lr <= 0:
            raise ValueError("batch_size and lr must be positive")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("beta1 and beta2 must be in [0, 1)")


_CONFIG_FIELDS = [f.name for f in dataclasses.fields(SlideConfig)]


def _to_json(obj):
    return list(obj) if isinstance(obj, tuple) else obj


def default_batch_size(n_train: int) -> int:
    """Small data needs more, smaller steps: 32 below ~14K samples, 128 above ~56K."""
    return int(np.clip(2 ** round(math.log2(max(n_train, 1) / 300)), 32, 128))


def default_epochs(n_train: int, batch_size: int) -> int:
    """Enough epochs for about 3,000 optimizer steps, between 5 and 30."""
    steps = math.ceil(n_train / batch_size)
    return int(np.clip(math.ceil(3000 / steps), 5, 30))


def hidden_blocks(hidden) -> list:
    """(weight offset, bias offset, n_out, n_in) of each layer of the flat hidden stack
    ``Wh``/``bh``, which holds hidden layers 1..len(hidden)-1 as [n_out, n_in] blocks."""
    blocks, off, boff = [], 0, 0
    for n_in, n_out in zip(hidden[:-1], hidden[1:]):
        blocks.append((off, boff, int(n_out), int(n_in)))
        off += int(n_out * n_in)
        boff += int(n_out)
    return blocks


def hidden_block(p, blk):
    """Weights [n_out, n_in] and bias [n_out] of one hidden block: views into p["Wh"], p["bh"]."""
    off, boff, n_out, n_in = blk
    return p["Wh"][off:off + n_out * n_in].reshape(n_out, n_in), p["bh"][boff:boff + n_out]


def init_parameters(hidden, n_features: int, n_labels: int, seed: int) -> dict:
    """Initial float32 parameters (``W0, b0, Wh, bh, W, b``) for a seed; shared with gpu_ref."""
    rng = np.random.default_rng(seed)
    sizes = [int(h) for h in hidden]
    p = {}
    # input rows are L2-normalised sparse vectors: unit-scale pre-activations need weights of
    # order one, not 1/sqrt(n_features)
    p["W0"] = rng.standard_normal((n_features, sizes[0]), np.float32) * np.float32(0.5)
    p["b0"] = np.zeros(sizes[0], np.float32)
    blocks = [rng.standard_normal((sizes[l], sizes[l - 1]), np.float32) * np.float32(math.sqrt(2.0 / sizes[l - 1]))
              for l in range(1, len(sizes))]
    p["Wh"] = np.concatenate([b.ravel() for b in blocks]) if blocks else np.zeros(0, np.float32)
    p["bh"] = np.zeros(sum(sizes[1:]), np.float32)
    p["W"] = rng.standard_normal((n_labels, sizes[-1]), np.float32) * np.float32(1.0 / math.sqrt(sizes[-1]))
    p["b"] = np.zeros(n_labels, np.float32)
    return p


try:  # scikit-learn is optional; with it, the estimator carries its tags into Pipelines
    from sklearn.base import BaseEstimator as _EstimatorBase
except ImportError:  # pragma: no cover
    _EstimatorBase = object


class SlideClassifier(_EstimatorBase):
    """Extreme multi-label classifier trained sparsely on CPU threads.

    Parameters are those of :class:`SlideConfig`, e.g.
    ``SlideClassifier(hidden=(128,), sparsity=0.005, lr=1e-3)``.

    Fitted attributes: ``n_features_in_``, ``n_labels_``, ``params_`` (dict of float32 arrays),
    ``step_`` (optimizer steps), ``epoch_`` (completed epochs), ``history_`` (per-epoch dicts),
    ``timings_`` (seconds per phase).
    """

    def __init__(self, **config):
        unknown = set(config) - set(_CONFIG_FIELDS)
        if unknown:
            raise TypeError(f"unknown parameter(s): {', '.join(sorted(unknown))}")
        self.config = SlideConfig(**config)
        self._fitted = False

    # -- scikit-learn protocol -----------------------------------------------------------------
    def get_params(self, deep: bool = True) -> dict:
        return {k: getattr(self.config, k) for k in _CONFIG_FIELDS}

    def set_params(self, **params):
        self.config = dataclasses.replace(self.config, **params)
        return self

    def __repr__(self):
        default = dataclasses.asdict(SlideConfig())
        changed = {k: v for k, v in self.get_params().items() if v != default[k]}
        return f"SlideClassifier({', '.join(f'{k}={v!r}' for k, v in changed.items())})"

    # -- set-up ----------------------------------------------------------------------------------
    def resolved_config(self, n_labels: int, n_train: int) -> dict:
        """Batch size, active-set target and table settings for ``n_labels`` outputs and
        ``n_train`` training samples."""
        c = self.config
        batch_size = c.batch_size or default_batch_size(n_train)
        if c.sparsity is None:
            target = min(n_labels, max(1024, math.ceil(0.005 * n_labels)))
        else:
            target = min(n_labels, max(1, math.ceil(c.sparsity * n_labels)))
        sampled = target < n_labels
        # a quarter of the active set is each sample's own LSH candidates (hard negatives), the
        # rest a random pool shared by the batch (dense matrix products, few distinct rows to
        # update); without sampling the pool is every neuron
        lsh_cap = target // 4 if sampled else 0
        out = {"batch_size": batch_size, "active_target": target, "sampled": sampled,
               "lsh_cap": lsh_cap, "pool": target - lsh_cap}
        if out["sampled"]:
            over = {k: getattr(c, k) for k in ("K", "L", "range_pow", "bucket_size") if getattr(c, k)}
            # the tables only supply lsh_cap candidates per sample, so fewer and smaller than
            # BOLT's rule: at Amazon-670K shape 24 tables of 64 matched 82 of 164 in P@1 at
            # 0.77 of the memory and a third of the rehash time (bench/README.md)
            tc = autotune(n_labels, target / n_labels, family=c.hash_family, policy=c.bucket_policy,
                          max_tables=24, max_bucket_size=64, **over)
            out["tables"] = dataclasses.asdict(tc)
        hs = c.hidden_sparsity or (1.0,) * len(c.hidden)
        out["hidden_layers"] = [None] * len(c.hidden)
        for l in range(1, len(c.hidden)):
            if hs[l] < 1:
                tc = autotune(c.hidden[l], hs[l], family=c.hash_family, policy=c.bucket_policy,
                              max_tables=24, max_bucket_size=64)
                out["hidden_layers"][l] = {"target": max(1, math.ceil(hs[l] * c.hidden[l])),
                                           "tables": dataclasses.asdict(tc)}
        per_batch = 64 * batch_size
        out["rehash_every"] = c.rehash_every or per_batch
        out["rebuild_every"] = c.rebuild_every or 16 * per_batch
        return out

    def _init_params(self, n_features: int, n_labels: int, n_train: int):
        self.params_ = init_parameters(self.config.hidden, n_features, n_labels, self.config.seed)
        p = self.params_
        self.moments_ = {f"{k}.{s}": np.zeros_like(v) for k, v in p.items() for s in "mv"}
        self.n_features_in_, self.n_labels_, self.n_train_ = n_features, n_labels, n_train
        self.step_, self.epoch_, self.samples_seen_ = 0, 0, 0
        self.history_, self.timings_ = [], {}
        self.hash_seed_ = self.config.seed
        self._fitted = True
        self._setup()
        self._next_rehash = self.resolved_["rehash_every"]
        self._rehash_interval = float(self.resolved_["rehash_every"])
        self._next_rebuild = self.resolved_["rebuild_every"]
        self._refresh_tables()

    def _setup(self):
        """Derived state: offsets, gradients, tables, scratch (never saved)."""
        c = self.config
        self.resolved_ = self.resolved_config(self.n_labels_, self.n_train_)
        self.batch_size_ = self.resolved_["batch_size"]
        sizes = np.array(c.hidden, np.int64)
        self._sizes = sizes
        self._blocks = hidden_blocks(c.hidden)
        # the kernels take the offsets as arrays (at least one entry, even with no stack)
        self._h_off = np.array([b[0] for b in self._blocks] or [0], np.int64)
        self._b_off = np.array([b[1] for b in self._blocks] or [0], np.int64)
        self.grads_ = {k: np.zeros_like(v) for k, v in self.params_.items()}
        self.tables_ = None
        if self.resolved_["sampled"]:
            tc = TableConfig(**self.resolved_["tables"])
            self.tables_ = HashTables(int(sizes[-1]), self.n_labels_, tc, seed=self.hash_seed_)
        self.hidden_tables_ = [None] * sizes.size
        for l, layer in enumerate(self.resolved_["hidden_layers"]):
            if layer is not None:
                self.hidden_tables_[l] = HashTables(int(sizes[l - 1]), int(sizes[l]),
                                                    TableConfig(**layer["tables"]),
                                                    seed=self._layer_seed(l))
        self._mark_out = np.zeros(self.n_labels_, np.uint8)
        self._scratch_key = None

    def _scratch(self, n_rows: int, max_labels: int):
        """Per-thread and per-batch buffers, grown when a batch needs more."""
        t = numba.get_num_threads()
        width = self.resolved_["lsh_cap"] + max_labels
        old = self._scratch_key
        if old is None or old[0] != t or old[1] < width or old[2] < n_rows:
            width = max(width, old[1] if old else 0)
            n_rows = max(n_rows, old[2] if old else 0)
            tc = self.tables_.config if self.tables_ is not None else None
            self._qs = QueryScratch(t, self.n_labels_, tc.L if tc else 1, tc.bucket_size if tc else 1)
            self._active = np.zeros((n_rows, width), np.int32)
            self._n_active = np.zeros(n_rows, np.int64)
            self._logits = np.zeros((t, width), np.float32)
            self._dbuf = np.zeros((t, 2 * int(self._sizes.max())), np.float32)
            self._touched = np.zeros(n_rows * width + self.resolved_["pool"], np.int32)
            self._scratch_key = (t, width, n_rows)
        self._qs.renew_if_old()

    # -- forward ---------------------------------------------------------------------------------
    def _layer_seed(self, l: int) -> int:
        """Hash seed of hidden layer l's tables (the output layer's is ``hash_seed_``)."""
        return self.hash_seed_ + 7919 * l

    def _block(self, l: int):
        """Weights [H_l, H_{l-1}] and bias [H_l] of hidden layer l >= 1 (views into Wh, bh)."""
        return hidden_block(self.params_, self._blocks[l - 1])

    def _forward(self, X: sp.csr_matrix) -> np.ndarray:
        """Activations of every hidden layer, float32 [n, Σ hidden], layer by layer over the batch."""
        p, sizes = self.params_, self._sizes
        acts = np.empty((X.shape[0], int(sizes.sum())), np.float32)
        kernels.forward_input(X.indptr.astype(np.int64), X.indices, X.data, p["W0"], p["b0"], acts)
        lo = 0
        for l in range(1, sizes.size):
            W, b = self._block(l)
            tables = self.hidden_tables_[l]
            if tables is None:
                active, n_active = np.zeros((X.shape[0], 0), np.int32), np.zeros(X.shape[0], np.int64)
            else:
                codes = tables.family.hash_dense(acts[:, lo:lo + int(sizes[l - 1])])
                active, n_active = tables.query_codes(
                    codes, self.resolved_["hidden_layers"][l]["target"], rank=True)
            kernels.forward_layer(acts, lo, lo + int(sizes[l - 1]), W, b, active, n_active)
            lo += int(sizes[l - 1])
        return acts

    def _last(self, acts):
        return acts[:, acts.shape[1] - int(self._sizes[-1]):]

    # -- training --------------------------------------------------------------------------------
    def _tick(self, name, t0):
        self.timings_[name] = self.timings_.get(name, 0.0) + time.perf_counter() - t0
        return time.perf_counter()

    def _train_batch(self, Xb: sp.csr_matrix, Yb: sp.csr_matrix) -> float:
        c, p, g = self.config, self.params_, self.grads_
        n = Xb.shape[0]
        self._scratch(n, int(np.diff(Yb.indptr).max()))
        bounds = thread_chunks(n)
        t0 = time.perf_counter()
        acts = self._forward(Xb)
        h = self._last(acts)
        t0 = self._tick("forward_hidden", t0)
        rng = np.random.default_rng([c.seed, 1, self.step_])
        if self.tables_ is not None:
            codes = self.tables_.family.hash_dense(h)
            buckets, seen = self.tables_.buckets, self.tables_.seen
            pool = np.sort(rng.choice(self.n_labels_, size=self.resolved_["pool"], replace=False)).astype(np.int32)
        else:  # every neuron active: the pool is all of them
            codes = np.zeros((n, 1), np.int32)
            buckets, seen = np.zeros((0, 1, 1), np.int32), np.zeros((0, 1), np.int32)
            pool = np.arange(self.n_labels_, dtype=np.int32)
        t0 = self._tick("hash", t0)
        # the shared pool is a dense block: its logits and gradients are matrix products
        W_pool = p["W"][pool]
        z_pool = h @ W_pool.T
        z_pool += p["b"][pool]
        t0 = self._tick("pool_matmul", t0)
        qs = self._qs
        dH = np.empty((n, h.shape[1]), np.float32)
        losses = np.empty(n, np.float32)
        kernels.output_step(
            Yb.indptr.astype(np.int64), Yb.indices, acts, codes, p["W"], p["b"], g["W"], g["b"],
            buckets, seen, qs.stamp, qs.hits, qs.gens, qs.cand, qs.hist, self.resolved_["lsh_cap"],
            pool, z_pool, self._active, self._n_active, bounds, self._logits, dH, losses)
        t0 = self._tick("select+output", t0)
        dH += z_pool @ W_pool
        g["W"][pool] += z_pool.T @ h
        g["b"][pool] += z_pool.sum(axis=0)
        t0 = self._tick("pool_matmul", t0)
        kernels.backward_hidden(Xb.indptr.astype(np.int64), Xb.indices, Xb.data, acts, dH,
                                p["W0"], p["Wh"], self._h_off, self._sizes, g["W0"], g["b0"],
                                g["Wh"], g["bh"], self._b_off, bounds, self._dbuf)
        t0 = self._tick("backward_hidden", t0)
        self.step_ += 1
        hp = (c.lr, c.beta1, c.beta2, c.eps, self.step_)
        n_out = kernels.unique_rows(pool, self._active[:n], self._n_active[:n], self._mark_out, self._touched)
        in_rows = np.unique(Xb.indices).astype(np.int32)
        self._adam_update(self._touched[:n_out], in_rows, g, g["W"], g["W0"], hp)
        t0 = self._tick("adam", t0)
        self.samples_seen_ += n
        self._tables_stale = True
        self._maybe_rehash()
        self._tick("rehash", t0)
        return float(losses.mean())

    def _adam_update(self, out_rows, in_rows, dense_grads, gW, gW0, hp, compact=False):
        """Adam on the touched output rows (and their biases), the touched input rows, and the
        small dense parameters. ``gW``/``gW0`` are full-size accumulators indexed by row, or
        with ``compact`` blocks whose row t belongs to ``out_rows[t]`` / ``in_rows[t]``."""
        p, m = self.params_, self.moments_
        g_out = np.arange(out_rows.size, dtype=np.int32) if compact else out_rows
        g_in = np.arange(in_rows.size, dtype=np.int32) if compact else in_rows
        kernels.adam_rows(out_rows, g_out, p["W"], m["W.m"], m["W.v"], gW, *hp)
        kernels.adam_entries(out_rows, g_out, p["b"], m["b.m"], m["b.v"], dense_grads["b"], *hp)
        kernels.adam_rows(in_rows, g_in, p["W0"], m["W0.m"], m["W0.v"], gW0, *hp)
        for k in ("b0", "Wh", "bh"):
            if p[k].size:
                kernels.adam_dense(p[k], m[k + ".m"], m[k + ".v"], dense_grads[k], *hp)

    def apply_gradients(self, out_rows, in_rows, grads) -> None:
        """One Adam step from gradients computed elsewhere (the heterogeneous trainer's GPU
        worker): ``grads["W"]`` [len(out_rows), H] and ``grads["b"]`` [len(out_rows)] for output
        rows ``out_rows``, ``grads["W0"]`` [len(in_rows), H0] for input rows ``in_rows``, and full
        ``b0``, ``Wh``, ``bh``. All float32 host arrays; they are zeroed on return."""
        c = self.config
        self.step_ += 1
        self._adam_update(np.asarray(out_rows, np.int32), np.asarray(in_rows, np.int32), grads,
                          grads["W"], grads["W0"], (c.lr, c.beta1, c.beta2, c.eps, self.step_),
                          compact=True)
        self._tables_stale = True

    def _tables(self):
        """(tables, weights, seed) of every sampled layer: hidden ones, then the output."""
        out = [(t, self._block(l)[0], self._layer_seed(l)) for l, t in enumerate(self.hidden_tables_)
               if t is not None]
        if self.tables_ is not None:
            out.append((self.tables_, self.params_["W"], self.hash_seed_))
        return out

    def _maybe_rehash(self):
        if self.samples_seen_ >= self._next_rebuild:
            self.hash_seed_ += 1
            for tables, W, seed in self._tables():
                tables.rebuild(W, seed=seed)
            self._tables_stale = False
            self._next_rebuild = self.samples_seen_ + self.resolved_["rebuild_every"]
            self._next_rehash = self.samples_seen_ + int(self._rehash_interval)
        elif self.samples_seen_ >= self._next_rehash:
            for tables, W, _ in self._tables():
                tables.rehash(W)
            self._tables_stale = False
            self._rehash_interval *= self.config.rehash_growth
            self._next_rehash = self.samples_seen_ + int(self._rehash_interval)

    def _check(self, X, Y=None, where="input"):
        if not self._fitted:
            return check_xy(X, Y, where=where)
        return check_xy(X, Y, n_features=self.n_features_in_,
                        n_labels=self.n_labels_ if Y is not None else None, where=where)

    def _epoch(self, X, Y, progress=None) -> float:
        """One pass over (X, Y) in a seeded order; returns the mean loss."""
        bs = self.batch_size_
        order = np.random.default_rng([self.config.seed, 2, self.epoch_]).permutation(X.shape[0])
        self._refresh_tables()
        total, count = 0.0, 0
        for lo in range(0, X.shape[0], bs):
            idx = np.sort(order[lo:lo + bs])
            loss = self._train_batch(X[idx], Y[idx])
            total += loss * idx.size
            count += idx.size
            if progress is not None:
                progress.update(idx.size)
                progress.set_postfix(loss=f"{loss:.3f}", refresh=False)
        return total / max(count, 1)

    def fit(self, X, Y, epochs: int | None = None, validation=None, progress: bool = False,
            on_epoch=None, eval_k: int = 5, eval_samples: int | None = None):
        """Train for ``epochs`` more epochs (a fresh model if not yet fitted).

        Parameters
        ----------
        X : CSR-convertible [n, n_features]; Y : CSR indicator [n, n_labels] or label lists.
        epochs : ``None`` for :func:`default_epochs` (about 3,000 steps, 5 to 30 epochs).
        validation : optional ``(X_val, Y_val)``, evaluated after each epoch (P@1/3/5, nDCG).
        progress : show a tqdm bar (samples/s, loss).
        on_epoch : called as ``on_epoch(model, record)`` after each epoch (checkpoints, logs).
        eval_samples : evaluate on this many validation rows (a seeded random subset).
        """
        X, Y = self._check(X, Y, where="fit")
        if not self._fitted:
            self._init_params(X.shape[1], Y.shape[1], X.shape[0])
        if validation is not None:
            Xv, Yv = self._check(*validation, where="validation")
            if eval_samples is not None and eval_samples < Xv.shape[0]:
                sel = np.sort(np.random.default_rng(self.config.seed).choice(Xv.shape[0], eval_samples, replace=False))
                Xv, Yv = Xv[sel], Yv[sel]
        threads = set_num_threads(self.config.threads)
        if epochs is None:
            epochs = default_epochs(X.shape[0], self.batch_size_)
        start_epoch = self.epoch_
        for _ in range(int(epochs)):
            bar = None
            if progress:
                from tqdm.auto import tqdm
                bar = tqdm(total=X.shape[0], unit="samples", unit_scale=True,
                           desc=f"epoch {self.epoch_ + 1}/{start_epoch + epochs}", leave=True)
            t0 = time.perf_counter()
            with engine_threads(self.config.threads):
                loss = self._epoch(X, Y, bar)
            seconds = time.perf_counter() - t0
            if bar is not None:
                bar.close()
            self.epoch_ += 1
            record = {"epoch": self.epoch_, "train_seconds": seconds,
                      "samples_per_second": X.shape[0] / seconds, "loss": loss, "threads": threads}
            if validation is not None:
                record.update(self.evaluate(Xv, Yv, k=eval_k))
            self.history_.append(record)
            if on_epoch is not None:
                on_epoch(self, record)
        return self

    def _refresh_tables(self):
        """Rehash with the current weights. Epochs start with it (so a run resumed from a
        checkpoint, whose tables are rebuilt on load, continues exactly), and LSH serving does
        it first when training has moved the weights since the last rehash."""
        for tables, W, _ in self._tables():
            tables.rehash(W)
        self._tables_stale = False

    def partial_fit(self, X, Y):
        """One pass over (X, Y) in the given row order's batches (for streams)."""
        X, Y = self._check(X, Y, where="partial_fit")
        if not self._fitted:
            self._init_params(X.shape[1], Y.shape[1], X.shape[0])
        bs = self.batch_size_
        with engine_threads(self.config.threads):
            for lo in range(0, X.shape[0], bs):
                self._train_batch(X[lo:lo + bs], Y[lo:lo + bs])
        return self

    # -- inference -------------------------------------------------------------------------------
    def _require_fitted(self):
        """Serving starts here: the model must exist, and its tables reflect its weights."""
        if not self._fitted:
            raise RuntimeError("this SlideClassifier is not fitted yet; call fit first")
        if self._tables_stale:
            self._refresh_tables()

    def embed(self, X) -> np.ndarray:
        """Last hidden layer activations, float32 [n, hidden[-1]]."""
        self._require_fitted()
        X = self._check(X, where="embed")
        set_num_threads(self.config.threads)
        return np.ascontiguousarray(self._last(self._forward(X)))

    def predict_topk(self, X, k: int = 5, mode: str = "exact", block: int | None = None):
        """Top-k labels per row: ``(ids int64 [n, k], scores float32 [n, k])``, best first.

        ``mode="exact"`` scores every output (blocked matrix product + parallel partial sort);
        ``mode="lsh"`` scores only the hash-table candidates of each row (sub-linear serving;
        rows with fewer than k candidates are padded with id -1).
        """
        self._require_fitted()
        X = self._check(X, where="predict")
        set_num_threads(self.config.threads)
        k = int(k)
        if mode not in ("exact", "lsh"):
            raise ValueError(f"mode must be 'exact' or 'lsh', got {mode!r}")
        W, b = self.params_["W"], self.params_["b"]
        ids = np.empty((X.shape[0], k), np.int64)
        scores = np.empty((X.shape[0], k), np.float32)
        block = block or max(1, min(4096, (1 << 26) // self.n_labels_))
        for lo in range(0, X.shape[0], block):
            hi = min(lo + block, X.shape[0])
            h = self._last(self._forward(X[lo:hi]))
            if mode == "exact" or self.tables_ is None:
                s = h @ W.T
                s += b
                ids[lo:hi], scores[lo:hi] = topk(s, k)
            else:
                cand, n_c = self.tables_.query(h, rank=True)
                cs = np.empty(cand.shape, np.float32)
                kernels.score_candidates(np.ascontiguousarray(h), W, b, cand, n_c, cs)
                pos, scores[lo:hi] = topk(cs, k)
                ids[lo:hi] = np.where(pos >= 0, np.take_along_axis(cand, np.maximum(pos, 0), 1), -1)
                ids[lo:hi][~np.isfinite(scores[lo:hi])] = -1
        return ids, scores

    def predict(self, X) -> np.ndarray:
        """Top-1 label per row, int64 [n]."""
        return self.predict_topk(X, 1)[0][:, 0]

    def decision_function(self, X) -> np.ndarray:
        """All output logits, float32 [n, n_labels] (dense: mind the memory on wide layers)."""
        self._require_fitted()
        X = self._check(X, where="decision_function")
        return self._last(self._forward(X)) @ self.params_["W"].T + self.params_["b"]

    def evaluate(self, X, Y, k: int = 5, mode: str = "exact") -> dict:
        """P@1/3/5 and nDCG@1/3/5 of the exact (or LSH) top-k."""
        X, Y = self._check(X, Y, where="evaluate")
        top, _ = self.predict_topk(X, k, mode=mode)
        return evaluate(top, Y, k)

    def score(self, X, Y) -> float:
        """P@1."""
        return self.evaluate(X, Y, k=1)["P@1"]

    # -- persistence -----------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the model to directory ``path`` (npz + JSON, atomic; see :mod:`slide.checkpoint`)."""
        self._require_fitted()
        meta = {
            "engine": "slide",
            "config": {k: _to_json(v) for k, v in self.get_params().items()},
            "n_features": self.n_features_in_, "n_labels": self.n_labels_, "n_train": self.n_train_,
            "step": self.step_, "epoch": self.epoch_, "samples_seen": self.samples_seen_,
            "hash_seed": self.hash_seed_, "next_rehash": self._next_rehash,
            "rehash_interval": self._rehash_interval, "next_rebuild": self._next_rebuild,
            "history": self.history_,
        }
        write_checkpoint(path, join_arrays(self.params_, self.moments_), meta, self.step_)

    @classmethod
    def load(cls, path) -> "SlideClassifier":
        """Load a model saved by :meth:`save`, or by the dense reference (same format)."""
        arrays, meta = read_checkpoint(path)
        fields = set(_CONFIG_FIELDS)
        model = cls(**{k: v for k, v in meta["config"].items() if k in fields})
        model.params_, model.moments_ = split_arrays(arrays)
        model.n_features_in_, model.n_labels_ = int(meta["n_features"]), int(meta["n_labels"])
        model.n_train_ = int(meta.get("n_train", 0))
        model.step_, model.epoch_ = int(meta["step"]), int(meta["epoch"])
        model.samples_seen_ = int(meta.get("samples_seen", 0))
        model.hash_seed_ = int(meta.get("hash_seed", model.config.seed))
        model.history_ = meta.get("history", [])
        model.timings_ = {}
        model._fitted = True
        model._setup()
        r = model.resolved_
        model._next_rehash = int(meta.get("next_rehash", r["rehash_every"]))
        model._rehash_interval = float(meta.get("rehash_interval", r["rehash_every"]))
        model._next_rebuild = int(meta.get("next_rebuild", r["rebuild_every"]))
        model._refresh_tables()
        return model
