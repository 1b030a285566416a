import numpy as np
import pytest
import scipy.sparse as sp

from slide.data import (DataFormatError, check_xy, read_dataset, read_libsvm, read_xmc, take_rows,
                        write_libsvm, write_xmc)
from slide.synthetic import make_dataset


def _write(tmp_path, text, name="d.txt"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_read_xmc_basic(tmp_path):
    p = _write(tmp_path, "3 5 4\n0,2 1:0.5 3:1.25\n 4:2e-1\n3 0:1 1:-2.5E+1\n")
    X, Y = read_xmc(p)
    assert X.shape == (3, 5) and Y.shape == (3, 4) and X.dtype == np.float32
    np.testing.assert_allclose(X.toarray(), [[0, .5, 0, 1.25, 0], [0, 0, 0, 0, .2], [1, -25, 0, 0, 0]])
    np.testing.assert_array_equal(Y.toarray(), [[1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]])


def test_blank_label_field_without_space_and_crlf(tmp_path):
    p = _write(tmp_path, "2 3 2\r\n1:1 2:3\r\n1 0:2\r\n")
    X, Y = read_xmc(p)
    np.testing.assert_allclose(X.toarray(), [[0, 1, 3], [2, 0, 0]])
    assert Y.nnz == 1 and Y[1, 1] == 1


@pytest.mark.parametrize("fmt", ["xmc", "libsvm"])
def test_round_trip_exact(tmp_path, fmt):
    Xtr, Ytr, _, _ = make_dataset("eurlex-4k", n_train=300, n_test=1, seed=3)
    p = tmp_path / "rt.txt"
    (write_xmc if fmt == "xmc" else write_libsvm)(p, Xtr, Ytr)
    X, Y = (read_xmc(p) if fmt == "xmc" else read_libsvm(p, Xtr.shape[1], Ytr.shape[1]))
    assert (X != Xtr).nnz == 0 and (Y != Ytr).nnz == 0
    assert X.shape == Xtr.shape and Y.shape == Ytr.shape
    X2, Y2 = read_dataset(p, Xtr.shape[1], Ytr.shape[1])
    assert (X2 != Xtr).nnz == 0


def test_libsvm_infers_sizes(tmp_path):
    X, Y = read_libsvm(_write(tmp_path, "1,4 0:1 9:2\n2 3:1\n"))
    assert X.shape == (2, 10) and Y.shape == (2, 5)


@pytest.mark.parametrize("text,line,problem", [
    ("2 5 3\n0 1:1\n1 2:x\n", 3, "malformed value"),
    ("2 5 3\n0 1:1\n1 7:1\n", 3, "feature id out of range"),
    ("2 5 3\n0 1:1\n0,3 2:1\n", 3, "label id out of range"),
    ("2 5 3\n0 -1:1\n1 2:1\n", 2, "negative id"),
    ("2 5 3\n-1 1:1\n1 2:1\n", 2, "negative id"),
    ("2 5 3\n0 1:nan\n1 2:1\n", 2, "NaN or infinite"),
    ("2 5 3\n0 1:1\n1 2:inf\n", 3, "NaN or infinite"),
    ("2 5 3\n0 1:1e999\n1 2:1\n", 2, "NaN or infinite"),
    ("2 5 3\n0 1:1\n1 2\n", 3, "malformed token"),
    ("2 5 3\n0 1:1 ab:2\n1 2:1\n", 2, "malformed token"),
    ("3 5 3\n0 1:1\n1 2:1\n", 4, "declares 3 rows"),
    ("1 5 3\n0 1:1\n1 2:1\n", 3, "declares 1 rows"),
    ("2 5 3\n0 1:1\n\n1 2:1\n", 4, "declares 2 rows"),  # the blank line is a row
    ("2 5 3\n0 1:1\n0 1:1e39\n", 3, "too large for float32"),
    ("2 5 3\n0 1:1\n0 3000000000:1\n", 3, "id too large"),
    ("2 5 3\n1.0 1:1\n0 2:1\n", 2, "malformed token"),
    ("2 5\n0 1:1\n1 2:1\n", 1, "got 2 fields"),
    ("2 5 3 4\n0 1:1\n1 2:1\n", 1, "got 4 fields"),
    ("99999999999999999999 5 3\n0 1:1\n", 1, "header declares 99999999999999999999 samples"),
])
def test_malformed_input_names_file_and_line(tmp_path, text, line, problem):
    p = _write(tmp_path, text)
    with pytest.raises(DataFormatError) as e:
        read_xmc(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}:"), msg
    assert problem in msg


def test_blank_lines_are_empty_rows_and_a_bom_is_skipped(tmp_path):
    p = _write(tmp_path, "\ufeff3 4 2\n1 0:1\n\n0,1 3:2\n\n\n")
    X, Y = read_xmc(p)
    assert X.shape == (3, 4) and Y.shape == (3, 2)
    np.testing.assert_array_equal(np.diff(X.indptr), [1, 0, 1])
    np.testing.assert_array_equal(np.diff(Y.indptr), [1, 0, 2])


def test_headerless_ids_beyond_int32_are_refused(tmp_path):
    with pytest.raises(DataFormatError, match=r":2: id too large"):
        read_libsvm(_write(tmp_path, "0 1:1\n1 3000000000:1\n"))
    with pytest.raises(DataFormatError, match=r":1: id too large"):
        read_libsvm(_write(tmp_path, "2147483647 1:1\n", "b.txt"))


def test_directory_and_header_size_mismatch(tmp_path):
    with pytest.raises(DataFormatError, match="is a directory"):
        read_dataset(tmp_path)
    p = _write(tmp_path, "1 5 3\n0 1:1\n")
    with pytest.raises(DataFormatError, match=r":1: header declares 5 features, the model has 4"):
        read_dataset(p, n_features=4)
    q = _write(tmp_path, "0 7:1\n", "h.txt")
    with pytest.raises(DataFormatError, match=r"feature id out of range .*\(the data has 4 features\)"):
        read_dataset(q, n_features=4)


def test_label_matrices_and_lists_are_checked():
    X = sp.csr_matrix(np.ones((2, 3), np.float32))
    with pytest.raises(DataFormatError, match="holds -1; a label matrix holds only 0 and 1"):
        check_xy(X, np.array([[1, -1], [-1, 1]]))
    Y = sp.csr_matrix((np.array([1.0, 0.0]), np.array([0, 1]), np.array([0, 1, 2])), shape=(2, 2))
    assert check_xy(X, Y)[1].nnz == 1  # an explicit zero is not a label
    with pytest.raises(DataFormatError, match="label ids must be integers"):
        check_xy(X, [[0.0, 2.7], [1]])
    assert check_xy(X, [[0.0, 2.0], [1]])[1].nnz == 3
    with pytest.raises(DataFormatError, match="Complex data not supported"):
        check_xy(np.ones((2, 3), complex))
    with pytest.raises(DataFormatError, match="no labels"):
        check_xy(X, [[], []], require_labels=True)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(DataFormatError, match="empty file"):
        read_xmc(_write(tmp_path, ""))
    with pytest.raises(DataFormatError, match="empty file"):
        read_dataset(_write(tmp_path, "\n \n", "b.txt"))
    with pytest.raises(FileNotFoundError):
        read_xmc(tmp_path / "nope.txt")
    with pytest.raises(DataFormatError, match="missing 'N D L' header"):
        read_xmc(_write(tmp_path, "0 1:1\n", "c.txt"))


def test_check_xy_sorts_a_copy_of_unsorted_rows_and_keeps_sorted_ones():
    """Rows whose column indices decrease come back as a sorted copy (the caller's matrix as it
    was); sorted rows, duplicates included as scipy counts them, come back as they are."""
    data, indices, indptr = (np.array([1, 2, 3, 4], np.float32), np.array([0, 3, 2, 1]),
                             np.array([0, 2, 4]))
    X = sp.csr_matrix((data, indices, indptr), shape=(2, 5))
    got = check_xy(X)
    assert got is not X and list(X.indices) == [0, 3, 2, 1]
    assert list(got.indices) == [0, 3, 1, 2] and list(got.data) == [1, 2, 4, 3]
    for kept in (sp.csr_matrix((data, np.array([0, 3, 1, 2]), indptr), shape=(2, 5)),
                 sp.csr_matrix((data, np.array([1, 1, 0, 4]), indptr), shape=(2, 5)),
                 sp.csr_matrix((data[:1], np.array([4]), np.array([0, 0, 1])), shape=(2, 5))):
        assert check_xy(kept) is kept
    unsorted_nan = sp.csr_matrix((np.array([1, 2, np.nan], np.float32), np.array([2, 1, 0]),
                                  np.array([0, 2, 3])), shape=(2, 3))
    with pytest.raises(DataFormatError, match=r"row 1 \(0-based\): X holds a NaN"):
        check_xy(unsorted_nan)


def test_check_xy_errors():
    X = sp.csr_matrix(np.array([[1.0, np.nan]], np.float32))
    with pytest.raises(DataFormatError, match=r"row 0 \(0-based\): X holds a NaN"):
        check_xy(X)
    for bad in (np.inf, -np.inf, np.nan):  # the first bad value's row, in float32 and float64
        for dtype in (np.float32, np.float64):
            X = sp.csr_matrix(np.array([[1.0, 0.0], [0.0, 2.0], [3.0, bad], [bad, 1.0]], dtype))
            with pytest.raises(DataFormatError, match=r"row 2 \(0-based\): X holds a NaN"):
                check_xy(X)
    assert check_xy(sp.csr_matrix(np.array([[1.0, 3.4e38]], np.float32))).nnz == 2
    with pytest.raises(DataFormatError, match="3 features, but the model is expecting 2 features"):
        check_xy(sp.csr_matrix(np.ones((1, 3))), n_features=2)
    with pytest.raises(DataFormatError, match="rows"):
        check_xy(sp.csr_matrix(np.ones((2, 3))), [[0]])
    with pytest.raises(DataFormatError, match="out of range"):
        check_xy(sp.csr_matrix(np.ones((1, 3))), [[5]], n_labels=3)
    with pytest.raises(DataFormatError, match="no samples"):
        check_xy(sp.csr_matrix((0, 3)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_take_rows_gives_what_scipys_row_index_gives(dtype):
    """Rows in any order, repeated, empty ones and none at all: the same matrix as ``X[rows]``,
    entry order within each row kept (unsorted rows stay unsorted, and are not flagged sorted)."""
    X = sp.random(300, 50, density=0.1, format="csr", dtype=dtype, random_state=0)
    X = sp.vstack([X[:7], sp.csr_matrix((1, 50), dtype=dtype), X[8:]], format="csr")  # row 7 empty
    rng = np.random.default_rng(0)
    for rows in (rng.integers(0, 300, 64), np.array([299, 0, 0, 7]), np.zeros(0, np.int64)):
        got, want = take_rows(X, rows), X[rows]
        assert got.dtype == dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.indptr, want.indptr)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.data, want.data)
    unsorted = sp.csr_matrix((np.array([1.0, 2.0], dtype), np.array([3, 1]), np.array([0, 2])),
                             shape=(1, 5))
    got = take_rows(unsorted, [0])
    assert list(got.indices) == [3, 1] and not got.has_sorted_indices
    for bad in ([300], [-1], [[0]]):
        with pytest.raises(IndexError, match="row ids"):
            take_rows(X, bad)


def test_take_rows_into_an_earlier_result_gives_the_new_rows():
    """``out`` of the same shape is given the new rows and returned (its flags no longer claim
    what was known of the old rows); of another shape or dtype, a new matrix is built and
    ``out`` is left as it was."""
    X = sp.random(200, 40, density=0.2, format="csr", dtype=np.float32, random_state=1)
    X.has_sorted_indices = True
    first = take_rows(X, [3, 5, 7])
    assert first.has_sorted_indices
    again = take_rows(X, [10, 2, 199], out=first)
    assert again is first
    np.testing.assert_array_equal(again.toarray(), X[[10, 2, 199]].toarray())
    unsorted = sp.csr_matrix((np.array([1.0, 2.0, 4.0], np.float32), np.array([3, 1, 0]),
                              np.array([0, 2, 3, 3])), shape=(3, 40))
    assert take_rows(unsorted, [0, 1, 2], out=first) is first
    assert list(first.indices) == [3, 1, 0] and not first.has_sorted_indices
    for other in (take_rows(X, [4, 6]), take_rows(X.astype(np.float64), [4, 6, 8])):
        before = other.toarray()
        fresh = take_rows(X, [0, 1, 2], out=other)
        assert fresh is not other and fresh.dtype == np.float32
        np.testing.assert_array_equal(fresh.toarray(), X[[0, 1, 2]].toarray())
        np.testing.assert_array_equal(other.toarray(), before)
