"""The label shards' parts that run in one process: the rows a shard starts from, its settings,
the manifest and its errors, the memory check's advice; the collectives on 2 ranks are in
tests/test_distributed.py."""
import json
import os

import numpy as np
import pytest
import scipy.sparse as sp

from slide import resources
from slide.checkpoint import CheckpointError
from slide.config import SlideConfig, init_parameters, resolve
from slide.estimator import SlideClassifier
from slide.resources import ModelTooLargeError, parse_bytes
from slide.shards import ShardPlace, read_manifest, shard_bounds, shard_settings


def test_a_shard_starts_as_its_rows_of_the_whole_layer():
    whole = init_parameters((8,), 30, 70_000, 5, None, 0.1)
    for lo, hi in [(0, 10), (65_530, 65_545), (69_990, 70_000)]:
        part = init_parameters((8,), 30, hi - lo, 5, None, 0.1, first_row=lo)
        np.testing.assert_array_equal(part["W"], whole["W"][lo:hi])
        np.testing.assert_array_equal(part["W0"], whole["W0"])


def test_shards_split_the_rows_and_the_active_set():
    assert [shard_bounds(10, 3, i) for i in range(3)] == [(0, 3), (3, 6), (6, 10)]
    c = SlideConfig()
    r = resolve(c, 5000, 200_000, 50_000, 0.1, None, 3.0)
    s = shard_settings(c, r, 4, 50_000)
    assert (s["lsh_cap"], s["pool"]) == (-(-r["lsh_cap"] // 4), -(-r["pool"] // 4))
    t, ts = r["tables"], s["tables"]
    # the same hash functions, buckets for a quarter of the rows
    assert (ts["K"], ts["L"], ts["range_pow"]) == (t["K"], t["L"], t["range_pow"])
    assert ts["bucket_size"] < t["bucket_size"]
    assert shard_settings(c, r, 1, 200_000) is r
    fixed = SlideConfig(bucket_size=48)
    assert shard_settings(fixed, resolve(fixed, 5000, 200_000, 50_000, 0.1, None, 3.0), 4,
                          50_000)["tables"]["bucket_size"] == 48


def test_memory_sizes_parse_and_a_limit_refuses_with_the_shards_that_fit(monkeypatch):
    assert parse_bytes("12G") == 12 * 2 ** 30 and parse_bytes("512m") == 512 * 2 ** 20
    assert parse_bytes("3.5e9") == 3_500_000_000 and parse_bytes("1GiB") == 2 ** 30
    for bad in ("lots", "-3G", "0"):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)
    n, L = 20_000, 20_000  # every label a positive: the output layer is most of the model
    X = sp.random(n, 50, density=0.1, format="csr", random_state=0, dtype=np.float32)
    Y = sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), np.arange(n) % L)), shape=(n, L))
    settings = dict(hidden=(256,), epochs=1, early_stopping=False, threads=1)
    model = SlideClassifier(**settings)
    model.initialize(X, Y)
    need = resources.model_memory_bytes(model.resolved_, 50, model.n_outputs_, 1,
                                        features_per_row=model.features_per_row_)["total"]
    monkeypatch.setenv(resources.MEMORY_LIMIT_ENV, str(int(need * 0.7)))
    with pytest.raises(ModelTooLargeError, match=r"over 2 MPI ranks.*mpiexec -n 2 slide train "
                                                 r".* --distributed labels"):
        SlideClassifier(**settings).fit(X, Y)
    monkeypatch.setenv(resources.MEMORY_LIMIT_ENV, str(int(need * 0.3)))
    with pytest.raises(ModelTooLargeError, match="over 4 MPI ranks"):
        SlideClassifier(**settings).fit(X, Y)
    monkeypatch.setenv(resources.MEMORY_LIMIT_ENV, "1K")
    with pytest.raises(ModelTooLargeError, match="the hidden layers alone are too large"):
        SlideClassifier(**settings).fit(X, Y)


def _tiny_model():
    rng = np.random.default_rng(1)
    X = sp.random(120, 20, density=0.2, format="csr", random_state=1, dtype=np.float32)
    Y = sp.csr_matrix((np.ones(120, np.float32), (np.arange(120), rng.integers(0, 6, 120))),
                      shape=(120, 6))
    return SlideClassifier(hidden=(8,), epochs=1, early_stopping=False, threads=1).fit(X, Y)


def test_a_manifest_names_complete_shards_and_a_shard_alone_is_refused(tmp_path):
    model = _tiny_model()
    model.save(tmp_path / "step-3" / "shard-0000")
    (tmp_path / "shards.json").write_text(json.dumps({"shards": ["step-3/shard-0000"], "rows": [0, 6]}))
    assert read_manifest(tmp_path)["shards"] == ["step-3/shard-0000"]
    for manifest, says in [({"shards": ["step-3/shard-0001"], "rows": [0, 6]}, "is missing"),
                           ({"shards": ["../x/shard-0000"], "rows": [0, 6]}, "is missing"),
                           ({"shards": ["step-3/shard-0000"], "rows": [6, 0]}, "do not match"),
                           ({"rows": [0, 6]}, "not a shard manifest")]:
        (tmp_path / "shards.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match=says):
            read_manifest(tmp_path)
    # a plain model is no shard, and a shard's files are not a model of their own
    with pytest.raises(CheckpointError, match="not a shard"):
        SlideClassifier.load(tmp_path / "step-3" / "shard-0000", shards=ShardPlace(0, 2))
    meta = tmp_path / "step-3" / "shard-0000" / "config.json"
    doc = json.loads(meta.read_text())
    doc["label_shard"] = {"index": 1, "count": 2}
    meta.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="one shard of a label-sharded checkpoint"):
        SlideClassifier.load(tmp_path / "step-3" / "shard-0000")
    with pytest.raises(CheckpointError, match="shard 1 of 2, loaded by rank 0 of 2"):
        SlideClassifier.load(tmp_path / "step-3" / "shard-0000", shards=ShardPlace(0, 2))
    assert not os.path.exists(tmp_path / "model")
