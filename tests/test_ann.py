"""predict_topk(mode="ann"): the engine's clusters of the label vectors, and an HNSW index of
them from hnswlib or FAISS (the ann extra; skipped where neither is installed, except the error
that says so)."""
import importlib.util
import os

import numpy as np
import pytest

from slide import SlideClassifier
import slide.clusters
import slide.grouped
from slide.ann import LIBRARIES, LabelIndex, available_backend, make_index
from slide.clusters import LabelClusters, cluster_count
from tests.conftest import clustered_layer

INSTALLED = [b for b in LIBRARIES if importlib.util.find_spec(b) is not None]
#: every backend, each with settings that find nearly all of a small model's top-k
SETTINGS = [("clusters", {"probe": 0.5})] + [(b, {"ef": 200}) for b in INSTALLED]


@pytest.fixture(scope="module")
def fitted(tiny_data):
    X, Y, Xte, _ = tiny_data
    return SlideClassifier(hidden=(16,), epochs=2, threads=1, seed=0).fit(X[:1500], Y[:1500]), Xte


@pytest.mark.parametrize("backend, settings", SETTINGS)
def test_ann_finds_the_exact_top_k_with_its_scores(fitted, backend, settings):
    model, Xte = fitted
    exact, exact_scores = model.predict_topk(Xte[:300], 10)
    model.set_ann(backend=backend, **settings)
    ids, scores = model.predict_topk(Xte[:300], 10, mode="ann")
    recall = np.mean([np.intersect1d(a, b).size / 10 for a, b in zip(ids, exact)])
    assert recall > 0.97
    # its scores are the model's scores of the labels it returns, best first
    S = model.decision_function(Xte[:300])
    np.testing.assert_allclose(scores, np.take_along_axis(S, ids, 1), rtol=1e-4, atol=1e-5)
    assert np.all(np.diff(scores, axis=1) <= 1e-6)


@pytest.mark.parametrize("backend, settings", SETTINGS)
def test_the_index_follows_the_weights_and_the_rows(fitted, tiny_data, backend, settings):
    import copy
    model, Xte = fitted
    model = copy.deepcopy(model)
    model.set_ann(backend=backend, **settings)
    first = model.server_.label_index()
    model.predict_topk(Xte[:5], 5, mode="ann")
    assert model.server_.label_index() is first  # kept while the weights stand
    X, Y = tiny_data[0], tiny_data[1]
    model.partial_fit(X[1500:1600], Y[1500:1600])
    ids, scores = model.predict_topk(Xte[:50], 5, mode="ann")
    assert model.server_.label_index() is not first  # rebuilt from the new weights
    exact = model.predict_topk(Xte[:50], 5)[1]
    found = np.isclose(scores, exact, rtol=1e-4, atol=1e-5)
    assert found.mean() > 0.95 and found[:, 0].all()
    # labels added later are in the index with their rows
    model.add_labels(3)
    assert model.server_.label_index().n == model.n_outputs_


def _as_in_a_model(W):
    """``W`` as a model holds its output layer, and so as a model's index is given it: a view
    of wider rows (the optimizer's moments beside the weights). The kernels are compiled for
    one layout fewer where the tests give them the one that serving gives them."""
    return np.hstack((W, np.zeros_like(W), np.zeros_like(W)))[:, :W.shape[1]]


@pytest.mark.parametrize("backend", ["clusters"] + INSTALLED)
def test_fewer_labels_than_k_are_padded(backend):
    W = _as_in_a_model(np.eye(3, 4, dtype=np.float32))
    index = make_index(backend=backend, ef=16).build(W, np.zeros(3, np.float32))
    rows, scores = index.query(np.array([[0, 1, 0, 0]], np.float32), 5)
    assert rows[0, 0] == 1 and rows[0, 3:].tolist() == [-1, -1] and np.isneginf(scores[0, 3:]).all()


def test_without_a_library_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert available_backend() == "clusters"  # the engine's own needs nothing more
    with pytest.raises(ImportError, match="ann extra"):
        available_backend("hnswlib")
    with pytest.raises(ImportError, match="ann extra"):
        LabelIndex()
    with pytest.raises(ValueError, match="backend must be one of"):
        available_backend("annoy")


def _layer(n=3000, d=40, seed=0):
    """Label rows in 60 groups about their own directions, and 200 queries near some of them,
    the rows laid out as a model's."""
    W, b, H = clustered_layer(n, d, 60, 200, seed)
    return _as_in_a_model(W), b, H


def _single_rows(index, H, k=10, **kw):
    """Each row of ``H`` asked alone (one kernel of its own), stacked."""
    answers = [index.query(H[r:r + 1], k, **kw) for r in range(H.shape[0])]
    return np.vstack([a[0] for a in answers]), np.vstack([a[1] for a in answers])


def _probe_all(W, b, H):
    """With every cluster probed and every estimate rescored the answer is the exact top-k,
    in a batch and a row at a time; with the default rescoring the int8 estimates alone must
    rank the top-k first."""
    S = H @ W.T + b
    exact = np.argsort(-S, axis=1, kind="stable")[:, :10]
    index = LabelClusters(probe=1.0).build(W, b)
    for threads in (1, 3):  # one task, and tasks whose lanes are merged
        for rows, scores in (index.query(H, 10, threads, keep=W.shape[0]),
                             _single_rows(index, H[:40], threads=threads, keep=W.shape[0])):
            # a label's two entries make one candidate
            np.testing.assert_array_equal(rows, exact[:len(rows)])
            np.testing.assert_allclose(scores, np.take_along_axis(S[:len(rows)], rows, 1),
                                       rtol=1e-5, atol=1e-5)
        for rows in (index.query(H, 10, threads)[0], _single_rows(index, H, threads=threads)[0]):
            assert np.mean([np.intersect1d(a, e).size for a, e in zip(rows, exact)]) >= 9.9


_KINDS = sorted({slide.clusters.int8_kind(), "avx2" if slide.grouped.target_has("avx2") else None,
                 None}, key=str)


@pytest.mark.parametrize("kind", _KINDS)
def test_clusters_score_every_label_exactly_when_probing_all(monkeypatch, kind):
    """The host's int8 kernels (AVX-512 VNNI's batch tiles, AVX2's), those of CPUs with AVX2
    only, and the loop of CPUs without (AMX's tiles: the next test)."""
    monkeypatch.setattr(slide.clusters, "int8_kind", lambda: kind)
    monkeypatch.setattr(slide.clusters, "amx_ready", lambda: False)
    _probe_all(*_layer())


def test_clusters_score_every_label_exactly_by_amx_tiles(monkeypatch):
    """A batch's scan in AMX's tiles (the instruction where the process may use it, the same
    sums as loops on a target without it), in every cluster, in none (VNNI's tiles) and in
    those that enough rows chose: every rank and score as probing all requires."""
    import slide.amx
    if slide.amx._on_target() and not slide.amx.amx_ready():
        pytest.skip("the CPU has AMX but Linux did not lend this process its tiles")
    monkeypatch.setattr(slide.clusters, "_kind", lambda: slide.grouped.AMX)
    for fewest in (1, 10 ** 9, slide.clusters.AMX_FROM):  # every cluster by AMX, none, the rule
        monkeypatch.setattr(slide.clusters, "AMX_FROM", fewest)
        _probe_all(*_layer())


@pytest.mark.parametrize("d", [3, 44, 64, 130])
def test_amx_tiles_sum_a_groups_rows_as_numpy_does(d):
    """AMX's int32 sums of up to 16 query rows with one or two pairs of groups of the int8
    copy, at depths of a part of a 64-byte step, whole steps and both (the depth padded to 4,
    44, 64, 132), the rows and labels at the extremes of both ranges; the tile configuration
    of each depth."""
    import slide.amx as X
    from numba import njit
    if X._on_target() and not X.amx_ready():
        pytest.skip("the CPU has AMX but Linux did not lend this process its tiles")
    q, _, _, _, stored = _tile_case(False, d, np.random.default_rng(4))
    P, depth = slide.grouped.PAIR, stored.shape[1]
    assert depth == -(-d // 4) * 4 and q.shape[0] >= 3
    cfg = X.tile_config(depth)
    rows, colsb = cfg[48:64], cfg[16:48].view(np.uint16)
    assert cfg[0] == 1 and rows[2] == 16 and colsb[2] == 64 and rows[4] == 16
    assert colsb[0] == colsb[4] == 64 and rows[0] == 16  # full tiles: sixteen labels
    assert colsb[3] == depth % 64 and rows[6] == (depth % 64) // 4

    @njit
    def sums(cfg, A, q, p, n_pairs, C):
        slide.amx.amx_begin(cfg)
        slide.amx.amx_sums(A, q, p, n_pairs, C)
        slide.amx.amx_end()

    A = np.random.default_rng(5).integers(0, 128, (X.AMX_ROWS, depth)).astype(np.uint8)
    A[0] = 127
    want = A.astype(np.int64) @ stored.T
    for p, n_pairs in ((0, 1), (0, 2), (q.shape[0] - 2, 2), (q.shape[0] - 1, 1)):
        C = np.full((X.AMX_ROWS, 3 * P), 7, np.int32)
        sums(cfg, A, q, p, n_pairs, C)
        np.testing.assert_array_equal(C[:, :P * n_pairs], want[:, P * p:P * (p + n_pairs)])
        assert np.all(C[:, P * n_pairs:] == 7)  # nothing beyond the pairs written


def _group_sums(name, hq, q, groups):
    """Each query row's int32 sums with each of the ``groups`` of ``q`` by the kernel ``name``
    (the loop, and the AVX2 one where the host has it; ``dot16`` a pair of groups a call):
    yields int32 [rows of hq, groups · GROUP]."""
    from numba import njit
    avx2 = slide.grouped.target_has("avx2")
    kernels = [getattr(slide.grouped, name + "_loop")] + \
        ([getattr(slide.grouped, name + "_avx2")] if avx2 else [])
    width = 16 if name == "dot16" else 8
    for kernel in kernels:
        @njit
        def sums(hq, q, out):
            for r in range(hq.shape[0]):
                for g in range(out.shape[1] // width):
                    kernel(hq[r], q, g, out[r, g * width:(g + 1) * width])
        out = np.zeros((hq.shape[0], groups * slide.grouped.GROUP), np.int32)
        sums(hq, q, out)
        yield out


@pytest.mark.parametrize("d", [44, 3])
def test_a_group_of_int8_rows_sums_as_numpy_does(d):
    """Each label's int32 sum with a query from the grouped layout (the host's kernel and the
    loop alike) is numpy's of its int8 row, at the extremes of both ranges and with an odd
    count of 4-byte pieces (44) or a padded one (3), each group half of a pair's bytes."""
    from slide.screen import quantize_labels
    rng = np.random.default_rng(1)
    W = rng.standard_normal((37, d)).astype(np.float32)
    W[0] = 1.0  # every byte 127
    W[1, ::2] = -5.0  # -127 at every other byte
    index = LabelClusters(clusters=3).build(W, np.zeros(37, np.float32))
    P = slide.grouped.PAIR
    depth = index.q.shape[1] // P
    assert depth == -(-d // 4) * 4 and np.all(index.starts % P == 0)
    assert index.q.shape[0] == index.starts[-1] // P
    rows = np.zeros((37, depth), np.int8)
    rows[:, :d] = quantize_labels(np.ascontiguousarray(W), np.zeros(37, np.float32)).q
    hq = rng.integers(0, slide.grouped.LEVELS + 1, (4, depth)).astype(np.uint8)
    hq[0] = slide.grouped.LEVELS
    for out in _group_sums("dot16", hq, index.q, 2 * index.q.shape[0]):
        real = index.members >= 0
        want = hq.astype(np.int64) @ rows[index.members[real]].T.astype(np.int64)
        np.testing.assert_array_equal(out[:, real], want)
        assert np.all(out[:, ~real] == 0)  # padding rows are zeros
    assert np.all(np.isneginf(index.label_bias[~real])) and np.all(index.scale[~real] == 0)


def _tile_case(nibbles, d, rng):
    """A layer's grouped copy for the tile kernels: ``(q, scale, bias, sums, stored [rows,
    depth] int64)``, the int8 copy of an index (``nibbles`` false) or a 4-bit copy, with rows
    at the extremes of both ranges."""
    C = slide.grouped
    W = rng.standard_normal((37, d)).astype(np.float32)
    W[0] = 1.0
    W[1, ::2] = -5.0
    b = rng.standard_normal(37).astype(np.float32)
    if nibbles:
        starts = np.array([0, 40])
        q, scale, bias, sums, _ = C.int4_groups(np.hstack((W, b[:, None])), np.arange(37),
                                               np.array([37]), starts)
        return q, scale, bias, sums, _levels4(q, 40)
    index = LabelClusters(clusters=1).build(W, b)
    q, P = index.q, C.PAIR
    depth = q.shape[1] // P
    stored = q.reshape(q.shape[0], depth // 4, P, 4).transpose(0, 2, 1, 3).reshape(-1, depth)
    return q, index.scale, index.label_bias, index.sums, stored.astype(np.int64)


@pytest.mark.parametrize("nibbles", [False, True])
@pytest.mark.parametrize("d", [44, 3])
def test_a_tile_of_rows_estimates_a_clusters_groups_as_numpy_does(d, nibbles):
    """A tile's estimates, each of up to TILE_ROWS rows (any of the batch's, in any order) of
    each of up to TILE_GROUPS groups of the int8 or the 4-bit copy, written at an offset of
    the tile's rows: the scalar formula of numpy's int32 sums bit for bit, for every tile
    shape, by VNNI's tiles (the instruction, or the generic code of CPUs without it), AVX2's
    (or the loop) and the loop, at the extremes of both ranges."""
    from numba import njit
    C = slide.grouped
    rng = np.random.default_rng(2)
    q, scale, bias, lsums, stored = _tile_case(nibbles, d, rng)
    G, depth = C.GROUP, stored.shape[1]
    hq = rng.integers(0, C.LEVELS + 1, (9, depth)).astype(np.uint8)
    hq[0] = C.LEVELS
    t = rng.random(9).astype(np.float32)
    z = rng.integers(0, C.LEVELS, 9).astype(np.int32)
    shift = (C.OFFSET * hq.sum(1)).astype(np.int32) if nibbles else np.zeros(9, np.int32)
    sums = hq.astype(np.int64) @ stored.T
    x = (sums - shift[:, None] - z[:, None].astype(np.int64) * lsums).astype(np.float32)
    want = scale * t[:, None] * x + bias
    order = np.array([7, 0, 3, 8, 1, 5], np.int32)

    @njit
    def tile(kind, hq, spread, rows, j0, nr, q, g, ng, t, z, shift, scale, bias, sums, out, o):
        if nibbles:
            C.tile4_estimates(kind, hq, spread, rows, j0, nr, q, g, ng, t, z, shift, scale, bias,
                              sums, out, o)
        else:
            C.tile_estimates(kind, hq, rows, j0, nr, q, g, ng, t, z, scale, bias, sums, out, o)

    spread = C.spread_words(hq, depth) if nibbles else np.empty((9, 0, 32), np.int32)
    groups = q.shape[0] * (1 if nibbles else 2)
    for kind in (C.VNNI, C.AVX2, C.LOOP):
        for nr in range(1, C.TILE_ROWS + 1):
            for ng in range(1, C.TILE_GROUPS + 1):
                # the int8 copy's tiles start at a pair; the 4-bit copy's at any group
                last = groups - ng if nibbles else groups - 2
                for j0, g in ((0, 0), (len(order) - nr, last)):
                    out = np.full((C.TILE_ROWS, G * (groups + 1)), 7.0, np.float32)
                    tile(kind, hq, spread, order, j0, nr, q, g, ng, t, z, shift, scale, bias,
                         lsums, out, G)
                    np.testing.assert_array_equal(out[:nr, G:G + G * ng],
                                                  want[order[j0:j0 + nr]][:, G * g:G * (g + ng)])
                    # nothing beyond the tile's rows and groups is written
                    assert np.all(out[nr:] == 7) and np.all(out[:, :G] == 7)
                    assert np.all(out[:, G + G * ng:] == 7)


def _levels4(q, rows):
    """The 4-bit copy ``q`` (:func:`slide.grouped.int4_groups`'s layout) decoded: its stored
    values 0..15, int64 [rows, D]."""
    G = slide.grouped.GROUP
    pieces = q.reshape(q.shape[0], -1, G, 4)  # [group, piece of 8 depths, row, 4 bytes]
    both = np.concatenate((pieces & 15, pieces >> 4), axis=3)  # depths 8 i + 0..7
    return both.transpose(0, 2, 1, 3).reshape(-1, 8 * pieces.shape[1])[:rows].astype(np.int64)


@pytest.mark.parametrize("d", [44, 3])
def test_a_group_of_4bit_rows_sums_as_numpy_does(d):
    """The centroids' 4-bit copy: each row's levels -7..7 of its largest weight, stored as w +
    8, two to a byte; a query's int32 sums with them from the grouped layout (the host's
    kernel and the loop alike) are numpy's, at the extremes of both ranges, with the depth
    padded to whole pairs of 8-depth pieces (44 -> 48, 3 -> 16)."""
    rng = np.random.default_rng(1)
    n, G = 37, slide.grouped.GROUP
    V = rng.standard_normal((n, d + 1)).astype(np.float32)
    V[0, :d] = 1.0  # every level 7
    V[1, :d:2], V[1, 1:d:2] = -5.0, 0.1  # -7 at every other depth, 0 between
    V[2, :d] = 0.0  # no scale: every level 0
    starts = np.array([0, -(-n // G) * G])
    q, scale, bias, sums, place = slide.grouped.int4_groups(V, np.arange(n), np.array([n]), starts)
    depth = -(-d // 16) * 16
    assert q.shape == (starts[-1] // G, G * depth // 2) and np.all(place == np.arange(n))
    stored = _levels4(q, n)
    levels = stored - slide.grouped.OFFSET
    np.testing.assert_array_equal(levels[:, d:], 0)
    assert np.all(levels[0, :d] == 7) and np.all(levels[1, :d:2] == -7) and np.all(levels[2] == 0)
    assert np.abs(levels).max() <= slide.grouped.NIBBLE
    # each weight within half a step of its level; the sums are the levels'
    assert np.all(np.abs(levels[:, :d] * scale[:n, None] - V[:, :d]) <= 0.5001 * scale[:n, None])
    np.testing.assert_array_equal(sums[:n], levels.sum(1))
    np.testing.assert_array_equal(bias[:n], V[:, d])
    assert np.all(np.isneginf(bias[n:])) and np.all(scale[n:] == 0)
    hq = rng.integers(0, slide.grouped.LEVELS + 1, (4, depth)).astype(np.uint8)
    hq[0] = slide.grouped.LEVELS
    for out in _group_sums("dot4", hq, q, q.shape[0]):
        np.testing.assert_array_equal(out[:, :n], hq.astype(np.int64) @ stored.T)


def test_clusters_find_most_of_the_top_k_from_a_share_of_the_labels():
    W, b, H = _layer()
    index = LabelClusters(probe=0.1).build(W, b)
    assert index.centroids.shape[0] == cluster_count(3000) == 512
    # each label in its nearest cluster and in the nearest other by SOAR's rule (its distance
    # plus λ (r·(v - c))² / |r|², r its first residual), each cluster padded to whole groups
    real = index.members >= 0
    assert np.all(np.bincount(index.members[real], minlength=3000) == 2)
    V = np.hstack((W, b[:, None])).astype(np.float64)
    C = index.centroids.astype(np.float64)
    far = (C ** 2).sum(1) - 2 * V @ C.T
    first = np.argmin(far, axis=1)
    r = V - C[first]
    rr = (r ** 2).sum(1)[:, None]  # a label that is its centroid: the distance alone
    along = ((r * V).sum(1)[:, None] - r @ C.T) ** 2 / np.where(rr > 0, rr, np.inf)
    soar = far + slide.clusters.ORTHOGONAL * along
    soar[np.arange(3000), first] = np.inf
    second = np.argmin(soar, axis=1)
    assert np.mean(second != np.argsort(far, axis=1)[:, 1]) > 0.05  # the rule moves some
    cluster = np.repeat(np.arange(index.sizes.size), np.diff(index.starts))
    mine = [set(cluster[index.members == j]) == {first[j], second[j]} for j in range(3000)]
    assert np.mean(mine) > 0.99  # up to float32's rounding at a near-tie
    sizes = np.diff(index.starts)
    assert np.all(sizes % slide.grouped.PAIR == 0) and index.sizes.sum() == 6000
    assert np.all((index.sizes <= sizes) & (sizes < index.sizes + slide.grouped.PAIR))
    assert np.all([np.all(index.members[index.starts[c]:index.starts[c] + index.sizes[c]] >= 0)
                   for c in range(index.sizes.size)])
    exact = np.argsort(-(H @ W.T + b), axis=1)[:, :10]
    rows = index.query(H, 10)[0]
    recall = np.mean([np.intersect1d(a, e).size / 10 for a, e in zip(rows, exact)])
    assert recall > 0.9
    # a row alone takes the batch's clusters: the same int8 estimates of the centroids
    np.testing.assert_array_equal(_single_rows(index, H)[0], rows)
    # every row's candidates: whole clusters holding at least the budget, best centroids first
    chosen, counts = index.chosen(H)
    sizes = index.sizes
    # the centroids' scores as the query estimates them: 4-bit levels, 7-bit queries
    q, scale, bias, sums = index.coarse
    n_clusters = sizes.size
    levels = _levels4(q, n_clusters) - slide.grouped.OFFSET
    hq, t, z, _ = index._quantized(H)
    estimates = (scale[:n_clusters] * t[:, None] *
                 ((hq.astype(np.int64) - z[:, None]) @ levels.T) + bias[:n_clusters])
    scores = H @ index.weights.T + index.bias
    assert np.corrcoef(estimates.ravel(), scores.ravel())[0, 1] > 0.99
    for r in range(20):
        mine = chosen[r, :counts[r]]
        assert sizes[mine].sum() >= index.budget > sizes[mine[:-1]].sum()
        coarse = estimates[r]
        others = np.setdiff1d(np.arange(coarse.size), mine)
        bin_width = (coarse.max() - coarse.min()) / 255
        assert coarse[others].max() <= coarse[mine].min() + bin_width * 1.001


def test_two_clusters_a_label_take_one_more_step_over_both_entries():
    """With two clusters a label, k-means takes one more step after the last assignment: each
    centroid the mean of every entry its cluster holds, then every label assigned again."""
    from slide.clusters import _assign, kmeans
    W, b, _ = _layer(n=1500)
    V = np.ascontiguousarray(np.hstack((W, b[:, None])))
    C1, one = kmeans(W, b, 64, seed=3, nearest=1)
    first = _assign(W, b, C1, 1, nearest=2)
    want = C1.astype(np.float64)
    for c in range(64):
        held = V[(first == c).any(axis=1)]
        if held.size:
            want[c] = held.mean(axis=0)
    C, two = kmeans(W, b, 64, seed=3, nearest=2)
    np.testing.assert_allclose(C, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(C, C1, atol=1e-3)  # the step moved them
    np.testing.assert_array_equal(two, _assign(W, b, C, 1, nearest=2))
    np.testing.assert_array_equal(one[:, 0], _assign(W, b, C1, 1)[:, 0])


def test_the_int8_copy_reads_the_layer_where_it_lies():
    """The layer's int8 copy is made from its rows as the model lays them out, with no float
    copy of them: at a depth not a multiple of 4, the same bytes, scales, biases and sums as
    from a contiguous copy zero-padded in float32 (a zero weight quantizes to 0 at any scale),
    each row at its place of runs of pieces (the layout written out in numpy here)."""
    from slide.grouped import PAIR, grouped_layout, int8_groups
    W, b, _ = clustered_layer(300, 37, 10, 1)
    order = np.random.default_rng(0).permutation(300)
    sizes, starts = np.array([100, 120, 80]), np.array([0, 112, 240, 320])  # whole pairs
    got = int8_groups(_as_in_a_model(W), b, order, sizes, starts)
    want = int8_groups(np.pad(W, ((0, 0), (0, 3))), b, order, sizes, starts)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    q = np.random.default_rng(1).integers(-127, 128, (300, 40)).astype(np.int8)
    for pieces, width in ((4, PAIR), (8, slide.grouped.GROUP)):
        out, place = grouped_layout(q, order, sizes, starts, pieces=pieces, width=width)
        flat = np.zeros((320, 40), np.int8)
        flat[place] = q[order]
        laid = flat.reshape(-1, width, 40 // pieces, pieces).transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(out, laid.reshape(out.shape))


def test_a_refresh_makes_no_float_copy_of_the_layer():
    """Following the weights costs the int8 copy and its layout (about 0.6 of the layer's
    float32 bytes traced), not a copy of ``[w, b]`` in float32 (2.9 of them before)."""
    import tracemalloc
    W, b, _ = clustered_layer(20000, 128, 60, 1)
    W = _as_in_a_model(W)
    index = LabelClusters(clusters=64, spill=False).build(W, b)
    index.refresh(W, b)  # compiled
    tracemalloc.start()
    try:
        index.refresh(W, b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.75 * 20000 * 128 * 4


def test_a_batch_not_rescored_is_ranked_by_the_int8_estimates():
    """``rescore=False``: each row's top-k by the int8 copy's estimates, best first, which are
    the scores it gives: close to the labels' float32 scores (a wrong id is far off), and at
    probe 1 nearly the exact top-k."""
    W, b, H = _layer()
    index = LabelClusters(probe=1.0, spill=False).build(W, b)
    ids, estimates = index.query(H, 10, threads=2, rescore=False)
    exact = H @ W.T + b
    assert np.all(np.diff(estimates, axis=1) <= 0)
    np.testing.assert_allclose(estimates, np.take_along_axis(exact, ids, 1),
                               atol=0.01 * np.abs(exact).max())
    top = np.argsort(-exact, axis=1)[:, :10]
    assert np.mean([np.intersect1d(a, e).size / 10 for a, e in zip(ids, top)]) > 0.95
    rescored = index.query(H, 10, threads=2)[0]
    assert not np.array_equal(ids, rescored)  # the float32 scores reorder some


def test_one_cluster_a_label_when_not_spilled():
    W, b, H = _layer()
    index = LabelClusters(probe=1.0, spill=False).build(W, b)
    real = index.members >= 0
    assert sorted(index.members[real].tolist()) == list(range(3000)) and index.sizes.sum() == 3000
    exact = np.argsort(-(H[:40] @ W.T + b), axis=1, kind="stable")[:, :10]
    for rows in (index.query(H[:40], 10, keep=3000)[0], _single_rows(index, H[:40], keep=3000)[0]):
        np.testing.assert_array_equal(rows, exact)


def test_a_row_alone_scores_the_candidates_it_would_in_a_batch():
    """Every label of a row's clusters (:meth:`LabelClusters.chosen`) is a candidate, whether
    the row comes alone or in a batch: with every estimate rescored, its top-50 is the exact
    top-50 of them (most of its 60-odd, so that a cluster missed shows). Large biases, so
    that the centroids' count in the choice."""
    W, b, H = _layer()
    b = 20 * b
    index = LabelClusters(probe=0.02).build(W, b)
    chosen, counts = index.chosen(H)
    S = H @ W.T + b
    want = []
    for r in range(H.shape[0]):
        mine = [index.members[index.starts[c]:index.starts[c] + index.sizes[c]]
                for c in chosen[r, :counts[r]]]
        labels = np.unique(np.concatenate(mine))  # a label in two of them counts once
        want.append(labels[np.argsort(-S[r, labels], kind="stable")[:50]])
    for threads in (1, 3):
        for rows, _ in (index.query(H, 50, threads, keep=W.shape[0]),
                        _single_rows(index, H, 50, threads=threads, keep=W.shape[0])):
            np.testing.assert_array_equal(rows, np.array(want))


def test_clusters_settings_are_checked():
    for bad in ({"probe": 0.0}, {"probe": 1.5}, {"clusters": 0}, {"probe": True}):
        with pytest.raises(ValueError):
            LabelClusters(**bad)
    assert cluster_count(1) == 1 and cluster_count(21316) == 1024 and cluster_count(10) == 10


def test_clusters_rebuilt_from_the_last_centroids(fitted, tiny_data, monkeypatch):
    """After the weights move (training, added labels) the clusters start from the last
    index's centroids; new settings start afresh."""
    import copy
    model, Xte = fitted
    model = copy.deepcopy(model)
    starts = []
    kmeans = slide.clusters.kmeans

    def recording(W, b, n_clusters, seed=0, threads=1, start=None, nearest=1):
        starts.append(None if start is None else np.array(start))
        return kmeans(W, b, n_clusters, seed, threads, start, nearest)
    monkeypatch.setattr(slide.clusters, "kmeans", recording)
    model.set_ann(probe=0.5)
    model.predict_topk(Xte[:5], 5, mode="ann")
    first = model.server_.label_index()
    assert starts[-1] is None
    X, Y = tiny_data[0], tiny_data[1]
    model.partial_fit(X[1500:1600], Y[1500:1600])
    ids, scores = model.predict_topk(Xte[:50], 5, mode="ann")
    np.testing.assert_array_equal(starts[-1], first.centroids)
    assert np.isclose(scores, model.predict_topk(Xte[:50], 5)[1], rtol=1e-4, atol=1e-5).mean() > 0.95
    second = model.server_.label_index()
    # rows that carry two labels new to the model: they get output rows, the server restarts
    import scipy.sparse as sp
    rows = Y[1600:1700]
    fresh = sp.csr_matrix((np.ones(20, np.float32), (np.arange(20), np.arange(20) % 2)),
                          shape=(rows.shape[0], 2))
    outputs = model.n_outputs_
    model.partial_fit(X[1600:1700], sp.hstack([rows, fresh]).tocsr())
    assert model.n_outputs_ >= outputs + 2
    assert model.server_.label_index().n == model.n_outputs_
    np.testing.assert_array_equal(starts[-1], second.centroids)
    model.set_ann(probe=0.4)
    model.predict_topk(Xte[:5], 5, mode="ann")
    assert starts[-1] is None


@pytest.mark.parametrize("nibbles", [False, True])
def test_a_groups_estimates_are_the_scalar_formulas_bit_for_bit(nibbles):
    """The eight estimates of a group in one vector step, from its sums at an offset: scale ·
    t · (dots - shift - z · sums) + bias, integers first, then float32 in that order, as numpy
    computes each lane; a padding lane (scale 0, bias -inf) stays -inf. The bits of the lanes
    above a bound are those numpy finds, a NaN's never set; so are those of two groups'
    estimates compared in registers (``pair_above``)."""
    from numba import njit
    G = slide.grouped.GROUP
    estimates8, above8, pair_above = (slide.grouped.estimates8, slide.grouped.above8,
                                      slide.grouped.pair_above)

    @njit
    def run(dots, o, scale, bias, sums, p, t, z, shift, est, least):
        estimates8(dots, o, scale, bias, sums, p, t, z, shift, est)
        return above8(est, 0, least)

    @njit
    def pair(dots, o, scale, bias, sums, p, t, z, shift, least):
        return pair_above(dots, o, scale, bias, sums, p, t, z, shift, least)

    rng = np.random.default_rng(3)
    n = 5 * G
    scale = rng.random(n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    sums = rng.integers(-127 * 512, 127 * 512, n).astype(np.int32)
    scale[-1], bias[-1], sums[-1] = 0.0, -np.inf, 0
    dots = rng.integers(0, 127 * 127 * 512, 3 * G).astype(np.int32)
    t, z = np.float32(0.0123), np.int32(57)
    shift = np.int32(8 * 40_000) if nibbles else np.int32(0)
    for g, o in ((0, 0), (2, G), (4, 2 * G)):
        p = g * G
        x = (dots[o:o + G].astype(np.int64) - shift - np.int64(z) * sums[p:p + G]).astype(np.float32)
        want = scale[p:p + G] * t * x + bias[p:p + G]
        least = np.median(want[np.isfinite(want)])  # some lanes above it, some not
        est = np.empty(G, np.float32)
        bits = run(dots, o, scale, bias, sums, p, t, z, shift, est, least)
        np.testing.assert_array_equal(est, want)
        assert bits == sum(1 << u for u in range(G) if want[u] > least) and 0 < bits < 255
        if o + 2 * G <= dots.size:
            x = (dots[o:o + 2 * G].astype(np.int64) - shift -
                 np.int64(z) * sums[p:p + 2 * G]).astype(np.float32)
            want2 = scale[p:p + 2 * G] * t * x + bias[p:p + 2 * G]
            got = pair(dots, o, scale, bias, sums, p, t, z, shift, least)
            assert got == sum(1 << u for u in range(2 * G) if want2[u] > least)
            assert got & 255 and got >> G
    assert np.isneginf(est[-1])
    assert run(dots, 0, scale * np.nan, bias, sums, 0, t, z, shift, est, -np.inf) == 0
    assert pair(dots, 0, scale * np.nan, bias, sums, 0, t, z, shift, -np.inf) == 0


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_rows_grouped_by_cluster_in_order_with_work_split(n):
    """Each cluster's rows, in row order, as a loop over the rows' choices finds them (rows
    past 64 sit in further words of the clusters' bits), and bounds that split the clusters
    into runs of about equal labels times rows."""
    rng = np.random.default_rng(n)
    n_clusters = 37
    starts = np.concatenate(([0], np.cumsum(8 * rng.integers(1, 5, n_clusters))))
    chosen = np.zeros((n, n_clusters), np.int32)
    counts = rng.integers(0, n_clusters + 1, n)
    for r in range(n):
        chosen[r, :counts[r]] = rng.permutation(n_clusters)[:counts[r]]
    ptr, rows, bounds = slide.clusters._by_cluster(chosen, counts, starts, 3)
    for c in range(n_clusters):
        want = [r for r in range(n) if c in chosen[r, :counts[r]]]
        assert rows[ptr[c]:ptr[c + 1]].tolist() == want
    assert ptr[-1] == counts.sum() and bounds[0] == 0 and bounds[-1] == n_clusters
    work = np.diff(ptr) * np.diff(starts)
    assert np.all(np.diff(bounds) >= 0)
    share = [work[bounds[t]:bounds[t + 1]].sum() for t in range(3)]
    assert max(share) <= work.sum() / 3 + work.max()


@pytest.fixture(scope="module")
def held_out_model(tiny_data):
    """A model that kept rows held out of its training (early stopping without the refit)."""
    X, Y, Xte, _ = tiny_data
    model = SlideClassifier(hidden=(16,), epochs=2, threads=1, seed=0, refit=False)
    return model.fit(X[:2000], Y[:2000]), Xte


def _recall(model, H, index, k=10):
    """The mean share of each row's exact top-k (float32, every label) that ``index`` finds."""
    from slide.metrics import topk_product
    exact = topk_product(H, model.params_["W"], model.server_.bias(), k)[0]
    ids = index.query(H, k, 1)[0]
    return np.mean([np.intersect1d(a, e).size for a, e in zip(ids, exact)]) / k


def test_the_probe_is_the_least_that_finds_the_recall_on_held_out_rows(held_out_model):
    import copy
    from slide.ann import CALIBRATION_ROWS, PROBES
    model, Xte = held_out_model
    model = copy.deepcopy(model)
    held = model.held_out_
    assert 0 < held.shape[0] <= CALIBRATION_ROWS and held.shape[1] == model.n_features_in_
    H = model.embed(held)
    chosen = []
    for target in (0.8, 0.95):
        model.set_ann(recall=target)
        model.predict_topk(Xte[:3], 10, mode="ann")
        index = model.server_.label_index()
        c = index.calibration
        assert c["target"] == target and c["rows"] == held.shape[0] and c["probe"] == index.probe
        j = PROBES.index(index.probe)
        assert _recall(model, H, index) == pytest.approx(c["recall"]) and c["recall"] >= target
        if j:  # the probe before it finds less
            index.probe = PROBES[j - 1]
            assert _recall(model, H, index) < target
        chosen.append(j)
    assert 0 < chosen[0] < chosen[1]  # more recall, more probed


def test_a_probe_given_or_no_held_out_rows_is_not_calibrated(held_out_model, fitted):
    import copy
    model, Xte = held_out_model
    model = copy.deepcopy(model)
    model.set_ann(probe=0.3).predict_topk(Xte[:3], 5, mode="ann")
    index = model.server_.label_index()
    assert index.probe == 0.3 and index.calibration is None
    plain, _ = fitted  # refitted on every row: nothing held out
    assert plain.held_out_ is None
    plain = copy.deepcopy(plain).set_ann()
    plain.predict_topk(Xte[:3], 5, mode="ann")
    index = plain.server_.label_index()
    assert index.probe == slide.clusters.DEFAULT_PROBE and index.calibration is None
    with pytest.raises(ValueError, match="recall must be a share"):
        plain.set_ann(recall=1.5)


def test_the_held_out_rows_are_saved_with_the_model(held_out_model, tmp_path):
    import scipy.sparse as sp
    from slide.checkpoint import CheckpointError
    model, Xte = held_out_model
    model.save(tmp_path / "m")
    back = SlideClassifier.load(tmp_path / "m")
    assert back.held_out_.shape == model.held_out_.shape
    assert (back.held_out_ != model.held_out_).nnz == 0
    back.predict_topk(Xte[:3], 10, mode="ann")
    assert back.server_.label_index().calibration is not None
    # a checkpoint whose held-out rows name a feature beyond the model's: named, not a crash
    bad = model.held_out_.copy()
    bad.indices[0] = model.n_features_in_ + 5
    keep = model.held_out_
    try:
        model.held_out_ = sp.csr_matrix((bad.data, bad.indices, bad.indptr))
        model.save(tmp_path / "bad")
    finally:
        model.held_out_ = keep
    with pytest.raises(CheckpointError, match="held_out"):
        SlideClassifier.load(tmp_path / "bad")
    # left out on request: the saved model then has none
    try:
        model.held_out_ = None
        model.save(tmp_path / "without")
    finally:
        model.held_out_ = keep
    assert SlideClassifier.load(tmp_path / "without").held_out_ is None


@pytest.mark.parametrize("backend", INSTALLED)
def test_a_graphs_beam_is_chosen_as_the_probe_is(held_out_model, backend):
    import copy
    from slide.ann import EFS
    model, Xte = held_out_model
    model = copy.deepcopy(model).set_ann(backend=backend, recall=0.99)
    model.predict_topk(Xte[:3], 10, mode="ann")
    index = model.server_.label_index()
    assert index.calibration["ef"] == index.ef in EFS and index.calibration["recall"] >= 0.99
