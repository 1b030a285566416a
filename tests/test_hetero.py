import threading

import numba
import numpy as np
import pytest

from gpu_ref.hetero import BatchPolicy, HeteroConfig, HeteroError, HeteroTrainer
from slide.metrics import precision_at_k
from slide.estimator import SlideClassifier


def _trainer(policy="hogbatch", cls=HeteroTrainer, **kw):
    model = SlideClassifier(hidden=(32,), sparsity=0.25, seed=0, early_stopping=False, lr=3e-3,
                            epochs=kw.pop("epochs", 3))
    cfg = dict(policy=policy, cpu_batch=32, gpu_batch=128, gpu_pool=64, device="cpu")
    cfg.update(kw)
    return cls(model, HeteroConfig(**cfg))


@pytest.mark.parametrize("policy, mined", [("hogbatch", 0), ("adaptive", 0), ("hogbatch", 4)])
def test_every_sample_once_per_epoch_and_model_learns(tiny_data, policy, mined):
    Xtr, Ytr, Xte, Yte = tiny_data
    h = _trainer(policy, cls=_PacedWorkers, epochs=6, min_gain=0.0,
                 gpu_mined=mined).fit(Xtr, Ytr, validation=(Xte, Yte))
    seen = np.concatenate(h.epoch_indices_["cpu"] + h.epoch_indices_["gpu"])
    np.testing.assert_array_equal(np.sort(seen), np.arange(Xtr.shape[0]))
    rec = h.model.history_[-1]
    assert rec["cpu_samples"] + rec["gpu_samples"] == Xtr.shape[0]
    assert rec["cpu_updates"] > 0 and rec["gpu_updates"] > 0
    assert 0 < rec["cpu_utilisation"] <= 1.0 and 0 < rec["gpu_utilisation"] <= 1.0
    assert all(np.isfinite(v).all() for v in h.model.params_.values())
    popular = np.argsort(-np.bincount(Ytr.indices, minlength=Ytr.shape[1]))[:1]
    base = precision_at_k(Yte, np.tile(popular, (Xte.shape[0], 1)), 1)[0]
    assert rec["val_P@1"] > base + 0.1, (rec["val_P@1"], base)


class _VirtualTime:
    """A clock of its own for each worker, advanced by its paced steps: a discrete-event
    schedule over the real threads. A worker whose step ends at virtual time t goes on (to take
    its next chunk of the stream) only once no other worker of the pass can end a step before t,
    so the workers take the stream's chunks in the order their paces say, however loaded the
    machine is and however long the real steps take. Each pass starts every worker it expects
    at time 0; a worker not expected (the GPU worker waiting for the engine's first step) joins
    at 0 with its first step."""

    def __init__(self):
        self._cond = threading.Condition()
        self._now = {}  # worker: virtual time of its last step's end (0 before its first)
        self._done = {}  # worker: its time when it left the pass
        self._names = {}  # thread id: worker

    def expect(self, names) -> None:
        with self._cond:
            self._now, self._done = {name: 0.0 for name in names}, {}
            self._cond.notify_all()

    def clock(self) -> float:
        """The calling worker's time; outside a worker of the pass, the pass's end so far."""
        with self._cond:
            name = self._names.get(threading.get_ident())
            if name in self._now:
                return self._now[name]
            return max(self._done.values(), default=0.0)

    def spend(self, name: str, seconds: float) -> None:
        with self._cond:
            self._names[threading.get_ident()] = name
            self._now[name] = self._now.get(name, 0.0) + seconds
            self._cond.notify_all()
            self._cond.wait_for(lambda: all((t, o) > (self._now[name], name)
                                            for o, t in self._now.items() if o != name))

    def leave(self, name: str) -> None:
        with self._cond:
            if name in self._now:
                self._done[name] = self._now.pop(name)
            self._cond.notify_all()


class _PacedWorkers(HeteroTrainer):
    """Both workers paced by a fixed virtual time per sample (10,000 and 1,000 samples a second
    unless set), which the trainer's clock reads: their speeds, and the order in which they take
    the stream's chunks, are set by the paces, not by how busy the machine is."""
    cpu_pace, gpu_pace = 1e-4, 1e-3

    def __init__(self, *args, **kwargs):
        self.time = _VirtualTime()
        super().__init__(*args, clock=self.time.clock, **kwargs)

    def _run(self, X, Y, order):
        # the GPU worker of a pass starts with the CPU's, unless it waits for the engine's
        # first step (the model's first pass) or has retired
        gpu = self._engine_ready.is_set() and not self.policy_.retired
        self.time.expect(["cpu", "gpu"] if gpu else ["cpu"])
        return super()._run(X, Y, order)

    def _cpu_step(self, X, Y, idx):
        loss = super()._cpu_step(X, Y, idx)
        self.time.spend("cpu", self.cpu_pace * idx.size)
        return loss

    def _gpu_step(self, X, Y, idx):
        loss = super()._gpu_step(X, Y, idx)
        self.time.spend("gpu", self.gpu_pace * idx.size)
        return loss

    def _worker_done(self, name):
        self.time.leave(name)


class _SlowGPU(_PacedWorkers):
    """The GPU worker twenty times slower than the engine."""
    cpu_pace, gpu_pace = 1e-5, 2e-4


def test_adaptive_balances_update_ratio_when_one_worker_is_slow(tiny_data):
    Xtr, Ytr = tiny_data[0], tiny_data[1]
    ratios = {}
    for policy in ("hogbatch", "adaptive"):
        # batch sizes whose product (512) the policy keeps: at the target ratio 2 it settles near
        # 51 and 10 (one CPU update of 51 takes 5 ms, one GPU update of 10 takes 10 ms), about 30
        # rounds an epoch of 3,000 rows. Fixed at 8 and 64, one GPU update outlasts 80 CPU updates
        h = _trainer(policy, cls=_PacedWorkers, cpu_batch=8, gpu_batch=64, target_ratio=2.0,
                     threshold=16, min_gain=0.0, epochs=4, warmup_updates=0, window=0.0)
        h.fit(Xtr, Ytr)
        after_first = h.model.history_[1:]  # the first epoch starts from the fixed batches
        ratios[policy] = sum(r["cpu_updates"] for r in after_first) / \
            sum(r["gpu_updates"] for r in after_first)
    assert abs(np.log(ratios["adaptive"] / 2.0)) < np.log(1.3), ratios
    assert ratios["hogbatch"] > 20, ratios


def test_slow_worker_retires_and_run_learns_as_cpu_alone(tiny_data):
    """A second worker far slower than the engine gives its cores and samples back: from then on
    the run is the CPU engine's, and it learns as well as the engine alone."""
    Xtr, Ytr, Xte, Yte = tiny_data
    # five epochs: the first, shared with the slow worker, lags; the rest must make it up. Judged
    # after its first update (no warm-up, no window): in an epoch of 3,000 rows the slow worker
    # makes only one or two, and the pair is only 5% faster than the engine alone
    h = _trainer("adaptive", cls=_SlowGPU, epochs=5, warmup_updates=0, window=0.0)
    h.fit(Xtr, Ytr, validation=(Xte, Yte))
    first, last = h.model.history_[0], h.model.history_[-1]
    assert first["gpu_retired"] and last["gpu_retired"]
    assert last["gpu_samples"] == 0 and last["cpu_samples"] == Xtr.shape[0]
    assert first["gpu_share"] < 0.5
    alone = SlideClassifier(hidden=(32,), sparsity=0.25, seed=0, early_stopping=False, lr=3e-3,
                            epochs=5).fit(Xtr, Ytr, validation=(Xte, Yte))
    assert last["val_P@1"] >= alone.history_[-1]["val_P@1"] - 0.05, (last, alone.history_[-1])


def test_policy_rule_and_bounds():
    p = BatchPolicy(HeteroConfig(policy="adaptive", cpu_batch=100, gpu_batch=400, target_ratio=1.0,
                                 threshold=2, warmup_updates=0))
    p.observe("cpu", 1000, 1.0)
    p.observe("gpu", 4000, 1.0)  # 4x faster: equal update rates need gpu/cpu batch = 4: unchanged
    assert p.batch == {"cpu": 100, "gpu": 400}
    p = BatchPolicy(HeteroConfig(policy="adaptive", cpu_batch=100, gpu_batch=400, threshold=2,
                                 warmup_updates=0))
    p.observe("cpu", 1000, 1.0)
    p.observe("gpu", 1e6, 1.0)  # far faster: clipped at threshold
    assert p.batch["gpu"] == 800 and p.batch["cpu"] == 50
    fixed = BatchPolicy(HeteroConfig(policy="hogbatch", cpu_batch=100, gpu_batch=400,
                                     warmup_updates=0))
    fixed.observe("cpu", 10, 1.0)
    fixed.observe("gpu", 1e6, 1.0)
    assert fixed.batch == {"cpu": 100, "gpu": 400} and not fixed.retired


def _judged(gpu_speed, min_gain=1.1):
    """A policy fed the engine alone at 1,000 samples a second (after a first, compiling step
    at 10), the GPU worker's two warm-up steps at 10, then side by side the engine at 800 and
    the GPU worker at ``gpu_speed``."""
    p = BatchPolicy(HeteroConfig(policy="hogbatch", min_gain=min_gain, warmup_updates=2,
                                 window=2.0))
    p.observe("cpu", 10, 1.0)  # compiling: not the engine's speed
    assert not p.alone_measured()
    p.observe("cpu", 1000, 1.0)
    assert not p.alone_measured()  # one second of the two-second window
    p.observe("cpu", 1000, 1.0)
    assert p.alone_measured()
    for _ in range(2):
        p.observe("gpu", 10, 1.0)  # compiling: not counted
        p.observe("cpu", 800, 1.0)  # beside a worker still compiling: not counted either
    for _ in range(2):
        assert p.judgement is None  # judged after a window of each, side by side
        p.observe("gpu", gpu_speed, 1.0)
        p.observe("cpu", 800, 1.0)
    return p


def test_gpu_worker_judged_by_the_pair_against_the_engine_alone():
    # slower than half the engine, and still worth its cores: the pair trains 1.2x the samples
    kept = _judged(400)
    assert not kept.retired
    assert kept.judgement == {"alone": 1000.0, "cpu_beside": 800.0, "gpu": 400.0,
                              "pair": 1200.0, "gain": 1.2}
    # the engine slowed by a fifth for a worker that gives a fifth back: not worth it
    assert _judged(200).retired and _judged(200).batch == {"cpu": 128, "gpu": 1024}
    assert _judged(250).retired and not _judged(250, min_gain=1.0).retired
    assert not _judged(0.001, min_gain=0.0).retired


def test_end_of_stream_is_shared_by_speed():
    p = BatchPolicy(HeteroConfig(policy="hogbatch", cpu_batch=100, gpu_batch=400,
                                 warmup_updates=0))
    assert p.take_size("gpu", 300) == 400  # no speeds measured yet: the batch
    p.observe("cpu", 1000, 1.0)
    p.observe("gpu", 3000, 1.0)
    assert p.take_size("gpu", 10_000) == 400 and p.take_size("cpu", 10_000) == 100
    assert p.take_size("gpu", 400) == 300  # three quarters of what is left
    assert p.take_size("cpu", 1000) == 100  # its quarter (250) is more than its batch
    assert p.take_size("gpu", 40) == 100  # never below the smaller batch
    p.retired = True
    assert p.take_size("gpu", 400) == 400


def test_partial_fit_calls_keep_both_workers_busy(tiny_data):
    """Every partial_fit call ends its stream: with a GPU batch of 256 in calls of 320 rows, a
    worker that waited for the engine's first step in every call and took a whole batch
    regardless of what was left would leave the CPU worker 64 of the 320 rows (16 before the
    GPU worker starts, 48 after), and idle for most of the call. Both paced at 10,000 samples
    a second, the rows are shared about evenly once their speeds are known."""
    Xtr, Ytr = tiny_data[0], tiny_data[1]
    h = _trainer(cls=_PacedWorkers, cpu_batch=16, gpu_batch=256, min_gain=0.0,
                 warmup_updates=0, window=0.0)
    h.cpu_pace = h.gpu_pace = 1e-4
    shares = []
    for lo in range(0, 2240, 320):
        stats = h.partial_fit(Xtr[lo:lo + 320], Ytr[lo:lo + 320])
        shares.append(stats["cpu"]["samples"] / 320)
    assert min(shares[2:]) > 0.35, shares


class _ThreadRecorder(HeteroTrainer):
    def _cpu_step(self, X, Y, idx):
        self.cpu_threads_seen.add(threading.get_ident())
        return super()._cpu_step(X, Y, idx)


class _ThreadCounter(_PacedWorkers):
    def _cpu_step(self, X, Y, idx):
        self.counts.add((self._gpu_active.is_set(), numba.get_num_threads()))
        return super()._cpu_step(X, Y, idx)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads")
def test_engine_runs_one_thread_fewer_beside_the_gpu_worker(tiny_data):
    """The GPU worker's host thread is busy too: beside it the engine's team is one thread
    smaller, so that none of its threads waits for a core; alone it has every one again."""
    Xtr, Ytr = tiny_data[0][:1000], tiny_data[1][:1000]
    h = _trainer(cls=_ThreadCounter, min_gain=0.0, epochs=2, window=0.0)
    h.model.set_params(threads=2)
    h.counts = set()
    h.fit(Xtr, Ytr)
    # (a step that began as the GPU worker joined can run at the full count)
    assert {(False, 2), (True, 1)} <= h.counts and (False, 1) not in h.counts


def test_engine_steps_on_the_calling_thread(tiny_data):
    """The engine's steps run on the thread that calls fit / partial_fit (whose OpenMP team
    the engine already has), never on a thread started for the run."""
    Xtr, Ytr = tiny_data[0][:1000], tiny_data[1][:1000]
    h = _trainer(cls=_ThreadRecorder, min_gain=0.0, epochs=2)
    h.cpu_threads_seen = set()
    h.fit(Xtr, Ytr)
    h.partial_fit(Xtr[:300], Ytr[:300])
    assert h.cpu_threads_seen == {threading.get_ident()}


class _FailingGPU(_PacedWorkers):
    def _gpu_step(self, X, Y, idx):
        if self.model.epoch_ >= 1:
            raise MemoryError("device out of memory (injected)")
        return super()._gpu_step(X, Y, idx)


def test_worker_error_stops_run_and_keeps_last_checkpoint(tmp_path, tiny_data):
    Xtr, Ytr = tiny_data[0][:1000], tiny_data[1][:1000]
    # min_gain 0: the worker must not retire in epoch 1 (on numpy it can be slower than half
    # the engine), or it would never reach the failure injected in epoch 2
    h = _trainer(cls=_FailingGPU, min_gain=0.0)
    saved_steps = []

    def checkpoint(model, record):
        model.save(tmp_path / "ck")
        saved_steps.append(model.step_)

    with pytest.raises(HeteroError, match="gpu worker failed at epoch 2: MemoryError: device out of memory"):
        h.fit(Xtr, Ytr, on_epoch=checkpoint)
    assert h.model.epoch_ == 1 and saved_steps and len(saved_steps) == 1
    loaded = SlideClassifier.load(tmp_path / "ck")
    assert loaded.epoch_ == 1 and loaded.step_ == saved_steps[0]
    assert all(np.isfinite(v).all() for v in loaded.params_.values())


def test_config_validation():
    with pytest.raises(ValueError, match="policy"):
        HeteroConfig(policy="greedy")
    with pytest.raises(ValueError):
        HeteroConfig(threshold=0.5)


def test_gpu_worker_with_mined_negatives_updates_the_labels_and_each_rows_best(tiny_data):
    Xtr, Ytr = tiny_data[0], tiny_data[1]
    h = _trainer(epochs=1, gpu_pool=0, gpu_mined=3, min_gain=0.0)
    h.fit(Xtr, Ytr)
    state = h._begin()
    assert state.params["W"].shape[0] == state.n_labels
    idx = np.arange(10, 30)
    Xp, Yr = h.model.preprocess(Xtr), h.model.targets(Xtr, Ytr)
    H = h.model.embed(Xtr[idx])
    S = H @ state.params["W"].T + state.params["b"]
    want = set(np.argsort(-S, axis=1)[:, :3].ravel()) | set(Yr[idx].indices)
    seen = []
    apply = state.apply_gradients
    state.apply_gradients = lambda out_rows, *a: (seen.append(np.asarray(out_rows)),
                                                 apply(out_rows, *a))
    h._gpu_step(Xp, Yr, idx)
    assert set(seen[0]) == want, sorted(set(seen[0]) ^ want)


def test_hetero_settings_are_checked():
    with pytest.raises(ValueError, match="gpu_pool and gpu_mined"):
        HeteroConfig(gpu_mined=-1)
    with pytest.raises(ValueError, match="gpu_refresh"):
        HeteroConfig(gpu_refresh=0)
