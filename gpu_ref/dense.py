"""The engine's network trained densely: full softmax over every label, Adam on every parameter.

One implementation for both devices: the array module ``xp`` (cupy on a GPU, numpy otherwise)
is chosen once at construction and the math never branches on it. Parameters use the engine's
names and layouts (``W0`` [n_features, H0] input-major, flat hidden stack ``Wh``/``bh``, output
``W`` [n_labels, H_last], ``b``) and its checkpoint format, so a model trained here loads into
:class:`slide.SlideClassifier` and vice versa.
"""
from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp

from slide.checkpoint import join_arrays, read_checkpoint, split_arrays, write_checkpoint
from slide.data import check_xy
from slide.metrics import evaluate, topk
from slide.network import default_batch_size, default_epochs, hidden_block, hidden_blocks, init_parameters

__all__ = ["DenseClassifier", "get_array_module", "gpu_available", "softmax_grads", "forward",
           "uniform_targets"]


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


class DenseClassifier:
    """Dense reference: ``DenseClassifier(hidden=(128,), lr=3e-3, batch_size=None, seed=0,
    device="auto")``. Same ``fit``/``partial_fit``/``predict_topk``/``score``/``save``/``load``
    and the same defaults as the sparse engine; initialisation draws exactly as the engine's
    does for the same seed.
    """

    def __init__(self, hidden=(128,), lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, batch_size=None,
                 seed=0, device="auto"):
        self.hidden = tuple(int(h) for h in np.atleast_1d(hidden))
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.batch_size, self.seed, self.device = batch_size, int(seed), device
        self.xp, self._sparse = get_array_module(device)
        self._fitted = False

    def get_params(self, deep=True):
        return {"hidden": self.hidden, "lr": self.lr, "beta1": self.beta1, "beta2": self.beta2,
                "eps": self.eps, "batch_size": self.batch_size, "seed": self.seed, "device": self.device}

    def set_params(self, **params):
        for k, v in params.items():
            setattr(self, k, v)
        return self

    # -- parameters ------------------------------------------------------------------------------
    def _init_params(self, n_features, n_labels, n_train):
        self.batch_size_ = self.batch_size or default_batch_size(n_train)
        self._set_arrays(init_parameters(self.hidden, n_features, n_labels, self.seed), None,
                         n_features, n_labels)
        self.step_, self.epoch_ = 0, 0
        self.history_ = []

    def _set_arrays(self, params, moments, n_features, n_labels):
        xp = self.xp
        self.params_ = {k: xp.asarray(v, dtype=xp.float32) for k, v in params.items()}
        self.moments_ = ({k: xp.asarray(v) for k, v in moments.items()} if moments else
                         {f"{k}.{s}": xp.zeros_like(v) for k, v in self.params_.items() for s in "mv"})
        self.n_features_in_, self.n_labels_ = int(n_features), int(n_labels)
        self._blocks = hidden_blocks(self.hidden)
        self._fitted = True

    def _to_device(self, X):
        return X if self.xp is np else self._sparse.csr_matrix(X)

    def _forward(self, Xd):
        return forward(self.xp, Xd, self.params_, self._blocks)

    def loss_and_grads(self, X, Y):
        """Mean softmax cross-entropy over every label and its gradients (see :func:`softmax_grads`)."""
        return softmax_grads(self.xp, self._to_device(X), uniform_targets(self.xp, Y), self.params_,
                             self._blocks)

    def _adam(self, grads):
        self.step_ += 1
        c1 = 1.0 / (1.0 - self.beta1 ** self.step_)
        c2 = 1.0 / (1.0 - self.beta2 ** self.step_)
        for k, w in self.params_.items():
            g, m, v = grads[k], self.moments_[k + ".m"], self.moments_[k + ".v"]
            m *= self.beta1
            m += (1 - self.beta1) * g
            v *= self.beta2
            v += (1 - self.beta2) * g * g
            w -= self.lr * (m * c1) / (self.xp.sqrt(v * c2) + self.eps)

    def train_batch(self, X, Y) -> float:
        loss, grads = self.loss_and_grads(X, Y)
        self._adam(grads)
        return loss

    # -- estimator API ---------------------------------------------------------------------------
    def _check(self, X, Y=None, where="input"):
        if not self._fitted:
            return check_xy(X, Y, where=where)
        return check_xy(X, Y, n_features=self.n_features_in_,
                        n_labels=self.n_labels_ if Y is not None else None, where=where)

    def fit(self, X, Y, epochs=None, validation=None, progress=False, on_epoch=None, eval_k=5):
        X, Y = self._check(X, Y, where="fit")
        if not self._fitted:
            self._init_params(X.shape[1], Y.shape[1], X.shape[0])
        if epochs is None:
            epochs = default_epochs(X.shape[0], self.batch_size_)
        for _ in range(int(epochs)):
            order = np.random.default_rng([self.seed, 2, self.epoch_]).permutation(X.shape[0])
            bar = None
            if progress:
                from tqdm.auto import tqdm
                bar = tqdm(total=X.shape[0], unit="samples", unit_scale=True, desc=f"dense epoch {self.epoch_ + 1}")
            t0 = time.perf_counter()
            total = 0.0
            for lo in range(0, X.shape[0], self.batch_size_):
                idx = np.sort(order[lo:lo + self.batch_size_])
                loss = self.train_batch(X[idx], Y[idx])
                total += loss * idx.size
                if bar is not None:
                    bar.update(idx.size)
                    bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self._sync()
            seconds = time.perf_counter() - t0
            if bar is not None:
                bar.close()
            self.epoch_ += 1
            rec = {"epoch": self.epoch_, "train_seconds": seconds,
                   "samples_per_second": X.shape[0] / seconds, "loss": total / X.shape[0]}
            if validation is not None:
                rec.update(self.evaluate(*validation, k=eval_k))
            self.history_.append(rec)
            if on_epoch is not None:
                on_epoch(self, rec)
        return self

    def partial_fit(self, X, Y):
        X, Y = self._check(X, Y, where="partial_fit")
        if not self._fitted:
            self._init_params(X.shape[1], Y.shape[1], X.shape[0])
        for lo in range(0, X.shape[0], self.batch_size_):
            self.train_batch(X[lo:lo + self.batch_size_], Y[lo:lo + self.batch_size_])
        return self

    def _sync(self):
        if self.xp is not np:
            self.xp.cuda.Stream.null.synchronize()

    def _host(self, a):
        return a if self.xp is np else self.xp.asnumpy(a)

    def predict_topk(self, X, k=5, block=None):
        X = self._check(X, where="predict")
        block = block or max(1, min(4096, (1 << 26) // self.n_labels_))
        ids = np.empty((X.shape[0], k), np.int64)
        scores = np.empty((X.shape[0], k), np.float32)
        for lo in range(0, X.shape[0], block):
            hi = min(lo + block, X.shape[0])
            s = self._forward(self._to_device(X[lo:hi]))[-1] @ self.params_["W"].T + self.params_["b"]
            if self.xp is np:
                ids[lo:hi], scores[lo:hi] = topk(s, k)
            else:
                part = self.xp.argpartition(-s, k - 1, axis=1)[:, :k]
                vals = self.xp.take_along_axis(s, part, 1)
                order = self.xp.argsort(-vals, axis=1)
                ids[lo:hi] = self._host(self.xp.take_along_axis(part, order, 1))
                scores[lo:hi] = self._host(self.xp.take_along_axis(vals, order, 1))
        return ids, scores

    def predict(self, X):
        return self.predict_topk(X, 1)[0][:, 0]

    def evaluate(self, X, Y, k=5):
        X, Y = self._check(X, Y, where="evaluate")
        return evaluate(self.predict_topk(X, k)[0], Y, k)

    def score(self, X, Y):
        return self.evaluate(X, Y, k=1)["P@1"]

    def host_params(self) -> dict:
        return {k: self._host(v) for k, v in self.params_.items()}

    def save(self, path):
        meta = {"engine": "dense", "config": {"hidden": list(self.hidden), "lr": self.lr,
                                              "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps,
                                              "batch_size": self.batch_size_, "seed": self.seed},
                "n_features": self.n_features_in_, "n_labels": self.n_labels_,
                "step": self.step_, "epoch": self.epoch_, "history": self.history_}
        moments = {k: self._host(v) for k, v in self.moments_.items()}
        write_checkpoint(path, join_arrays(self.host_params(), moments), meta, self.step_)

    @classmethod
    def load(cls, path, device="auto"):
        arrays, meta = read_checkpoint(path)
        c = meta["config"]
        model = cls(hidden=c["hidden"], lr=c.get("lr", 3e-3), beta1=c.get("beta1", 0.9),
                    beta2=c.get("beta2", 0.999), eps=c.get("eps", 1e-8),
                    batch_size=c.get("batch_size"), seed=c.get("seed", 0), device=device)
        params, moments = split_arrays(arrays)
        model._set_arrays(params, moments, meta["n_features"], meta["n_labels"])
        model.batch_size_ = model.batch_size or default_batch_size(meta.get("n_train", 0))
        model.step_, model.epoch_ = int(meta["step"]), int(meta["epoch"])
        model.history_ = meta.get("history", [])
        return model
