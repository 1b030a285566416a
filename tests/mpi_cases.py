"""Cases that run under ``mpiexec -n 2`` (``tests/test_distributed.py`` launches them).

``python -m tests.mpi_cases CASE [ARGS]``: every rank runs CASE; rank 0 prints ``OK CASE`` when
its checks pass. A failing check raises, which ends the job through ``DataParallel.guard``.
"""
import os
import shutil
import signal
import sys
import time

import numpy as np
import scipy.sparse as sp
from mpi4py import MPI

from slide.distributed import DataParallel
from slide.estimator import SlideClassifier

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def _data(n, n_features=60, n_labels=9, seed=0):
    """Rows a network learns only in part: each label draws 2 of 8 features it shares with its
    neighbours, plus 5 noise features."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_labels, n)
    rows, cols, vals = [], [], []
    for i, l in enumerate(labels):
        f = np.concatenate([l * 4 + rng.integers(0, 8, 2), rng.integers(0, n_features, 5)])
        rows += [i] * f.size
        cols += f.tolist()
        vals += rng.random(f.size).tolist()
    X = sp.csr_matrix((np.float32(vals), (rows, cols)), shape=(n, n_features))
    X.sum_duplicates()
    Y = sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), labels)), shape=(n, n_labels))
    return X, Y


def _interleaved(X, Y, batch, rank, size):
    """Rank ``rank``'s rows when union batch k is every rank's batch k in rank order."""
    n_batches = X.shape[0] // (batch * size)
    ids = np.concatenate([np.arange(k * batch * size + rank * batch, k * batch * size + (rank + 1) * batch)
                          for k in range(n_batches)])
    return X[ids], Y[ids]


def _model(**kw):
    settings = dict(hidden=(16,), sparsity=1.0, threads=1, batch_size=8, seed=3, early_stopping=False)
    settings.update(kw)
    return SlideClassifier(**settings)


def _same_on_all_ranks(arrays: dict) -> bool:
    mine = np.array([np.float64(np.sum(a, dtype=np.float64)) for _, a in sorted(arrays.items())])
    everyone = COMM.allgather(mine)
    return all(np.array_equal(everyone[0], e) for e in everyone)


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]), initial=0.0)) for k in a)


def sync_equals_union():
    """sync on 2 ranks = one process on the union batches; moments equal on every rank."""
    X, Y = _data(128)
    Xr, Yr = _interleaved(X, Y, 8, RANK, SIZE)
    dp = DataParallel(mode="sync")
    m = _model().partial_fit(Xr, Yr, distributed=dp)
    assert _same_on_all_ranks(m.params_) and _same_on_all_ranks(m.moments_)
    if RANK == 0:
        one = _model(batch_size=8 * SIZE).partial_fit(X, Y)
        diff = _max_diff(m.params_, one.params_)
        assert diff < 1e-5, f"sync differs from the single process by {diff}"
        assert m.step_ == one.step_, (m.step_, one.step_)
        print(f"OK sync_equals_union max|diff|={diff:.2e} steps={m.step_}")


def local_every_step_is_the_mean_of_local_steps():
    """local, every=1: after each step the replicas hold the mean of every rank's own Adam step
    from the common weights (each rank with its own moments), checked against the same
    arithmetic done in one process. With Adam this is not sync's step on the averaged gradient
    (Adam is not linear in the gradient); with moments per rank it is local SGD's average."""
    X, Y = _data(128)
    Xr, Yr = _interleaved(X, Y, 8, RANK, SIZE)
    loc = _model().partial_fit(Xr, Yr, distributed=DataParallel(mode="local", every=1))
    assert _same_on_all_ranks(loc.params_), "local replicas differ after an average"
    assert not _same_on_all_ranks({"v": loc.moments_["W.v"]}), "local moments should stay per rank"
    if RANK == 0:
        shards = [_interleaved(X, Y, 8, r, SIZE) for r in range(SIZE)]
        replicas = [_model() for _ in range(SIZE)]
        for m in replicas:
            m.initialize(X, Y)
        for k in range(shards[0][0].shape[0] // 8):
            for m, (Xs, Ys) in zip(replicas, shards):
                m.partial_fit(Xs[k * 8:(k + 1) * 8], Ys[k * 8:(k + 1) * 8])
            mean = {p: sum(m.params_[p] for m in replicas) * np.float32(1.0 / SIZE) for p in loc.params_}
            for m in replicas:
                m.restore(mean)
        diff = _max_diff(loc.params_, replicas[0].params_)
        assert diff < 1e-6, f"local every=1 differs from the mean of local steps by {diff}"
        print(f"OK local_every_step max|diff|={diff:.2e}")


def delayed_learns_like_one_process(mode="delayed"):
    """2 ranks (half the rows each) reach the single process's test P@1 within 0.02, and the
    replicas end equal."""
    X, Y = _data(3000, seed=1)
    Xte, Yte = _data(1000, seed=2)
    settings = dict(hidden=(32,), sparsity=0.5, batch_size=16, epochs=8, lr=3e-3)
    dp = DataParallel(mode=mode, **({} if mode == "sync" else {"every": 4}))
    m = _model(**settings).fit(X[RANK::SIZE], Y[RANK::SIZE], distributed=dp)
    assert _same_on_all_ranks(m.params_), "replicas differ after fit"
    p_dist = m.evaluate(Xte, Yte)["P@1"]
    if RANK == 0:
        p_one = _model(**settings).fit(X, Y).evaluate(Xte, Yte)["P@1"]
        assert p_dist >= p_one - 0.02, f"{mode} on {SIZE} ranks: P@1 {p_dist:.3f}, one process {p_one:.3f}"
        print(f"OK {mode}_learns P@1 {p_dist:.3f} (one process {p_one:.3f}); rounds {dp.rounds_}, "
              f"{dp.bytes_sent_ / max(dp.steps_, 1):.0f} bytes/step")


def rank_fails(how="raises", kind="sync"):
    """Rank 1 fails after its first epoch (``raises``: an exception; ``dies``: killed;
    ``hangs``: stops answering): the job must end, not hang. ``kind``: data parallelism
    (``sync``) or label shards (``labels``)."""
    X, Y = _data(400)

    def on_epoch(model, record):
        if RANK == 1:
            if how == "raises":
                raise RuntimeError("rank 1 fails on purpose")
            if how == "hangs":
                time.sleep(120)
            os.kill(os.getpid(), signal.SIGKILL)

    # a short deadline only where it is the point: elsewhere a rank still compiling kernels
    # must not look like a hung one
    timeout = 3 if how == "hangs" else 60
    if kind == "labels":
        from slide.shards import LabelShards
        _model(epochs=3).fit(X, Y, on_epoch=on_epoch, distributed=LabelShards(timeout=timeout))
    else:
        _model(epochs=3).fit(X[RANK::SIZE], Y[RANK::SIZE], on_epoch=on_epoch,
                             distributed=DataParallel(mode="sync", timeout=timeout))
    raise AssertionError("training went on after a rank failed")


def _shard_rows(model):
    """This rank's rows of the whole layer's ``W``, ``b`` (the shards split the output rows of
    the single process's map, in order)."""
    lo, hi = model.label_shards_.bounds(model.n_outputs_fitted_)
    return lo, hi


def labels_equal_one_process():
    """2 label shards with every output active and one thread compute what one process does:
    the same output rows (each rank its slice), the same hidden layers on every rank, the same
    loss, predictions and validation loss; a sharded checkpoint loads whole into one process
    and resumes on 2 ranks."""
    import tempfile

    from slide.shards import LabelShards
    X, Y = _data(256, n_labels=11)
    Xv, Yv = _data(64, n_labels=11, seed=5)
    dp = LabelShards()
    settings = dict(hidden=(16,), epochs=3, batch_size=16, lr=3e-3)
    m = _model(**settings).fit(X, Y, validation=(Xv, Yv), distributed=dp)
    lo, hi = _shard_rows(m)
    hidden = {k: m.params_[k] for k in ("W0", "b0", "Wh", "bh")}
    assert _same_on_all_ranks(hidden), "the hidden layers differ between the shards"
    assert _same_on_all_ranks({k: m.moments_[k] for k in ("W0.m", "W0.v")})
    ids, scores = m.predict_topk(Xv, 3)
    ev = m.evaluate(Xv, Yv, k=3, loss=True)
    one = _model(**settings).fit(X, Y, validation=(Xv, Yv))
    diffs = {"W": np.abs(m.params_["W"] - one.params_["W"][lo:hi]).max(),
             "b": np.abs(m.params_["b"] - one.params_["b"][lo:hi]).max(),
             "W.v": np.abs(m.moments_["W.v"] - one.moments_["W.v"][lo:hi]).max(),
             **{k: np.abs(hidden[k] - one.params_[k]).max(initial=0.0) for k in hidden}}
    worst = max(float(v) for v in diffs.values())
    assert worst < 1e-5, f"label shards differ from one process: {diffs}"
    losses = [(a["loss"], b["loss"], a["val_loss"], b["val_loss"])
              for a, b in zip(m.history_, one.history_)]
    for a, b, va, vb in losses:
        assert abs(a - b) < 1e-5 and abs(va - vb) < 1e-5, losses
    one_ids, one_scores = one.predict_topk(Xv, 3)
    assert np.array_equal(ids, one_ids) and np.allclose(scores, one_scores, atol=1e-5)
    ev_one = one.evaluate(Xv, Yv, k=3, loss=True)
    assert all(abs(ev[k] - ev_one[k]) < 1e-5 for k in ev), (ev, ev_one)
    # a sharded checkpoint: whole into one process, and resumed on the same ranks
    path = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    m.save(path)
    if RANK == 0:
        whole = SlideClassifier.load(path)
        assert np.array_equal(whole.predict_topk(Xv, 3)[0], ids)
        assert whole.labels_.size == one.labels_.size and whole.shards() is None
        assert np.array_equal(whole.params_["W"], np.concatenate(COMM.gather(m.params_["W"])))
    else:
        COMM.gather(m.params_["W"])
    back = dp.load(SlideClassifier, path)
    assert np.array_equal(back.params_["W"], m.params_["W"]) and back.epoch_ == m.epoch_
    back.set_params(warm_start=True, epochs=1).fit(X, Y, validation=(Xv, Yv), distributed=dp)
    assert back.epoch_ == m.epoch_ + 1
    if RANK == 0:
        shutil.rmtree(path)
        print(f"OK labels_equal_one_process max|diff|={worst:.2e} P@1={ev['P@1']:.3f}")


def labels_learn_like_one_process():
    """Sampled output layer (LSH candidates and the pool split over 2 shards): the test P@1 of
    one process within 0.03."""
    from slide.shards import LabelShards
    X, Y = _data(3000, n_labels=40, n_features=200, seed=1)
    Xte, Yte = _data(1000, n_labels=40, n_features=200, seed=2)
    settings = dict(hidden=(32,), sparsity=0.3, batch_size=16, epochs=6, lr=3e-3)
    m = _model(**settings).fit(X, Y, distributed=LabelShards())
    p_dist = m.evaluate(Xte, Yte)["P@1"]
    # sub-linear serving: each shard's LSH candidates, merged as the exact top-k are
    exact = m.predict_topk(Xte, 5)[0]
    found = m.predict_topk(Xte, 5, mode="lsh")[0]
    recall = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(exact, found)])
    assert found.max() < Y.shape[1] and recall > 0.5, recall
    if RANK == 0:
        p_one = _model(**settings).fit(X, Y).evaluate(Xte, Yte)["P@1"]
        assert p_dist >= p_one - 0.03, f"2 label shards: P@1 {p_dist:.3f}, one process {p_one:.3f}"
        print(f"OK labels_learn P@1 {p_dist:.3f} (one process {p_one:.3f}); LSH recall@5 "
              f"{recall:.3f}")


def labels_replicas_equal_one_process(mode="sync"):
    """4 ranks as 2 label shards x 2 replicas, every output active, one thread: sync across the
    replicas of batch B trains as one process on the union batches of 2B (each rank its
    shard's rows of it, the hidden layers equal everywhere); a checkpoint written by the first
    replica loads whole."""
    import tempfile

    from slide.shards import LabelShards
    X, Y = _data(256, n_labels=11)
    dp = LabelShards(replicas=2, mode=mode)
    assert (dp.size, dp.replicas) == (2, 2) and dp.replica == RANK // 2 and dp.rank == RANK % 2
    Xr, Yr = _interleaved(X, Y, 8, dp.replica, 2)
    m = _model().partial_fit(Xr, Yr, distributed=dp)
    lo, hi = _shard_rows(m)
    hidden = {k: m.params_[k] for k in ("W0", "b0", "Wh", "bh")}
    assert _same_on_all_ranks(hidden), "the hidden layers differ between the ranks"
    one = _model(batch_size=16).partial_fit(X, Y)
    diff = max(_max_diff(hidden, {k: one.params_[k] for k in hidden}),
               float(np.abs(m.params_["W"] - one.params_["W"][lo:hi]).max()),
               float(np.abs(m.params_["b"] - one.params_["b"][lo:hi]).max()))
    assert diff < 1e-5, f"2 shards x 2 replicas differ from one process by {diff}"
    assert m.step_ == one.step_, (m.step_, one.step_)
    ids = m.predict_topk(X[:40], 3)[0]
    assert np.array_equal(ids, one.predict_topk(X[:40], 3)[0])
    path = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    m.save(path)
    COMM.Barrier()
    if RANK == 0:
        whole = SlideClassifier.load(path)
        assert np.array_equal(whole.predict_topk(X[:40], 3)[0], ids)
        shutil.rmtree(path)
        print(f"OK labels_replicas max|diff|={diff:.2e} steps={m.step_}")


CASES = {f.__name__: f for f in (labels_replicas_equal_one_process, sync_equals_union, local_every_step_is_the_mean_of_local_steps,
                                 delayed_learns_like_one_process, rank_fails,
                                 labels_equal_one_process, labels_learn_like_one_process)}

if __name__ == "__main__":
    CASES[sys.argv[1]](*sys.argv[2:])
