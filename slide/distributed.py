"""Data-parallel training over MPI (mpi4py): synchronous, local and delayed averaging.

Every rank trains a replica of the model on its own shard of the training rows; a
:class:`DataParallel` passed to ``SlideClassifier.fit`` (or ``partial_fit``) keeps the replicas
together. One mechanism, three settings:

``sync``
    every step averages the batch's gradients over the ranks before the Adam update: the
    replicas stay equal, and N ranks of batch B train like one process on batches of N·B.
``local``
    each rank steps alone; every ``every`` steps the ranks average the parameter rows that
    changed on any rank since the last average (local SGD).
``delayed``
    as ``local``, but the average starts as a non-blocking allreduce and is applied ``delay``
    steps later as ``avg + (now - sent)``: the rank keeps the progress it made while the
    network worked (DaSGD, local SGD with delayed averaging).

What travels: only rows that some rank touched (``sync``: gradient rows of the step;
``local``/``delayed``: parameter rows changed since the last average) of the output layer, its
biases and the input layer, plus the small dense parameters (hidden biases and stack), packed in
one float32 buffer and summed by one allreduce. Before it, the ranks agree on the union of
those rows with an allreduce of a bit mask (``(n_labels + n_features) / 8`` bytes). The whole
670K-row layer travels only if every row changed.

Adam's moments never travel. In ``sync`` every rank applies the same update to the same averaged
gradient, so the moments stay equal without traffic. In ``local`` and ``delayed`` each rank's
moments stay its own running statistics of the gradients it computes: after an average the
rank's next local steps see its own gradient noise, which its own moments describe; averaging
them would triple the bytes of a round (weights, first and second moments) and, for the second
moment, would not give the statistics of the averaged model's gradients anyway. Checkpoints
hold rank 0's moments; a resumed run gives them to every rank.

Faults: every collective waits with a deadline (``timeout`` seconds); a rank whose training
raises prints its error and aborts the job (``MPI_Abort``), so the other ranks end instead of
waiting forever. ``mpiexec`` also ends the job when a rank dies.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback

import numpy as np
from numba import njit, prange

from slide.runtime import copy_into, leading_rows
from slide.signals import TrainingStopped

__all__ = ["DataParallel", "MODES", "DEFAULT_EVERY", "cores_per_rank", "mpi"]

MODES = ("sync", "local", "delayed")
#: local/delayed: steps between averages. A round carries every row any rank changed since the
#: last, and the rows a step touches overlap little from step to step, so longer rounds carry
#: fewer bytes a step, and packing and merging them, not the link, is the cost to keep small
#: (docs/distributed.md)
DEFAULT_EVERY = 64
DEFAULT_TIMEOUT = 300.0


def mpi():
    """mpi4py's MPI module, with a message naming the extra where it is missing."""
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError("distributed training needs mpi4py and an MPI library: "
                          "pip install 'slide-xmc[mpi]'") from e
    return MPI


def cores_per_rank(comm) -> int:
    """This host's cores divided among the ranks that share it (at least 1)."""
    MPI = mpi()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        n_local = local.Get_size()
    finally:
        local.Free()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // n_local)


# --------------------------------------------------------------------------------------------
# Packing kernels: rows of a parameter (or gradient) into a contiguous buffer and back
# --------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, parallel=True)
def _gather_rows(src, ids, dst):
    """``dst[t] = src[ids[t], :d]`` for dst [len(ids), d] and src [n, D >= d]: a matrix, or the
    row block whose leading columns it is (:func:`slide.runtime.leading_rows`)."""
    d = dst.shape[1]
    for t in prange(ids.size):
        copy_into(dst[t], src[ids[t], :d])


@njit(cache=True, nogil=True, parallel=True)
def _scatter_rows(dst, ids, src, scale):
    """``dst[ids[t]] = scale * src[t]``."""
    for t in prange(ids.size):
        row = dst[ids[t]]
        s = src[t]
        for j in range(row.size):
            row[j] = scale * s[j]


@njit(cache=True, nogil=True, parallel=True)
def _merge_rows(dst, ids, total, sent, inv_n):
    """``dst[ids[t], :d] = total[t] * inv_n + (dst[ids[t], :d] - sent[t])`` for total and sent
    [len(ids), d] and dst as ``_gather_rows``'s src: the ranks' average plus this rank's
    progress since it sent ``sent`` (zero when nothing moved in between)."""
    d = total.shape[1]
    for t in prange(ids.size):
        row = dst[ids[t], :d]
        tt, ss = total[t], sent[t]
        for j in range(d):
            row[j] = tt[j] * inv_n + (row[j] - ss[j])


class _Parts:
    """The (2-D array, row ids) pieces that travel in one step or round, laid out back to back
    in one float32 buffer: ``views[i]`` [len(ids), d] holds piece i's rows. A piece's array is
    what the kernels read and write, the C-contiguous row block where its d columns lead."""

    def __init__(self, arrays: dict, out_ids: np.ndarray, in_ids: np.ndarray, storage):
        one = np.zeros(1, np.int32)
        pieces = [(arrays["W"], out_ids), (arrays["b"].reshape(-1, 1), out_ids),
                  (arrays["W0"], in_ids), (arrays["b0"].reshape(1, -1), one)]
        self.names = ["W", "b", "W0", "b0"]
        for k in ("Wh", "bh"):
            if arrays[k].size:
                pieces.append((arrays[k].reshape(1, -1), one))
                self.names.append(k)
        sizes = [ids.size * a.shape[1] for a, ids in pieces]
        self.buffer = storage(int(sum(sizes)))
        self.views, lo = [], 0
        for (a, ids), s in zip(pieces, sizes):
            self.views.append(self.buffer[lo:lo + s].reshape(ids.size, a.shape[1]))
            lo += s
        # a training model's W and W0 are the leading columns of their row blocks, which as
        # C-contiguous rows compile to vector copies (a strided view copies element by element)
        self.pieces = [(leading_rows(a), ids) for a, ids in pieces]

    def gather(self):
        for (rows, ids), v in zip(self.pieces, self.views):
            _gather_rows(rows, ids, v)
        return self.buffer

    def like(self, buffer):
        """Views of another buffer of the same layout."""
        out, lo = [], 0
        for v in self.views:
            out.append(buffer[lo:lo + v.size].reshape(v.shape))
            lo += v.size
        return out


class _Round:
    """A parameter average in flight: what was sent, where the sum arrives, and a thread that
    drives MPI's progress engine while the rank computes (MPICH moves a large message only
    while some thread calls into MPI)."""

    def __init__(self, parts: _Parts, total: np.ndarray, request, apply_at: int):
        self.parts, self.total, self.request, self.apply_at = parts, total, request, apply_at
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._progress, daemon=True)
        self.thread.start()

    def _progress(self):
        while not self.request.Test():
            time.sleep(2e-4)
        self.done.set()


class DataParallel:
    """Keeps the replicas of one model on the ranks of an MPI communicator together.

    Parameters
    ----------
    comm : mpi4py communicator (default ``MPI.COMM_WORLD``).
    mode : "sync", "local" or "delayed" (see the module docstring).
    every : steps between averages in ``local``/``delayed`` (default :data:`DEFAULT_EVERY`);
        ``sync`` averages every step.
    delay : ``delayed`` only: steps between the start of an average and its use (default
        ``every // 2``, at least 1, at most ``every``).
    timeout : seconds any collective may wait before the job is aborted with a message naming
        the rank that gave up.

    Attributes after training: ``bytes_sent_`` (float32 payload this rank put into collectives,
    masks included), ``steps_``, ``rounds_`` (averages done), ``wait_seconds_`` (time blocked
    on the network), ``pack_seconds_`` (packing, unpacking, merging), ``exchanged_rows_``
    (list of (output rows, input rows) each gradient or parameter exchange carried).
    """

    def __init__(self, comm=None, mode: str = "sync", every: int | None = None,
                 delay: int | None = None, timeout: float = DEFAULT_TIMEOUT):
        MPI = mpi()
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "sync" and every not in (None, 1):
            raise ValueError(f"sync averages every step; every={every!r} applies to local and delayed")
        if mode != "delayed" and delay not in (None, 0):
            raise ValueError(f"delay applies to the delayed mode, got delay={delay!r} with {mode!r}")
        every = 1 if mode == "sync" else (DEFAULT_EVERY if every is None else every)
        if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        if mode == "delayed":
            delay = max(1, every // 2) if delay is None else delay
            if isinstance(delay, bool) or not isinstance(delay, (int, np.integer)) or not 1 <= delay <= every:
                raise ValueError(f"delay must be an integer from 1 to every={every}, got {delay!r}")
        else:
            delay = 0
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.mode, self.every, self.delay, self.timeout = mode, int(every), int(delay), float(timeout)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        #: training threads of a model whose ``threads`` is None: the host's cores over its ranks
        self.threads = cores_per_rank(self.comm)
        self._model, self._round = None, None
        self._stop_round = None  # agree_stop's allreduce in flight
        self._storage = {}
        self.reset_counters()

    def __repr__(self):
        return (f"DataParallel(mode={self.mode!r}, every={self.every}, delay={self.delay}, "
                f"ranks={self.size})")

    @property
    def sums_gradients(self) -> bool:
        """Whether a step's gradients are summed across ranks before the update (``sync`` on
        two or more ranks): then every touched row's gradient must wait for the ranks' sum."""
        return self.mode == "sync" and self.size > 1

    def reset_counters(self):
        self.bytes_sent_, self.steps_, self.rounds_ = 0, 0, 0
        self.wait_seconds_, self.pack_seconds_ = 0.0, 0.0
        self.exchanged_rows_ = []

    # -- collectives with a deadline ----------------------------------------------------------
    def abort(self, message: str):
        """Print ``message`` for this rank and end every rank of the job."""
        sys.stderr.write(f"slide: rank {self.rank} of {self.size}: {message}\n")
        sys.stderr.flush()
        # the launcher forwards a rank's output on its own schedule and Abort kills every rank
        # at once: on a loaded machine the message could be lost with the process
        time.sleep(0.5)
        self.comm.Abort(1)

    def _wait(self, request, what: str):
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not request.Test():
            if time.monotonic() > deadline:
                self.abort(f"{what}: no answer from the other ranks within {self.timeout:g} s "
                           "(a rank stopped or hangs); ending the job")
            spins += 1
            if spins > 1000:
                time.sleep(1e-4)
        self.wait_seconds_ += time.perf_counter() - t0

    def allreduce(self, a: np.ndarray, op: str = "sum") -> np.ndarray:
        """A new array: ``a`` reduced over the ranks (``op``: sum, max or bor)."""
        a = np.ascontiguousarray(a)
        out = np.empty_like(a)
        ops = {"sum": self._MPI.SUM, "max": self._MPI.MAX, "bor": self._MPI.BOR}
        self._wait(self.comm.Iallreduce(a, out, op=ops[op]), f"allreduce of {a.nbytes} bytes")
        self.bytes_sent_ += a.nbytes
        return out

    def broadcast(self, a: np.ndarray) -> None:
        """Overwrite ``a`` with rank 0's (through a contiguous copy where ``a`` is a view that is
        not contiguous: a training model's weights and moments in their row block)."""
        buf = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        self._wait(self.comm.Ibcast(buf, root=0), f"broadcast of {a.nbytes} bytes")
        if buf is not a:
            a[...] = buf

    def agree_stop(self, signum: int) -> int:
        """The stop request the ranks agree on at this batch boundary (a signal number, 0 for
        none), every rank calling once per batch. Each call starts a non-blocking allreduce
        (max) of this rank's request and reads the one the previous call started, which has
        had a batch's time to arrive: the ranks learn of a request one batch late, and all at
        the same batch."""
        agreed = 0
        if self._stop_round is not None:
            request, _, got = self._stop_round
            self._wait(request, "the ranks' agreement on a stop")
            self._stop_round, agreed = None, int(got[0])
        if not agreed:
            sent, got = np.array([signum], np.int64), np.zeros(1, np.int64)
            self._stop_round = (self.comm.Iallreduce(sent, got, op=self._MPI.MAX), sent, got)
        return agreed

    def settle_stop(self) -> None:
        """Complete the stop agreement in flight (the end of an epoch: no request is left
        pending at the end of a run)."""
        if self._stop_round is not None:
            self._wait(self._stop_round[0], "the ranks' agreement on a stop")
            self._stop_round = None

    @contextlib.contextmanager
    def guard(self):
        """Inside the block, an exception on this rank aborts the job (printing it), so that no
        other rank waits on it; with one rank it propagates as usual."""
        try:
            yield
        except TrainingStopped:
            raise  # every rank stops after the same batch (agree_stop): none is left waiting
        except Exception:
            if self.size > 1:
                self.abort("training failed:\n" + traceback.format_exc())
            raise

    # -- data ---------------------------------------------------------------------------------
    def agree_shapes(self, X, Y):
        """Give every rank's shard the largest feature and label counts seen on any rank
        (headerless files size themselves from their largest id)."""
        d, n_l = (int(v) for v in self.allreduce(np.array([X.shape[1], Y.shape[1]], np.int64), "max"))
        if X.shape[1] != d:
            X = X.copy()
            X.resize((X.shape[0], d))
        if Y.shape[1] != n_l:
            Y = Y.copy()
            Y.resize((Y.shape[0], n_l))
        return X, Y

    @property
    def replicas(self) -> int:
        """Ranks that train on different rows."""
        return self.size

    @property
    def ranks(self) -> int:
        """The job's ranks."""
        return self.size

    def total(self, n):
        """Sum over the ranks of ``n`` (an int, or an int64 array summed entry by entry): the
        whole data's count of what each rank counted in its rows."""
        if isinstance(n, np.ndarray):
            return self.allreduce(n.astype(np.int64))
        return int(self.allreduce(np.array([n], np.int64))[0])

    def steps_per_epoch(self, n_local: int, batch: int) -> int:
        """Every rank takes the same number of steps (the most any shard needs)."""
        return int(self.allreduce(np.array([-(-n_local // batch)], np.int64), "max")[0])

    def epoch_order(self, order: np.ndarray, batch: int) -> np.ndarray:
        """This rank's epoch order, taking as many steps as the longest shard's (a collective
        step needs every rank): a shorter shard repeats its first rows to fill that many full
        batches; a shard that already takes them keeps its order."""
        steps = self.steps_per_epoch(order.size, batch)
        if order.size and -(-order.size // batch) < steps:
            return np.resize(order, steps * batch)
        return order

    def mean(self, values: dict, weight: float) -> dict:
        """Weighted mean over the ranks of a dict's float values (a shard's metrics, ``weight``
        its rows); other values are kept: the same dict on every rank."""
        keys = sorted(k for k, v in values.items() if isinstance(v, (float, np.floating)))
        a = np.array([weight] + [float(values[k]) * weight for k in keys], np.float64)
        s = self.allreduce(a)
        return {**values, **{k: float(v / max(s[0], 1e-300)) for k, v in zip(keys, s[1:])}}

    # -- the model ----------------------------------------------------------------------------
    def merge_preprocessor(self, pre) -> None:
        """Fit ``pre`` (fitted on this shard) on every shard's document frequencies."""
        pre.fit_counts(self.allreduce(pre.document_frequency_), self.total(pre.n_documents_))

    @property
    def started(self):
        """The training state last made equal across the ranks (:meth:`start`), or None."""
        return self._model

    def start(self, state, record=None) -> None:
        """Make every replica rank 0's: the training state's parameters, moments, hash seed,
        counters and learning rate, and the run record's epoch."""
        self._model, self._round = state, None
        self.share(state, record)
        if record is not None:
            record.epoch_position = 0  # a shard's position in its epoch means nothing elsewhere
        self._n_out, self._n_in = state.n_labels, state.n_features
        self._changed = np.zeros(self._n_out + self._n_in, bool)
        self._step = 0

    def share(self, state, record=None, params=None) -> None:
        """Give every rank rank 0's parameters ``params`` (names; default all) with their
        moments, its hash seed, counters and learning rate, and its record's epoch."""
        names = sorted(state.params) if params is None else params
        for k in names:
            for arrays, key in ((state.params, k), (state.moments, f"{k}.m"), (state.moments, f"{k}.v")):
                if arrays[key].size:
                    self.broadcast(arrays[key])
        epoch = record.epoch if record is not None else 0
        counters = np.array([state.hash_seed, state.step, state.samples_seen, epoch], np.int64)
        self.broadcast(counters)
        state.hash_seed, state.step, state.samples_seen, epoch = (int(v) for v in counters)
        lr = np.array([state.learning_rate], np.float64)
        self.broadcast(lr)
        state.learning_rate = float(lr[0])
        state.params_changed()
        if record is not None:
            record.epoch = epoch

    def _buffer(self, name: str):
        """A function giving a float32 buffer of n values, kept between steps: a round can
        carry hundreds of MB, and fresh pages each time would cost the kernel's zero-filling."""
        def get(n: int) -> np.ndarray:
            a = self._storage.get(name)
            if a is None or a.size < n:
                a = self._storage[name] = np.empty(max(n, int(1.25 * (0 if a is None else a.size))), np.float32)
            return a[:n]
        return get

    def _union(self, mask: np.ndarray):
        """Row ids (output, input) marked on any rank."""
        bits = self.allreduce(np.packbits(mask), "bor")
        ids = np.flatnonzero(np.unpackbits(bits, count=mask.size))
        cut = np.searchsorted(ids, self._n_out)
        return ids[:cut].astype(np.int32), (ids[cut:] - self._n_out).astype(np.int32)

    def _mark(self, out_rows, in_rows, mask=None):
        mask = np.zeros(self._n_out + self._n_in, bool) if mask is None else mask
        mask[out_rows] = True
        mask[self._n_out + in_rows] = True
        return mask

    def before_update(self, state, out_rows, in_rows, grads):
        """``sync``: average the step's gradients over the ranks, on the rows any rank touched.
        ``grads`` holds this rank's compact gradients: row t of ``grads["W"]`` and entry t of
        ``grads["b"]`` for output row ``out_rows[t]``, row t of ``grads["W0"]`` for input row
        ``in_rows[t]``, and the dense ``b0``, ``Wh``, ``bh``. Returns the rows of the union and
        their averaged gradients in the same form (views of the exchange buffer), and leaves
        this rank's zeroed. Other modes: the arguments, unchanged."""
        if not self.sums_gradients:
            return out_rows, in_rows, grads
        out_ids, in_ids = self._union(self._mark(out_rows, in_rows))
        self.exchanged_rows_.append((out_ids.size, in_ids.size))
        t0 = time.perf_counter()
        parts = _Parts(state.params, out_ids, in_ids, self._buffer("gradients"))  # the layout
        parts.buffer[:] = 0.0  # a row this rank did not touch: no gradient from it
        one = np.zeros(1, np.int32)
        at = {"W": np.searchsorted(out_ids, out_rows).astype(np.int32),
              "W0": np.searchsorted(in_ids, in_rows).astype(np.int32)}
        at["b"] = at["W"]
        for name, view in zip(parts.names, parts.views):
            local = grads[name].reshape(-1, view.shape[1])
            _scatter_rows(view, at.get(name, one), local, np.float32(1.0))
            local[...] = 0.0
        self.pack_seconds_ += time.perf_counter() - t0
        buf = parts.buffer
        self._wait(self.comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM),
                   f"gradient allreduce of {buf.nbytes} bytes")
        self.bytes_sent_ += buf.nbytes
        buf *= np.float32(1.0 / self.size)
        averaged = dict(grads)  # a Wh or bh of size 0 travels nowhere
        for name, view in zip(parts.names, parts.views):
            averaged[name] = view if name in ("W", "W0") else view.reshape(-1)
        return out_ids, in_ids, averaged

    def after_update(self, state, out_rows, in_rows) -> None:
        """Count the step; ``local``/``delayed``: mark the rows it changed, finish the average
        in flight when its delay is up and start the next one every ``every`` steps.

        The model's ``samples_seen_``, and with it the tables' rehash schedule, counts this
        rank's rows: a rehash costs every rank the whole table, so counting all ranks' rows
        would make it N times as frequent per step on N ranks. Per step the weights move about
        as far as on one rank (Adam's step does not grow with the batch), so the tables stay as
        fresh as a single process's."""
        self.steps_ += 1
        if self.mode == "sync" or self.size == 1:
            return
        self._mark(out_rows, in_rows, self._changed)
        self._step += 1
        if self._round is not None and self._step >= self._round.apply_at:
            self._finish_round(state)
        if self._step % self.every == 0:
            self._start_round(state)
            if self.delay == 0:
                self._finish_round(state)

    def finish(self, state) -> None:
        """End of an epoch (or of ``partial_fit``): complete any average in flight and average
        every row changed since, so that all replicas are equal (evaluation, early stopping
        and checkpoints see one model)."""
        self.settle_stop()
        if self.mode == "sync" or self.size == 1:
            return
        if self._round is not None:
            self._finish_round(state)
        self._start_round(state)
        self._finish_round(state)

    def _start_round(self, state):
        out_ids, in_ids = self._union(self._changed)
        self.exchanged_rows_.append((out_ids.size, in_ids.size))
        self._changed[:] = False
        t0 = time.perf_counter()
        parts = _Parts(state.params, out_ids, in_ids, self._buffer("sent"))
        sent = parts.gather()
        total = self._buffer("total")(sent.size)
        self.pack_seconds_ += time.perf_counter() - t0
        request = self.comm.Iallreduce(sent, total, op=self._MPI.SUM)
        self.bytes_sent_ += sent.nbytes
        self._round = _Round(parts, total, request, self._step + self.delay)

    def _finish_round(self, state):
        r, self._round = self._round, None
        t0 = time.perf_counter()
        if not r.done.wait(self.timeout):
            self.abort(f"parameter allreduce of {r.parts.buffer.nbytes} bytes: no answer from the "
                       f"other ranks within {self.timeout:g} s (a rank stopped or hangs); ending the job")
        self.wait_seconds_ += time.perf_counter() - t0
        t0 = time.perf_counter()
        inv = np.float32(1.0 / self.size)
        for (rows, ids), sent, total in zip(r.parts.pieces, r.parts.views, r.parts.like(r.total)):
            _merge_rows(rows, ids, total, sent, inv)
        self.pack_seconds_ += time.perf_counter() - t0
        self.rounds_ += 1
        state.params_changed()
