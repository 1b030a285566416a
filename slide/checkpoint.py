"""Checkpoint files: ``model-<step>.npz`` (arrays) + ``config.json`` (everything else).

No pickle anywhere. Each file is written under a temporary name and renamed into place; the
JSON, which names the npz it belongs to, is replaced last, so a crash at any point leaves the
previous checkpoint loadable, and a failed write removes its temporary file. The sparse engine
and the dense reference share this format.

Reading checks everything before a model is built from it: the JSON's keys and types, that the
arrays file lies inside the model directory, that the npz opens and each member's header
matches its stored size, and (through :meth:`Checkpoint.arrays_like` and
:meth:`Checkpoint.read_into`) each array's shape and dtype against the configuration, so a
damaged or mismatched checkpoint gives a :class:`CheckpointError` naming the file and problem,
never a crash inside a kernel. Arrays are read when asked for, one at a time: a model can read
its largest ones straight into the memory that will hold them (at 670K labels the output
layer, its moments and its best copy are 1.4 GB, which a load that read every array first
would hold beside that memory).
"""
from __future__ import annotations

import contextlib
import functools
import json
import numbers
import os
import zipfile

import numpy as np
import scipy.sparse as sp

from slide.runtime import aligned_empty, aligned_zeros
from slide.config import checked_choice
from slide.labels import LabelMap

__all__ = ["CheckpointError", "Checkpoint", "write_checkpoint", "read_checkpoint", "FORMAT_VERSION"]

# 2: preprocessing and early-stopping state; version 1 files load with identity preprocessing
FORMAT_VERSION = 2

#: bytes :meth:`Checkpoint.read_into` reads from the file at a time
READ_BYTES = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint cannot be read or written; the message names the file and the problem."""


def _remove_stale_temporaries(path: str) -> None:
    """Temporary files left by saves that were killed (they are never referenced)."""
    for f in os.listdir(path):
        if f.startswith(".") and f.endswith(".tmp"):
            try:
                os.remove(os.path.join(path, f))
            except OSError:
                pass


def write_checkpoint(path, arrays: dict, meta: dict, step: int) -> None:
    """Write ``arrays`` (name → ndarray) and JSON-serialisable ``meta`` into directory ``path``.

    On failure (a full disk, a file where the directory should be) the previous checkpoint is
    kept, the partial file removed, and :class:`CheckpointError` raised.
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path}: exists and is not a directory")
    name = f"model-{int(step)}.npz"
    tmp_npz = os.path.join(path, f".{name}.tmp")
    tmp_json = os.path.join(path, ".config.json.tmp")
    try:
        os.makedirs(path, exist_ok=True)
        _remove_stale_temporaries(path)
        with open(tmp_npz, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp_npz, os.path.join(path, name))
        doc = {"format": "slide", "format_version": FORMAT_VERSION, "arrays": name, **meta}
        with open(tmp_json, "w") as fh:
            json.dump(doc, fh, indent=1)
        os.replace(tmp_json, os.path.join(path, "config.json"))
    except OSError as e:
        for tmp in (tmp_npz, tmp_json):
            if os.path.exists(tmp):
                os.remove(tmp)
        raise CheckpointError(f"{path}: could not save the model ({e.strerror or e}); "
                              f"the previous checkpoint, if any, is unchanged") from None
    for f in os.listdir(path):  # older arrays are no longer referenced
        if f.startswith("model-") and f.endswith(".npz") and f != name:
            os.remove(os.path.join(path, f))


class Checkpoint:
    """A checkpoint read from disk: ``meta`` (the JSON) and its arrays file's checked members
    (read on demand), with checked accessors for what a model needs."""

    def __init__(self, path: str, meta: dict, members: dict):
        self.path, self.meta, self._members = path, meta, members
        self._where = os.path.join(path, "config.json")
        self.n_features = self.int("n_features", minimum=1)
        self.n_labels = self.int("n_labels", minimum=1)
        self.n_train = self.int("n_train", 1, minimum=1)
        # checkpoints written before the share was recorded resolve as they were trained: 0
        self.rare_share = self.float("rare_share", 0.0)
        if not 0.0 <= self.rare_share <= 1.0:
            self._fail(f"'rare_share' must be in [0, 1], got {self.rare_share}")
        # the training rows' mean label count; checkpoints written before it was recorded leave
        # it None and resolve as they were trained
        self.labels_per_row = (self.float("labels_per_row") if meta.get("labels_per_row") is not None
                               else None)
        if self.labels_per_row is not None and self.labels_per_row < 0:
            self._fail(f"'labels_per_row' must be at least 0, got {self.labels_per_row}")
        # a refit's kept decision of rows updated in few steps (slide.fitting._refit); None
        # where the rule decides, as in checkpoints written before it was recorded
        self.slow_rows = meta.get("slow_rows")
        if self.slow_rows is not None and not isinstance(self.slow_rows, bool):
            self._fail(f"'slow_rows' must be true, false or null, got {self.slow_rows!r}")
        # the settings fit chose on the held-out slice (slide.config.resolve's "choices"); None
        # where none was chosen. Checkpoints written when only the width was chosen say "width"
        self.choice = meta.get("choice")
        if self.choice is None and meta.get("width") is not None:
            self.choice = {"width": self.int("width", minimum=1)}
        if self.choice is not None:
            try:
                self.choice = checked_choice(self.choice)
            except (TypeError, ValueError) as e:
                self._fail(f"'choice': {e}")
        self.step = self.int("step", minimum=0)
        self.epoch = self.int("epoch", minimum=0)
        if not isinstance(meta.get("config"), dict):
            raise CheckpointError(f"{self._where}: 'config' must be an object")

    def _fail(self, problem):
        raise CheckpointError(f"{self._where}: {problem}")

    def int(self, key, default=None, minimum=None, maximum=2 ** 62) -> int:
        v = self.meta.get(key, default)
        if v is None and default is not None:
            v = default
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                self._fail(f"'{key}' must be an integer, got {v!r}" if key in self.meta
                           else f"missing '{key}'")
        if minimum is not None and v < minimum:
            self._fail(f"'{key}' must be at least {minimum}, got {v}")
        if v > maximum:
            self._fail(f"'{key}' must be at most {maximum}, got {v}")
        return int(v)

    def float(self, key, default=None, positive: bool = False) -> float:
        v = self.meta.get(key, default)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not np.isfinite(v) \
                or (positive and v <= 0):
            self._fail(f"'{key}' must be a finite{' positive' if positive else ''} number, got {v!r}")
        return float(v)

    def object(self, key) -> dict | None:
        """A JSON object entry, or None when absent or null."""
        v = self.meta.get(key)
        if v is not None and not isinstance(v, dict):
            self._fail(f"'{key}' must be an object or null, got {type(v).__name__}")
        return v

    def records(self, key) -> list:
        """A list of JSON objects (empty when absent)."""
        v = self.meta.get(key) or []
        if not isinstance(v, list) or not all(isinstance(r, dict) for r in v):
            self._fail(f"'{key}' must be a list of objects")
        return v

    def parsed(self, key, parse):
        """``parse(object)`` of an object entry (None when absent), its errors as ours."""
        v = self.object(key)
        if v is None:
            return None
        try:
            return parse(v)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            self._fail(f"'{key}' is invalid ({type(e).__name__}: {e})")

    def config_params(self, estimator_cls) -> dict:
        """The saved settings that ``estimator_cls`` takes (engines share the format)."""
        names = estimator_cls._get_param_names()
        # checkpoints written before the activation and the hard negatives' source were
        # settings were trained with ReLU and the LSH tables
        saved = {"activation": "relu", "negatives_from": "lsh", **self.meta["config"]}
        return {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in names}

    @functools.cached_property
    def labels(self) -> LabelMap:
        """The label of each output row (array ``labels``; a checkpoint written before models
        kept rows only for the labels with a training positive has one for every label)."""
        if "labels" not in self:
            return LabelMap.identity(self.n_labels)
        kind, shape = self._members["labels"][3], self._members["labels"][1]
        if len(shape) != 1 or not np.issubdtype(kind, np.integer) or not shape[0]:
            raise CheckpointError(f"{self.npz_path}: array 'labels' must be a non-empty 1-D "
                                  f"integer array, got {kind} {shape}")
        ids = self.array("labels")
        if ids.min() < 0 or ids.max() >= self.n_labels or np.unique(ids).size != ids.size:
            raise CheckpointError(f"{self.npz_path}: array 'labels' must hold distinct label ids "
                                  f"in 0..{self.n_labels - 1} ('n_labels' in {self._where})")
        return LabelMap(ids, self.n_labels)

    @property
    def log_prior(self) -> np.ndarray | None:
        """The output rows' log training priors (array ``log_prior``; None in checkpoints
        written before the prior correction, which predict as they did)."""
        if "log_prior" not in self:
            return None
        _, shape, _, dtype = self._members["log_prior"]
        if shape != (self.labels.size,) or dtype != np.float32:
            raise CheckpointError(f"{self.npz_path}: array 'log_prior' is {dtype} {shape}, the "
                                  f"model has {self.labels.size} output rows (float32)")
        a = self.array("log_prior")
        if not np.all(np.isfinite(a)) or np.any(a > 0):
            raise CheckpointError(f"{self.npz_path}: array 'log_prior' must hold finite log "
                                  "probabilities (at most 0)")
        return a

    def held_out(self, n_features: int):
        """The rows fit held out of training (arrays ``held_out.data``, ``.indices`` and
        ``.indptr``: a CSR matrix over ``n_features``), or None where the checkpoint has none
        (written before they were kept, or fitted without a held-out slice)."""
        names = ("held_out.data", "held_out.indices", "held_out.indptr")
        if not any(name in self for name in names):
            return None
        if not all(name in self for name in names):
            raise CheckpointError(f"{self.npz_path}: the held-out rows need all of "
                                  f"{', '.join(names)}")
        data, indices, indptr = (self.array(name) for name in names)
        if (data.ndim != 1 or indices.shape != data.shape or indptr.ndim != 1 or indptr.size < 1
                or indptr[0] != 0 or indptr[-1] != data.size or np.any(np.diff(indptr) < 0)
                or (indices.size and (indices.min() < 0 or indices.max() >= n_features))
                or not np.all(np.isfinite(data))):
            raise CheckpointError(f"{self.npz_path}: arrays 'held_out.*' are not CSR rows over "
                                  f"{n_features} features with finite values")
        return sp.csr_matrix((data.astype(np.float32), indices.astype(np.int32),
                              indptr.astype(np.int64)), shape=(indptr.size - 1, n_features))

    @property
    def features_per_row(self) -> float | None:
        """The training rows' mean non-zeros (None in checkpoints written before it was kept)."""
        if self.meta.get("features_per_row") is None:
            return None
        v = self.float("features_per_row")
        if not v >= 0:
            self._fail(f"'features_per_row' must be at least 0, got {v}")
        return v

    @property
    def n_outputs_fitted(self) -> int:
        """The output rows the model was initialised with (what the defaults rule read)."""
        return self.int("n_outputs_fitted", self.labels.size, minimum=1, maximum=self.n_labels)

    def label_clusters(self, n_labels: int, width: int):
        """``(centroids float32 [C, width + 1], assign int32 [n_labels, m])`` of the output
        layer's label clusters where hard negatives come from them (arrays
        ``clusters.centroids``, ``clusters.assign``), or None where the checkpoint has none."""
        names = ("clusters.centroids", "clusters.assign")
        if not any(name in self for name in names):
            return None
        if not all(name in self for name in names):
            raise CheckpointError(f"{self.npz_path}: the label clusters need both of "
                                  f"{', '.join(names)}")
        C, assign = (self.array(name) for name in names)
        if (C.dtype != np.float32 or C.ndim != 2 or C.shape[1] != width + 1 or not C.shape[0]
                or not np.all(np.isfinite(C)) or assign.dtype != np.int32 or assign.ndim != 2
                or assign.shape[0] != n_labels or assign.shape[1] not in (1, 2)
                or (assign.size and (assign.min() < 0 or assign.max() >= C.shape[0]))):
            raise CheckpointError(
                f"{self.npz_path}: arrays 'clusters.*' must be finite float32 centroids "
                f"[C, {width + 1}] and int32 clusters in [0, C) of the {n_labels} labels [n, 1 or 2]")
        return C, assign

    def __contains__(self, key: str) -> bool:
        return key in self._members

    def array(self, key: str) -> np.ndarray:
        """The whole array ``key`` (a member of the arrays file), read now."""
        with self._member(key) as fh:
            return np.lib.format.read_array(fh, allow_pickle=False)

    def read_into(self, key: str, out: np.ndarray) -> None:
        """Read float32 array ``key`` into ``out`` [n, d] (any row stride, e.g. a column block
        of a wider array), checked against ``out``'s shape, a few megabytes at a time."""
        self._check(key, out.shape)
        fortran = self._members[key][2]
        if fortran or out.ndim != 2 or out.size == 0:  # not what np.save writes for a matrix
            out[...] = self.array(key)
            return
        rows = max(1, READ_BYTES // (4 * out.shape[1]))
        # a C-contiguous out is read into straight; a column block through a buffer of rows
        buf = None if out.flags.c_contiguous else \
            np.empty((min(rows, out.shape[0]), out.shape[1]), np.float32)
        with self._member(key) as fh:
            _read_header(fh)  # checked at open; the data follows it
            for lo in range(0, out.shape[0], rows):
                hi = min(lo + rows, out.shape[0])
                part = out[lo:hi] if buf is None else buf[:hi - lo]
                view = memoryview(part).cast("B")
                got = 0
                while got < view.nbytes:
                    n = fh.readinto(view[got:])
                    if not n:
                        raise EOFError("the array's data ends early")
                    got += n
                if buf is not None:
                    out[lo:hi] = part
            if fh.read(1):  # and the zip's checksum is checked at the member's end
                raise ValueError("data after the array")

    def arrays_like(self, shapes: dict, prefix: str = "", suffixes=("",), zeros: bool = False,
                    missing_ok: bool = False) -> dict:
        """float32 arrays ``prefix + name + suffix`` for every ``name`` in ``shapes``, checked
        against those shapes, each starting on a cache line (:func:`lsh.aligned_empty`: a
        served model's rows are read at random). Missing ones: zeros with ``zeros`` (Adam
        moments of a file written without them), skipped with ``missing_ok``, an error
        otherwise."""
        out = {}
        for name, shape in shapes.items():
            for suffix in suffixes:
                key = f"{prefix}{name}{suffix}"
                if key not in self._members:
                    if zeros:
                        out[f"{name}{suffix}"] = aligned_zeros(shape, np.float32)
                        continue
                    if missing_ok:
                        continue
                out[f"{name}{suffix}"] = a = aligned_empty(shape, np.float32)
                self.read_into(key, a)  # checks the shape
        return out

    def _check(self, key: str, shape) -> None:
        """That member ``key`` exists and is float32 of ``shape``."""
        if key not in self._members:
            raise CheckpointError(f"{self.npz_path}: array '{key}' is missing")
        _, stored, _, dtype = self._members[key]
        if stored != tuple(shape) or dtype != np.float32:
            raise CheckpointError(
                f"{self.npz_path}: array '{key}' is {dtype} {stored}, the configuration "
                f"({self._where}) needs float32 {tuple(shape)}")

    @contextlib.contextmanager
    def _member(self, key: str):
        """Member ``key`` of the arrays file, open for reading; whatever its bytes make numpy or
        zipfile trip over (a bad checksum, a truncated stream) is a :class:`CheckpointError`."""
        try:
            with zipfile.ZipFile(self.npz_path) as zf, zf.open(self._members[key][0]) as fh:
                yield fh
        except CheckpointError:
            raise
        except Exception as e:  # untrusted bytes
            raise CheckpointError(f"{self.npz_path}: array '{key}' is unreadable "
                                  f"({type(e).__name__}: {e})") from None

    @property
    def npz_path(self) -> str:
        return os.path.join(self.path, self.meta["arrays"])

    def preprocessor(self, n_features: int):
        from slide.preprocess import Preprocessor
        meta = self.meta.get("preprocessing")
        arrays = {k[4:]: self.array(k) for k in self._members if k.startswith("pre.")}
        if meta is None:  # written before preprocessing was part of the model: rows as given
            meta = {"norm": None, "tfidf": False, "n_documents": 1}
            arrays = {"document_frequency": np.ones(n_features, np.int64)}
        if not isinstance(meta, dict):
            self._fail("'preprocessing' must be an object")
        try:
            return Preprocessor.from_state(arrays, meta, n_features)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{self.npz_path}: preprocessing state is invalid ({e})") from None


def read_checkpoint(path) -> Checkpoint:
    """Read and check the checkpoint in directory ``path``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such model directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: not a model directory (no config.json)")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: corrupt JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != "slide":
        raise CheckpointError(f"{cfg_path}: not a slide model")
    version = meta.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int):
        raise CheckpointError(f"{cfg_path}: format_version must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: format version {version} is newer than this "
                              f"library's ({FORMAT_VERSION})")
    name = meta.get("arrays")
    if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(".npz") \
            or name.startswith("."):
        raise CheckpointError(f"{cfg_path}: 'arrays' must name an .npz file inside the model "
                              f"directory, got {name!r}")
    npz = os.path.join(path, name)
    _remove_stale_temporaries(path)
    if not os.path.exists(npz):
        raise CheckpointError(f"{npz}: missing (named by {cfg_path})")
    try:
        members = _npz_members(npz)
    except CheckpointError:
        raise
    except Exception as e:  # untrusted bytes: whatever numpy or zipfile trip over is "unreadable"
        raise CheckpointError(f"{npz}: unreadable ({type(e).__name__}: {e})") from None
    return Checkpoint(path, meta, members)


def _npz_members(npz: str) -> dict:
    """The members of an uncompressed or compressed .npz: name → (zip entry, shape, Fortran
    order, dtype), each header checked against its stored size before anything is allocated
    (a corrupted shape cannot ask for terabytes). The data is read later, when asked for."""
    members = {}
    with zipfile.ZipFile(npz) as zf:
        for info in zf.infolist():
            if not info.filename.endswith(".npy"):
                raise CheckpointError(f"{npz}: unexpected member {info.filename!r}")
            with zf.open(info) as fh:
                shape, fortran, dtype = _read_header(fh)
                if dtype.hasobject:
                    raise CheckpointError(f"{npz}: {info.filename} holds Python objects")
                need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                if need != info.file_size - fh.tell():
                    raise CheckpointError(f"{npz}: {info.filename} declares {shape} {dtype} but "
                                          f"stores {info.file_size - fh.tell()} bytes")
            members[info.filename[:-4]] = (info, tuple(shape), bool(fortran), dtype)
    return members


def _read_header(fh) -> tuple:
    """(shape, Fortran order, dtype) of the .npy stream ``fh``, which is left at its data."""
    fmt = np.lib.format
    major, _ = fmt.read_magic(fh)
    return (fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0)(fh)
