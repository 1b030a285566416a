"""Serving: exact top-k against LSH top-k, as recall and latency, for a recommender to pick its
point on the curve.

    python -m bench.serving --preset demo --tables 0,24,48,96 --threads 2

Trains the engine with its defaults on the preset (or loads ``--model``), then for exact scoring
and for LSH serving with each number of tables (``set_serving(N)``; 0: its default, as many as
training's) and each number of ``--candidates`` scored a row (0: its default): recall@k against
the exact top-k (|LSH top-k ∩ exact top-k| / k), P@1 and P@k, and per-query latency p50 and p99
for single rows and for batches of 128 (medians of repeated timed calls after a warm-up), and
for LSH the memory it holds beside the model (its tables and the int8 copy by label). With
``--clients 1,2,4``, single rows also come from that many Python threads at once, as a
recommender's pool of workers sends them: queries/s over the run, p50 and p99 latency, and how
many answers differ from the same rows answered in one call (none: each query borrows its own
scratch). With ``--ann-backends clusters,faiss-ivf,faiss-ivfpq,hnswlib,faiss``, the same for
``mode="ann"``: the engine's clusters at each share of the labels in ``--ann-probe``, FAISS's
IndexIVFFlat and IndexIVFPQFastScan with as many lists probing the same share (peers, asked
directly), and an HNSW
graph from each library at each query beam in ``--ann-ef``; with each index's build seconds
(the first query's, compile included) and size. ``--data TRAIN --test TEST`` reads files instead of
a preset; ``--save-model DIR`` keeps the trained model for ``--model``. Writes ``OUT.json`` and
prints a table.
"""
from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from bench.common import dataset, machine, write_json


def _side_by_side(entries, rows, batch, reps, rng, turn=1):
    """p50 and p99 latency (ms) over ``reps`` queries of ``batch`` rows for each ``(prepare,
    fn)`` of ``entries``, the entries taking turns of ``turn`` queries each, so that the
    machine's slow spells fall on all of them alike. A turn long enough for an entry to find
    its own data in the caches (single rows: 20 queries) measures it as a server answering
    only that mode would run, not in the wake of another's memory traffic; each entry's
    queries come from its own part of ``rows``, so none finds another's rows in the caches.
    ``prepare()`` (untimed) sets the shared index's knob for its entry."""
    times = [[] for _ in entries]
    span = rows.shape[0] - batch + 1
    stride = max(1, span // len(entries))
    for _ in range(-(-reps // turn)):
        starts = rng.integers(0, span, turn)
        for j, (prepare, fn) in enumerate(entries):
            prepare()
            for lo in starts:
                start = (int(lo) + j * stride) % span
                query = rows[start:start + batch]  # the caller's cost, not the query's
                t0 = time.perf_counter()
                fn(query)
                times[j].append(time.perf_counter() - t0)
    return [(float(np.percentile(t, 50) * 1e3), float(np.percentile(t, 99) * 1e3)) for t in times]


def _clients(fn, rows, clients, queries, rng, want):
    """``queries`` single rows of ``rows`` (drawn at random) from ``clients`` Python threads at
    once: queries/s over the run, p50 and p99 latency (ms), and how many answers differ from
    ``want`` (the ids of every row, answered in one call)."""
    picks = rng.integers(0, rows.shape[0], queries)
    times = [[] for _ in range(clients)]
    wrong = [0] * clients
    start = threading.Barrier(clients + 1)

    def work(c):
        start.wait()
        for i in picks[c::clients]:
            query = rows[i:i + 1]
            t0 = time.perf_counter()
            ids = fn(query)[0]
            times[c].append(time.perf_counter() - t0)
            wrong[c] += not np.array_equal(ids[0], want[i])

    threads = [threading.Thread(target=work, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    lat = np.concatenate(times)
    return {"clients": clients, "queries_per_s": float(queries / seconds),
            "p50_ms": float(np.percentile(lat, 50) * 1e3),
            "p99_ms": float(np.percentile(lat, 99) * 1e3), "answers_differing": int(sum(wrong))}


#: ann backends whose knob is the share of the labels scored (the others': the query beam ef)
PROBED = ("clusters", "faiss-ivf", "faiss-ivfpq")
#: FAISS's inverted files, built and asked here (the others through ``set_ann``)
FAISS_IVF = ("faiss-ivf", "faiss-ivfpq")
#: FAISS's product-quantized lists: 4-bit codes of two dimensions each, the best this many
#: times k rescored in float32
PQ_DIMS, PQ_REFINE = 2, 16


def _padded(V, width):
    if V.shape[1] == width:  # no copy for the float32 lists, whose width is the vectors'
        return V
    out = np.zeros((V.shape[0], width), np.float32)
    out[:, :V.shape[1]] = V
    return out


def _faiss_ivf(model, backend):
    """FAISS's inverted file over the same label vectors, with as many lists as the engine's
    clusters (a peer of backend="clusters"): ``"faiss-ivf"`` scans its lists in float32,
    ``"faiss-ivfpq"`` in 4-bit product codes by SIMD table lookups (``IndexIVFPQFastScan``,
    FAISS's fastest list scan), the ``PQ_REFINE`` k best rescored in float32."""
    import faiss
    from slide.clusters import cluster_count
    from slide.export import label_vectors
    V = label_vectors(model)
    nlist = cluster_count(V.shape[0])
    t0 = time.perf_counter()
    if backend == "faiss-ivf":
        width = V.shape[1]
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(width), width, nlist,
                                   faiss.METRIC_INNER_PRODUCT)
        mib = V.nbytes / 2**20 + 8 * V.shape[0] / 2**20
    else:
        width = -(-V.shape[1] // (2 * PQ_DIMS)) * 2 * PQ_DIMS  # an even number of codes
        V = _padded(V, width)
        pq = faiss.IndexIVFPQFastScan(faiss.IndexFlatIP(width), width, nlist, width // PQ_DIMS,
                                      4, faiss.METRIC_INNER_PRODUCT)
        index = faiss.IndexRefineFlat(pq)
        index.k_factor = PQ_REFINE
        mib = V.nbytes / 2**20 + (width // PQ_DIMS / 2 + 8) * V.shape[0] / 2**20
    index.train(V)
    index.add(V)
    return {"backend": backend, "index": index, "nlist": nlist, "width": width,
            "seconds": time.perf_counter() - t0, "mib": mib}


def _faiss_ivf_predict(model, built, probe, k):
    import faiss
    from slide.export import query_vectors
    faiss.omp_set_num_threads(model.threads)
    index, nprobe = built["index"], max(1, round(probe * built["nlist"]))
    pq = built["backend"] == "faiss-ivfpq"
    params = None if pq else faiss.SearchParametersIVF(nprobe=nprobe)
    ids = np.asarray(model.labels_.ids)

    def predict(X):
        if pq:
            faiss.downcast_index(index.base_index).nprobe = nprobe
            # a single row's fast scan on two threads took 7.7 ms, on one 0.4 ms
            faiss.omp_set_num_threads(1 if X.shape[0] == 1 else model.threads)
        _, rows = index.search(_padded(query_vectors(model, X), built["width"]), k,
                               params=params)
        return np.where(rows >= 0, ids[np.maximum(rows, 0)], -1), None
    return predict


def _print(row, k):
    mode, probed = row["mode"], row["probe"] is not None
    setting = (f"{row['backend']} {'probe' if probed else 'ef'}="
               f"{row['probe'] if probed else row['ef']:g}"
               + (" (chosen)" if row.get("chosen") else "") if mode == "ann" else
               f"tables={str(row['tables']):>4s} candidates={str(row['candidates']):>6s}")
    print(f"{mode:5s} {setting}  recall@{k} {row[f'recall@{k}']:.3f}  P@1 {row['P@1']:.3f}  "
          f"single p50 {row['single_p50_ms']:.2f} ms p99 {row['single_p99_ms']:.2f} ms  "
          f"batch of 128 p50 {row['batch128_p50_ms']:.1f} ms p99 {row['batch128_p99_ms']:.1f} ms"
          + (f"  {row['serving_mib']:.0f} MiB" if row["serving_mib"] is not None else "")
          + (f"  built in {row['build_seconds']:.1f} s" if row["build_seconds"] is not None else "")
          + (f"  ({row['single_speedup']:.1f}x / {row['batch_speedup']:.1f}x the exact mode of "
             f"the same turns: {row['exact_single_p50_ms']:.2f} / {row['exact_batch128_p50_ms']:.1f}"
             " ms)" if "single_speedup" in row else ""), flush=True)
    for c in row["clients"]:
        print(f"      {c['clients']} clients: {c['queries_per_s']:.0f} queries/s, p50 "
              f"{c['p50_ms']:.2f} ms p99 {c['p99_ms']:.2f} ms, {c['answers_differing']} "
              "answers differing", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo")
    p.add_argument("--n-train", type=int, default=None)
    p.add_argument("--n-test", type=int, default=2000)
    p.add_argument("--model", default=None, help="a saved model instead of training one")
    p.add_argument("--save-model", default=None, help="save the trained model here")
    p.add_argument("--data", default=None, metavar="TRAIN", help="a training file (not a preset)")
    p.add_argument("--test", default=None, metavar="TEST", help="its test file")
    p.add_argument("--ann-backends", default="",
                   help="mode='ann' backends to try: clusters,hnswlib,faiss; and faiss-ivf, "
                        "faiss-ivfpq: FAISS's IndexIVFFlat, IndexIVFPQFastScan (4-bit codes, "
                        "float32 refine) with as many lists as the engine's clusters (bench only)")
    p.add_argument("--ann-ef", default="32,64,128,256",
                   help="HNSW query beams to try; auto: the one set_ann chooses")
    p.add_argument("--ann-clusters", type=int, default=None,
                   help="the clusters backend's clusters (default: its rule over the labels)")
    p.add_argument("--ann-probe", default="0.05,0.1,0.2",
                   help="shares of the labels the clusters (and faiss-ivf, faiss-ivfpq) score, "
                        "to try; auto: the one set_ann chooses")
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default: the model's rule)")
    p.add_argument("--tables", default="0,24,48,96", help="serving tables to try (0: the default)")
    p.add_argument("--candidates", default="0",
                   help="most candidates scored a row, for each number of serving tables (0: default)")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--single-reps", type=int, default=200)
    p.add_argument("--batch-reps", type=int, default=20)
    p.add_argument("--turn", type=int, default=20,
                   help="single rows each setting answers in a row before the next takes its turn")
    p.add_argument("--clients", default="",
                   help="numbers of Python threads sending single rows at once (e.g. 1,2,4)")
    p.add_argument("--out", default="bench/results/serving")
    args = p.parse_args(argv)
    from slide.ann import DEFAULT_EF, DEFAULT_PROBE
    from slide.metrics import evaluate, recall_against
    from slide.estimator import SlideClassifier
    if args.data:
        from slide.data import read_dataset, shuffle_rows
        Xtr, Ytr = read_dataset(args.data)
        Xte, Yte = read_dataset(args.test, n_features=Xtr.shape[1], n_labels=Ytr.shape[1])
        Xte, Yte = shuffle_rows(Xte, Yte, seed=0, n=min(args.n_test, Xte.shape[0]))
    else:
        Xtr, Ytr, Xte, Yte = dataset(args.preset, args.n_train, args.n_test, 0)
    if args.model:
        model = SlideClassifier.load(args.model).set_params(threads=args.threads)
    else:
        model = SlideClassifier(threads=args.threads, seed=0, epochs=args.epochs).fit(Xtr, Ytr)
        if args.save_model:
            model.save(args.save_model)
    k = args.k
    exact_ids = model.predict_topk(Xte, k)[0]
    rows = []
    rng = np.random.default_rng(0)
    tables_tried = [int(t) for t in args.tables.split(",")]
    candidates_tried = [int(c) for c in args.candidates.split(",")]
    clients_tried = [int(c) for c in args.clients.split(",") if c]
    settings = [("exact", None, None)] + [("lsh", t, c) for t in tables_tried for c in candidates_tried
                                          if model.tables_ is not None]
    # (mode, backend or tables, its knob: ef, probe or candidates)
    for b in args.ann_backends.split(","):
        knobs = args.ann_probe if b in PROBED else args.ann_ef
        # "auto": the probe or beam the index chose on the model's held-out rows
        settings += [("ann", b, None if v == "auto" else float(v)) for v in knobs.split(",")
                     if b and not (v == "auto" and b in FAISS_IVF)]
    built = {}
    exact_entry = None
    group, group_key = [], None  # the settings that share one built index, timed side by side

    def time_group():
        """Latencies of the group's settings taken in turns with the exact mode's (its own
        from the first group), and their speedups against the exact mode of the same turns."""
        entries = [exact_entry] + [e for _, e in group if e is not exact_entry]
        single = _side_by_side(entries, Xte, 1, args.single_reps, rng, turn=args.turn)
        batch = _side_by_side(entries, Xte, 128, args.batch_reps, rng)
        timed = [r for r, e in group if e is not exact_entry]
        for row, (s1, s99), (b1, b99) in zip(timed, single[1:], batch[1:]):
            row.update(single_p50_ms=s1, single_p99_ms=s99, batch128_p50_ms=b1,
                       batch128_p99_ms=b99, exact_single_p50_ms=single[0][0],
                       exact_batch128_p50_ms=batch[0][0],
                       single_speedup=single[0][0] / s1, batch_speedup=batch[0][0] / b1)
        if "single_p50_ms" not in rows[0]:
            rows[0].update(single_p50_ms=single[0][0], single_p99_ms=single[0][1],
                           batch128_p50_ms=batch[0][0], batch128_p99_ms=batch[0][1])
            _print(rows[0], k)
        for row in timed:
            _print(row, k)
        group.clear()

    for mode, tables, candidates in settings:
        key = (mode, tables, None if mode == "ann" else candidates)
        # before this setting replaces the index the group shares; the exact mode's own
        # figures come from the first group's turns
        if group and key != group_key and group_key[0] != "exact":
            time_group()
        group_key = key
        if mode == "lsh":
            model.set_serving(tables or None, candidates or None)
        predict = (lambda X, m=mode: model.predict_topk(X, k, mode=m))
        if mode == "ann" and tables in FAISS_IVF:
            if built.get("backend") != tables:
                built = _faiss_ivf(model, tables)
            predict = _faiss_ivf_predict(model, built, candidates, k)
        elif mode == "ann":
            if built.get("backend") != tables:
                model.set_ann(backend=tables, clusters=args.ann_clusters)
                t0 = time.perf_counter()
                model.predict_topk(Xte[:1], k, mode="ann")
                built = {"backend": tables, "seconds": time.perf_counter() - t0,
                         "mib": model.server_.label_index().nbytes / 2**20}
        if mode == "ann" and tables not in FAISS_IVF:
            index = model.server_.label_index()  # the same index, another beam or share

            def prepare(index=index, knob=candidates, probed=tables in PROBED):
                name = "probe" if probed else "ef"
                if knob is None:  # the index's own choice (its default without held-out rows)
                    chosen = index.calibration or {name: DEFAULT_PROBE if probed else DEFAULT_EF}
                    setattr(index, name, chosen[name])
                else:
                    setattr(index, name, knob if probed else int(knob))
        else:
            def prepare():
                pass
        prepare()
        ids = predict(Xte)[0]  # also the warm-up
        res = evaluate(Yte, ids, k)
        lsh = mode == "lsh"
        # what LSH serving holds beside the model: its tables and the int8 copy by label
        # (slide.screen.Int8Labels: a byte a weight and 16 a label)
        W = model.params_["W"]
        extra = model.serving_tables_.nbytes + W.shape[0] * (W.shape[1] + 16) if lsh else None
        ann = mode == "ann"
        probed = ann and tables in PROBED
        row = {"mode": mode, "tables": model.serving_tables_.config.L if lsh else None,
               "candidates": model.serving_candidates_ if lsh else None,
               "serving_mib": extra / 2**20 if lsh else built["mib"] if ann else None,
               "backend": tables if ann else None,
               "ef": (index.ef if candidates is None else candidates) if ann and not probed
               else None,
               "probe": (index.probe if candidates is None else candidates) if probed else None,
               "chosen": ann and candidates is None,
               "calibration": index.calibration if ann and candidates is None else None,
               "build_seconds": built["seconds"] if ann else None,
               f"recall@{k}": recall_against(ids, exact_ids), "P@1": res["P@1"],
               f"P@{k}": res[f"P@{k}"]}
        row["clients"] = [_clients(lambda X, f=predict, p=prepare: (p(), f(X))[1], Xte, c,
                                   args.single_reps, rng, ids) for c in clients_tried]
        rows.append(row)
        entry = (prepare, predict)
        if mode == "exact":
            exact_entry = entry
        group.append((row, entry))
    time_group()
    write_json(args.out + ".json", {"machine": machine(), "args": vars(args),
                                    "n_labels": model.n_labels_,
                                    "n_outputs": model.n_outputs_,
                                    "training_tables": model.resolved_["tables"]["L"] if model.tables_ else None,
                                    "bucket_size": model.resolved_["tables"]["bucket_size"] if model.tables_ else None,
                                    "rows": rows})


if __name__ == "__main__":
    main()
