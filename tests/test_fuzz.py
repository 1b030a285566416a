"""Random mutations of valid data files and checkpoints: the reader and ``load`` must answer with
a clean error (``DataFormatError``, ``CheckpointError``) or a correct result, never a crash.

A short budget runs here; ``python -m bench.fuzz`` runs the same properties for long.
"""
import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slide.checkpoint import CheckpointError
from slide.data import DataFormatError, read_dataset
from slide.estimator import SlideClassifier

EXAMPLES = int(os.environ.get("SLIDE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 100,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

VALID = (b"4 6 3\n0,2 0:1.5 3:2\n1 1:0.5 5:1e-3\n 2:4\n2,1 0:1 4:7.25\n")

# one mutation: overwrite, insert or delete a byte run, or truncate
mutation = st.tuples(st.sampled_from(["set", "insert", "delete", "truncate"]),
                     st.integers(0, 10 ** 6), st.binary(min_size=1, max_size=4))


def _mutate(data: bytes, muts) -> bytes:
    b = bytearray(data)
    for kind, pos, chunk in muts:
        pos %= max(len(b), 1)
        if kind == "set":
            b[pos:pos + len(chunk)] = chunk
        elif kind == "insert":
            b[pos:pos] = chunk
        elif kind == "delete":
            del b[pos:pos + len(chunk)]
        else:
            del b[pos:]
    return bytes(b)


# bytes the format is made of, so that mutations often stay close to valid
alphabet_chunk = st.lists(st.sampled_from(list(b"0123456789:, \n.-e+\t") + [0xEF, 0xBB, 0xBF, 0xFF]),
                          min_size=1, max_size=4).map(bytes)
format_mutation = st.tuples(st.sampled_from(["set", "insert", "delete", "truncate"]),
                            st.integers(0, 10 ** 6), alphabet_chunk)


@FUZZ
@given(st.lists(st.one_of(mutation, format_mutation), min_size=1, max_size=4))
def test_reader_on_mutated_files(tmp_path_factory, muts):
    path = tmp_path_factory.mktemp("fuzz") / "d.txt"
    path.write_bytes(_mutate(VALID, muts))
    try:
        X, Y = read_dataset(str(path))
    except DataFormatError:
        return
    assert X.shape[0] == Y.shape[0] > 0
    assert X.dtype == np.float32 and np.isfinite(X.data).all()
    assert X.indices.min(initial=0) >= 0 and X.indices.max(initial=-1) < X.shape[1]
    assert Y.indices.min(initial=0) >= 0 and Y.indices.max(initial=-1) < Y.shape[1]
    assert (np.diff(X.indptr) >= 0).all() and (np.diff(Y.indptr) >= 0).all()


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tiny_data):
    X, Y = tiny_data[0][:300], tiny_data[1][:300]
    path = tmp_path_factory.mktemp("ck") / "model"
    SlideClassifier(hidden=(8,), sparsity=0.2, epochs=1, seed=0).fit(X, Y).save(path)
    return path, X[:5]


def _json_mutation():
    keys = st.sampled_from(["format_version", "arrays", "n_features", "n_labels", "n_train", "step",
                            "epoch", "config", "samples_seen", "learning_rate", "hash_seed",
                            "next_rehash", "rehash_interval", "next_rebuild", "preprocessing",
                            "early_stopping", "history"])
    values = st.one_of(st.none(), st.integers(-5, 10 ** 12), st.floats(allow_nan=True),
                       st.text(max_size=5), st.lists(st.integers(0, 3), max_size=3),
                       st.just({}), st.just("/etc/passwd"), st.just("../model-1.npz"))
    return st.tuples(st.sampled_from(["drop", "set"]), keys, values)


@FUZZ
@given(json_muts=st.lists(_json_mutation(), max_size=3),
       npz_muts=st.lists(mutation, max_size=3))
def test_load_on_mutated_checkpoints(tmp_path_factory, saved_model, json_muts, npz_muts):
    src, X = saved_model
    path = tmp_path_factory.mktemp("mut") / "model"
    shutil.copytree(src, path)
    meta = json.loads((path / "config.json").read_text())
    for kind, key, value in json_muts:
        if kind == "drop":
            meta.pop(key, None)
        else:
            meta[key] = value
    (path / "config.json").write_text(json.dumps(meta))
    npz = next(p for p in path.iterdir() if p.suffix == ".npz")
    npz.write_bytes(_mutate(npz.read_bytes(), npz_muts))
    try:
        model = SlideClassifier.load(path)
    except CheckpointError:
        return
    ids, scores = model.predict_topk(X, 3)
    assert ids.shape == (5, 3) and (ids < model.n_labels_).all()
