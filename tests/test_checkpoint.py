"""Checkpoint files read on demand: whole arrays, and arrays streamed into strided memory."""
import numpy as np
import pytest

from slide import checkpoint
from slide.checkpoint import CheckpointError, read_checkpoint, write_checkpoint

META = {"n_features": 3, "n_labels": 7, "step": 1, "epoch": 1, "config": {}}


def _saved(tmp_path, compressed=False, rows=7):
    rng = np.random.default_rng(0)
    arrays = {"W": rng.standard_normal((rows, 5)).astype(np.float32),
              "adam.W.m": rng.standard_normal((rows, 5)).astype(np.float32),
              "b": rng.standard_normal(rows).astype(np.float32)}
    write_checkpoint(tmp_path, arrays, {**META, "n_labels": rows}, step=1)
    if compressed:  # the format reads both kinds of npz
        np.savez_compressed(tmp_path / "model-1.npz", **arrays)
    return arrays


@pytest.mark.parametrize("compressed", [False, True])
def test_read_into_fills_a_column_block_in_pieces(tmp_path, monkeypatch, compressed):
    arrays = _saved(tmp_path, compressed)
    # three rows at a time: two whole pieces and a short last one
    monkeypatch.setattr(checkpoint, "READ_BYTES", 3 * 5 * 4)
    ck = read_checkpoint(tmp_path)
    B = np.full((7, 15), -1.0, np.float32)
    ck.read_into("W", B[:, 5:10])
    np.testing.assert_array_equal(B[:, 5:10], arrays["W"])
    assert (B[:, :5] == -1).all() and (B[:, 10:] == -1).all()
    C = np.full((7, 5), -1.0, np.float32)  # C-contiguous: read into straight, in pieces too
    ck.read_into("W", C)
    np.testing.assert_array_equal(C, arrays["W"])
    np.testing.assert_array_equal(ck.array("adam.W.m"), arrays["adam.W.m"])
    assert "b" in ck and "adam.W.v" not in ck
    with pytest.raises(CheckpointError, match=r"array 'W' is float32 \(7, 5\), the configuration"):
        ck.read_into("W", np.empty((7, 4), np.float32))
    with pytest.raises(CheckpointError, match="array 'adam.W.v' is missing"):
        ck.read_into("adam.W.v", B[:, :5])


def test_damaged_data_is_a_checkpoint_error_when_read(tmp_path):
    # members larger than zipfile's first read: the header check does not reach their ends
    _saved(tmp_path, rows=4000)
    npz = tmp_path / "model-1.npz"
    raw = bytearray(npz.read_bytes())
    raw[raw.index(b"\x93NUMPY") + 128 + 4 * 17_000] ^= 0xFF  # in W's data, its header intact
    npz.write_bytes(bytes(raw))
    ck = read_checkpoint(tmp_path)  # the headers are checked here, the data when it is read
    assert ck.array("b").shape == (4000,)
    with pytest.raises(CheckpointError, match=r"model-1.npz: array 'W' is unreadable .*CRC"):
        ck.read_into("W", np.empty((4000, 5), np.float32))
    with pytest.raises(CheckpointError, match=r"array 'W' is unreadable .*CRC"):
        ck.array("W")
