"""The output layer sharded by label over MPI ranks (mpi4py): models wider than one machine.

Every rank reads the same training rows and holds the same hidden layers; rank r of N holds
only its contiguous slice of the output rows (the labels with a training positive, in id
order), with their Adam moments and their LSH tables. A step runs on every rank over the same
batch:

1. each rank computes the hidden layers (equal on every rank) and its shard's active set:
   the sample's labels that are its own, its own LSH candidates and its share of the shared
   pool (the resolved ``lsh_cap`` and ``pool`` divided by N);
2. each rank's largest logit and sum of exponentials per sample are combined into the softmax's
   normaliser over every shard (one allgather of ``2 × batch`` floats a rank);
3. each rank updates its own output rows and computes its share of the gradient with respect
   to the last hidden layer; the shares are summed (one allreduce of ``batch × hidden``
   floats, the loss riding along);
4. every rank back-propagates the same gradient through the same hidden layers, which stay
   equal without further traffic (checked at the end of every epoch).

None of the traffic grows with the labels: the output rows and their Adam state never travel.
With every output active and one thread, the ranks together compute what one process does,
up to the order of floating-point sums (``tests/test_distributed.py``). Predictions and
evaluation merge the shards' top-k (one allgather of ``rows × k`` pairs); the validation loss
combines the shards' normalisers as training does.

Shards × replicas: with ``replicas=R`` the ranks are N shards × R replicas; the ranks of a
replica train as above on that replica's share of the rows, and the ranks holding the same shard
in different replicas keep it (and the hidden layers) equal as data parallelism keeps replicas
(:class:`slide.distributed.DataParallel` over them: ``sync``, ``local`` or ``delayed``). With
``sync`` and one thread, N shards × R replicas of batch B train as one process on batches of
R·B.

Checkpoints: every rank writes its own model directory ``step-S/shard-RRRR`` under the
checkpoint directory (as one process's, atomically), then rank 0 replaces ``shards.json`` with
one naming them: the commit point, so that the manifest always names a complete set of one
step. It resumes on the same number
of ranks (:meth:`LabelShards.load`) and loads into one process where the model fits
(``SlideClassifier.load`` concatenates the shards).

docs/label-shards.md gives the traffic model and the measurements.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import NamedTuple

import numpy as np

from slide.config import tables_for_rows
from slide.distributed import DEFAULT_TIMEOUT, DataParallel, cores_per_rank, mpi
from slide.labels import LabelMap

__all__ = ["LabelShards", "ShardPlace", "MANIFEST", "shard_bounds", "shard_settings", "is_sharded",
           "read_manifest"]

#: the file that makes a directory of shard checkpoints complete
MANIFEST = "shards.json"
#: the parameters every shard holds whole (the hidden layers)
HIDDEN = ("W0", "b0", "Wh", "bh")


def shard_bounds(n_rows: int, n_shards: int, index: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of shard ``index`` of ``n_shards`` contiguous, near-equal shards."""
    return index * n_rows // n_shards, (index + 1) * n_rows // n_shards


def shard_settings(config, resolved: dict, n_shards: int, n_rows: int) -> dict:
    """The resolved settings of one of ``n_shards`` label shards, which holds ``n_rows`` rows:
    each takes its share of the hard negatives and of the shared pool, so that the shards
    together sample as one layer, and its tables' buckets are sized for its rows (a query then
    costs a shard its share of one process's)."""
    if n_shards <= 1:
        return resolved
    out = dict(resolved)
    out["lsh_cap"] = -(-int(resolved["lsh_cap"]) // n_shards)
    out["pool"] = -(-int(resolved["pool"]) // n_shards)
    if "cluster_negatives" in resolved:
        out["cluster_negatives"] = -(-int(resolved["cluster_negatives"]) // n_shards)
    if resolved.get("tables"):
        out["tables"] = tables_for_rows(config, resolved["tables"], n_rows)
    return out


def is_sharded(path) -> bool:
    """Whether directory ``path`` holds a label-sharded checkpoint."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def read_manifest(path) -> dict:
    """The manifest of a sharded checkpoint: ``shards`` (directory names, in rank order)
    and ``rows`` (each shard's first output row, then the total)."""
    from slide.checkpoint import CheckpointError
    where = os.path.join(os.fspath(path), MANIFEST)
    try:
        with open(where) as fh:
            manifest = json.load(fh)
        shards, rows = list(manifest["shards"]), [int(r) for r in manifest["rows"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: not a shard manifest ({e})") from None
    if not shards or len(rows) != len(shards) + 1 or any(a > b for a, b in zip(rows, rows[1:])):
        raise CheckpointError(f"{where}: the shards and their rows do not match")
    for name in shards:
        parts = str(name).split("/")
        if len(parts) != 2 or any(p in ("", ".", "..") for p in parts) or \
                not os.path.isdir(os.path.join(os.fspath(path), *parts)):
            raise CheckpointError(f"{where}: shard {name!r} is missing")
    return {"shards": shards, "rows": rows}


class ShardPlace(NamedTuple):
    """Which shard a model is (``rank`` of ``size``), where no job runs them: one process
    reading a sharded checkpoint's files."""
    rank: int
    size: int


class LabelShards(DataParallel):
    """Shards a model's output layer by label over the ranks of an MPI communicator, and, with
    ``replicas``, replicates the shards for data parallelism.

    Pass it as ``distributed`` to ``SlideClassifier.fit`` (or ``slide train --distributed
    labels`` under ``mpiexec``). The fitted model on each rank holds its shard (``labels_``:
    the shard's labels; ``label_shards_``: this object); ``predict_topk``, ``predict`` and
    ``evaluate`` are then collective (the ranks of a replica call them with the same rows and
    get the whole model's answer), and ``save`` writes a sharded checkpoint (see the module
    docstring).

    Parameters
    ----------
    comm : mpi4py communicator (default ``MPI.COMM_WORLD``).
    replicas : ranks are ``shards × replicas``: rank r holds shard ``r % shards`` of replica
        ``r // shards``. The ranks of a replica call ``fit`` with the same rows (a replica's
        shard of the data); the ranks that hold the same shard in different replicas keep it
        equal as :class:`slide.distributed.DataParallel` keeps replicas (``mode``, ``every``,
        ``delay`` as there), and with it the hidden layers. Default 1: every rank the same
        rows.
    timeout : seconds any collective may wait before the job is aborted with a message.

    ``rank`` and ``size`` are the shard's index and the shard count; ``replica`` the replica's
    index. Attributes after training: ``bytes_sent_`` (float32 payload this rank put into the
    shards' collectives), ``steps_``, ``wait_seconds_`` (blocked on the network);
    ``replication`` (the :class:`~slide.distributed.DataParallel` across replicas, or None).
    """

    def __init__(self, comm=None, timeout: float = DEFAULT_TIMEOUT, replicas: int = 1,
                 mode: str = "sync", every: int | None = None, delay: int | None = None):
        MPI = mpi()
        world = MPI.COMM_WORLD if comm is None else comm
        if isinstance(replicas, bool) or not isinstance(replicas, (int, np.integer)) or \
                replicas < 1 or world.Get_size() % replicas:
            raise ValueError(f"replicas must divide the {world.Get_size()} ranks, got {replicas!r}")
        shards = world.Get_size() // int(replicas)
        self.replica = world.Get_rank() // shards
        # the ranks of one replica (the same rows, every shard) and of one shard (every replica)
        group = world if replicas == 1 else world.Split(self.replica, world.Get_rank())
        super().__init__(group, mode="sync", timeout=timeout)
        self.mode = "labels"
        self.threads = cores_per_rank(world)
        self._world = self if replicas == 1 else DataParallel(world, mode="sync", timeout=timeout)
        self.replication = None
        if replicas > 1:
            self.replication = DataParallel(world.Split(self.rank, world.Get_rank()), mode=mode,
                                            every=every, delay=delay, timeout=timeout)
        elif mode != "sync" or every is not None or delay is not None:
            raise ValueError("mode, every and delay apply across replicas (replicas > 1)")

    def __repr__(self):
        r = self.replication
        return f"LabelShards(shards={self.size}" + ("" if r is None else
                                                    f", replicas={r.size}, mode={r.mode!r}") + ")"

    @property
    def sums_gradients(self) -> bool:
        """Whether the replicas sum a step's gradients before its update."""
        return self.replication is not None and self.replication.sums_gradients

    @property
    def replicas(self) -> int:
        """Ranks that train on different rows: the replicas."""
        return 1 if self.replication is None else self.replication.size

    @property
    def ranks(self) -> int:
        """The job's ranks: shards × replicas."""
        return self.size * self.replicas

    def agree_stop(self, signum: int) -> int:
        return DataParallel.agree_stop(self._world, signum)

    def settle_stop(self) -> None:
        DataParallel.settle_stop(self._world)

    def bounds(self, n_rows: int) -> tuple[int, int]:
        """This rank's output rows ``[lo, hi)`` of ``n_rows``."""
        return shard_bounds(n_rows, self.size, self.rank)

    # -- data: every rank holds every row -------------------------------------------------------
    def agree_shapes(self, X, Y):
        """Check that the ranks of a replica were given the same rows (shapes and non-zeros);
        the replicas' shards of the data as ``DataParallel`` does."""
        if self.replication is not None:
            X, Y = self.replication.agree_shapes(X, Y)
        mine = np.array([X.shape[0], X.shape[1], Y.shape[1], X.nnz, Y.nnz], np.int64)
        if (self.allreduce(mine, "max") != mine).any() or (-self.allreduce(-mine, "max") != mine).any():
            raise ValueError("label shards train on the same rows on every rank: the ranks were "
                             f"given different data (this rank: {X.shape[0]} rows, {X.nnz} "
                             "non-zeros); give every rank the whole training file")
        return X, Y

    # the ranks of a replica hold the same rows: what the data says is the replicas' sum
    def total(self, n):
        return n if self.replication is None else self.replication.total(n)

    def epoch_order(self, order, batch):
        return order if self.replication is None else self.replication.epoch_order(order, batch)

    def mean(self, values, weight):
        # scored from the whole model on every rank of a replica: already the same there
        return values if self.replication is None else self.replication.mean(values, weight)

    def merge_preprocessor(self, pre) -> None:
        if self.replication is not None:
            self.replication.merge_preprocessor(pre)

    def shard_labels(self, labels: LabelMap, log_prior):
        """This rank's part of the output rows (a :class:`LabelMap` of the whole label space)
        and of their log priors."""
        lo, hi = self.bounds(labels.size)
        if hi <= lo:
            raise ValueError(f"{self.size} label shards need at least {self.size} labels with a "
                             f"training positive; the data has {labels.size}")
        prior = None if log_prior is None else log_prior[lo:hi]
        return LabelMap(labels.ids[lo:hi], labels.n_labels), prior

    def targets(self, labels: LabelMap, Y):
        """``Y`` over this shard's rows, each label's entry holding its weight in the target
        (1 / the row's labels in every shard), which the step reads."""
        Yr = labels.to_rows(Y).astype(np.float32)
        counts = np.diff(Y.indptr)
        kept = self.allreduce(np.array([Yr.nnz], np.int64))[0]
        if kept != Y.nnz:
            raise ValueError("these rows have labels without an output row in any shard; a "
                             "label-sharded model keeps the rows it was initialised with "
                             "(initialise it from rows that hold every label)")
        Yr.data = np.repeat(1.0 / np.maximum(counts, 1), np.diff(Yr.indptr)).astype(np.float32)
        return Yr

    # -- the model ------------------------------------------------------------------------------
    def start(self, state, record=None) -> None:
        """Make the hidden layers (weights, moments), counters and learning rate rank 0's; the
        output rows are each shard's own (the same shard's in every replica: the first
        replica's)."""
        if self.replication is not None:
            self.replication.start(state, record)
        self._model = state
        self.share(state, record, params=HIDDEN)

    def before_update(self, state, out_rows, in_rows, grads):
        if self.replication is None:
            return out_rows, in_rows, grads
        return self.replication.before_update(state, out_rows, in_rows, grads)

    def after_update(self, state, out_rows, in_rows) -> None:
        self.steps_ += 1
        if self.replication is not None:
            self.replication.after_update(state, out_rows, in_rows)

    def finish(self, state) -> None:
        """End of an epoch: settle the stop agreement and check that the hidden layers are
        still equal on every rank (the ranks compute the same update, but a kernel's threads
        may add in another order); where they are not, rank 0's are given to all."""
        self.settle_stop()
        if self.replication is not None:
            self.replication.finish(state)
        sums = np.array([float(np.sum(state.params[k], dtype=np.float64)) for k in HIDDEN])
        if (self.allreduce(sums, "max") != -self.allreduce(-sums, "max")).any():
            self.share(state, params=HIDDEN)

    # -- the step -------------------------------------------------------------------------------
    def normaliser(self, stats: np.ndarray, Yb) -> np.ndarray:
        """The softmax's normaliser over every shard from this shard's ``stats`` [n, 2]
        (:func:`slide.kernels.logit_stats`), with each sample's label weight: float32 [n, 3]
        as :func:`slide.kernels.output_step` takes it."""
        n = stats.shape[0]
        norm = np.empty((n, 3), np.float32)
        every = self._allgather(stats)  # [shards, n, 2]: one collective, not a max then a sum
        top = every[:, :, 0].max(axis=0)
        # a shard with no active neuron for a row holds -inf and 0: its share is 0
        with np.errstate(invalid="ignore"):
            shift = np.where(every[:, :, 1] > 0, every[:, :, 0] - top, 0.0)
        norm[:, 0] = top
        norm[:, 1] = (every[:, :, 1] * np.exp(shift)).sum(axis=0)
        starts = Yb.indptr[:-1]
        has = np.diff(Yb.indptr) > 0
        norm[:, 2] = 0.0
        norm[has, 2] = Yb.data[starts[has]]
        return norm

    def sum_shards(self, dH: np.ndarray, loss: float) -> float:
        """Sum every shard's share of the hidden gradient ``dH`` (in place) and of the batch's
        mean loss (returned)."""
        buf = np.empty(dH.size + 1, np.float32)
        buf[:-1] = dH.ravel()
        buf[-1] = loss
        total = self.allreduce(buf)
        dH[...] = total[:-1].reshape(dH.shape)
        return float(total[-1])

    # -- queries --------------------------------------------------------------------------------
    def _allgather(self, a: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(a)
        out = np.empty((self.size,) + a.shape, a.dtype)
        self._wait(self.comm.Iallgather(a, out), f"allgather of {a.nbytes} bytes")
        self.bytes_sent_ += a.nbytes
        return out

    def merge_topk(self, ids: np.ndarray, scores: np.ndarray, k: int):
        """The best ``k`` of every shard's top-k ``(ids, scores)`` [n, k] (ids in the label
        space, -1 padding with score -inf): the same arrays on every rank."""
        all_ids = np.concatenate(self._allgather(ids.astype(np.int64)), axis=1)
        all_scores = np.concatenate(self._allgather(scores.astype(np.float32)), axis=1)
        all_scores = np.where(all_ids < 0, -np.inf, all_scores)
        # stable: between equal scores the lower rank, as one process's lower row
        order = np.argsort(-all_scores, axis=1, kind="stable")[:, :k]
        return (np.take_along_axis(all_ids, order, 1),
                np.take_along_axis(all_scores, order, 1).astype(np.float32))

    def evaluate(self, model, X, Y, k: int = 5, loss: bool = False) -> dict:
        """:meth:`slide.base.TrainableMixin.evaluate` over every shard (collective): the top-k
        merged, the loss's normaliser combined over the shards."""
        from slide.base import array_module, softmax_parts
        from slide.metrics import evaluate as evaluate_topk
        X, Y = model.check_data(X, Y, where="evaluate", fitted=True)
        if not loss:
            return evaluate_topk(Y, model.predict_topk(X, k)[0], k)
        n = X.shape[0]
        ids = np.empty((n, k), np.int64)
        scores = np.empty((n, k), np.float32)
        # per row: this shard's largest logit and sum of exponentials, its labels' logits summed
        top, sums, picked = (np.zeros(n, np.float64) for _ in range(3))
        Yr = model.labels_.to_rows(Y)
        shift = model.prior_shift()
        for lo, hi, S in model.score_blocks(X):
            rows, scores[lo:hi] = model.block_topk(S, k)
            ids[lo:hi] = model.labels_.to_labels(rows)
            if shift is not None:  # the loss is training's: of the logits as trained
                S -= array_module(S).asarray(shift)
            top[lo:hi], sums[lo:hi], picked[lo:hi] = softmax_parts(S, Yr[lo:hi])
        ids, scores = self.merge_topk(ids, scores, k)
        best = self.allreduce(top, "max")
        parts = self.allreduce(np.concatenate((sums * np.exp(top - best), picked)))
        counts = np.diff(Y.indptr)
        lse = best + np.log(parts[:n])
        per_row = lse - parts[n:] / np.maximum(counts, 1)
        has = counts > 0
        return {**evaluate_topk(Y, ids, k), "loss": float(per_row[has].sum() / max(has.sum(), 1))}

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, model, path, write) -> None:
        """Every rank writes its shard with ``write(directory)`` into a directory of this step's
        (``step-S/shard-RRRR``); once every shard is complete rank 0 replaces the manifest
        with one naming them, the commit point, and removes the earlier steps' shards."""
        if self.replica > 0:  # the replicas hold the same shards: the first one writes
            return
        path = os.fspath(path)
        step_dir = f"step-{int(model.step_)}"
        if self.rank == 0:
            os.makedirs(os.path.join(path, step_dir), exist_ok=True)
        self._barrier()  # the directory exists before any shard goes in
        write(os.path.join(path, step_dir, f"shard-{self.rank:04d}"))
        self._barrier()  # every shard is complete before the manifest names it
        if self.rank == 0:
            n = int(model.n_outputs_fitted_)
            manifest = {"format": "slide-label-shards", "version": 1,
                        "shards": [f"{step_dir}/shard-{r:04d}" for r in range(self.size)],
                        "rows": [shard_bounds(n, self.size, r)[0] for r in range(self.size)] + [n]}
            tmp = os.path.join(path, f".{MANIFEST}.tmp")
            with open(tmp, "w") as fh:
                json.dump(manifest, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, os.path.join(path, MANIFEST))
            for name in os.listdir(path):  # no longer referenced
                if name.startswith("step-") and name != step_dir:
                    shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        self._barrier()  # the manifest is there when save returns

    def _barrier(self) -> None:
        """Every rank of the shards here (a collective with the deadline of the others)."""
        self.allreduce(np.zeros(1, np.int64))

    def load(self, cls, path):
        """This rank's shard of the sharded checkpoint ``path``, ready to train on (resume) and
        to answer collective queries. The checkpoint must have as many shards as ranks."""
        from slide.checkpoint import CheckpointError
        manifest = read_manifest(path)
        if len(manifest["shards"]) != self.size:
            raise CheckpointError(f"{path}: {len(manifest['shards'])} label shards, but the job has "
                                  f"{self.size} ranks; resume it on as many (or load it into one "
                                  "process)")
        return cls.load(os.path.join(os.fspath(path), *manifest["shards"][self.rank].split("/")),
                        shards=self)
