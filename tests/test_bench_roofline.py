"""The roofline's counts of bytes and operations per sample, against hand-computed cases."""
import math

import numpy as np
import pytest

from bench.roofline import bytes_per_sample, flops_per_sample

# a small sampled configuration: batch 4, one hidden layer of 8, 16 LSH + 32 shared outputs
RESOLVED = {"batch_size": 4, "hidden": [8], "lsh_cap": 16, "pool": 32,
            "tables": {"L": 3, "bucket_size": 5}, "rehash_every": 64}


def distinct(n, draws):
    return n * (1 - math.exp(-draws / n))


def test_flops_by_phase_hand_computed():
    f = flops_per_sample(RESOLVED, n_features=100, n_labels=1000, nnz=6, labels=2)
    assert f["forward_hidden"] == 2 * 6 * 8
    alone = 4 * 16 * math.exp(-(4 * 18 + 32 - 1) / 1000)  # Adam's step in the output step
    pool_only = 32 * math.exp(-4 * 18 / 1000)  # Adam's step with the pool's products
    assert f["select+output"] == pytest.approx(3 * 2 * 18 * 8 + 10 * alone * 9 / 4)  # 16 + 2 rows
    # three products over the pool and the batch's labels (8 draws of 1000, less those the
    # pool holds already)
    columns = 32 + distinct(1000, 4 * 2) * (1 - 32 / 1000)
    assert f["pool_matmul"] == pytest.approx(3 * 2 * columns * 8 + 10 * pool_only * 9 / 4)
    in_alone = 4 * 6 * math.exp(-(4 * 6 - 1) / 100)  # features of one sample's row alone
    assert f["backward_hidden"] == pytest.approx(2 * 6 * 8 + 10 * in_alone * 8 / 4)
    u_out, u_in = distinct(1000, 4 * 18 + 32), distinct(100, 4 * 6)
    assert f["adam"] == pytest.approx(10 * ((u_out - alone - pool_only) * 9 + (u_in - in_alone) * 8) / 4)
    assert f["rehash"] == 0.0
    assert f["total"] == pytest.approx(sum(v for k, v in f.items() if k != "total"))


def test_flops_count_the_hidden_stack_forward_once_and_backward_twice():
    deep = dict(RESOLVED, hidden=[8, 4])
    f0 = flops_per_sample(RESOLVED, 100, 1000, 6, 2)
    f1 = flops_per_sample(deep, 100, 1000, 6, 2)
    assert f1["forward_hidden"] - f0["forward_hidden"] == 2 * 8 * 4
    assert f1["backward_hidden"] - f0["backward_hidden"] == pytest.approx(4 * 8 * 4)
    # the output layer sees the last width
    columns = 32 + distinct(1000, 4 * 2) * (1 - 32 / 1000)
    assert f1["pool_matmul"] == pytest.approx(3 * 2 * columns * 4
                                              + 10 * 32 * math.exp(-4 * 18 / 1000) * 5 / 4)


def test_pool_products_span_the_batch_labels_counted_or_every_row():
    counted = flops_per_sample(RESOLVED, 100, 1000, 6, 2, batch_labels=5.0)
    none = flops_per_sample(RESOLVED, 100, 1000, 6, 2, batch_labels=0.0)
    assert counted["pool_matmul"] - none["pool_matmul"] == pytest.approx(3 * 2 * 5 * (1 - 0.032) * 8)
    # a whole output: the pool is every row, the labels among them
    whole = dict(RESOLVED, lsh_cap=0, pool=40)
    f = flops_per_sample(whole, 100, 40, 6, 2, batch_labels=5.0)
    assert f == flops_per_sample(whole, 100, 40, 6, 2, batch_labels=0.0)


def test_bytes_by_phase_hand_computed():
    b = bytes_per_sample(RESOLVED, n_features=100, n_labels=1000, nnz=6, labels=2)
    u_own, u_out, u_in = distinct(1000, 4 * 18), distinct(1000, 4 * 18 + 32), distinct(100, 4 * 6)
    # the candidates' draws (4 x 16) that none of the batch's other 4 x 18 + 32 - 1 draws meets,
    # and the pool's rows that none of the 4 x 18 own draws meets
    alone = 4 * 16 * math.exp(-(4 * 18 + 32 - 1) / 1000)
    pool_only = 32 * math.exp(-4 * 18 / 1000)
    assert b["forward_hidden"] == 6 * 8 * 4
    assert b["hash"] == 0.0
    # alone: weights read and written, two moments read and written (row and bias); the other
    # own rows: weights read, gradient rows read and written
    assert b["select+output"] == pytest.approx(3 * 5 * 4 + (alone * 9 * 6 * 4 + (u_own - alone) * 8 * 12) / 4)
    # the pool's rows gathered; pool-only rows: weights written, two moments read and written
    # (row and bias); the others' gradient rows read and written
    assert b["pool_matmul"] == pytest.approx((32 * 8 * 4 + pool_only * 9 * 5 * 4
                                              + (32 - pool_only) * 8 * 8) / 4)
    # input rows alone: weights and both moments read and written in the backward pass; the
    # others: gradient rows read and written there, four arrays through Adam
    in_alone = 4 * 6 * math.exp(-(4 * 6 - 1) / 100)
    assert b["backward_hidden"] == pytest.approx((in_alone * 8 * 6 * 4 + (u_in - in_alone) * 8 * 8) / 4)
    assert b["adam"] == pytest.approx(((u_out - alone - pool_only) * 9 + (u_in - in_alone) * 8) * 8 * 4 / 4)
    # input rows as counted replace the estimate
    c = bytes_per_sample(RESOLVED, n_features=100, n_labels=1000, nnz=6, labels=2, input_rows=(20, 15))
    assert c["backward_hidden"] == pytest.approx((15 * 8 * 6 * 4 + 5 * 8 * 8) / 4)
    assert c["adam"] == pytest.approx(((u_out - alone - pool_only) * 9 + 5 * 8) * 8 * 4 / 4)
    assert b["rehash"] == pytest.approx((1000 * 8 * 4 + 3 * 1000 * 4) / 64)


def test_where_the_output_is_whole_no_row_is_alone_and_the_pool_only_rows_skip_adam():
    whole = dict(RESOLVED, lsh_cap=0, pool=1000)
    b = bytes_per_sample(whole, n_features=100, n_labels=1000, nnz=6, labels=2)
    u_own, u_out = distinct(1000, 4 * 2), distinct(1000, 4 * 2 + 1000)
    pool_only = 1000 * math.exp(-4 * 2 / 1000)  # every row but the batch's ~8 labels
    assert b["select+output"] == pytest.approx(3 * 5 * 4 + u_own * 8 * 12 / 4)
    in_alone = 4 * 6 * math.exp(-(4 * 6 - 1) / 100)
    assert b["adam"] == pytest.approx(((u_out - pool_only) * 9 + (distinct(100, 4 * 6) - in_alone) * 8)
                                      * 8 * 4 / 4)


def test_rehash_bytes_follow_the_rehashes_the_window_ran():
    per_rehash = 1000 * 8 * 4 + 3 * 1000 * 4
    none = bytes_per_sample(RESOLVED, 100, 1000, 6, 2, rehashes_per_sample=0.0)
    two = bytes_per_sample(RESOLVED, 100, 1000, 6, 2, rehashes_per_sample=2 / 640)
    assert none["rehash"] == 0.0
    assert two["rehash"] == pytest.approx(per_rehash / 320)
    assert two["total"] - none["total"] == pytest.approx(per_rehash / 320)


def test_scattered_pass_touches_exactly_the_listed_rows():
    import numpy as np

    from bench.roofline import _scattered_update, scattered_bandwidth
    R, D = np.ones((50, 24), np.float32), np.ones((10, 8), np.float32)
    rows = np.array([3, 17, 40], np.int32)
    _scattered_update(rows, R, D)  # D compact: row t for rows[t]
    other = np.setdiff1d(np.arange(50), rows)
    assert (R[rows] == 2).all() and (D[:3] == 0).all()
    assert (R[other] == 1).all() and (D[3:] == 1).all()
    assert 0 < scattered_bandwidth(2000, 8, 300, threads=1, reps=2) < math.inf


def test_roofline_limit_takes_each_phase_at_its_later_roof():
    from bench.roofline import roofline_limit
    need = {"a": 100.0, "b": 10.0, "total": 110.0}  # bytes per sample
    work = {"a": 1.0, "b": 1000.0, "total": 1001.0}  # operations per sample
    least, limit = roofline_limit(need, work, bw=10.0, fl=100.0)
    assert least == {"a": 10.0, "b": 10.0}  # a by memory (100 / 10), b by arithmetic (1000 / 100)
    assert limit == pytest.approx(1 / 20)


def test_batch_order_runs_epoch_after_epoch_in_whole_batches():
    from bench.roofline import batch_order
    order = batch_order(100, 32, 7)  # 3 whole batches an epoch: epochs 0, 1 and a third of 2
    assert order.shape == (7 * 32,)
    np.testing.assert_array_equal(order[:96], np.random.default_rng(0).permutation(100)[:96])
    for e in range(3):
        epoch = order[96 * e:96 * (e + 1)]
        assert np.unique(epoch).size == epoch.size  # no row twice within an epoch's batches
    assert not np.array_equal(order[:96], order[96:192])  # a new permutation each epoch


def test_rounds_are_each_measured_against_the_roofs_either_side(tmp_path):
    import json

    from bench.roofline import main
    out = tmp_path / "roofline.json"
    main(["--preset", "demo", "--n-train", "600", "--warm-steps", "1", "--steps", "3",
          "--rounds", "3", "--stream-mb", "4", "--out", str(out)])
    d = json.loads(out.read_text())
    rounds, probes = d["rounds"], d["probes"]
    assert len(rounds) == 3 and len(probes) == 4  # one before each round, one after the last
    assert sum(r["samples"] for r in rounds) == 3 * d["resolved"]["batch_size"]
    for r, round_ in enumerate(rounds):
        assert round_["bandwidth"] == max(probes[r][0], probes[r + 1][0])
        assert round_["matmul_flops"] == max(probes[r][1], probes[r + 1][1])
        assert round_["fraction"] == pytest.approx(
            round_["samples_per_second"] / round_["roofline_samples_per_second"])
    # the whole window against the highest roofs of all
    assert d["bandwidth"]["2"] >= max(p[0] for p in probes)
    assert d["fraction_median_of_rounds"] == pytest.approx(
        sorted(r["fraction"] for r in rounds)[1])
