"""Extreme-classification data: readers, writers and a synthetic generator.

Two text formats are read, both one sample per line as ``l1,l2,... f:v f:v ...``:

* the Extreme Classification Repository format, whose first line is the header ``N D L``
  (samples, features, labels), with 0-based ids;
* libsvm multilabel files, the same lines without a header.

The label field may be empty (the line then starts with a space or directly with ``f:v``).
Features come back as a float32 CSR matrix ``X`` [N, D] and labels as a float32 CSR indicator
matrix ``Y`` [N, L]. Parsing is one numba pass over the file's bytes; problems are reported as
:class:`DataFormatError` naming the file, the line and what is wrong.
"""
from __future__ import annotations

import os

import numpy as np
import scipy.sparse as sp
from numba import njit

from slide.runtime import copy_into, prefetch

__all__ = ["DataFormatError", "read_xmc", "write_xmc", "read_libsvm", "write_libsvm",
           "read_dataset", "read_shard", "check_xy", "labels_to_csr", "shuffle_rows", "take_rows"]


class DataFormatError(ValueError):
    """A data file or array is malformed; the message names the file, line and problem."""


# --------------------------------------------------------------------------------------------
# Parsing kernel
# --------------------------------------------------------------------------------------------
_OK, _BAD_TOKEN, _FEATURE_RANGE, _LABEL_RANGE, _NEGATIVE, _NONFINITE, _BAD_VALUE, _TOO_LARGE, \
    _OVERFLOW = range(9)
_MESSAGES = {
    _BAD_TOKEN: "malformed token",
    _FEATURE_RANGE: "feature id out of range",
    _LABEL_RANGE: "label id out of range",
    _NEGATIVE: "negative id",
    _NONFINITE: "value is NaN or infinite",
    _BAD_VALUE: "malformed value",
    _TOO_LARGE: "id too large (ids must be below 2147483647)",
    _OVERFLOW: "value too large for float32 (|v| > 3.4e38)",
}
MAX_ID = 2**31 - 2  # ids are stored as int32, and id + 1 (a size) must fit too
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_SPACE, _TAB, _NL, _CR = 32, 9, 10, 13
_COMMA, _COLON, _MINUS, _PLUS, _DOT = 44, 58, 45, 43, 46


@njit(cache=True, nogil=True)
def _is_blank(c):
    return c == _SPACE or c == _TAB or c == _CR


@njit(cache=True, nogil=True)
def _parse_int(buf, i, end):
    """Parse a non-negative decimal integer at buf[i:]; return (value, next, status)."""
    if i < end and buf[i] == _MINUS:
        return -1, i, _NEGATIVE
    start = i
    v = 0
    while i < end and 48 <= buf[i] <= 57:
        v = v * 10 + (buf[i] - 48)
        if v > MAX_ID:
            return -1, i, _TOO_LARGE
        i += 1
    if i == start:
        return -1, i, _BAD_TOKEN
    return v, i, _OK


@njit(cache=True, nogil=True)
def _parse_float(buf, i, end):
    """Parse a decimal float (sign, digits, fraction, exponent) at buf[i:]."""
    neg = False
    if i < end and (buf[i] == _MINUS or buf[i] == _PLUS):
        neg = buf[i] == _MINUS
        i += 1
    if i < end and (buf[i] | 32) in (110, 105):  # 'n'an / 'i'nf, any case
        return 0.0, i, _NONFINITE
    mant = 0
    exp10 = 0
    digits = 0
    while i < end and 48 <= buf[i] <= 57:
        if mant < 100_000_000_000_000_000:
            mant = mant * 10 + (buf[i] - 48)
        else:
            exp10 += 1
        digits += 1
        i += 1
    if i < end and buf[i] == _DOT:
        i += 1
        while i < end and 48 <= buf[i] <= 57:
            if mant < 100_000_000_000_000_000:
                mant = mant * 10 + (buf[i] - 48)
                exp10 -= 1
            digits += 1
            i += 1
    if digits == 0:
        return 0.0, i, _BAD_VALUE
    if i < end and (buf[i] | 32) == 101:  # 'e' / 'E'
        i += 1
        eneg = False
        if i < end and (buf[i] == _MINUS or buf[i] == _PLUS):
            eneg = buf[i] == _MINUS
            i += 1
        e = 0
        start = i
        while i < end and 48 <= buf[i] <= 57:
            if e < 10000:
                e = e * 10 + (buf[i] - 48)
            i += 1
        if i == start:
            return 0.0, i, _BAD_VALUE
        exp10 += -e if eneg else e
    v = float(mant)
    if exp10 > 0:
        v = v * 10.0 ** exp10
    elif exp10 < 0:
        # dividing by an exact power of ten is correctly rounded; multiplying by 10**-k is not
        v = v / 10.0 ** (-exp10) if exp10 >= -300 else 0.0
    if not np.isfinite(v):
        return 0.0, i, _NONFINITE
    if v > _FLOAT32_MAX:
        return 0.0, i, _OVERFLOW
    return -v if neg else v, i, _OK


@njit(cache=True, nogil=True)
def _parse_lines(buf, start, n_features, n_labels, feat_ids, feat_vals, label_ids,
                 x_indptr, y_indptr):
    """Parse sample lines of ``buf[start:]`` into preallocated CSR arrays.

    ``n_features`` / ``n_labels`` < 0 means unbounded (libsvm without declared sizes).
    Returns (status, rows, line_offset, column, max_feature, max_label); on error ``rows`` is
    the 0-based index of the offending sample line and ``column`` its byte column.
    """
    end = buf.size
    i = start
    row = 0
    nf = 0
    nl = 0
    max_f = -1
    max_l = -1
    x_indptr[0] = 0
    y_indptr[0] = 0
    while i < end:
        line_start = i
        # skip leading blanks; a line starting with a blank has an empty label field
        while i < end and _is_blank(buf[i]):
            i += 1
        if i >= end or buf[i] == _NL:
            # a blank line: trailing ones end the file, others are rows without labels or
            # features (Extreme Classification Repository files have them)
            j = i
            while j < end and (buf[j] == _NL or _is_blank(buf[j])):
                j += 1
            if j == end:
                break
        # the label field: a first token without ':'
        j = i
        while j < end and not _is_blank(buf[j]) and buf[j] != _NL and buf[j] != _COLON:
            j += 1
        has_labels = j > i and (j == end or buf[j] != _COLON)
        if has_labels:
            while True:
                v, i, st = _parse_int(buf, i, end)
                if st != _OK:
                    return st, row, line_start, i - line_start, max_f, max_l
                if n_labels >= 0 and v >= n_labels:
                    return _LABEL_RANGE, row, line_start, i - line_start, max_f, max_l
                label_ids[nl] = v
                nl += 1
                if v > max_l:
                    max_l = v
                if i < end and buf[i] == _COMMA:
                    i += 1
                    continue
                break
            if i < end and not (_is_blank(buf[i]) or buf[i] == _NL):
                return _BAD_TOKEN, row, line_start, i - line_start, max_f, max_l
        # feature tokens f:v
        while True:
            while i < end and _is_blank(buf[i]):
                i += 1
            if i >= end or buf[i] == _NL:
                break
            f, i, st = _parse_int(buf, i, end)
            if st != _OK:
                return st, row, line_start, i - line_start, max_f, max_l
            if i >= end or buf[i] != _COLON:
                return _BAD_TOKEN, row, line_start, i - line_start, max_f, max_l
            i += 1
            if n_features >= 0 and f >= n_features:
                return _FEATURE_RANGE, row, line_start, i - line_start, max_f, max_l
            val, i, st = _parse_float(buf, i, end)
            if st != _OK:
                return st, row, line_start, i - line_start, max_f, max_l
            if i < end and not (_is_blank(buf[i]) or buf[i] == _NL):
                return _BAD_VALUE, row, line_start, i - line_start, max_f, max_l
            feat_ids[nf] = f
            feat_vals[nf] = val
            nf += 1
            if f > max_f:
                max_f = f
        row += 1
        if row >= x_indptr.size:  # more lines than the caller allowed for
            return _OK, row, i, -1, max_f, max_l
        x_indptr[row] = nf
        y_indptr[row] = nl
        if i < end:
            i += 1  # the newline
    return _OK, row, i, 0, max_f, max_l


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------
def _read_bytes(path) -> np.ndarray:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataFormatError(f"{path}: is a directory, not a data file")
    try:
        buf = np.fromfile(path, dtype=np.uint8)
    except OSError as e:
        raise DataFormatError(f"{path}: cannot read ({e.strerror or e})") from None
    if buf[:3].tobytes() == b"\xef\xbb\xbf":  # a UTF-8 byte order mark, written by some editors
        buf = buf[3:]
    if buf.size == 0 or not np.any((buf != _SPACE) & (buf != _NL) & (buf != _TAB) & (buf != _CR)):
        raise DataFormatError(f"{path}: empty file")
    return buf


def _parse_header(path, buf):
    """Return ((N, D, L), byte offset of line 2) if line 1 is an ``N D L`` header, else None
    (a headerless libsvm file, whose first line holds ``f:v`` tokens or a label list)."""
    nl = np.flatnonzero(buf[:4096] == _NL)
    first = bytes(buf[: nl[0]] if nl.size else buf[:4096]).decode("ascii", "replace").strip()
    parts = first.split()
    if ":" in first or "," in first or not parts:
        return None
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise DataFormatError(f"{path}:1: malformed header {first[:60]!r}: expected three "
                              f"non-negative integers 'N D L' (samples, features, labels), "
                              f"got {len(parts)} field{'s' if len(parts) != 1 else ''}")
    n, d, n_labels = (int(p) for p in parts)
    for name, v in (("samples", n), ("features", d), ("labels", n_labels)):
        if v > MAX_ID + 1:
            raise DataFormatError(f"{path}:1: header declares {v} {name}; at most {MAX_ID + 1} "
                                  f"are supported")
    return (n, d, n_labels), (int(nl[0]) + 1 if nl.size else buf.size)


def _sizes(n_features, n_labels) -> str:
    """How the error messages describe the id bounds in force."""
    parts = [f"{v} {name}" for v, name in ((n_features, "features"), (n_labels, "labels")) if v >= 0]
    return f" (the data has {' and '.join(parts)})" if parts else ""


def _parse(path, buf, start, first_line, n_rows, n_features, n_labels):
    n_tokens = int(np.count_nonzero(buf[start:] == _COLON))
    n_label_bound = int(np.count_nonzero(buf[start:] == _COMMA)) + int(
        np.count_nonzero(buf[start:] == _NL)) + 1
    row_bound = n_rows + 1 if n_rows >= 0 else n_label_bound
    feat_ids = np.empty(n_tokens, dtype=np.int64)
    feat_vals = np.empty(n_tokens, dtype=np.float64)
    label_ids = np.empty(n_label_bound, dtype=np.int64)
    x_indptr = np.zeros(row_bound + 1, dtype=np.int64)
    y_indptr = np.zeros(row_bound + 1, dtype=np.int64)
    status, rows, line_start, col, max_f, max_l = _parse_lines(
        buf, start, n_features, n_labels, feat_ids, feat_vals, label_ids, x_indptr, y_indptr)
    if status != _OK:
        line_no = first_line + rows
        line_end = line_start + int(np.argmax(buf[line_start:line_start + 200] == _NL) or 200)
        snippet = bytes(buf[line_start:line_end]).decode("ascii", "replace")
        if len(snippet) > 60:
            snippet = snippet[:57] + "..."
        raise DataFormatError(
            f"{path}:{line_no}: {_MESSAGES[status]} at column {col + 1} in {snippet!r}"
            + (_sizes(n_features, n_labels) if status in (_FEATURE_RANGE, _LABEL_RANGE) else ""))
    if n_rows >= 0 and rows != n_rows:
        raise DataFormatError(
            f"{path}:{first_line + min(rows, n_rows)}: header declares {n_rows} rows "
            f"but the file has {'more than ' if rows > n_rows else ''}{rows if rows <= n_rows else n_rows}")
    if rows == 0:
        raise DataFormatError(f"{path}: no samples")
    d = n_features if n_features >= 0 else max_f + 1
    n_l = n_labels if n_labels >= 0 else max_l + 1
    x_ptr = x_indptr[: rows + 1]
    y_ptr = y_indptr[: rows + 1]
    X = sp.csr_matrix((feat_vals[: x_ptr[-1]].astype(np.float32), feat_ids[: x_ptr[-1]].astype(np.int32),
                       x_ptr), shape=(rows, max(d, 0)))
    Y = sp.csr_matrix((np.ones(y_ptr[-1], dtype=np.float32), label_ids[: y_ptr[-1]].astype(np.int32),
                       y_ptr), shape=(rows, max(n_l, 0)))
    for M in (X, Y):
        M.sum_duplicates()  # also sorts indices
    Y.data[:] = 1.0
    return X, Y


def read_xmc(path) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Read an Extreme Classification Repository file (header ``N D L``).

    Returns ``X`` float32 CSR [N, D] and ``Y`` float32 CSR indicator [N, L], indices sorted.
    Raises :class:`DataFormatError` naming file and line on any malformed input.
    """
    buf = _read_bytes(path)
    header = _parse_header(path, buf)
    if header is None:
        raise DataFormatError(f"{path}:1: missing 'N D L' header (use read_libsvm for headerless files)")
    (n, d, n_labels), start = header
    return _parse(path, buf, start, 2, n, d, n_labels)


def read_libsvm(path, n_features: int | None = None, n_labels: int | None = None):
    """Read a headerless libsvm multilabel file; sizes default to the largest id seen + 1."""
    buf = _read_bytes(path)
    return _parse(path, buf, 0, 1, -1, -1 if n_features is None else n_features,
                  -1 if n_labels is None else n_labels)


def read_dataset(path, n_features: int | None = None, n_labels: int | None = None):
    """Read either format, telling them apart by the ``N D L`` header line.

    ``n_features`` / ``n_labels``: the sizes a model expects. A headerless file takes them as
    its bounds; a file whose header declares other sizes is refused, naming the file.
    """
    buf = _read_bytes(path)
    header = _parse_header(path, buf)
    if header is None:
        return _parse(path, buf, 0, 1, -1, -1 if n_features is None else n_features,
                      -1 if n_labels is None else n_labels)
    (n, d, n_l), start = header
    for declared, expected, name in ((d, n_features, "features"), (n_l, n_labels, "labels")):
        if expected is not None and declared != expected:
            raise DataFormatError(f"{path}:1: header declares {declared} {name}, the model has "
                                  f"{expected}")
    return _parse(path, buf, start, 2, n, d, n_l)


def _line_start(fh, pos: int, data_start: int, size: int) -> int:
    """The first line start at or after byte ``pos`` (lines begin at ``data_start``)."""
    if pos <= data_start:
        return data_start
    fh.seek(pos - 1)  # pos starts a line when the byte before it ends one
    at = pos - 1
    while at < size:
        chunk = fh.read(1 << 16)
        i = chunk.find(b"\n")
        if i >= 0:
            return at + i + 1
        at += len(chunk)
    return size


def _newlines_before(path, end: int) -> int:
    """Line breaks in the first ``end`` bytes (read in chunks; for error messages only)."""
    count = 0
    with open(path, "rb") as fh:
        while end > 0:
            chunk = fh.read(min(end, 1 << 24))
            if not chunk:
                break
            count += chunk.count(b"\n")
            end -= len(chunk)
    return count


def read_shard(path, shard: int, n_shards: int):
    """Rows of one of ``n_shards`` shards of a data file (either format), reading only that
    shard's bytes: the bytes after the header are cut into equal ranges, each moved to the next
    line start, so every line belongs to exactly one shard and shards differ by a few rows.

    Returns ``(X, Y, declared_rows)``: this shard's CSR rows (sized from the header, or from the
    shard's largest ids for a headerless file) and the header's sample count (None without one),
    which the caller checks against the shards' total. Errors name the file's own line number.
    """
    path = os.fspath(path)
    if not 0 <= shard < n_shards:
        raise ValueError(f"shard must be in [0, {n_shards}), got {shard}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataFormatError(f"{path}: is a directory, not a data file")
    size = os.path.getsize(path)
    head = np.fromfile(path, dtype=np.uint8, count=min(size, 4096))
    bom = 3 if head[:3].tobytes() == b"\xef\xbb\xbf" else 0
    if head.size <= bom:
        raise DataFormatError(f"{path}: empty file")
    header = _parse_header(path, head[bom:])
    (n, d, n_l), start = header if header is not None else ((None, -1, -1), 0)
    data_start = bom + start
    span = size - data_start
    with open(path, "rb") as fh:
        lo = _line_start(fh, data_start + span * shard // n_shards, data_start, size)
        hi = _line_start(fh, data_start + span * (shard + 1) // n_shards, data_start, size)
    buf = np.fromfile(path, dtype=np.uint8, count=hi - lo, offset=lo)
    if not np.any((buf != _SPACE) & (buf != _NL) & (buf != _TAB) & (buf != _CR)):
        raise DataFormatError(f"{path}: shard {shard} of {n_shards} holds no rows (the file has "
                              f"fewer rows than shards)")
    try:
        X, Y = _parse(path, buf, 0, 1, -1, d, n_l)
    except DataFormatError as e:  # the shard counted its lines from 1: give the file's number
        prefix = f"{path}:"
        text = str(e)
        if text.startswith(prefix) and text[len(prefix):].split(":", 1)[0].isdigit():
            local, rest = text[len(prefix):].split(":", 1)
            text = f"{path}:{int(local) + _newlines_before(path, lo)}:{rest}"
        raise DataFormatError(text) from None
    return X, Y, n


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------
def _format_lines(X: sp.csr_matrix, Y: sp.csr_matrix):
    # Vectorised token formatting: one string per non-zero, joined per row by slicing.
    # '%.9g' round-trips every float32 exactly.
    feat_tok = np.char.add(np.char.add(X.indices.astype(str), ":"),
                           np.char.mod("%.9g", X.data.astype(np.float64)))
    lab_tok = Y.indices.astype(str)
    xp, yp = X.indptr, Y.indptr
    for r in range(X.shape[0]):
        labels = ",".join(lab_tok[yp[r]:yp[r + 1]])
        feats = " ".join(feat_tok[xp[r]:xp[r + 1]])
        yield f"{labels} {feats}".rstrip(" ") + "\n" if feats else f"{labels}\n"


def _write(path, X, Y, header: str | None):
    X, Y = check_xy(X, Y, where=os.fspath(path))
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="ascii") as fh:
        if header:
            fh.write(header)
        fh.writelines(_format_lines(X, Y))
    os.replace(tmp, path)


def write_xmc(path, X, Y) -> None:
    """Write ``X``, ``Y`` in the Extreme Classification Repository format (atomic)."""
    _write(path, X, Y, f"{X.shape[0]} {X.shape[1]} {Y.shape[1]}\n")


def write_libsvm(path, X, Y) -> None:
    """Write ``X``, ``Y`` as a headerless libsvm multilabel file (atomic)."""
    _write(path, X, Y, None)


# --------------------------------------------------------------------------------------------
# Validation shared by readers, writers and the estimators
# --------------------------------------------------------------------------------------------
def _row_of(indptr, position) -> int:
    return int(np.searchsorted(indptr, position, side="right") - 1)


#: :func:`_entries_check`'s answers where every value is finite
_SORTED, _UNSORTED = -1, -2


@njit(cache=True, nogil=True)
def _entries_check(indptr, indices, values) -> int:
    """The position of the first NaN or infinite value of a CSR matrix; where there is none,
    ``_SORTED`` or ``_UNSORTED`` (a row's column indices decrease somewhere, as scipy's
    ``has_sorted_indices`` tests). One pass: numpy's test and reduction, and scipy's sort test
    on a new row's slice, cost a single query more than its hidden layer does."""
    for p in range(values.size):
        if not np.isfinite(values[p]):
            return p
    for r in range(indptr.size - 1):
        for p in range(indptr[r] + 1, indptr[r + 1]):
            if indices[p - 1] > indices[p]:
                return _UNSORTED
    return _SORTED


def labels_to_csr(Y, n_labels: int | None = None, where: str = "Y") -> sp.csr_matrix:
    """A CSR 0/1 indicator matrix from a 0/1 matrix (sparse or dense) or label-id lists.

    A matrix must hold only 0 and 1 (explicit zeros in a sparse one are not labels); lists must
    hold non-negative integer ids. Anything else is a :class:`DataFormatError`: a {-1, +1}
    matrix or ids written as 2.7 would otherwise turn silently into wrong labels.
    """
    if sp.issparse(Y) or (isinstance(Y, np.ndarray) and Y.ndim == 2):
        Y = sp.csr_matrix(Y)
        if Y.dtype.kind not in "biuf":
            raise DataFormatError(f"{where}: Y must be numeric 0/1 labels, got dtype {Y.dtype}")
        Y = sp.csr_matrix(Y, dtype=np.float32, copy=True)
        Y.eliminate_zeros()
        bad = np.flatnonzero(Y.data != 1)
        if bad.size:
            raise DataFormatError(f"{where}: row {_row_of(Y.indptr, bad[0])} (0-based): Y holds "
                                  f"{Y.data[bad[0]]:g}; a label matrix holds only 0 and 1")
    else:
        if isinstance(Y, (str, bytes)) or not hasattr(Y, "__iter__"):
            raise DataFormatError(f"{where}: Y must be a 0/1 matrix or a list of label-id lists")
        rows = []
        for r, labels in enumerate(Y):
            a = np.asarray([labels] if np.isscalar(labels) else list(labels))
            if a.size and (a.dtype.kind not in "iuf" or (a.dtype.kind == "f" and
                                                          not np.all(np.mod(a, 1) == 0))):
                raise DataFormatError(f"{where}: row {r} (0-based): label ids must be integers, "
                                      f"got {a.tolist()[:5]}")
            rows.append(a.astype(np.int64))
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        indptr[1:] = np.cumsum([r.size for r in rows])
        indices = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        if indices.size and indices.min() < 0:
            raise DataFormatError(f"{where}: row {_row_of(indptr, int(np.argmin(indices)))} (0-based): "
                                  f"negative label id {int(indices.min())}")
        n = n_labels if n_labels is not None else (int(indices.max()) + 1 if indices.size else 0)
        if indices.size and indices.max() >= n:
            raise DataFormatError(f"{where}: row {_row_of(indptr, int(np.argmax(indices >= n)))} "
                                  f"(0-based): label id {int(indices.max())} out of range for {n} labels")
        Y = sp.csr_matrix((np.ones(indices.size, np.float32), indices.astype(np.int32), indptr),
                          shape=(len(rows), n))
    Y.sum_duplicates()
    Y.data[:] = 1.0
    return Y


def check_xy(X, Y=None, n_features: int | None = None, n_labels: int | None = None,
             where: str = "input", require_labels: bool = False, owner: str = "the model"):
    """Validate and normalise ``X`` (float32 CSR, sorted indices) and ``Y`` (CSR indicator).

    Raises :class:`DataFormatError` for shape mismatches, non-real or NaN/inf values, empty
    data, feature or label counts that do not match the model, and (``require_labels``, when
    a model is to be fitted) a ``Y`` without a single label. ``owner`` names the model in
    messages.
    """
    if not sp.issparse(X):
        try:
            X = np.asarray(X)
        except (ValueError, TypeError) as e:
            raise DataFormatError(f"{where}: X is not a matrix ({e})") from None
        if X.ndim != 2:
            raise DataFormatError(f"{where}: X must be 2-D (samples x features), got shape {X.shape}; "
                                  "Reshape your data: X.reshape(1, -1) for a single sample")
        if X.dtype.kind == "O":  # numbers held as Python objects: convert, or say what is not one
            try:
                X = X.astype(np.float64)
            except (TypeError, ValueError) as e:
                raise TypeError(f"{where}: X holds a value that is not a number ({e})") from None
    if X.dtype.kind == "c":
        raise DataFormatError(f"{where}: Complex data not supported (X has dtype {X.dtype})")
    if X.dtype.kind not in "biuf":
        raise DataFormatError(f"{where}: X must hold real numbers, got dtype {X.dtype}")
    # kept as it is where it already is one: a new wrapper would cost every single-row query
    if not (type(X) is sp.csr_matrix and X.dtype == np.float32):
        X = sp.csr_matrix(X, dtype=np.float32)
    if X.shape[0] == 0:
        raise DataFormatError(f"{where}: X has no samples")
    if X.shape[1] == 0:
        raise DataFormatError(f"{where}: 0 feature(s) (shape={X.shape}) while a minimum of 1 is required.")
    bad = _entries_check(X.indptr, X.indices, X.data)
    if bad >= 0:
        raise DataFormatError(f"{where}: row {_row_of(X.indptr, bad)} (0-based): X holds a NaN or "
                              f"infinite value")
    if bad == _UNSORTED:
        X = X.copy()
        X.sort_indices()
    if n_features is not None and X.shape[1] != n_features:
        raise DataFormatError(f"{where}: X has {X.shape[1]} features, but {owner} is expecting "
                              f"{n_features} features as input")
    if Y is None:
        return X
    Y = labels_to_csr(Y, n_labels, where=where)
    if Y.shape[0] != X.shape[0]:
        raise DataFormatError(f"{where}: X has {X.shape[0]} rows but Y has {Y.shape[0]}")
    if n_labels is not None and Y.shape[1] != n_labels:
        if Y.shape[1] > n_labels and Y.nnz and Y.indices.max() >= n_labels:
            raise DataFormatError(f"{where}: label id {int(Y.indices.max())} out of range for "
                                  f"{n_labels} labels")
        Y = sp.csr_matrix((Y.data, Y.indices, Y.indptr), shape=(Y.shape[0], n_labels))
    if require_labels and Y.nnz == 0:
        raise DataFormatError(f"{where}: no labels: every row's label set is empty "
                              f"({Y.shape[1]} labels declared); there is nothing to learn")
    return X, Y


#: rows asked for ahead by :func:`take_rows`: a batch's rows lie scattered through the matrix
_AHEAD = 2


@njit(cache=True, nogil=True)
def _rows_nnz(indptr, rows, n):
    """The entries of rows ``rows`` of a CSR matrix with ``n`` rows and ``indptr``, or -1 where
    a row id is outside [0, n)."""
    total = 0
    for r in rows:
        if r < 0 or r >= n:
            return -1
        total += indptr[r + 1] - indptr[r]
    return total


@njit(cache=True, nogil=True)
def _take_rows(indptr, indices, data, rows, out_indptr, out_indices, out_data):
    out_indptr[0] = 0
    k = 0
    for r in range(rows.size):
        if r + _AHEAD < rows.size:
            ahead = rows[r + _AHEAD]
            prefetch(indices[indptr[ahead]:indptr[ahead + 1]])
            prefetch(data[indptr[ahead]:indptr[ahead + 1]])
        lo, hi = indptr[rows[r]], indptr[rows[r] + 1]
        copy_into(out_indices[k:k + hi - lo], indices[lo:hi])
        copy_into(out_data[k:k + hi - lo], data[lo:hi])
        k += hi - lo
        out_indptr[r + 1] = k


def take_rows(X: sp.csr_matrix, rows, out: sp.csr_matrix | None = None) -> sp.csr_matrix:
    """Rows ``rows`` (int [m], each in [0, n)) of CSR ``X`` [n, d] as a CSR matrix [m, d]: what
    ``X[rows]`` gives, with the same dtype and each row's entries in the same order.

    ``out``: a matrix an earlier call returned for m rows of ``X`` (or of a matrix of the same
    shape and dtypes), which is given these rows and returned instead of a new one; otherwise
    (None, or another shape) a new matrix is built. A training loop takes each batch's rows
    this way: scipy's fancy row index checks the whole matrix's index arrays on every call,
    and building a new scipy matrix costs more between training steps, which leave Python's
    caches cold, than in a loop of its own (docs/runtime.md).
    """
    rows = np.asarray(rows, np.int64)
    n = X.shape[0]
    nnz = _rows_nnz(X.indptr, rows, n) if rows.ndim == 1 else -1
    if nnz < 0:
        raise IndexError(f"rows must be a 1-D array of row ids in [0, {n})")
    shape = (rows.size, X.shape[1])
    reuse = (out is not None and out.shape == shape and out.dtype == X.dtype
             and out.indptr.dtype == X.indptr.dtype and out.indices.dtype == X.indices.dtype)
    indptr = out.indptr if reuse else np.empty(rows.size + 1, X.indptr.dtype)
    indices = np.empty(nnz, X.indices.dtype)
    data = np.empty(nnz, X.dtype)
    _take_rows(X.indptr, X.indices, X.data, rows, indptr, indices, data)
    if reuse:  # what scipy knew of the rows before is not known of these
        out.indices, out.data = indices, data
        out.has_canonical_format = False
        out.has_sorted_indices = X.has_sorted_indices
    else:
        out = sp.csr_matrix((data, indices, indptr), shape=shape)
        if X.has_sorted_indices:  # known already: scipy would otherwise check the rows again
            out.has_sorted_indices = True
    return out


def shuffle_rows(X, Y, seed: int = 0, n: int | None = None):
    """A seeded random subset (or permutation) of rows: test files may be sorted by label."""
    order = np.random.default_rng(seed).permutation(X.shape[0])[:n]
    return X[order], Y[order]
