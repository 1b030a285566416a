"""The serving bench: one row per setting, each with the settings it ran."""
import json

from bench.serving import main


def test_serving_bench_reports_each_setting(tmp_path):
    main(["--preset", "demo", "--n-train", "600", "--n-test", "200", "--epochs", "1",
          "--tables", "0,6", "--candidates", "0,16", "--single-reps", "3", "--batch-reps", "2",
          "--threads", "1", "--clients", "1,3", "--out", str(tmp_path / "serving")])
    report = json.loads((tmp_path / "serving.json").read_text())
    rows = report["rows"]
    # exact, then the default tables (as many as training's) and 6, at each number of candidates
    # (the default: four times what training's bounded tables could return, at most every label)
    L, bucket, n_labels = report["training_tables"], report["bucket_size"], report["n_outputs"]
    assert [(r["mode"], r["tables"], r["candidates"]) for r in rows] == [
        ("exact", None, None), ("lsh", L, min(4 * L * bucket, n_labels)), ("lsh", L, 16),
        ("lsh", 6, min(4 * L * bucket, n_labels)), ("lsh", 6, 16)]
    assert rows[0]["recall@5"] == 1.0
    assert all(0 <= r["recall@5"] <= 1 and r["single_p50_ms"] > 0 for r in rows)
    # the tables' ids (4 bytes a label a table) and the int8 copy: more with more tables
    assert rows[0]["serving_mib"] is None and L != 6
    assert (rows[1]["serving_mib"] > rows[3]["serving_mib"] > 0) == (L > 6)
    assert rows[1]["serving_mib"] == rows[2]["serving_mib"]  # candidates take no memory
    # single rows from 1 and 3 threads at once, each answered as in one call of every row
    for r in rows:
        assert [c["clients"] for c in r["clients"]] == [1, 3]
        assert all(c["answers_differing"] == 0 and c["queries_per_s"] > 0 for c in r["clients"])
