"""Train and apply PECOS XR-Linear in its own environment (run as a subprocess by the benchmarks).

    PEERS_PYTHON bench/xr_linear_worker.py IN.npz OUT.npz [--k 5] [--threads T]

libpecos pins older numpy/scipy than this project, so it lives in a separate virtual environment
and this script imports nothing from the project (:mod:`peer_io` beside it neither): it reads
the rows from ``IN.npz`` (L2-normalised by :mod:`bench.peers`, as PECOS recommends), trains
``XLinearModel`` on a hierarchical k-means indexer over PIFA label embeddings (PECOS's
defaults), and writes the top-k label ids (int64 [n, k], -1 padded), their scores and the
training seconds to ``OUT.npz``.
"""
import argparse
import time

import numpy as np

from peer_io import load_problem, save_topk


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inp")
    ap.add_argument("out")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=-1)
    a = ap.parse_args()
    from pecos.xmc import Indexer, LabelEmbeddingFactory
    from pecos.xmc.xlinear.model import XLinearModel

    Xtr, Ytr, Xte = load_problem(a.inp)  # sorted indices: PECOS refuses unsorted rows
    t0 = time.perf_counter()
    emb = LabelEmbeddingFactory.create(Ytr, Xtr, method="pifa")
    chain = Indexer.gen(emb, threads=a.threads)
    model = XLinearModel.train(Xtr, Ytr, C=chain, threads=a.threads)
    train_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    P = model.predict(Xte, only_topk=a.k, threads=a.threads).tocsr()
    predict_seconds = time.perf_counter() - t0
    ids = np.full((Xte.shape[0], a.k), -1, np.int64)
    scores = np.full((Xte.shape[0], a.k), -np.inf, np.float32)
    for r in range(Xte.shape[0]):  # output formatting of a peer, not our inference
        lo, hi = P.indptr[r], P.indptr[r + 1]
        order = np.argsort(-P.data[lo:hi], kind="stable")[:a.k]
        ids[r, :order.size] = P.indices[lo:hi][order]
        scores[r, :order.size] = P.data[lo:hi][order]
    save_topk(a.out, ids, scores, train_seconds, predict_seconds)


if __name__ == "__main__":
    main()
