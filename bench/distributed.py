"""Data-parallel training on MPI: measured at 1 and 2 ranks here, modelled for clusters.

    python -m bench.distributed --out bench/results/distributed
    python -m bench.distributed --out bench/results/distributed --model-only   # re-model, re-plot

**Measured.** One process without MPI, then ``mpiexec -n 2`` for each mode (sync, local,
delayed), each rank on 1 thread, train the engine with its defaults (``--lr``: another learning
rate for every run) on the Amazon-670K preset
(each rank its own rows, in ``partial_fit`` chunks of ``--chunk-batches`` steps) for
``--seconds`` of training. Between chunks rank 0 scores P@1 on a fixed test sample (not timed:
all ranks wait at a barrier before the clock runs again). Each run records samples/s over all
ranks, compute and exchange seconds per step, the bytes each rank put into collectives per step
and the rows each exchange carried; the 2-rank runs also time blocking allreduces of 4-256 MB
(the link as the model sees it, through the engine's own non-blocking allreduce and wait). Compile and initialisation are excluded (a warm-up chunk).

**Modelled.** Throughput on N hosts, each computing a step in ``c`` seconds (the 1-rank run's
compute per step: one host = one rank like the measured one), linked at bandwidth ``B`` with
per-message latency ``alpha``:

* an allreduce of b bytes is a ring: ``2 (N-1) (alpha + b / (N B))``;
* the rows an exchange carries grow with N as independent draws: a rank touches a fraction p of
  the rows in a step (sync) or a round (local/delayed), taken from the 2-rank union
  ``u2 = 1 - (1-p)^2``, so N ranks carry ``1 - (1-p)^N`` of them (capped by all rows);
* packing, unpacking and merging cost what they cost per byte in the 2-rank runs;
* every exchange is preceded by the bit-mask allreduce of ``(n_labels + n_features) / 8`` bytes,
  and costs the measured local bookkeeping (building the mask, finding the ids);
* per step: sync ``c + mask + allreduce + pack``; local ``c + (mask + allreduce + pack) / H``;
  delayed ``c + (mask + max(0, allreduce - d c) + pack) / H`` (the allreduce overlaps d steps).

Efficiency is ``c / step time``; throughput ``N B_batch / step time``. The same model, given
this machine's measured allreduce bandwidth, predicts the 2-rank runs (including one blocking
average per chunk, which the harness's chunk end forces), and the JSON compares the two.
Writes ``OUT.json``, ``OUT.png`` and ``OUT.md``.
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

MODES = ("sync", "local", "delayed")
HOSTS = (2, 8, 32, 128)
GBPS = (10, 25, 100)
ALPHA = 20e-6  # seconds per message hop on an Ethernet cluster with MPI (an assumption)


# --------------------------------------------------------------------------------------------
# One measured run (every rank executes this under mpiexec, or alone)
# --------------------------------------------------------------------------------------------
def _worker(args):
    from slide.estimator import SlideClassifier
    from slide.synthetic import make_dataset
    comm = None
    if args.mode != "none":
        from mpi4py import MPI
        from slide.distributed import DataParallel
        comm = MPI.COMM_WORLD
        dp = DataParallel(comm, mode=args.mode, every=None if args.mode == "sync" else args.every,
                          delay=args.delay if args.mode == "delayed" else None)
    else:
        dp = None
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    barrier = comm.Barrier if comm is not None else (lambda: None)
    X, Y, Xte, Yte = make_dataset(args.preset, args.n_train, args.n_test, seed=0)
    X, Y = X[rank::size], Y[rank::size]
    model = SlideClassifier(threads=1, early_stopping=False, seed=0, lr=args.lr)
    if dp is None:  # the defaults follow the whole training set's shape, not the first chunk's
        model.initialize(X, Y)
    else:
        model.initialize(X, Y, distributed=dp)
    rng = np.random.default_rng([1, rank])
    order = rng.permutation(X.shape[0])
    t0 = time.perf_counter()
    model.partial_fit(X[order[:256]], Y[order[:256]], distributed=dp)  # compile and initialise
    warmup = time.perf_counter() - t0
    B = model.batch_size_
    chunk = args.chunk_batches * B
    model.state_.timings = {}
    if dp is not None:
        dp.reset_counters()
    trained, samples, points, pos = 0.0, 0, [], 256
    while comm.bcast(trained < args.seconds) if comm is not None else trained < args.seconds:
        # rank 0's clock decides for all: ranks that stopped apart would wait on each other
        if pos + chunk > order.size:
            order, pos = rng.permutation(X.shape[0]), 0
        ids = np.sort(order[pos:pos + chunk])
        pos += chunk
        barrier()
        t0 = time.perf_counter()
        model.partial_fit(X[ids], Y[ids], distributed=dp)
        trained += time.perf_counter() - t0
        samples += ids.size * size
        if rank == 0:
            p1 = model.evaluate(Xte, Yte, k=1)["P@1"]
            points.append({"seconds": trained, "samples": samples, "P@1": p1})
            print(f"[{args.mode} x{size}] {trained:6.1f}s {samples:8d} samples P@1={p1:.4f}", flush=True)
    steps = samples // (B * size)
    exchange = model.timings_.get("exchange", 0.0)
    out = {"mode": args.mode, "ranks": size, "batch": B, "hidden": model.resolved_["hidden"],
           "n_labels": model.n_labels_, "n_features": model.n_features_in_,
           "warmup_seconds": warmup, "train_seconds": trained, "samples": samples, "steps": steps,
           "samples_per_second": samples / trained,
           "compute_per_step": (trained - exchange) / steps, "exchange_per_step": exchange / steps,
           "timings": model.timings_, "points": points}
    if dp is not None:
        rows = np.array(dp.exchanged_rows_, float).reshape(-1, 2)
        out.update(every=dp.every, delay=dp.delay, exchanges=len(dp.exchanged_rows_),
                   bytes_per_step=dp.bytes_sent_ / steps, wait_per_step=dp.wait_seconds_ / steps,
                   pack_per_step=dp.pack_seconds_ / steps, rounds=dp.rounds_,
                   rows_per_exchange=rows.mean(axis=0).tolist() if rows.size else [0, 0],
                   bytes_per_exchange=dp.bytes_sent_ / max(len(dp.exchanged_rows_), 1),
                   pack_seconds=dp.pack_seconds_,
                   # per exchange, what is neither waiting nor packing: masks, ids, bookkeeping
                   fixed_per_exchange=max(0.0, exchange - dp.wait_seconds_ - dp.pack_seconds_)
                   / max(len(dp.exchanged_rows_), 1))
        out["allreduce"] = _allreduce_bandwidth(dp) if args.mode == "sync" else None
    if rank == 0:
        write_json(args.result, out)


def _allreduce_bandwidth(dp, sizes=(4 << 20, 64 << 20, 256 << 20)):
    """Seconds of a float32 sum over the ranks of each size (median of 3), through the same
    non-blocking allreduce and wait the engine's exchanges use, and the ring's bus bandwidth
    ``2 (N-1) / N * bytes / seconds``."""
    n = dp.size
    out = []
    for b in sizes:
        a = np.ones(b // 4, np.float32)
        times = []
        for _ in range(3):
            dp.comm.Barrier()
            t0 = time.perf_counter()
            dp.allreduce(a)
            times.append(time.perf_counter() - t0)
        t = float(np.median(times))
        out.append({"bytes": b, "seconds": t, "bus_bytes_per_second": 2 * (n - 1) / n * b / t})
    return out


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------
def _ring(bytes_, n, bandwidth, alpha):
    return 2 * (n - 1) * (alpha + bytes_ / (n * bandwidth)) if n > 1 else 0.0


def step_time(run, c, n, bandwidth, alpha, chunk_batches=None):
    """Modelled seconds per step of ``run``'s mode on n hosts (see the module docstring)."""
    if n == 1:
        return c
    L, D, H, H0 = run["n_labels"], run["n_features"], run["hidden"][-1], run["hidden"][0]
    u_out, u_in = run["rows_per_exchange"]
    # fraction of rows one rank carries, from the 2-rank union; then N ranks' union
    p_out = 1 - np.sqrt(max(0.0, 1 - u_out / L))
    p_in = 1 - np.sqrt(max(0.0, 1 - u_in / D))
    rows_out = L * (1 - (1 - p_out) ** n)
    rows_in = D * (1 - (1 - p_in) ** n)
    payload = 4 * (rows_out * (H + 1) + rows_in * H0 + H0)
    pack_per_byte = run["pack_seconds"] / max(run["bytes_per_exchange"] * run["exchanges"], 1)
    mask = _ring((L + D) / 8, n, bandwidth, alpha) + run["fixed_per_exchange"]
    comm = _ring(payload, n, bandwidth, alpha)
    pack = pack_per_byte * payload
    if run["mode"] == "sync":
        return c + mask + comm + pack
    H_ = run["every"]
    exposed = comm if run["mode"] == "local" else max(0.0, comm - run["delay"] * c)
    per_step = c + (mask + exposed + pack) / H_
    if chunk_batches:  # the harness ends each chunk with one blocking average
        per_step += (mask + comm + pack) / chunk_batches
    return per_step


def model(doc, alpha=ALPHA):
    single = next(r for r in doc["runs"] if r["ranks"] == 1)
    c = single["compute_per_step"]
    sync = next((r for r in doc["runs"] if r["mode"] == "sync"), None)
    link = max(x["bus_bytes_per_second"] for x in sync["allreduce"]) if sync and sync["allreduce"] else None
    predictions, checks = [], []
    for run in doc["runs"]:
        if run["ranks"] == 1:
            continue
        for gbps in GBPS:
            for n in HOSTS:
                t = step_time(run, c, n, gbps * 1e9 / 8, alpha)
                predictions.append({"mode": run["mode"], "hosts": n, "gbps": gbps,
                                    "efficiency": c / t, "samples_per_second": n * run["batch"] / t})
        if link:
            t = step_time(run, c, 2, link, 0.0, doc["args"]["chunk_batches"])
            predicted = 2 * run["batch"] / t
            checks.append({"mode": run["mode"], "measured": run["samples_per_second"],
                           "predicted": predicted,
                           "error": predicted / run["samples_per_second"] - 1})
    doc["model"] = {"compute_per_step": c, "alpha": alpha, "link_bytes_per_second": link,
                    "predictions": predictions, "two_rank_check": checks}
    return doc


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def _plot(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 1 + len(GBPS), figsize=(5 * (1 + len(GBPS)), 4))
    for run in doc["runs"]:
        pts = run["points"]
        label = "1 rank" if run["ranks"] == 1 else f"{run['mode']}, 2 ranks"
        axes[0].plot([p["seconds"] for p in pts], [p["P@1"] for p in pts], marker="o", label=label)
    axes[0].set(xlabel="training seconds", ylabel="P@1", title="measured, 1 thread per rank")
    axes[0].legend()
    for ax, gbps in zip(axes[1:], GBPS):
        for mode in MODES:
            pts = [p for p in doc["model"]["predictions"] if p["mode"] == mode and p["gbps"] == gbps]
            if pts:
                ax.plot([p["hosts"] for p in pts], [p["efficiency"] for p in pts], marker="o", label=mode)
        ax.axhline(0.9, color="grey", lw=0.5, ls="--")
        ax.set(xscale="log", xlabel="hosts", ylabel="scaling efficiency", ylim=(0, 1.05),
               title=f"modelled, {gbps} Gb/s")
        ax.set_xticks(HOSTS, [str(h) for h in HOSTS])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(doc) -> str:
    lines = ["| run | samples/s | compute ms/step | exchange ms/step | bytes sent/step | rows per exchange (out, in) | P@1 at end |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        name = "1 rank" if r["ranks"] == 1 else f"{r['mode']} x2"
        rows = r.get("rows_per_exchange")
        lines.append(f"| {name} | {r['samples_per_second']:.0f} | {1e3 * r['compute_per_step']:.1f} | "
                     f"{1e3 * r['exchange_per_step']:.1f} | {r.get('bytes_per_step', 0) / 1e6:.1f} MB | "
                     f"{'' if rows is None else f'{rows[0]:.0f}, {rows[1]:.0f}'} | "
                     f"{r['points'][-1]['P@1']:.4f} |")
    m = doc["model"]
    lines += ["", "| mode | " + " | ".join(f"{n} hosts @ {g} Gb/s" for g in GBPS for n in HOSTS[1:]) + " |",
              "|---|" + "---|" * (len(GBPS) * (len(HOSTS) - 1))]
    for mode in MODES:
        eff = {(p["hosts"], p["gbps"]): p["efficiency"] for p in m["predictions"] if p["mode"] == mode}
        if eff:
            lines.append(f"| {mode} | " + " | ".join(f"{eff[(n, g)]:.0%}" for g in GBPS for n in HOSTS[1:]) + " |")
    lines += ["", "| 2 ranks here | measured samples/s | model | error |", "|---|---|---|---|"]
    for c in m["two_rank_check"]:
        lines.append(f"| {c['mode']} | {c['measured']:.0f} | {c['predicted']:.0f} | {c['error']:+.0%} |")
    return "\n".join(lines) + "\n"


def _launch(args, mode, ranks, result):
    cmd = [sys.executable, "-m", "bench.distributed", "--worker", "--mode", mode,
           "--result", result] + [f"--{k.replace('_', '-')}={v}" for k, v in
                                  (("preset", args.preset), ("n_train", args.n_train),
                                   ("n_test", args.n_test), ("seconds", args.seconds),
                                   ("chunk_batches", args.chunk_batches), ("every", args.every),
                                   ("delay", args.delay), ("lr", args.lr)) if v is not None]
    if ranks > 1:
        cmd = mpiexec(ranks) + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env)
    with open(result) as fh:
        return json.load(fh)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/distributed")
    p.add_argument("--preset", default="amazon-670k")
    p.add_argument("--n-train", type=int, default=40000)
    p.add_argument("--n-test", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=60.0, help="training seconds per run")
    p.add_argument("--chunk-batches", type=int, default=256,
                   help="steps per partial_fit chunk (each ends with a blocking average: keep it "
                        "several times --every)")
    p.add_argument("--every", type=int, default=None,
                   help="local/delayed: steps between averages (default: the engine's)")
    p.add_argument("--delay", type=int, default=None,
                   help="delayed: steps an average is in flight (default: the engine's)")
    p.add_argument("--lr", type=float, default=None,
                   help="every run's learning rate (default: the engine's rule)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--model-only", action="store_true", help="re-model and re-plot OUT.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.model_only:
        with open(args.out + ".json") as fh:
            doc = json.load(fh)
    else:
        doc = {"machine": machine(), "args": vars(args), "runs": []}
        doc["runs"].append(_launch(args, "none", 1, args.out + ".tmp.json"))
        for mode in args.modes.split(","):
            doc["runs"].append(_launch(args, mode, 2, args.out + ".tmp.json"))
        os.remove(args.out + ".tmp.json")
    doc = model(doc)
    write_json(args.out + ".json", doc)
    _plot(doc, args.out + ".png")
    with open(args.out + ".md", "w") as fh:
        fh.write(_table(doc))
    print(_table(doc))


if __name__ == "__main__":
    main()
