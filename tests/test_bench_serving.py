"""The serving bench: one row per setting, each with the settings it ran."""
import json

import numpy as np
import pytest
import scipy.sparse as sp

from bench.serving import _side_by_side, main


def test_serving_bench_reports_each_setting(tmp_path):
    main(["--preset", "demo", "--n-train", "600", "--n-test", "200", "--epochs", "1",
          "--tables", "0,6", "--candidates", "0,16", "--single-reps", "3", "--batch-reps", "2",
          "--threads", "1", "--clients", "1,3", "--ann-backends", "clusters", "--ann-probe",
          "0.2,0.5,auto", "--out", str(tmp_path / "serving")])
    report = json.loads((tmp_path / "serving.json").read_text())
    rows = report["rows"]
    # exact, then the default tables (as many as training's) and 6, at each number of candidates
    # (the default: four times what training's bounded tables could return, at most every label)
    L, bucket, n_labels = report["training_tables"], report["bucket_size"], report["n_outputs"]
    assert [(r["mode"], r["tables"], r["candidates"]) for r in rows] == [
        ("exact", None, None), ("lsh", L, min(4 * L * bucket, n_labels)), ("lsh", L, 16),
        ("lsh", 6, min(4 * L * bucket, n_labels)), ("lsh", 6, 16), ("ann", None, None),
        ("ann", None, None), ("ann", None, None)]
    # "auto": the index's own probe; the refit trained on every row, so none held out: the default
    assert [(r["backend"], r["probe"], r["chosen"]) for r in rows[5:]] == [
        ("clusters", 0.2, False), ("clusters", 0.5, False), ("clusters", 0.05, True)]
    assert rows[7]["calibration"] is None
    assert rows[0]["recall@5"] == 1.0
    assert all(0 <= r["recall@5"] <= 1 and r["single_p50_ms"] > 0 for r in rows)
    # the tables' ids (4 bytes a label a table) and the int8 copy: more with more tables
    assert rows[0]["serving_mib"] is None and L != 6
    assert (rows[1]["serving_mib"] > rows[3]["serving_mib"] > 0) == (L > 6)
    assert rows[1]["serving_mib"] == rows[2]["serving_mib"]  # candidates take no memory
    # each setting timed in turns with the exact mode, its speedup against those turns
    for r in rows[1:]:
        assert r["exact_single_p50_ms"] > 0 and r["exact_batch128_p50_ms"] > 0
        assert np.isclose(r["single_speedup"], r["exact_single_p50_ms"] / r["single_p50_ms"])
        assert np.isclose(r["batch_speedup"], r["exact_batch128_p50_ms"] / r["batch128_p50_ms"])
    assert rows[5]["recall@5"] <= rows[6]["recall@5"]  # a larger share finds as much or more
    # single rows from 1 and 3 threads at once, each answered as in one call of every row
    for r in rows:
        assert [c["clients"] for c in r["clients"]] == [1, 3]
        assert all(c["answers_differing"] == 0 and c["queries_per_s"] > 0 for c in r["clients"])


def test_side_by_side_takes_turns_each_entry_on_rows_of_its_own():
    """Every turn gives each entry in order ``turn`` queries of ``batch`` rows after its
    untimed ``prepare``, at the same places shifted to a part of the rows of its own."""
    rows = sp.csr_matrix(np.arange(40, dtype=np.float32)[:, None])
    calls = []

    def entry(name):
        return (lambda: calls.append(("prepare", name)),
                lambda X: calls.append((name, tuple(X.toarray().ravel().astype(int)))))

    out = _side_by_side([entry("a"), entry("b"), entry("c")], rows, 2, 6,
                        np.random.default_rng(0), turn=3)
    assert len(out) == 3 and all(p50 >= 0 and p99 >= p50 for p50, p99 in out)
    assert [c[0] for c in calls] == (["prepare"] + ["a"] * 3 + ["prepare"] + ["b"] * 3 +
                                     ["prepare"] + ["c"] * 3) * 2
    queries = [c for c in calls if c[0] != "prepare"]
    assert all(len(q) == 2 and q[1] == q[0] + 1 for _, q in queries)
    span, stride = 39, 13
    for turn in range(2):
        a, b, c = (queries[9 * turn + 3 * j:9 * turn + 3 * j + 3] for j in range(3))
        for x, y, z in zip(a, b, c):
            assert y[1][0] == (x[1][0] + stride) % span and z[1][0] == (x[1][0] + 2 * stride) % span


def test_faiss_inverted_files_probing_every_list_find_the_exact_top_k(tmp_path):
    """The FAISS peers of the clusters: probing every list, the float32 lists find the exact
    top-k, and the product codes, their best ``PQ_REFINE`` k rescored in float32, nearly all
    of it (the padding to whole codes changes no inner product)."""
    pytest.importorskip("faiss")
    main(["--preset", "demo", "--n-train", "600", "--n-test", "200", "--epochs", "1",
          "--tables", "0", "--single-reps", "2", "--batch-reps", "1", "--threads", "1",
          "--ann-backends", "faiss-ivf,faiss-ivfpq", "--ann-probe", "0.05,1",
          "--out", str(tmp_path / "serving")])
    rows = json.loads((tmp_path / "serving.json").read_text())["rows"]
    ann = {(r["backend"], r["probe"]): r for r in rows if r["mode"] == "ann"}
    assert sorted(ann) == [("faiss-ivf", 0.05), ("faiss-ivf", 1.0), ("faiss-ivfpq", 0.05),
                           ("faiss-ivfpq", 1.0)]
    assert ann["faiss-ivf", 1.0]["recall@5"] >= 0.99
    assert ann["faiss-ivfpq", 1.0]["recall@5"] >= 0.9
    for backend in ("faiss-ivf", "faiss-ivfpq"):
        assert ann[backend, 0.05]["recall@5"] < ann[backend, 1.0]["recall@5"]
        assert ann[backend, 1.0]["serving_mib"] > 0 and ann[backend, 1.0]["single_p50_ms"] > 0
