"""The output layer sharded by label (``slide.shards``): measured at 1 and 2 ranks, modelled for
clusters.

    python -m bench.label_shards --data ../shared/data/git_openstack --out bench/results/label_shards_git
    python -m bench.label_shards --preset amazon-670k --n-train 100000 --out bench/results/label_shards_amazon
    python -m bench.label_shards --model-only --out bench/results/label_shards_amazon

**Measured.** One process (no MPI), one rank under ``mpiexec`` running the sharded step over the
whole layer (``1-shard``: the model's base), then ``mpiexec -n 2`` with
:class:`slide.shards.LabelShards`, every rank on one thread, train the engine with its defaults for the same ``--epochs`` (early
stopping and the refit off, so that both train the same epochs on the same rows), on a preset or
a data directory (``train.txt``, ``test.txt``). Each run records the test P@1 and P@5 (on up to
``--n-test`` rows), samples/s, the step's phases, the bytes each rank put into collectives per
step, the bytes of each rank's output layer (weights and Adam moments in their row block, the
biases and theirs, the LSH tables) and each rank's peak resident memory.

**Modelled.** A step on N shards costs what is replicated (the hidden layers forward and
backward, hashing the last hidden layer: ``forward_hidden``, ``backward_hidden``, ``hash``),
plus the output layer's phases divided by N (each shard computes 1/N of the active set and
rehashes 1/N of the rows: ``select+output``, ``logit_stats``, ``pool_matmul``, ``adam``,
``rehash``), plus two
collectives: the allgather of the normaliser's parts (8·batch bytes a rank), a ring of
``(N-1) (alpha + b / B)``, and the allreduce of the hidden gradient with the loss
(4·batch·(hidden + 1) bytes), a ring of ``2 (N-1) (alpha + b / (N B))``. The
output phases' time per step does not grow with the labels (the active set is fixed); the
rehash's does, in proportion to the rows a shard holds (measured per row here). The model,
given the 1-rank run's phases and this machine's measured allreduce of small messages,
(``1-shard``) predicts the 2-rank run; the JSON compares the two, and models 8-128 hosts for 10^6, 10^7 and
10^8 labels on 10/25/100 Gb/s links, with each host's output-layer memory.

Writes ``OUT.json`` and ``OUT.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from bench.common import machine, mpiexec, write_json

HOSTS = (1, 2, 8, 32, 128)
LABELS = (10 ** 6, 10 ** 7, 10 ** 8)
GBPS = (10, 25, 100)
ALPHA = 20e-6  # seconds per message hop on an Ethernet cluster with MPI (an assumption)
#: the step's phases each shard does in full, and those it does for its rows alone
REPLICATED = ("forward_hidden", "backward_hidden", "hash")
SHARDED = ("select+output", "logit_stats", "pool_matmul", "adam", "rehash")


def _load(args):
    if args.data:
        from slide.data import read_dataset
        X, Y = read_dataset(os.path.join(args.data, "train.txt"))
        Xte, Yte = read_dataset(os.path.join(args.data, "test.txt"), n_features=X.shape[1],
                                n_labels=Y.shape[1])
        return X, Y, Xte[:args.n_test], Yte[:args.n_test]
    from bench.common import dataset
    return dataset(args.preset, args.n_train, args.n_test)


def _output_bytes(model) -> int:
    """Bytes of this process's output layer: the row block (weights and moments), the biases
    and their moments, the training tables."""
    s = model.state_
    total = s.row_blocks()["W"].nbytes + s.params["b"].nbytes + \
        s.moments["b.m"].nbytes + s.moments["b.v"].nbytes
    if s.tables is not None:
        total += s.tables.nbytes
    return int(total)


def _worker(args):
    import resource

    from slide.estimator import SlideClassifier
    dp = None
    if args.mpi:
        from slide.shards import LabelShards
        dp = LabelShards()
    rank = 0 if dp is None else dp.rank
    X, Y, Xte, Yte = _load(args)
    model = SlideClassifier(threads=1, seed=0, epochs=args.epochs, early_stopping=False,
                            refit=False)
    t0 = time.perf_counter()
    model.initialize(X, Y, distributed=dp)
    per_step = _record_steps(model.state_)
    model.train(X, Y, continue_training=True, distributed=dp, until_epoch=args.epochs)
    fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    ev = model.evaluate(Xte, Yte, k=5)
    eval_seconds = time.perf_counter() - t0
    steps = int(model.step_)
    hist = model.history_
    out = {"ranks": args.ranks, "mpi": bool(args.mpi), "rank": rank, "epochs": model.epoch_, "steps": steps,
           "batch": model.batch_size_, "hidden": model.resolved_["hidden"],
           "n_outputs": int(model.n_outputs_fitted_), "rows_here": int(model.n_outputs_),
           "lsh_cap": model.resolved_["lsh_cap"], "pool": model.resolved_["pool"],
           "sampled": bool(model.resolved_["sampled"]),
           "fit_seconds": fit, "train_seconds": sum(h["train_seconds"] for h in hist),
           "samples_per_second": float(np.median([h["samples_per_second"] for h in hist])),
           "test_P@1": ev["P@1"], "test_P@5": ev["P@5"], "eval_seconds": eval_seconds,
           "timings_per_step": {k: v / max(steps, 1) for k, v in model.timings_.items()},
           "output_layer_bytes": _output_bytes(model),
           # seconds of every step after the first epoch's first (compile) by part: what each
           # rank does in full, its shard's part but the rehash, the rehash, the exchange
           "per_step": _spread(np.round(np.array(per_step[1:]), 7), 1000).tolist(),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if dp is not None:
        out["bytes_per_step"] = dp.bytes_sent_ / max(dp.steps_, 1)
        out["small_allreduce_seconds"] = _small_allreduce(dp, model.batch_size_,
                                                          model.resolved_["hidden"][-1])
        everyone = dp.comm.gather(out)
        if rank != 0:
            return
        per_step = everyone[0]["per_step"]
        for r in everyone:
            del r["per_step"]
        out = {"ranks": args.ranks, "mpi": True, "per_rank": everyone, "per_step": per_step,
               **{k: everyone[0][k] for k in ("epochs", "steps", "batch", "hidden", "n_outputs",
                                              "sampled", "test_P@1", "test_P@5", "fit_seconds",
                                              "train_seconds", "samples_per_second",
                                              "small_allreduce_seconds")},
               "timings_per_step": everyone[0]["timings_per_step"],
               "output_layer_bytes": max(r["output_layer_bytes"] for r in everyone),
               "peak_rss_bytes": max(r["peak_rss_bytes"] for r in everyone),
               "bytes_per_step": everyone[0]["bytes_per_step"]}
    write_json(args.result, out)


def _spread(a: np.ndarray, n: int) -> np.ndarray:
    """At most ``n`` rows of ``a``, evenly spaced (the recorded steps kept)."""
    return a if a.shape[0] <= n else a[np.linspace(0, a.shape[0] - 1, n).astype(int)]


def _record_steps(state) -> list:
    """Wrap ``state``'s step so that each call appends its seconds by part (replicated,
    sharded, rehash, exchange: the phases of :data:`REPLICATED`, :data:`SHARDED` and
    ``exchange``) to the list returned."""
    steps, step = [], state.train_step

    def timed(Xb, Yb):
        before = dict(state.timings)
        loss = step(Xb, Yb)
        d = {k: v - before.get(k, 0.0) for k, v in state.timings.items()}
        steps.append((sum(d.get(k, 0.0) for k in REPLICATED),
                      sum(d.get(k, 0.0) for k in SHARDED if k != "rehash"),
                      d.get("rehash", 0.0), d.get("exchange", 0.0)))
        return loss
    state.train_step = timed
    return steps


def _small_allreduce(dp, batch, hidden, repeats=50):
    """Median seconds of the step's two collectives (an allgather of batch × 2 float32s, an
    allreduce of batch·(hidden+1)) through the engine's own calls, every rank idle
    otherwise."""
    seconds = []
    a, b = np.ones((batch, 2), np.float32), np.ones(batch * (hidden + 1), np.float32)
    for _ in range(repeats):
        t0 = time.perf_counter()
        dp._allgather(a)
        dp.allreduce(b)
        seconds.append(time.perf_counter() - t0)
    return float(np.median(seconds))


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------
def _ring(bytes_, n, bandwidth, alpha):
    """An allreduce of ``bytes_`` on a ring of n."""
    return 0.0 if n <= 1 else 2 * (n - 1) * (alpha + bytes_ / (n * bandwidth))


def _gather(bytes_, n, bandwidth, alpha):
    """An allgather of ``bytes_`` from each of n on a ring."""
    return 0.0 if n <= 1 else (n - 1) * (alpha + bytes_ / bandwidth)


def step_time(one: dict, n: int, bandwidth: float, alpha: float, labels: int | None = None,
              exchange: float | None = None, draws: int = 4000) -> dict:
    """Seconds of a step on ``n`` label shards from the 1-rank run ``one``, for ``labels``
    output rows (the rehash in proportion), with its collectives on a ring of ``bandwidth``
    bytes/s and ``alpha`` s a hop, or ``exchange`` seconds measured.

    Each rank computes its part of a step, ``replicated + sharded / n`` of one of ``one``'s
    steps, and the collectives wait for the slowest: the mean over ``draws`` of the largest of
    n parts drawn from ``one``'s steps (a straggler costs every rank). Every rank rehashes at
    the same steps (the same schedule), so the rehash adds its mean, ``rehash / n``, outside
    the largest. Plus the exchange."""
    steps = np.asarray(one["per_step"], np.float64)
    scale = 1.0 if labels is None else labels / one["n_outputs"]
    parts = steps[:, 0] + steps[:, 1] / n
    rng = np.random.default_rng(0)
    slowest = parts[rng.integers(0, parts.size, (draws, n))].max(axis=1).mean()
    rehash = scale * steps[:, 2].mean() / n
    B, H = one["batch"], one["hidden"][-1]
    if exchange is None:
        exchange = _gather(8 * B, n, bandwidth, alpha) + _ring(4 * B * (H + 1), n, bandwidth, alpha)
    step = slowest + rehash + exchange
    return {"compute": float(parts.mean() + rehash), "straggler": float(slowest - parts.mean()),
            "exchange": exchange, "step": float(step), "samples_per_second": float(B / step)}


def output_bytes(labels: int, hidden: int, n: int) -> float:
    """Bytes of one shard's output layer: weights, two Adam moments and the best weights (16
    bytes a weight), the biases likewise."""
    return 16.0 * labels * (hidden + 1) / n


def model(doc: dict, alpha: float = ALPHA) -> dict:
    one, two = doc["runs"].get("1-shard"), doc["runs"].get("2")
    out = {"alpha": alpha, "assumptions": [
        "each host is one rank computing like the measured 1-thread rank",
        "the output phases (select+output, pool_matmul, adam) cost the same per step at any "
        "label count (a fixed active set); the rehash grows with a shard's rows",
        "allreduces are rings with alpha seconds a hop; the link's bandwidth is all the "
        "engine's"]}
    if one is None:
        return out
    pair = doc["runs"].get("1-shard-pair")
    if two is not None and pair is not None:
        # two ranks on this one host share its memory: the check's compute is that of a rank
        # beside another (the pair), the exchange this machine's
        predicted = step_time(pair, 2, 1.0, 0.0, exchange=two["small_allreduce_seconds"])
        measured = float(np.mean(np.asarray(two["per_step"])[:, :4].sum(axis=1)))
        out["check_2_ranks"] = {"predicted_step": predicted["step"], "measured_step": measured,
                                "predicted": predicted, "ratio": predicted["step"] / measured}
    H = one["hidden"][-1]
    grid = []
    for labels in LABELS:
        for gbps in GBPS:
            for n in HOSTS:
                s = step_time(one, n, gbps * 1e9 / 8, alpha, labels)
                grid.append({"labels": labels, "gbps": gbps, "hosts": n, **s,
                             "output_gib_per_host": output_bytes(labels, H, n) / 2 ** 30,
                             "speedup": step_time(one, 1, gbps * 1e9 / 8, alpha, labels)["step"]
                             / s["step"]})
    out["grid"] = grid
    return out


def _table(doc) -> str:
    lines = ["| ranks | test P@1 | P@5 | samples/s | output layer / rank (MiB) | peak RSS / rank "
             "(GiB) | bytes / step / rank |", "|---|---|---|---|---|---|---|"]
    for n, r in doc["runs"].items():
        lines.append(f"| {n} | {r['test_P@1']:.4f} | {r['test_P@5']:.4f} | "
                     f"{r['samples_per_second']:.0f} | {r['output_layer_bytes'] / 2**20:.1f} | "
                     f"{r['peak_rss_bytes'] / 2**30:.2f} | {r.get('bytes_per_step', 0):.0f} |")
    m = doc.get("model", {})
    if "check_2_ranks" in m:
        c = m["check_2_ranks"]
        lines += ["", f"Model check at 2 ranks: predicted step {1e3 * c['predicted_step']:.2f} ms, "
                      f"measured {1e3 * c['measured_step']:.2f} ms (ratio {c['ratio']:.2f})."]
    if m.get("grid"):
        lines += ["", "| labels | Gb/s | hosts | step (ms) | straggler (ms) | exchange (ms) | "
                      "samples/s | speedup | output GiB / host |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for g in m["grid"]:
            if g["gbps"] == 25 or g["hosts"] == 32:
                lines.append(f"| {g['labels']:.0e} | {g['gbps']} | {g['hosts']} | "
                             f"{1e3 * g['step']:.2f} | {1e3 * g['straggler']:.2f} | "
                             f"{1e3 * g['exchange']:.3f} | {g['samples_per_second']:.0f} | "
                             f"{g['speedup']:.2f} | {g['output_gib_per_host']:.2f} |")
    return "\n".join(lines) + "\n"


def _launch(args, run, result):
    if run == "1-shard-pair":  # two one-rank jobs at once: a rank beside another on this host
        other = subprocess.Popen(_command(args, "1-shard", result + ".other"),
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
        out = _launch(args, "1-shard", result)
        other.wait()
        os.remove(result + ".other")
        return out
    subprocess.run(_command(args, run, result), check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(result) as fh:
        return json.load(fh)


def _command(args, run, result) -> list:
    ranks = int(run.split("-")[0])
    cmd = [sys.executable, "-m", "bench.label_shards", "--worker", f"--ranks={ranks}",
           f"--result={result}", f"--epochs={args.epochs}", f"--n-test={args.n_test}",
           f"--n-train={args.n_train}", f"--preset={args.preset}"]
    if args.data:
        cmd.append(f"--data={args.data}")
    if run != "1":
        cmd = mpiexec(ranks) + cmd + ["--mpi"]
    return cmd


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/label_shards")
    p.add_argument("--preset", default="amazon-670k")
    p.add_argument("--data", default=None, metavar="DIR", help="train.txt and test.txt here")
    p.add_argument("--n-train", type=int, default=100000)
    p.add_argument("--n-test", type=int, default=5000)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--ranks", type=int, default=None, help="(worker) ranks of this run")
    p.add_argument("--runs", default="1,1-shard,1-shard-pair,2",
                   help="runs: 1 (one process, no MPI), 1-shard (one rank under mpiexec, the "
                        "sharded step over the whole layer: the model's base), 1-shard-pair "
                        "(two such jobs at once: the base of the check on this one host), N "
                        "(N shards)")
    p.add_argument("--mpi", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-only", action="store_true", help="re-model OUT.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.model_only:
        with open(args.out + ".json") as fh:
            doc = json.load(fh)
    else:
        doc = {"machine": machine(), "args": vars(args), "runs": {}}
        for n in args.runs.split(","):
            doc["runs"][n] = _launch(args, n, args.out + f".{n}.tmp.json")
            os.remove(args.out + f".{n}.tmp.json")
            r = doc["runs"][n]
            print(f"{n} rank(s): test P@1 {r['test_P@1']:.4f}, {r['samples_per_second']:.0f} "
                  f"samples/s, output layer {r['output_layer_bytes'] / 2**20:.1f} MiB a rank",
                  flush=True)
    doc["model"] = model(doc)
    runs = doc["runs"]
    if "1" in runs and "2" in runs:
        doc["two_over_one"] = {
            "P@1_difference": runs["2"]["test_P@1"] - runs["1"]["test_P@1"],
            "output_layer_share": runs["2"]["output_layer_bytes"] / runs["1"]["output_layer_bytes"]}
    write_json(args.out + ".json", doc)
    with open(args.out + ".md", "w") as fh:
        fh.write(_table(doc))
    print(_table(doc))


if __name__ == "__main__":
    main()
