"""Synthetic extreme-classification data shaped (and calibrated) like the public sets.

The generator is a topic model with a long tail, because real XMC data is hard for reasons a
simpler model hides:

* labels follow a power law of popularity (a few head labels, a long tail of rare ones);
* labels come in clusters of related labels (products bought together, topics of one field):
  a sample's further labels come mostly from its first label's cluster, so its labels are
  predictable from one another, and related labels are hard to tell apart;
* every label has a signature of features, a share of them taken from its cluster's topic
  words, so neighbouring labels share evidence;
* a sample's words come partly from its labels' signatures, partly from the topic of its
  labels' clusters and the rest from a Zipf-distributed background vocabulary (common words
  that carry no signal);
* rows are L2-normalised log term counts, as in the public sets' tf-idf-like features.

Each preset is calibrated so that simple baselines reach on it about what they reach on the
real set it imitates (docs/data.md lists XR-Linear's and 10-NN's figures per preset).
Same seed, same data. The draw is one numba pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from numba import njit

__all__ = ["DatasetShape", "PRESETS", "make_dataset", "load_default"]


@dataclass(frozen=True)
class DatasetShape:
    """The shape of an extreme-classification dataset and how hard its generator makes it.

    features_per_sample / labels_per_sample : means of the distinct non-zero features and of
        the labels per row.
    label_exponent : label popularity ∝ rank^-label_exponent.
    cluster_size : labels per cluster of related labels.
    same_cluster : probability that each further label of a row comes from its first label's
        cluster (else from the overall popularity).
    label_share / topic_share : fractions of a row's words drawn from its labels' signatures /
        its labels' cluster topics; the rest is background vocabulary.
    """
    name: str
    n_features: int
    n_labels: int
    n_train: int
    n_test: int
    features_per_sample: float
    labels_per_sample: float
    label_exponent: float = 0.6
    cluster_size: int = 50
    same_cluster: float = 0.7
    label_share: float = 0.1
    topic_share: float = 0.3


PRESETS = {s.name: s for s in [
    DatasetShape("amazon-670k", 135_909, 670_091, 490_449, 153_025, 75.0, 5.4),
    DatasetShape("delicious-200k", 782_585, 205_443, 196_606, 100_095, 300.0, 75.0),
    DatasetShape("wikilshtc-325k", 1_617_899, 325_056, 1_778_351, 587_084, 42.0, 3.2),
    DatasetShape("eurlex-4k", 5_000, 3_993, 15_539, 3_809, 236.0, 5.3),
    # Amazon-like in its label/feature ratios; the built-in dataset, whose rows are few enough
    # for the README's main job to finish within three minutes on 2 cores (docs/data.md)
    DatasetShape("demo", 20_000, 10_000, 11_500, 4_000, 40.0, 3.0),
]}

_SIGNATURE = 16       # features per label signature, strongest first
_TOPIC = 64           # words per cluster topic
_SIGNATURE_FROM_TOPIC = 0.3


@njit(cache=True, nogil=True)
def _draw(cdf, lo, hi):
    """Index in [lo, hi) drawn with probabilities given by the cumulative ``cdf[lo:hi]``."""
    base = cdf[lo - 1] if lo > 0 else 0.0
    u = base + np.random.random() * (cdf[hi - 1] - base)
    return min(lo + np.searchsorted(cdf[lo:hi], u, side="right"), hi - 1)


@njit(cache=True, nogil=True)
def _generate(seed, n, label_cdf, label_ids, label_cluster, cluster_start, member_cdf, members,
              signatures, topics, feature_cdf, feature_ids, features_per_sample,
              labels_per_sample, same_cluster, label_share, topic_share):
    """Draw ``n`` rows; returns CSR parts (x_indptr, x_ids, y_indptr, y_ids) with one x id per
    word (repeated ids are summed into counts by the caller)."""
    np.random.seed(seed)
    n_labels = label_cdf.size
    max_k = int(4 * labels_per_sample + 4)
    max_m = int(3 * features_per_sample + 8)
    x_ids = np.empty(n * 4 * max_m, np.int64)
    y_ids = np.empty(n * max_k, np.int64)
    x_indptr = np.zeros(n + 1, np.int64)
    y_indptr = np.zeros(n + 1, np.int64)
    seen = np.full(feature_cdf.size, -1, np.int64)  # row that last drew each feature
    nx = 0
    ny = 0
    for r in range(n):
        k = min(1 + np.random.poisson(labels_per_sample - 1.0), max_k, n_labels)
        start = ny
        first = label_ids[_draw(label_cdf, 0, n_labels)]
        y_ids[ny] = first
        ny += 1
        c = label_cluster[first]
        lo, hi = cluster_start[c], cluster_start[c + 1]
        for _ in range(50 * k):
            if ny - start >= k:
                break
            if hi - lo > 1 and np.random.random() < same_cluster:
                lab = members[_draw(member_cdf, lo, hi)]
            else:
                lab = label_ids[_draw(label_cdf, 0, n_labels)]
            dup = False
            for t in range(start, ny):
                dup = dup or y_ids[t] == lab
            if not dup:
                y_ids[ny] = lab
                ny += 1
        n_lab = ny - start
        # words until the row holds m distinct features (repeats become counts)
        m = max(1, min(max_m, np.random.poisson(features_per_sample)))
        distinct = 0
        for _ in range(4 * max_m):
            if distinct >= m:
                break
            u = np.random.random()
            lab = y_ids[start + np.random.randint(0, n_lab)]
            if u < label_share:
                # geometric rank inside the signature: a label's first features are its strongest
                f = signatures[lab, min(_SIGNATURE - 1, int(np.random.exponential(_SIGNATURE / 4.0)))]
            elif u < label_share + topic_share:
                f = topics[label_cluster[lab], min(_TOPIC - 1, int(np.random.exponential(_TOPIC / 4.0)))]
            else:
                f = feature_ids[_draw(feature_cdf, 0, feature_cdf.size)]
            if seen[f] != r:
                seen[f] = r
                distinct += 1
            x_ids[nx] = f
            nx += 1
        x_indptr[r + 1] = nx
        y_indptr[r + 1] = ny
    return x_indptr, x_ids[:nx], y_indptr, y_ids[:ny]


def _zipf_cdf(n: int, exponent: float) -> np.ndarray:
    w = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    return np.cumsum(w / w.sum())


def make_dataset(shape="demo", n_train: int | None = None, n_test: int | None = None,
                 seed: int = 0):
    """Generate a synthetic extreme-classification dataset shaped like a public one.

    Parameters
    ----------
    shape : str or DatasetShape
        A preset name from :data:`PRESETS` or a custom shape.
    n_train, n_test : int, optional
        Row counts; default to the shape's. Train and test rows are drawn from one stream, so
        a smaller ``n_train`` is a subsample of the same distribution.
    seed : int
        Same seed, same data.

    Returns
    -------
    (X_train, Y_train, X_test, Y_test): float32 CSR matrices, X rows L2-normalised, Y 0/1.
    """
    if isinstance(shape, str):
        if shape not in PRESETS:
            raise ValueError(f"unknown preset {shape!r}; choose from {', '.join(PRESETS)}")
        shape = PRESETS[shape]
    n_train = shape.n_train if n_train is None else int(n_train)
    n_test = shape.n_test if n_test is None else int(n_test)
    if n_train <= 0 or n_test < 0:
        raise ValueError("n_train must be positive and n_test non-negative")
    rng = np.random.default_rng(seed)
    L, D = shape.n_labels, shape.n_features
    label_cdf = _zipf_cdf(L, shape.label_exponent)
    label_ids = rng.permutation(L).astype(np.int64)        # popularity rank → label id
    popularity = np.empty(L)
    popularity[label_ids] = np.diff(label_cdf, prepend=0.0)
    n_clusters = max(1, L // shape.cluster_size)
    label_cluster = rng.integers(0, n_clusters, L).astype(np.int64)
    members = np.argsort(label_cluster, kind="stable").astype(np.int64)
    cluster_start = np.searchsorted(label_cluster[members], np.arange(n_clusters + 1)).astype(np.int64)
    member_cdf = np.cumsum(popularity[members])
    feature_cdf = _zipf_cdf(D, 1.0)                        # background words
    feature_ids = rng.permutation(D).astype(np.int64)
    # topic words: moderately common words, shared between topics
    topic_p = np.diff(_zipf_cdf(D, 0.5), prepend=0.0)
    topics = feature_ids[rng.choice(D, size=(n_clusters, _TOPIC), p=topic_p)].astype(np.int64)
    signatures = rng.integers(0, D, size=(L, _SIGNATURE)).astype(np.int64)
    from_topic = rng.random((L, _SIGNATURE)) < _SIGNATURE_FROM_TOPIC
    topic_words = topics[label_cluster[:, None], rng.integers(0, _TOPIC, (L, _SIGNATURE))]
    signatures = np.where(from_topic, topic_words, signatures)
    n = n_train + n_test
    x_indptr, x_ids, y_indptr, y_ids = _generate(
        int(rng.integers(2**31 - 1)), n, label_cdf, label_ids, label_cluster, cluster_start,
        member_cdf, members, signatures, topics, feature_cdf, feature_ids,
        float(shape.features_per_sample), float(shape.labels_per_sample),
        float(shape.same_cluster), float(shape.label_share), float(shape.topic_share))
    X = sp.csr_matrix((np.ones(x_ids.size, np.float32), x_ids.astype(np.int32), x_indptr), shape=(n, D))
    X.sum_duplicates()
    X.data = np.log1p(X.data).astype(np.float32)
    norms = np.sqrt(np.asarray(X.multiply(X).sum(axis=1)).ravel()).astype(np.float32)
    X = sp.csr_matrix(sp.diags(1.0 / np.maximum(norms, 1e-12)) @ X, dtype=np.float32)
    # the product leaves a row's columns out of order: sorted, as a loader's rows are, so that
    # a query's checks need not copy and sort them
    X.sort_indices()
    Y = sp.csr_matrix((np.ones(y_ids.size, np.float32), y_ids.astype(np.int32), y_indptr), shape=(n, L))
    Y.sort_indices()
    return X[:n_train], Y[:n_train], X[n_train:], Y[n_train:]


def load_default(seed: int = 0):
    """The built-in default dataset (the ``demo`` preset), generated on the fly."""
    return make_dataset("demo", seed=seed)
