"""A fitted model's vectors in forms other tools read: ``.npy`` files, and nearest-neighbour
indexes where hnswlib or FAISS is installed.

A label's vector is its output row with its bias appended, ``[w, b]``, and a query's is its last
hidden layer with a 1 appended, ``[h, 1]``: their inner product is the model's score, so a
maximum-inner-product index over the label vectors ranks labels as the model does.
"""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np

from slide import ann

__all__ = ["export_embeddings", "label_vectors", "query_vectors"]


def label_vectors(model) -> np.ndarray:
    """float32 [n_outputs, hidden + 1]: each output row with the bias predictions rank by
    (:meth:`slide.base.TrainableMixin.serving_bias`; row r is label ``model.labels_.ids[r]``)."""
    return ann.label_vectors(model.host_params()["W"], model.serving_bias())


def query_vectors(model, X) -> np.ndarray:
    """float32 [n, hidden + 1]: each row's last hidden layer with a 1 appended."""
    return ann.query_vectors(model.embed(X))


def _write_npy(path, a) -> None:
    tmp = f"{path}.tmp.npy"
    np.save(tmp, a, allow_pickle=False)
    os.replace(tmp, path)


def export_embeddings(model, out, X=None, indexes: bool = True) -> dict:
    """Write ``out/labels.npy`` (:func:`label_vectors`), ``out/label_ids.npy`` (int64: the
    label id of each row), with ``X`` ``out/queries.npy`` (:func:`query_vectors`), and with
    ``indexes`` an inner-product index of the label vectors for each of hnswlib
    (``labels.hnsw``, load with ``hnswlib.Index(space="ip", dim=hidden + 1)``) and FAISS
    (``labels.faiss``, an exact ``IndexFlatIP``; ``faiss.read_index``) that is installed, its
    ids the rows'. ``out/embeddings.json`` says what was written. Returns that record."""
    os.makedirs(out, exist_ok=True)
    L = label_vectors(model)
    ids = np.asarray(model.labels_.ids, np.int64)
    _write_npy(os.path.join(out, "labels.npy"), L)
    _write_npy(os.path.join(out, "label_ids.npy"), ids)
    files = {"labels": "labels.npy", "label_ids": "label_ids.npy"}
    if X is not None:
        _write_npy(os.path.join(out, "queries.npy"), query_vectors(model, X))
        files["queries"] = "queries.npy"
    if indexes and importlib.util.find_spec("hnswlib") is not None:
        # mode="ann"'s graph, its label vectors being these
        W, b = L[:, :-1], L[:, -1]
        ann.LabelIndex(backend="hnswlib").build(W, b).save(os.path.join(out, "labels.hnsw"))
        files["hnswlib"] = "labels.hnsw"
    if indexes and importlib.util.find_spec("faiss") is not None:
        import faiss
        index = faiss.IndexFlatIP(L.shape[1])
        index.add(L)
        faiss.write_index(index, os.path.join(out, "labels.faiss"))
        files["faiss"] = "labels.faiss"
    record = {"files": files, "n_labels": int(model.n_labels_), "rows": int(L.shape[0]),
              "dim": int(L.shape[1]),
              "score": "labels[r] . queries[i] is the model's score of label label_ids[r] "
                       "for row i; index ids are rows"}
    with open(os.path.join(out, "embeddings.json"), "w") as fh:
        json.dump(record, fh, indent=1)
    return record
