"""The engine's network trained densely: full softmax over every label, Adam on every parameter
a step touches (all of them but the input rows of features absent from the batch).

One implementation for both devices: the array module ``xp`` (cupy on a GPU, numpy otherwise)
is chosen from ``device`` and the math never branches on it. Parameters use the engine's names
and layouts (``W0`` [n_features, H0] input-major, flat hidden stack ``Wh``/``bh``, output ``W``
[n_labels, H_last], ``b``), its settings and defaults (:class:`slide.config.SlideConfig`,
:func:`slide.config.resolve`), its preprocessing, training loop and checkpoint format, so a
model trained here loads into :class:`slide.SlideClassifier` and vice versa.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from sklearn.base import BaseEstimator
from sklearn.exceptions import NotFittedError

from slide.checkpoint import read_checkpoint, write_checkpoint
from slide.config import (SlideConfig, hidden_block, hidden_blocks, init_parameters,
                          parameter_shapes, resolve)
from slide.data import check_xy
from slide.metrics import topk
from slide.preprocess import Preprocessor
from slide.resources import check_fits, model_memory_bytes
from slide.train import EarlyStopping, TrainableMixin, fit_loop

__all__ = ["DenseClassifier", "get_array_module", "gpu_available", "softmax_grads", "forward",
           "uniform_targets", "local_columns", "adam_step"]


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "no GPU"
        return False


def get_array_module(device: str = "auto"):
    """``(xp, sparse_module)`` for ``device`` in {"auto", "cpu", "gpu"}."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'gpu', got {device!r}")
    if device == "gpu" or (device == "auto" and gpu_available()):
        if not gpu_available():
            raise RuntimeError("device='gpu' needs cupy and a CUDA device; none found")
        import cupy
        import cupyx.scipy.sparse as cusparse
        return cupy, cusparse
    return np, sp


def forward(xp, Xd, p, blocks) -> list:
    """Activations of every hidden layer for CSR ``Xd`` [n, rows of p["W0"]] on module ``xp``."""
    acts = [xp.maximum(Xd @ p["W0"] + p["b0"], 0)]
    for blk in blocks:
        W, b = hidden_block(p, blk)
        acts.append(xp.maximum(acts[-1] @ W.T + b, 0))
    return acts


def uniform_targets(xp, Y):
    """Dense float32 targets [n, L]: uniform over each row's labels (rows without labels: 0)."""
    Y = sp.csr_matrix(Y, dtype=np.float32)
    counts = np.maximum(np.diff(Y.indptr), 1).astype(np.float32)
    return xp.asarray((sp.diags(1.0 / counts) @ Y).toarray(), dtype=xp.float32)


def local_columns(M: sp.csr_matrix, columns: np.ndarray) -> sp.csr_matrix:
    """``M`` restricted to (and renumbered over) the sorted ``columns`` it uses: a batch's rows
    over only the input rows (or output labels) the step touches."""
    return sp.csr_matrix((M.data, np.searchsorted(columns, M.indices), M.indptr),
                         shape=(M.shape[0], columns.size))


def softmax_grads(xp, Xd, T, p, blocks):
    """Mean softmax cross-entropy of the network ``p`` and its gradients.

    ``p`` holds ``W0`` [d, H0] (the rows of the features in ``Xd`` [n, d]), ``b0``, the flat hidden
    stack ``Wh``/``bh`` and an output block ``W`` [m, H], ``b`` [m]: every label, or any subset
    of rows (a sampled softmax, as the heterogeneous trainer's GPU worker uses) whose targets are
    the columns of ``T`` [n, m]. Returns ``(loss, grads)``, grads shaped like ``p``.
    """
    acts = forward(xp, Xd, p, blocks)
    n = Xd.shape[0]
    h = acts[-1]
    z = h @ p["W"].T + p["b"]
    z -= z.max(axis=1, keepdims=True)
    logp = z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))
    loss = float(-(T * logp).sum() / n)
    dz = (xp.exp(logp) - T) / n
    g = {"W": dz.T @ h, "b": dz.sum(axis=0)}
    dh = dz @ p["W"]
    gWh, gbh = [], []
    for l in range(len(blocks) - 1, -1, -1):
        dpre = dh * (acts[l + 1] > 0)
        W, _ = hidden_block(p, blocks[l])
        gWh.append((dpre.T @ acts[l]).ravel())
        gbh.append(dpre.sum(axis=0))
        dh = dpre @ W
    d0 = dh * (acts[0] > 0)
    g["W0"] = xp.asarray(Xd.T @ d0)
    g["b0"] = d0.sum(axis=0)
    g["Wh"] = xp.concatenate(gWh[::-1]) if gWh else xp.zeros(0, xp.float32)
    g["bh"] = xp.concatenate(gbh[::-1]) if gbh else xp.zeros(0, xp.float32)
    return loss, g


def adam_step(xp, w, m, v, g, lr, beta1, beta2, eps, step, decay=0.0):
    """Adam (with decoupled weight decay ``decay`` × lr) on arrays ``w``, ``m``, ``v`` in place,
    in the same float32 arithmetic as the engine's kernels."""
    c1 = np.float32(1.0 / (1.0 - beta1 ** step))
    c2 = np.float32(1.0 / (1.0 - beta2 ** step))
    b1, b2 = np.float32(beta1), np.float32(beta2)
    m *= b1
    m += (np.float32(1) - b1) * g
    v *= b2
    v += (np.float32(1) - b2) * g * g
    w -= np.float32(lr) * (m * c1) / (xp.sqrt(v * c2) + np.float32(eps)) + np.float32(lr * decay) * w


class DenseClassifier(TrainableMixin, BaseEstimator):
    """Dense reference with the engine's settings, defaults, loop and checkpoints.

    ``device``: "auto" (cupy when a GPU is present), "cpu" (numpy) or "gpu"; changing it with
    ``set_params`` on a fitted model moves the parameters at the next call.
    """

    def __init__(self, hidden=None, norm="l2", tfidf=False, lr=None, beta1=0.9, beta2=0.999,
                 eps=1e-8, weight_decay=None, batch_size=None, epochs=None, early_stopping=True,
                 validation_fraction=0.1, n_iter_no_change=5, seed=0, warm_start=False,
                 device="auto"):
        self.hidden = hidden
        self.norm = norm
        self.tfidf = tfidf
        self.lr = lr
        self.beta1 = beta1
        self.beta2 = beta2
        self.eps = eps
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.epochs = epochs
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.n_iter_no_change = n_iter_no_change
        self.seed = seed
        self.warm_start = warm_start
        self.device = device

    # -- settings --------------------------------------------------------------------------------
    def _is_fitted(self) -> bool:
        return hasattr(self, "params_")

    def __sklearn_is_fitted__(self) -> bool:
        return self._is_fitted()

    def _config(self) -> SlideConfig:
        return SlideConfig(**{k: v for k, v in self.get_params().items() if k != "device"})

    def fit_settings(self) -> dict:
        c = self._config()
        return {"early_stopping": c.early_stopping,
                "validation_fraction": c.validation_fraction,
                "n_iter_no_change": c.n_iter_no_change, "seed": c.seed}

    def _use_device(self):
        """Move the parameters when ``device`` now names another array module."""
        xp, sparse = get_array_module(self.device)
        if getattr(self, "xp", None) is xp:
            return
        if self._is_fitted():
            to = (lambda a: xp.asarray(a)) if xp is not np else self._host
            self.params_ = {k: to(v) for k, v in self.params_.items()}
            self.moments_ = {k: to(v) for k, v in self.moments_.items()}
        self.xp, self._sparse = xp, sparse

    def _host(self, a):
        return a if isinstance(a, np.ndarray) else a.get()

    # -- the step API --------------------------------------------------------------------------
    def check_data(self, X, Y=None, where="input", fitted=True):
        if not (fitted and self._is_fitted()):
            return check_xy(X, Y, where=where, require_labels=Y is not None)
        return check_xy(X, Y, n_features=self.n_features_in_,
                        n_labels=self.n_labels_ if Y is not None else None, where=where)

    def initialize(self, X, Y) -> None:
        self.config_ = self._config()
        self.n_features_in_, self.n_labels_, self.n_train_ = X.shape[1], Y.shape[1], X.shape[0]
        self.preprocessor_ = Preprocessor(self.config_.norm, self.config_.tfidf).fit(X)
        self.resolved_ = resolve(self.config_, self.n_features_in_, self.n_labels_, self.n_train_)
        check_fits(model_memory_bytes(self.resolved_, self.n_features_in_, self.n_labels_, 1),
                   f"a dense model of {self.n_features_in_} features, hidden "
                   f"{self.resolved_['hidden']} and {self.n_labels_} labels")
        self.xp = None
        params = init_parameters(self.resolved_["hidden"], self.n_features_in_, self.n_labels_,
                                 self.config_.seed, self.preprocessor_.seen_features())
        self._set_arrays(params, None)
        self.learning_rate_ = self.resolved_["lr"]
        self.step_, self.epoch_ = 0, 0
        self.history_ = []
        self.early_stopping_, self.best_params_, self.stopping_ = None, None, None

    def _set_arrays(self, params, moments):
        self.params_ = dict(params)
        self.moments_ = dict(moments) if moments else \
            {f"{k}.{s}": np.zeros_like(v) for k, v in params.items() for s in "mv"}
        self.batch_size_ = self.resolved_["batch_size"]
        self._blocks = hidden_blocks(self.resolved_["hidden"])
        self.xp = None
        self._use_device()

    def train_step(self, Xb, Yb) -> float:
        """One Adam step on a preprocessed batch; the input layer's gradient and update cover
        only the rows of the batch's features (as the engine's)."""
        self._use_device()
        xp, p, m = self.xp, self.params_, self.moments_
        in_rows = np.unique(Xb.indices)
        Xl = local_columns(Xb, in_rows)
        rows = self.xp.asarray(in_rows)
        local = {**p, "W0": p["W0"][rows]}
        Xd = Xl if xp is np else self._sparse.csr_matrix(Xl)
        loss, g = softmax_grads(xp, Xd, uniform_targets(xp, Yb), local, self._blocks)
        self.step_ += 1
        c, lr, wd = self.config_, self.learning_rate_, self.resolved_["weight_decay"]
        hp = (lr, c.beta1, c.beta2, c.eps, self.step_)
        w0, m0, v0 = local["W0"], m["W0.m"][rows], m["W0.v"][rows]
        adam_step(xp, w0, m0, v0, g["W0"], *hp, wd)
        p["W0"][rows], m["W0.m"][rows], m["W0.v"][rows] = w0, m0, v0
        for k in ("b0", "Wh", "bh", "W", "b"):
            adam_step(xp, p[k], m[k + ".m"], m[k + ".v"], g[k], *hp,
                      wd if k in ("Wh", "W") else 0.0)
        return loss

    def _params_changed(self):
        pass

    def fit(self, X, Y, validation=None, progress: bool = False, on_epoch=None):
        """As :meth:`slide.SlideClassifier.fit`."""
        warm = self.warm_start and self._is_fitted()
        if warm:
            self.config_ = self._config()
            self.resolved_ = resolve(self.config_, self.n_features_in_, self.n_labels_, self.n_train_)
        return fit_loop(self, X, Y, validation=validation, progress=progress, on_epoch=on_epoch,
                        continue_training=warm)

    def partial_fit(self, X, Y):
        if self._is_fitted():
            X, Y = self.check_data(X, Y, where="partial_fit")
        else:
            X, Y = self.check_data(X, Y, where="partial_fit", fitted=False)
            self.initialize(X, Y)
        self.train_epoch(self.transform(X), Y, np.arange(X.shape[0]))
        return self

    def synchronize(self):
        """Wait for the device to finish queued work (for timing)."""
        if self.xp is not np:
            self.xp.cuda.Stream.null.synchronize()

    # -- inference -----------------------------------------------------------------------------
    def score_blocks(self, X, block=None):
        """Exact scores of every label, block by block, on the device: yields ``(lo, hi, S)``."""
        if not self._is_fitted():
            raise NotFittedError("this DenseClassifier is not fitted yet; call fit first")
        self._use_device()
        Xp = self.transform(X)
        xp = self.xp
        block = block or max(1, min(4096, (1 << 26) // self.n_labels_))
        for lo in range(0, Xp.shape[0], block):
            hi = min(lo + block, Xp.shape[0])
            Xd = Xp[lo:hi] if xp is np else self._sparse.csr_matrix(Xp[lo:hi])
            yield lo, hi, forward(xp, Xd, self.params_, self._blocks)[-1] @ self.params_["W"].T + self.params_["b"]

    def block_topk(self, S, k):
        """Top-k ``(ids, scores)`` (host arrays) of device score rows ``S``."""
        xp = self.xp
        if xp is np:
            return topk(S, k)
        part = xp.argpartition(-S, k - 1, axis=1)[:, :k]
        vals = xp.take_along_axis(S, part, 1)
        order = xp.argsort(-vals, axis=1)
        return (self._host(xp.take_along_axis(part, order, 1)).astype(np.int64),
                self._host(xp.take_along_axis(vals, order, 1)))

    def predict_topk(self, X, k=5, block=None):
        X = self.check_data(X, where="predict")
        ids = np.empty((X.shape[0], k), np.int64)
        scores = np.empty((X.shape[0], k), np.float32)
        for lo, hi, S in self.score_blocks(X, block):
            ids[lo:hi], scores[lo:hi] = self.block_topk(S, k)
        return ids, scores

    def predict(self, X):
        return self.predict_topk(X, 1)[0][:, 0]

    def host_params(self) -> dict:
        return {k: self._host(v) for k, v in self.params_.items()}

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path):
        pre_arrays, pre_meta = self.preprocessor_.get_state()
        arrays = {**self.host_params(), **{f"adam.{k}": self._host(v) for k, v in self.moments_.items()},
                  **{f"pre.{k}": v for k, v in pre_arrays.items()}}
        if self.best_params_ is not None:
            arrays.update({f"best.{k}": self._host(v) for k, v in self.best_params_.items()})
        meta = {"engine": "dense", "config": self.config_.to_json(), "preprocessing": pre_meta,
                "n_features": self.n_features_in_, "n_labels": self.n_labels_, "n_train": self.n_train_,
                "step": self.step_, "epoch": self.epoch_, "learning_rate": self.learning_rate_,
                "history": self.history_, "stopping": self.stopping_,
                "early_stopping": self.early_stopping_.to_json() if self.early_stopping_ else None}
        write_checkpoint(path, arrays, meta, self.step_)

    @classmethod
    def load(cls, path, device="auto"):
        ck = read_checkpoint(path)
        model = cls(**ck.config_params(cls), device=device)
        model.config_ = model._config()
        model.n_features_in_, model.n_labels_, model.n_train_ = ck.n_features, ck.n_labels, ck.n_train
        model.resolved_ = resolve(model.config_, ck.n_features, ck.n_labels, ck.n_train)
        shapes = parameter_shapes(model.resolved_["hidden"], ck.n_features, ck.n_labels)
        model._set_arrays(ck.arrays_like(shapes),
                          ck.arrays_like(shapes, prefix="adam.", suffixes=(".m", ".v"), zeros=True))
        best = ck.arrays_like(shapes, prefix="best.", missing_ok=True)
        model.best_params_ = {k: model.xp.asarray(v) for k, v in best.items()} or None
        model.preprocessor_ = ck.preprocessor(ck.n_features)
        model.learning_rate_ = ck.float("learning_rate", model.resolved_["lr"])
        model.step_, model.epoch_ = ck.step, ck.epoch
        model.history_ = ck.meta.get("history") or []
        es = ck.meta.get("early_stopping")
        model.early_stopping_ = EarlyStopping.from_json(es) if es else None
        model.stopping_ = ck.meta.get("stopping")
        return model
