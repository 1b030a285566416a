"""Train and apply Parabel in the peers environment (run as a subprocess by the benchmarks).

    PEERS_PYTHON bench/parabel_worker.py IN.npz OUT.npz --train-file TRAIN.txt [--k 5] [--threads T]

Parabel (Prabhu et al., WWW 2018) through omikuji, a Rust implementation of partitioned label
trees whose default settings are Parabel's: 3 trees of balanced 2-means splits over the labels'
mean feature rows until a cluster holds fewer than 100 labels, a linear classifier at every
node (hinge loss, C = 1, weights under 0.1 pruned), and a beam of 10 at prediction. Like
``xr_linear_worker.py`` it imports nothing from the project (:mod:`peer_io` beside it
neither). omikuji trains from a file: :mod:`bench.peers` writes the training rows in the
Extreme Classification Repository's format (``--train-file``) beside ``IN.npz``, both
L2-normalised. The worker trains with omikuji's defaults and writes the top-k label ids
(int64 [n, k], -1 padded), their scores and the training seconds to ``OUT.npz``.
"""
import argparse
import time

import numpy as np

from peer_io import load_problem, save_topk


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("inp")
    ap.add_argument("out")
    ap.add_argument("--train-file", required=True, help="the training rows of IN.npz, XMC format")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0: omikuji's choice")
    a = ap.parse_args()
    import omikuji

    _, _, Xte = load_problem(a.inp)
    t0 = time.perf_counter()
    model = omikuji.Model.train_on_data(a.train_file, omikuji.Model.default_hyper_param(),
                                        n_threads=a.threads or None)
    train_seconds = time.perf_counter() - t0
    model.init_prediction_thread_pool(a.threads)
    ids = np.full((Xte.shape[0], a.k), -1, np.int64)
    scores = np.full((Xte.shape[0], a.k), -np.inf, np.float32)
    t0 = time.perf_counter()
    for r in range(Xte.shape[0]):  # omikuji's Python API predicts one row at a time
        lo, hi = Xte.indptr[r], Xte.indptr[r + 1]
        pairs = list(zip(Xte.indices[lo:hi].tolist(), Xte.data[lo:hi].tolist()))
        top = model.predict(pairs, top_k=a.k)
        for j, (label, score) in enumerate(top):
            ids[r, j], scores[r, j] = label, score
    predict_seconds = time.perf_counter() - t0
    save_topk(a.out, ids, scores, train_seconds, predict_seconds)


if __name__ == "__main__":
    main()
