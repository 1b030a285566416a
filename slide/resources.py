"""Memory: what a model will need before it is allocated, what the machine has, what was used.

A header that declares ten million labels would otherwise start allocating a model that cannot
fit and be killed by the kernel minutes later; :func:`check_fits` refuses it up front with the
size, the parts that make it up and the settings that shrink it.
"""
from __future__ import annotations

import math
import os
import resource
import sys

from slide.candidates import ClusterCandidates
from slide.config import sample_negatives

__all__ = ["peak_rss_mb", "available_memory_bytes", "memory_limit_bytes", "parse_bytes",
           "model_memory_bytes", "check_fits", "ModelTooLargeError", "MEMORY_LIMIT_ENV"]


class ModelTooLargeError(MemoryError):
    """The configuration needs more memory than the machine has available."""


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (Linux reports KiB)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1024 if sys.platform != "darwin" else r / 2**20


def available_memory_bytes() -> int | None:
    """Memory this process may still use: the smaller of MemAvailable and the cgroup's free
    limit (containers), or None when neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as fh:
                text = fh.read().strip()
            with open(usage) as fh:
                used = int(fh.read().strip())
            if text.isdigit() and int(text) < 1 << 60:
                found.append(int(text) - used)
        except (OSError, ValueError):
            continue
    if not found:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return max(0, min(found))


def model_memory_bytes(resolved: dict, n_features: int, n_labels: int, threads: int,
                       compact_gradients: bool = True, features_per_row: float | None = None,
                       runs: int = 1, best_weights: bool = True) -> dict:
    """Bytes a model needs, by part, for :func:`slide.config.resolve`'s settings ``resolved``
    over ``n_labels`` output rows.

    Per parameter, float32 weights and two Adam moments, and, with ``best_weights``, one more
    for the best weights kept by early stopping; LSH tables, or the output's label clusters
    where they give its hard negatives, and per-thread scratch. Gradients: with
    ``compact_gradients`` (the engine's), a row for each output row one step can add gradients
    to (the batch's hard negatives and labels and the shared pool, at most every label) and for
    each input row (a batch's non-zeros at ``features_per_row``, at most every feature);
    otherwise (the dense reference) a full array per parameter. ``runs``: models held at once
    (fit holds the best run of its selection while the next trains, where no refit follows: 2).
    """
    hidden = [int(h) for h in resolved["hidden"]]
    n_params = n_features * hidden[0] + sum(a * b for a, b in zip(hidden[:-1], hidden[1:])) \
        + n_labels * (hidden[-1] + 1) + sum(hidden)
    gradients = n_params
    if compact_gradients:
        out_rows = min(n_labels, resolved["batch_size"] * (sample_negatives(resolved) + 1)
                       + resolved["pool"])
        gradients -= (n_labels - out_rows) * (hidden[-1] + 1)
        if features_per_row is not None:
            in_rows = min(n_features, math.ceil(resolved["batch_size"] * features_per_row))
            gradients -= (n_features - in_rows) * hidden[0]
    runs = max(1, int(runs))
    parts = {"parameters": 4 * n_params * runs, "adam_moments": 8 * n_params * runs,
             "gradients": 4 * gradients, "best_weights": 4 * n_params * runs * best_weights}
    clusters = resolved.get("sampled") and resolved.get("negatives_from") == "clusters"
    tables = 0
    # the output's tables are built where they give the hard negatives; the label clusters
    # otherwise (slide.candidates)
    for t in [None if clusters else resolved.get("tables")] + \
            [l["tables"] for l in resolved.get("hidden_layers", []) if l]:
        if t:
            tables += 4 * t["L"] * (1 << t["range_pow"]) * (t["bucket_size"] + 1)
    parts["hash_tables"] = tables * runs
    if clusters:
        held, passing = ClusterCandidates.expected_bytes(n_labels, hidden[-1])
        parts["label_clusters"] = held * runs + passing
    # per-thread query sets (slots and positions for two to four times the largest union, and
    # its ids and hit counts: at most 40 bytes an id), the step's maps of the labels (a row's
    # owners, uint8; its place in the shared pool, int32), and where the output is whole a
    # block of exact scores for the validation loss (64 MB; a sampled output is scored top-k)
    out = resolved.get("tables")
    union = out["L"] * out["bucket_size"] if out else 0
    parts["scratch"] = 40 * max(1, threads) * union + 5 * n_labels + \
        (0 if resolved.get("sampled") else 1 << 26)
    parts["total"] = sum(parts.values())
    return parts


#: environment variable holding a memory limit for each process (bytes, or with a K/M/G/T
#: suffix): under mpiexec, each rank's share of a host
MEMORY_LIMIT_ENV = "SLIDE_MEMORY_LIMIT"


def parse_bytes(text: str) -> int:
    """``"12G"``, ``"512M"``, ``"3.5e9"`` as bytes (binary suffixes K, M, G, T)."""
    t = str(text).strip().upper().rstrip("B").rstrip("I")
    scale = 1
    if t and t[-1] in "KMGT":
        scale = 1024 ** ("KMGT".index(t[-1]) + 1)
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise ValueError(f"a memory size must be a number of bytes with an optional K, M, G or "
                         f"T suffix, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(value)


def memory_limit_bytes() -> int | None:
    """What this process may use: the available memory, or less where
    ``SLIDE_MEMORY_LIMIT`` says so (None where neither is known)."""
    avail = available_memory_bytes()
    limit = os.environ.get(MEMORY_LIMIT_ENV)
    if limit:
        limit = parse_bytes(limit)
        avail = limit if avail is None else min(avail, limit)
    return avail


def check_fits(parts: dict, what: str = "this model", per_shard=None) -> None:
    """Raise :class:`ModelTooLargeError` if ``parts["total"]`` exceeds the memory this process
    may use (:func:`memory_limit_bytes`). ``per_shard(n)``: one rank's parts with the output
    layer over n label shards (:mod:`slide.shards`); the error then says how many would fit."""
    avail = memory_limit_bytes()
    if avail is None or parts["total"] <= avail:
        return
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    detail = ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in parts.items()
                       if k != "total" and v >= 2**26)
    raise ModelTooLargeError(
        f"{what} needs about {gib(parts['total'])} ({detail}) but {gib(avail)} is available. "
        f"A smaller hidden layer (hidden) shrinks every weight matrix; fewer or smaller hash "
        f"tables (L, bucket_size) shrink the tables; for an output layer this wide, check that "
        f"the data's declared label count is what you meant" + _shards_advice(per_shard, avail))


def _shards_advice(per_shard, avail: int) -> str:
    """The fewest label shards whose ranks each fit in ``avail`` bytes, as advice."""
    if per_shard is None:
        return ""
    n = 2
    while n <= 1 << 16:
        if per_shard(n)["total"] <= avail:
            return (f". Sharded by label over {n} MPI ranks with this much memory each, it "
                    f"would fit: mpiexec -n {n} slide train ... --distributed labels "
                    f"(SlideClassifier.fit(..., distributed=slide.shards.LabelShards()))")
        n *= 2
    return ". Even 65,536 label shards would not fit: the hidden layers alone are too large"
