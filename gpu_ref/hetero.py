"""Heterogeneous CPU+GPU training of one model: Hogbatch and Adaptive Hogbatch.

Two workers share one epoch stream and whichever is free takes the next chunk of it:

* the **CPU worker** runs the sparse engine's batch step (numba threads, Hogwild) on small
  batches, updating the host model in place;
* the **GPU worker** takes large batches. For each one it pulls from the host model only the rows
  the batch needs (the input rows of its features, and as output rows its labels plus a random
  pool of negatives and, with ``gpu_mined``, each row's best-scoring rows, chosen against a
  copy of the output layer that crosses to the device every ``gpu_refresh`` steps), computes a
  dense softmax over those rows on the device (cupy, or numpy in a thread when there is no
  GPU), and pushes back the gradient rows, which the host applies with the same row-wise Adam
  as the CPU's. Every GPU batch starts from the CPU's latest rows.

Policies: ``hogbatch`` keeps both batch sizes fixed. ``adaptive`` moves them so that the ratio of
CPU to GPU updates approaches ``target_ratio``: with measured speeds s (samples per busy second),
update rates are s / batch, so it sets gpu_batch / cpu_batch = target_ratio · s_gpu / s_cpu while
keeping their product fixed, each within a factor ``threshold`` of its initial value.

Under either policy the GPU worker must earn its cores: it retires (the engine gets every core
back) where the pair trains fewer samples a second than ``min_gain`` times the engine alone.
The engine runs alone for a first window (its first step, which compiles, not counted), the GPU
worker's first ``warmup_updates`` steps are not counted either (cupy compiles its kernels in
them), and the next window of both workers side by side is compared with the first. The
engine runs one thread fewer beside the GPU worker, whose host thread is busy too (CUDA's
spin-wait, the gathers, the row-wise Adam), so that the engine's threads do not wait on a core
it holds (docs/heterogeneous.md).

Under either policy the end of a stream is shared out: a worker never takes more than the share
of the samples left that its measured speed gives it (nor fewer than the smaller configured
batch), so that both finish together instead of one waiting out the other's last large batch.
This matters most to ``partial_fit``, whose every call ends in such a tail.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from gpu_ref.dense import (batch_rows, forward, get_array_module, hard_rows, join_rows,
                           softmax_grads, uniform_targets)
from gpu_ref.ops import PRECISIONS, matmul_precision
from slide.runtime import engine_threads, set_num_threads
from slide.config import hidden_blocks
from slide.data import take_rows

__all__ = ["HeteroConfig", "HeteroTrainer", "HeteroError", "BatchPolicy"]


class HeteroError(RuntimeError):
    """A worker failed; the run stopped and the message names the worker."""


@dataclass(frozen=True)
class HeteroConfig:
    """Settings of a heterogeneous run.

    policy : "hogbatch" (fixed batch sizes) or "adaptive".
    cpu_batch, gpu_batch : (initial) batch sizes of the two workers.
    gpu_pool : random negative output rows per GPU batch, besides the batch's labels.
    gpu_mined : besides them, each row of a GPU batch brings its ``gpu_mined`` highest-scoring
        output rows, found by the exact product of its last hidden layer with a copy of the
        output layer on the device (the exact peer of the engine's LSH candidates).
    gpu_refresh : GPU steps between refreshes of that copy from the host model (the engine's
        tables are likewise rebuilt from the weights every so many samples). On numpy the
        worker reads the host model itself.
    target_ratio : CPU updates per GPU update that ``adaptive`` aims at.
    threshold : ``adaptive`` keeps each batch size within [initial / threshold, initial · threshold].
    device : the GPU worker's device: "auto" (cupy if a GPU is present), "gpu" or "cpu".
    cpu_threads : the CPU worker's numba threads while the GPU worker runs (default: the
        model's, or every core, less one for the GPU worker's host thread).
    min_gain : the GPU worker retires (for the rest of the run; the CPU worker then gets every
        core back) when the pair's samples a second, measured side by side, fall below
        ``min_gain`` times the engine's alone: a worker that gains less takes cores and samples
        from the engine without speeding the run up (0: never).
    warmup_updates : the GPU worker's first steps, not timed for the policy (they compile).
    window : busy seconds of each worker in each of the two measured windows (the engine
        alone, then side by side); each speed is the median of its steps' rates.
    precision : the GPU worker's matrix products, "tf32" or "fp32" (see ``DenseClassifier``).
    """
    policy: str = "adaptive"
    cpu_batch: int = 128
    gpu_batch: int = 1024
    gpu_pool: int = 4096
    gpu_mined: int = 0
    gpu_refresh: int = 16
    target_ratio: float = 1.0
    threshold: float = 8.0
    device: str = "auto"
    cpu_threads: int | None = None
    min_gain: float = 1.1
    warmup_updates: int = 5
    window: float = 1.0
    precision: str = "tf32"

    def __post_init__(self):
        if self.policy not in ("hogbatch", "adaptive"):
            raise ValueError(f"policy must be 'hogbatch' or 'adaptive', got {self.policy!r}")
        if min(self.cpu_batch, self.gpu_batch, self.gpu_refresh) < 1:
            raise ValueError("batch sizes and gpu_refresh must be positive")
        if min(self.gpu_pool, self.gpu_mined) < 0:
            raise ValueError("gpu_pool and gpu_mined must be non-negative")
        if self.target_ratio <= 0 or self.threshold < 1:
            raise ValueError("target_ratio must be positive and threshold at least 1")
        if self.min_gain < 0 or self.warmup_updates < 0 or self.window < 0:
            raise ValueError("min_gain, warmup_updates and window must be non-negative")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")


class BatchPolicy:
    """Batch sizes of the two workers, fixed or adapted from their measured speeds, and whether
    the GPU worker has earned its place (:attr:`judgement`)."""

    def __init__(self, config: HeteroConfig, smoothing: float = 0.3):
        self.config = config
        self.batch = {"cpu": config.cpu_batch, "gpu": config.gpu_batch}
        self.retired = False
        #: the speeds the retirement was judged on (samples a second), once judged
        self.judgement = None
        self._updates = {"cpu": 0, "gpu": 0}
        self._speed = {}
        # per-step rates of the two windows: the engine alone, then both side by side
        self._alone, self._beside = [], {"cpu": [], "gpu": []}
        self._alone_seconds, self._beside_seconds = 0.0, {"cpu": 0.0, "gpu": 0.0}
        self._alpha = smoothing
        self._lock = threading.Lock()

    def alone_measured(self) -> bool:
        """Whether the engine's window alone is complete (the GPU worker waits for it)."""
        with self._lock:
            return self._alone_seconds >= self.config.window and \
                len(self._alone) >= max(1, self.config.warmup_updates)

    def observe(self, worker: str, samples: int, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            self._updates[worker] += 1
            s = samples / seconds
            if worker == "cpu" and self._updates["gpu"] == 0:
                if self._updates["cpu"] > 1:  # the first step compiles
                    self._alone.append(s)
                    self._alone_seconds += seconds
            if worker == "gpu" and self._updates["gpu"] <= self.config.warmup_updates:
                return  # compiling: its speed would mislead the policy
            if self._updates["gpu"] > self.config.warmup_updates:
                self._beside[worker].append(s)
                self._beside_seconds[worker] += seconds
            old = self._speed.get(worker)
            self._speed[worker] = s if old is None else (1 - self._alpha) * old + self._alpha * s
            if len(self._speed) < 2:
                return
            if self.judgement is None and self._alone and \
                    min(self._beside_seconds.values()) >= self.config.window and \
                    min(map(len, self._beside.values())) >= max(1, self.config.warmup_updates):
                self._judge()
            if self.retired:  # the engine alone again, at the batch size it learns with
                self.batch = {"cpu": self.config.cpu_batch, "gpu": self.config.gpu_batch}
            elif self.config.policy == "adaptive":
                self._adapt()

    def _judge(self):
        alone = float(np.median(self._alone))
        cpu, gpu = (float(np.median(self._beside[w])) for w in ("cpu", "gpu"))
        self.judgement = {"alone": alone, "cpu_beside": cpu, "gpu": gpu, "pair": cpu + gpu,
                          "gain": (cpu + gpu) / alone}
        self.retired = cpu + gpu < self.config.min_gain * alone

    def take_size(self, worker: str, remaining: int) -> int:
        """How many of the ``remaining`` samples of a stream ``worker`` takes next: its batch,
        or near the end, its speed's share of the rest, so that both workers end together."""
        with self._lock:
            batch = self.batch[worker]
            if self.retired or len(self._speed) < 2:
                return batch
            other = "gpu" if worker == "cpu" else "cpu"
            share = self._speed[worker] / (self._speed[worker] + self._speed[other])
            floor = min(self.config.cpu_batch, self.config.gpu_batch)
            return int(min(batch, max(floor, np.ceil(share * remaining))))

    @property
    def speeds(self) -> dict:
        """Smoothed samples per busy second of each worker measured so far."""
        return dict(self._speed)

    def _adapt(self):
        c = self.config
        product = c.cpu_batch * c.gpu_batch
        ratio = c.target_ratio * self._speed["gpu"] / self._speed["cpu"]  # wanted gpu/cpu batch
        gpu = np.clip(np.sqrt(product * ratio), c.gpu_batch / c.threshold, c.gpu_batch * c.threshold)
        cpu = np.clip(product / gpu, c.cpu_batch / c.threshold, c.cpu_batch * c.threshold)
        self.batch = {"cpu": max(1, int(round(cpu))), "gpu": max(1, int(round(gpu)))}


class _Stream:
    """One epoch's sample order, handed out in chunks to whichever worker asks."""

    def __init__(self, order: np.ndarray):
        self.order, self.pos = order, 0
        self._lock = threading.Lock()

    @property
    def remaining(self) -> int:
        return self.order.size - self.pos

    def take(self, n: int):
        with self._lock:
            if self.pos >= self.order.size:
                return None
            chunk = self.order[self.pos:self.pos + n]
            self.pos += chunk.size
            return chunk


class HeteroTrainer:
    """Runs a :class:`slide.SlideClassifier`'s epochs with a CPU worker and a GPU worker together.

    ``HeteroTrainer(model, HeteroConfig(policy="adaptive")).fit(X, Y, validation)`` trains
    ``model`` through its own ``fit`` (:func:`slide.fitting.fit_model`: preprocessing,
    validation slice, early stopping, checkpoints), with this trainer as the runner of its
    epochs over the model's training state. Each epoch's record adds, per worker, its updates,
    samples, busy seconds and utilisation (busy / wall), its final batch size and its mean
    loss. ``epoch_indices_`` keeps the sample ids each worker processed in the last pass.
    ``clock`` measures the workers' steps (the policy's speeds come from it).
    """

    def __init__(self, model, config: HeteroConfig = HeteroConfig(), clock=time.perf_counter):
        self.model, self.config, self.clock = model, config, clock
        self.xp, self._sparse = get_array_module(config.device)
        self._state = None

    def settings(self) -> dict:
        """The trainer's settings (``slide train`` records them beside the model's)."""
        from dataclasses import asdict
        return asdict(self.config)

    def fit(self, X, Y, validation=None, progress: bool = False, on_epoch=None):
        """Train the model as :meth:`slide.SlideClassifier.fit` does, with both workers."""
        self.model.fit(X, Y, validation=validation, progress=progress, on_epoch=on_epoch,
                       runner=self)
        return self

    def partial_fit(self, X, Y):
        """One pass over (X, Y) in row order with both workers; returns the per-worker stats."""
        return self.model.partial_fit(X, Y, runner=self)

    # -- the runner of a training state's epochs -------------------------------------------------
    def train_epoch(self, Xp, Y, order, progress=None, learning_rate=None) -> dict:
        """One epoch of preprocessed rows in ``order``, shared out to both workers."""
        state = self._begin()
        if learning_rate is not None:
            state.learning_rate = float(learning_rate)
        self._rng = np.random.default_rng([state.config.seed, 3, self.model.epoch_])
        state.begin_epoch()
        wall, stats = self._run(Xp, Y, order)
        if progress is not None:
            progress.update(order.size)
        record = {"loss": sum(s["loss"] * s["samples"] for s in stats.values()) / max(order.size, 1),
                  "policy": self.config.policy, "device": "gpu" if self.xp is not np else "cpu",
                  **{f"{w}_{k}": v for w, s in stats.items() for k, v in s.items()}}
        record["update_ratio"] = stats["cpu"]["updates"] / max(stats["gpu"]["updates"], 1)
        record["gpu_retired"] = self.policy_.retired
        record["gpu_judgement"] = self.policy_.judgement
        record["gpu_share"] = stats["gpu"]["samples"] / max(order.size, 1)
        return record

    def train_rows(self, Xp, Y, order, progress=None) -> dict:
        """A stream's pass (``partial_fit``): both workers, no rehash; the per-worker stats."""
        self._begin()
        return self._run(Xp, Y, order)[1]

    def _begin(self):
        """The model's training state; a new one (a new fit) gets a new policy and layout."""
        state = self.model.state_
        if state is not self._state:
            self._state = state
            self._blocks = hidden_blocks(state.resolved["hidden"])
            # set once the engine's window alone is measured (its first step compiled its
            # kernels): only the first pass of a fitted model holds the GPU worker back
            self._engine_ready = threading.Event()
            self._gpu_active = threading.Event()  # the GPU worker is stepping this pass
            self.policy_ = BatchPolicy(self.config)
            self._output_copy, self._copy_age = None, 0
            self._rng = np.random.default_rng([state.config.seed, 3, state.step])
        return state

    # -- workers ---------------------------------------------------------------------------------
    def _cpu_step(self, X, Y, idx):
        return self._state.train_step(take_rows(X, idx), take_rows(Y, idx))

    def _gpu_step(self, X, Y, idx):
        """Pull the rows batch ``idx`` needs, compute their gradients on the device, push them."""
        xp, state = self.xp, self._state
        p = state.params
        Xb, Yb = take_rows(X, idx), take_rows(Y, idx)
        key = int(self._rng.integers(2**63))  # the worker's own stream of draws
        in_rows, Xl, out_rows, Yl = batch_rows(Xb, Yb, state.n_labels, self.config.gpu_pool, key)
        rows = {"W0": p["W0"][in_rows], "b0": p["b0"], "Wh": p["Wh"], "bh": p["bh"]}
        device_rows = {k: xp.asarray(v) for k, v in rows.items()}
        Xd = Xl if xp is np else self._sparse.csr_matrix(Xl)
        targets = tuple(xp.asarray(t) for t in uniform_targets(Yl))
        relu = state.resolved["activation"] == "relu"
        acts = None
        with matmul_precision(xp, self.config.precision):
            if self.config.gpu_mined:
                acts = forward(xp, Xd, device_rows, self._blocks, relu)
                W, b = self._output_rows_copy()
                joined, targets = join_rows(xp, xp.asarray(out_rows), targets,
                                            hard_rows(xp, acts[-1], W, b, self.config.gpu_mined))
                out_rows = joined if xp is np else xp.asnumpy(joined)
            device_rows["W"] = xp.asarray(p["W"][out_rows])
            device_rows["b"] = xp.asarray(p["b"][out_rows])
            loss, grads = softmax_grads(xp, Xd, targets, device_rows, self._blocks, relu, acts)
        host = {k: np.ascontiguousarray(v if xp is np else xp.asnumpy(v), dtype=np.float32)
                for k, v in grads.items()}
        state.apply_gradients(out_rows, in_rows, host)
        return float(loss)

    def _output_rows_copy(self):
        """The output layer the hard negatives are chosen from: the host model's on numpy, else
        a device copy refreshed every ``gpu_refresh`` GPU steps (into the same buffers)."""
        p = self._state.params
        if self.xp is np:
            return p["W"], p["b"]
        copy = self._output_copy
        if copy is None or copy[0].shape != p["W"].shape:
            copy = self._output_copy = (self.xp.asarray(p["W"]), self.xp.asarray(p["b"]))
            self._copy_age = 0
        elif self._copy_age >= self.config.gpu_refresh:
            # the engine's rows lie in blocks beside their moments: not one contiguous array
            copy[0].set(np.ascontiguousarray(p["W"]))
            copy[1].set(np.ascontiguousarray(p["b"]))
            self._copy_age = 0
        self._copy_age += 1
        return copy

    def _worker(self, name, step, stream, X, Y, stats, stop, errors, threads):
        """One worker's loop over ``stream``; ``threads``: its numba threads, for the CPU
        worker a pair (alone, beside the GPU worker)."""
        clock = self.clock
        alone, beside = threads if name == "cpu" else (threads, threads)
        try:
            with engine_threads(alone):
                t_start = clock()
                if name == "gpu":  # wait for the engine's window alone (and its compile)
                    while not (self._engine_ready.wait(0.05) or stop.is_set()):
                        pass
                    self._gpu_active.set()
                while not stop.is_set():
                    if name == "gpu" and self.policy_.retired:
                        break
                    if name == "cpu":
                        set_num_threads(beside if self._gpu_active.is_set() else alone)
                    idx = stream.take(self.policy_.take_size(name, stream.remaining))
                    if idx is None:
                        break
                    idx = np.sort(idx)
                    t0 = clock()
                    loss = step(X, Y, idx)
                    dt = clock() - t0
                    self.policy_.observe(name, idx.size, dt)
                    stats["updates"] += 1
                    stats["samples"] += int(idx.size)
                    stats["busy_seconds"] += dt
                    stats["loss_sum"] += loss * idx.size
                    self.epoch_indices_[name].append(idx)
                    if name == "cpu" and self.policy_.alone_measured():
                        self._engine_ready.set()
                stats["wall_seconds"] = clock() - t_start
        except BaseException as e:  # reported by the caller, after the other worker stopped
            errors.append((name, e))
            stop.set()
        finally:
            if name == "cpu":  # a CPU worker that never stepped must not hold the other back
                self._engine_ready.set()
            else:
                self._gpu_active.clear()
            self._worker_done(name)

    def _worker_done(self, name) -> None:
        """Called as each worker leaves a pass (a hook for schedulers that pace the workers)."""

    def _run(self, X, Y, order):
        """Both workers over the samples ``order``; returns (wall seconds, per-worker stats)."""
        m = self.model
        stream = _Stream(order)
        stop = threading.Event()
        errors = []
        stats = {w: {"updates": 0, "samples": 0, "busy_seconds": 0.0, "wall_seconds": 0.0,
                     "loss_sum": 0.0} for w in ("cpu", "gpu")}
        self.epoch_indices_ = {"cpu": [], "gpu": []}
        retired = self.policy_.retired
        alone = self._state.config.threads or os.cpu_count() or 1
        cpu_threads = (alone, self.config.cpu_threads or max(1, alone - 1))
        t0 = self.clock()
        # The CPU worker runs in the calling thread: each Python thread that opens the engine's
        # OpenMP regions keeps a team of its own, and a worker thread's team beside the
        # caller's would hold more threads than there are cores (docs/threading.md).
        gpu = None
        if not retired:
            gpu = threading.Thread(target=self._worker, name="slide-gpu", daemon=True,
                                   args=("gpu", self._gpu_step, stream, X, Y, stats["gpu"], stop,
                                         errors, 1))
            gpu.start()
        self._worker("cpu", self._cpu_step, stream, X, Y, stats["cpu"], stop, errors, cpu_threads)
        if gpu is not None:
            gpu.join()
        wall = self.clock() - t0
        if errors:
            name, e = errors[0]
            raise HeteroError(f"{name} worker failed at epoch {m.epoch_ + 1}: "
                              f"{type(e).__name__}: {e}") from e
        for w in stats:
            s = stats[w]
            s["utilisation"] = s["busy_seconds"] / wall if wall > 0 else 0.0
            s["final_batch"] = self.policy_.batch[w]
            s["loss"] = s.pop("loss_sum") / max(s["samples"], 1)
        return wall, stats
