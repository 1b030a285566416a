"""Time to accuracy: P@1 against wall-clock training seconds, one line per engine.

    python -m bench.time_to_accuracy --preset amazon-670k --engines slide,dense-cpu --minutes 10 \
        --n-train 100000 --out bench/results/tta_amazon

Every engine trains for the same wall-clock budget on the same data (batches of a seeded
shuffled order, epoch after epoch). Every ``--eval-every`` seconds of training it is evaluated
on the same fixed shuffled test sample; evaluation time is not counted in the budget, nor is
compiling: before its clock starts, each engine's process trains a throwaway model of the same
engine on ``--warmup-rows`` rows. ``--preset`` may also name a real set's folder in
``--data-dir`` (``train.txt``, ``test.txt``), whose every training row is used. Writes
``OUT.json`` (points, config, machine) and ``OUT.png`` (the plot). Engines: ``slide``,
``dense-cpu``, ``dense-gpu`` (cupy, full softmax), ``dense-gpu-sampled`` and
``dense-cpu-sampled`` (the batch's labels plus ``--negatives`` shared random rows),
``hetero-hogbatch`` and ``hetero-adaptive`` (``hetero`` is the latter): the engine's CPU
threads with a GPU worker (on numpy without a GPU), whose per-worker samples, busy seconds and
utilisation are recorded. ``+mined`` after a sampled or a hetero engine adds ``--mined`` hard
negatives a row, its best-scoring output rows by the exact product (``mined_negatives``,
``HeteroConfig.gpu_mined``); ``slide+lsh`` / ``slide+clusters`` is the engine with its hard
negatives from its LSH tables / label clusters whatever the rule says (``negatives_from``).
Each engine runs in its own process. The linear peers,
``xr-linear`` and ``parabel`` (:mod:`bench.peers`, in the peers environment of
``--peers-python``), train once with their defaults on the same rows: each is one point, its
training seconds and its P@1 on the same test sample (skipped, with a note, without that
environment).
The learning rate follows ``fit``'s schedule (``--schedule fit``, the default): at each epoch
of the harness, :func:`slide.loop.epoch_learning_rate` over the epochs ``fit`` would plan for
this training set (:func:`slide.config.resolve`), set through the step API's
``learning_rate_`` for every engine alike. There are no plateau drops (no validation slice
here). ``--schedule constant`` keeps the engine's initial rate.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from bench import peers
from bench.common import dataset, machine, run_isolated, write_json
from bench.quality import load_set
from slide.config import SlideConfig, resolve
from slide.loop import epoch_learning_rate


def _make(engine, args):
    engine, plus = engine.split("+", 1) if "+" in engine else (engine, "")
    if plus not in ("", "mined", "lsh", "clusters") or (
            plus == "mined" and not engine.endswith("sampled") and not engine.startswith("hetero")
    ) or (plus in ("lsh", "clusters") and engine != "slide"):
        raise ValueError(f"unknown engine {engine}+{plus}")
    mined = args.mined if plus == "mined" else 0
    if engine == "slide":
        from slide.estimator import SlideClassifier
        return SlideClassifier(hidden=(args.hidden,), sparsity=args.sparsity, threads=args.threads,
                               batch_size=args.batch_size, seed=args.seed,
                               negatives_from=plus or None)
    if engine in ("dense-cpu", "dense-gpu", "dense-gpu-sampled", "dense-cpu-sampled"):
        from gpu_ref import DenseClassifier
        return DenseClassifier(hidden=(args.hidden,), batch_size=args.batch_size, seed=args.seed,
                               device="cpu" if engine.startswith("dense-cpu") else "gpu",
                               negatives=args.negatives if engine.endswith("sampled") else None,
                               mined_negatives=mined)
    if engine.startswith("hetero"):
        from gpu_ref.hetero import HeteroConfig, HeteroTrainer
        from slide.estimator import SlideClassifier
        model = SlideClassifier(hidden=(args.hidden,), sparsity=args.sparsity, threads=args.threads,
                                batch_size=args.batch_size, seed=args.seed)
        policy = "hogbatch" if engine == "hetero-hogbatch" else "adaptive"
        return HeteroTrainer(model, HeteroConfig(policy=policy, cpu_batch=args.batch_size,
                                                 gpu_pool=args.negatives, gpu_mined=mined))
    raise ValueError(f"unknown engine {engine!r}")


def _chunk(engine, model, args) -> int:
    """Rows per ``partial_fit`` call of ``engine``'s ``model``."""
    chunk = args.batch_size * args.chunk_batches
    # a hetero call ends both workers' streams: let it hold several of the GPU's batches
    if engine.startswith("hetero"):
        chunk = max(chunk, 8 * model.config.gpu_batch)
    return chunk


def _warm_up(engine, args, Xtr, Ytr, Xte, Yte):
    """Train and evaluate a throwaway model of ``engine`` on the first ``--warmup-rows`` rows,
    so that the kernels the run needs (numba's, cupy's, a rehash's) are compiled before its
    clock starts: on a fresh machine the first engine's compile otherwise counts as training."""
    if args.warmup_rows <= 0:
        return
    t0 = time.perf_counter()
    warm = _make(engine, args)
    chunk = _chunk(engine, warm, args)
    for start in range(0, min(args.warmup_rows, Xtr.shape[0]), chunk):
        rows = np.arange(start, min(start + chunk, Xtr.shape[0]))
        warm.partial_fit(Xtr[rows], Ytr[rows])
    if hasattr(warm, "synchronize"):
        warm.synchronize()
    (warm.model if engine.startswith("hetero") else warm).evaluate(Xte[:64], Yte[:64], k=5)
    print(f"[{engine}] warm-up (not timed): {time.perf_counter() - t0:.1f}s", flush=True)


def _data(args):
    """The harness's rows: ``--n-train`` rows of the preset, or where ``--preset`` names a
    folder of ``--data-dir`` that real set's rows, with a fixed shuffled ``--n-eval`` of its
    test rows."""
    if os.path.isdir(os.path.join(args.data_dir, args.preset)):
        from slide.data import shuffle_rows
        _, Xtr, Ytr, Xte, Yte = load_set(args.preset, args.data_dir, args.seed)
        return (Xtr, Ytr, *shuffle_rows(Xte, Yte, seed=args.seed,
                                        n=min(args.n_eval, Xte.shape[0])))
    return dataset(args.preset, args.n_train, args.n_eval, args.seed)


def _run(engine, args, queue):
    Xtr, Ytr, Xte, Yte = _data(args)
    hetero = engine.startswith("hetero")
    _warm_up(engine, args, Xtr, Ytr, Xte, Yte)
    model = _make(engine, args)
    evaluated = model.model if hetero else model
    workers = {w: {"samples": 0, "updates": 0, "busy_seconds": 0.0} for w in ("cpu", "gpu")}
    chunk = _chunk(engine, model, args)
    points = []
    train_seconds, samples, epoch = 0.0, 0, 0
    next_eval = 0.0  # the first point comes after the first chunk
    budget = args.minutes * 60
    order = np.random.default_rng([args.seed, epoch]).permutation(Xtr.shape[0])
    pos = 0
    planned = resolve(SlideConfig(hidden=(args.hidden,), sparsity=args.sparsity,
                                  batch_size=args.batch_size), Xtr.shape[1], Ytr.shape[1],
                      Xtr.shape[0])["epochs"]
    base_lr = None  # the engine's initial rate, once the first call has resolved it
    while True:
        if pos >= Xtr.shape[0]:
            epoch += 1
            order = np.random.default_rng([args.seed, epoch]).permutation(Xtr.shape[0])
            pos = 0
            if args.schedule == "fit":
                base_lr = base_lr or evaluated.learning_rate_
                evaluated.learning_rate_ = epoch_learning_rate(base_lr, epoch, planned)
        idx = np.sort(order[pos:pos + chunk])
        pos += idx.size
        t0 = time.perf_counter()
        stats = model.partial_fit(Xtr[idx], Ytr[idx])
        if hasattr(model, "synchronize"):
            model.synchronize()
        train_seconds += time.perf_counter() - t0
        if hetero:
            for w, s in stats.items():
                for k in workers[w]:
                    workers[w][k] += s[k]
        samples += idx.size
        if train_seconds >= next_eval or train_seconds >= budget:
            res = evaluated.evaluate(Xte, Yte, k=5)
            points.append({"seconds": train_seconds, "samples": samples, "epoch": samples / Xtr.shape[0],
                           "learning_rate": float(evaluated.learning_rate_), **res})
            print(f"[{engine}] {train_seconds:7.1f}s  {samples:8d} samples  P@1={res['P@1']:.4f}", flush=True)
            next_eval = train_seconds + args.eval_every
            if train_seconds >= budget:
                break
    label, run = engine, {}
    if hetero:
        label = f"{engine} (GPU worker on {'cupy' if model.xp is not np else 'numpy, no GPU'})"
        for s in workers.values():
            s["utilisation"] = s["busy_seconds"] / max(train_seconds, 1e-9)
            s["share"] = s["samples"] / max(samples, 1)
        run = {"workers": workers, "gpu_retired": bool(model.policy_.retired),
               "gpu_judgement": model.policy_.judgement,
               "final_batch": dict(model.policy_.batch)}
    queue.put({"engine": engine, "label": label, "points": points, **run})


def _run_peer(engine, args):
    """A linear peer trained once with its defaults on the harness's rows: one point."""
    from slide.metrics import evaluate
    Xtr, Ytr, Xte, Yte = _data(args)
    res = peers.run(engine, Xtr, Ytr, Xte, args.peers_python, args.threads)
    point = {"seconds": res["train_seconds"], "samples": Xtr.shape[0], **evaluate(Yte, res["top"], 5)}
    print(f"[{engine}] {point['seconds']:7.1f}s  trained once  P@1={point['P@1']:.4f}", flush=True)
    return {"engine": engine, "label": f"{peers.NAMES[engine]} (its defaults, trained once)",
            "peer": True, "points": [point], "peak_rss_mb": res["peak_rss_mb"]}


def plot(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in doc["runs"]:
        pts = run["points"]
        if run.get("peer"):  # one model: a star at its training time, its P@1 carried on
            (p,) = pts
            star = ax.plot([p["seconds"]], [p["P@1"]], marker="*", ms=12, ls="none",
                           label=run.get("label", run["engine"]))[0]
            ax.axhline(p["P@1"], color=star.get_color(), ls=":", lw=1)
            continue
        ax.plot([p["seconds"] for p in pts], [p["P@1"] for p in pts], marker="o", ms=3, label=run.get("label", run["engine"]))
    a, mach = doc["args"], doc["machine"]
    ax.set_xlabel("training wall-clock seconds")
    ax.set_ylabel(f"P@1 on {a['n_eval']} shuffled test samples")
    ax.set_title(f"{a['preset']} ({a['n_train']:,} train), hidden {a['hidden']}, batch {a['batch_size']}, "
                 f"sparsity {a['sparsity']}\n{mach['cores']} cores ({mach['cpu']}), {a['threads']} threads, "
                 f"{mach['date']}", fontsize=10)
    ax.grid(alpha=0.3)
    if doc["runs"]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="amazon-670k",
                   help="a synthetic preset, or a real set's folder in --data-dir")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--engines", default="slide,dense-cpu")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--n-train", type=int, default=100_000)
    p.add_argument("--n-eval", type=int, default=2_000)
    p.add_argument("--eval-every", type=float, default=30.0, help="training seconds between evaluations")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--sparsity", type=float, default=0.005)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--negatives", type=int, default=4096,
                   help="random output rows per batch of dense-gpu-sampled and of hetero's GPU worker")
    p.add_argument("--mined", type=int, default=16,
                   help="hard negatives a row of the engines named with +mined")
    p.add_argument("--chunk-batches", type=int, default=10, help="batches between clock checks")
    p.add_argument("--warmup-rows", type=int, default=16_384,
                   help="rows a throwaway model of each engine trains before the clock starts "
                        "(compiles its kernels; 0: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--schedule", choices=["fit", "constant"], default="fit",
                   help="learning rate per epoch: fit's schedule over its planned epochs, or constant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers-python", default=peers.default_python(),
                   help="the peers environment's python (bench/peers.py), for xr-linear and parabel")
    p.add_argument("--out", default="bench/results/tta")
    p.add_argument("--replot", action="store_true", help="only redraw OUT.png from OUT.json")
    args = p.parse_args(argv)
    if args.replot:
        with open(args.out + ".json") as fh:
            plot(json.load(fh), args.out + ".png")
        return
    doc = {"machine": machine(), "args": vars(args), "notes": [], "runs": []}
    for engine in args.engines.split(","):
        if engine in peers.WORKERS and not args.peers_python:
            doc["notes"].append(f"{peers.NAMES[engine]} skipped: no peers environment")
            print(doc["notes"][-1])
        elif engine in peers.WORKERS:
            doc["runs"].append(_run_peer(engine, args))
        else:
            doc["runs"].append(run_isolated(_run, engine, args))
        write_json(args.out + ".json", doc)
    plot(doc, args.out + ".png")
    for run in doc["runs"]:
        last = run["points"][-1]
        print(f"{run['engine']}: P@1={last['P@1']:.4f} after {last['seconds']:.0f}s ({last['samples']} samples)")
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
