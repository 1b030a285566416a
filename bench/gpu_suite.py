"""Everything measured on a GPU machine, in one command that installs nothing:

    python -m bench.gpu_suite --out bench/results/gpu

1. the device and its two ceilings, measured: memory bandwidth (a device-to-device copy of 2 GiB,
   bytes read plus written) and matrix-product rates (8192³, float32 and TF32);
2. the GPU tests (``pytest -m gpu tests/test_gpu.py``);
3. one training batch and one inference batch per engine (``bench/test_bench_train.py``:
   the engine on 1, 2 and every core, dense numpy, dense cupy with full and sampled softmax),
   as pytest-benchmark JSON; the dense GPU step against the floor its FLOPs and bytes set;
4. time to accuracy on the Amazon-670K preset: the engine on every core, dense-gpu (full and
   sampled softmax, the latter also with mined hard negatives), hetero (Hogbatch, also with
   mined hard negatives, and Adaptive Hogbatch), P@1 against seconds, JSON + PNG;
5. ``cores``, the engine on the machine's CPU cores alone (no GPU needed): training and exact
   top-5 throughput at 1, 2, 4, ... threads up to every core (``bench.thread_scaling``), the
   roofline on every core in rounds after the warm-up (``bench.roofline``), the step's calls
   timed one by one on every core (``bench.step_kernels``: what one thread runs alone, what a
   call costs whatever its work) and exact top-k on 1, 4 and every core (``bench.exact_topk``).

Writes ``OUT/summary.json`` (and prints its table), ``OUT/gpu_tests.txt``, ``OUT/batches.json``,
``OUT/tta.json``, ``OUT/tta.png``, ``OUT/thread_scaling.json``, ``OUT/roofline.json``,
``OUT/step_kernels.json`` and ``OUT/exact_topk.json``. On an H200 machine with 16 cores
(2026-11-27) ``cores`` took 152 s (before ``bench.step_kernels`` joined it; on 2 cores, where
the roofline's window takes longest, 144 s with it), then ``limits,tests,batches`` 77 s in the
same command, and ``tta`` at ``--minutes 0.5`` 189 s in the next (numba's cache by then warm).
Where one command may run 10 minutes at most, run ``--parts cores`` and ``--parts
limits,tests,batches`` in one command and ``--parts tta`` in the next (parts run apart add to
one summary). ``--parts`` runs a subset, ``--minutes`` sets each engine's training budget.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from bench.common import machine, write_json

PARTS = ("limits", "tests", "batches", "tta", "cores")
#: the parts that need cupy and a CUDA device
GPU_PARTS = ("limits", "tests", "batches", "tta")
TTA_ENGINES = ("slide,dense-gpu,dense-gpu-sampled,dense-gpu-sampled+mined,hetero-hogbatch,"
               "hetero-hogbatch+mined,hetero-adaptive")


def _median_ms(fn, reps=10):
    import cupy as cp
    fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def device_limits() -> dict:
    """The device's name and measured ceilings (random data, medians of 10 after a warm-up)."""
    import cupy as cp
    from gpu_ref import ops
    props = cp.cuda.runtime.getDeviceProperties(0)
    src = cp.random.random(2 ** 29, dtype=cp.float32)  # 2 GiB
    dst = cp.empty_like(src)
    copy_ms = _median_ms(lambda: dst.__setitem__(Ellipsis, src))
    n = 8192
    a, b = cp.random.random((n, n), dtype=cp.float32), cp.random.random((n, n), dtype=cp.float32)
    rates = {}
    for precision in ops.PRECISIONS:
        with ops.matmul_precision(cp, precision):
            rates[precision] = 2 * n ** 3 / (_median_ms(lambda: a @ b) * 1e-3)
    del src, dst, a, b
    cp.get_default_memory_pool().free_all_blocks()
    return {"name": props["name"].decode(), "multiprocessors": props["multiProcessorCount"],
            "memory_gib": props["totalGlobalMem"] / 2 ** 30, "cupy": cp.__version__,
            "bandwidth_bytes_per_s": 2 * 2 ** 31 / (copy_ms * 1e-3),
            "flops_per_s": rates}


def dense_step_floor(n, hidden, labels, negatives, features_per_row, limits) -> dict:
    """FLOPs and the fewest bytes one dense step must move (float32), and the time floor they
    set at the measured ceilings. Output block of m rows (every label, or ~negatives + labels):
    3 products of n·H·m (logits, output gradient, hidden gradient); bytes: W read by two
    products, its gradient written and read, Adam reading w, m, v and writing them (8 passes
    of m·H), and the logits written, reduced twice and scaled in place (5 passes of n·m); a
    sampled step also gathers its W rows (one more pass)."""
    m = labels if negatives is None else negatives
    flops = 3 * 2 * n * hidden * m + 3 * 2 * n * features_per_row * hidden
    bytes_ = 4 * (m * hidden * (8 + (negatives is not None)) + 5 * n * m)
    t_flops = flops / limits["flops_per_s"]["tf32"]
    t_bytes = bytes_ / limits["bandwidth_bytes_per_s"]
    return {"flops": flops, "bytes": bytes_, "floor_seconds": max(t_flops, t_bytes),
            "bound": "memory" if t_bytes > t_flops else "compute"}


def _pytest(args, log):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True)
    with open(log, "w") as fh:
        fh.write(proc.stdout + proc.stderr)
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    return {"returncode": proc.returncode, "summary": tail, "seconds": time.perf_counter() - t0}


def batch_table(path) -> list:
    """Rows (shape, test, engine, median seconds, samples/s) of a pytest-benchmark JSON."""
    with open(path) as fh:
        doc = json.load(fh)
    rows = []
    for b in doc["benchmarks"]:
        e = b["extra_info"]
        rows.append({"shape": e["shape"], "test": b["name"].split("[")[0], "engine": e["engine"],
                     "median_ms": b["stats"]["median"] * 1e3,
                     "samples_per_second": e["samples_per_second"]})
    return rows


def thread_counts(cores: int) -> list:
    """1, 2, 4, ... below ``cores``, then ``cores``: the thread counts the ``cores`` part runs."""
    counts = [1]
    while counts[-1] * 2 < cores:
        counts.append(counts[-1] * 2)
    return counts + [cores] if cores > 1 else counts


def measure_cores(out: str, cores: int) -> dict:
    """The ``cores`` part: thread scaling, the roofline on every core (100,000 training rows of
    the Amazon-670K preset, its window after 480 batches), the same window's calls timed one by
    one and exact top-k, each written to its own JSON under ``out``; returns their headline
    figures."""
    from bench import exact_topk, roofline, step_kernels, thread_scaling
    path = {name: os.path.join(out, f"{name}.json")
            for name in ("thread_scaling", "roofline", "step_kernels", "exact_topk")}
    counts = ",".join(str(t) for t in thread_counts(cores))
    thread_scaling.main(["--threads", counts, "--layers", "omp", "--n-train", "6000",
                         "--out", path["thread_scaling"]])
    roofline.main(["--threads", str(cores), "--n-train", "100000", "--warm-steps", "480",
                   "--steps", "160", "--rounds", "8", "--out", path["roofline"]])
    step_kernels.main(["--threads", str(cores), "--n-train", "100000", "--warm-steps", "480",
                       "--steps", "160", "--out", path["step_kernels"]])
    exact_topk.main(["--threads", ",".join(str(t) for t in sorted({1, min(4, cores), cores})),
                     "--rows", "1,128,1024", "--out", path["exact_topk"]])
    docs = {}
    for name, p in path.items():
        with open(p) as fh:
            docs[name] = json.load(fh)
    roof = docs["roofline"]
    return {
        "thread_scaling": [{k: r[k] for k in ("threads", "train_samples_per_second",
                                                "predict_rows_per_second") if k in r}
                           for run in docs["thread_scaling"]["runs"] for r in run.get("rows", [])],
        "roofline": {k: roof[k] for k in ("measured_samples_per_second",
                                          "roofline_samples_per_second", "fraction",
                                          "fraction_median_of_rounds", "bandwidth",
                                          "matmul_flops")},
        "step_kernels": {k: docs["step_kernels"][k] for k in (
            "samples_per_second", "calls", "between_calls_us_per_sample")},
        "exact_topk": docs["exact_topk"]["results"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/gpu")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--minutes", type=float, default=0.6, help="training budget of each time-to-accuracy engine")
    p.add_argument("--engines", default=TTA_ENGINES, help="time-to-accuracy engines")
    p.add_argument("--n-train", type=int, default=100_000)
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    from gpu_ref import gpu_available
    if set(parts) & set(GPU_PARTS) and not gpu_available():
        p.error(f"no GPU: parts {', '.join(GPU_PARTS)} need cupy and a CUDA device")
    os.makedirs(args.out, exist_ok=True)
    summary_path = os.path.join(args.out, "summary.json")
    summary = {"machine": machine(), "args": vars(args)}
    if os.path.exists(summary_path):  # parts run separately add to one summary
        with open(summary_path) as fh:
            summary = {**json.load(fh), "machine": summary["machine"]}
    cores = os.cpu_count() or 1
    t_all = time.perf_counter()

    if "limits" in parts:
        summary["limits"] = device_limits()
        write_json(summary_path, summary)
        print(f"[limits] {json.dumps(summary['limits'])}", flush=True)
    if "tests" in parts:
        summary["tests"] = _pytest(["-m", "gpu", "tests/test_gpu.py", "-q"], os.path.join(args.out, "gpu_tests.txt"))
        write_json(summary_path, summary)
        print(f"[tests] {summary['tests']['summary']}", flush=True)
    if "batches" in parts:
        out = os.path.join(args.out, "batches.json")
        res = _pytest(["bench/test_bench_train.py", "--benchmark-only", f"--benchmark-json={out}", "-q"],
                      os.path.join(args.out, "batches.txt"))
        rows = batch_table(out) if os.path.exists(out) else []
        summary["batches"] = {**res, "rows": rows}
        limits = summary.get("limits")
        for r in rows:
            if r["engine"].startswith("dense-gpu") and r["test"] == "test_train_batch" and limits:
                from bench.test_bench_train import BATCH, NEGATIVES
                labels = 670_091 if r["shape"] == "amazon-670k" else 3_993
                neg = NEGATIVES if r["engine"].endswith("sampled") else None
                floor = dense_step_floor(BATCH, 128, labels, None if neg is None else min(neg + 300, labels),
                                         75, limits)
                r["floor"] = floor
                r["fraction_of_floor"] = floor["floor_seconds"] / (r["median_ms"] * 1e-3)
        rate = {(r["shape"], r["test"], r["engine"]): r["samples_per_second"] for r in rows}
        key = ("amazon-670k", "test_train_batch")
        if (*key, "slide-all") in rate and (*key, "dense-gpu") in rate:
            summary["per_core"] = {  # one training batch of 128 at Amazon-670K shape
                "slide_samples_per_second_per_core": rate[(*key, "slide-all")] / cores,
                "dense_gpu_samples_per_second": rate[(*key, "dense-gpu")],
                "dense_gpu_sampled_samples_per_second": rate.get((*key, "dense-gpu-sampled")),
                "cores_to_match_dense_gpu": rate[(*key, "dense-gpu")] / (rate[(*key, "slide-all")] / cores)}
        write_json(summary_path, summary)
        print(f"[batches] {res['summary']}", flush=True)
    if "tta" in parts:
        from bench import time_to_accuracy
        stem = os.path.join(args.out, "tta")
        time_to_accuracy.main(["--preset", "amazon-670k", "--engines", args.engines,
                               "--minutes", str(args.minutes), "--n-train", str(args.n_train),
                               "--n-eval", "2000", "--eval-every", "8", "--threads", str(cores),
                               "--out", stem])
        with open(stem + ".json") as fh:
            doc = json.load(fh)
        summary["tta"] = [{"engine": r["engine"], "final": r["points"][-1],
                           **({"workers": r["workers"], "gpu_retired": r["gpu_retired"]} if "workers" in r else {})}
                          for r in doc["runs"]]
        write_json(summary_path, summary)
    if "cores" in parts:
        summary["cores"] = measure_cores(args.out, cores)
        write_json(summary_path, summary)
    summary["seconds"] = time.perf_counter() - t_all
    write_json(summary_path, summary)
    _print_summary(summary)


def _print_summary(s):
    if "batches" in s:
        print("\nshape        test                  engine              median ms   samples/s  of floor")
        for r in s["batches"]["rows"]:
            frac = f"{r['fraction_of_floor']:.0%}" if "fraction_of_floor" in r else ""
            print(f"{r['shape']:12s} {r['test']:21s} {r['engine']:18s} {r['median_ms']:10.2f} "
                  f"{r['samples_per_second']:11.0f}  {frac}")
    if "per_core" in s:
        print(f"per core: {json.dumps(s['per_core'])}")
    for r in s.get("tta", []):
        f = r["final"]
        extra = ""
        if "workers" in r:
            w = r["workers"]
            extra = (f"  cpu share {w['cpu']['share']:.2f} util {w['cpu']['utilisation']:.2f}, "
                     f"gpu share {w['gpu']['share']:.2f} util {w['gpu']['utilisation']:.2f}")
        print(f"[tta] {r['engine']:18s} P@1 {f['P@1']:.4f} after {f['seconds']:.0f}s, "
              f"{f['samples']} samples{extra}")
    c = s.get("cores")
    if c:
        for r in c["thread_scaling"]:
            print(f"[cores] {r['threads']:3d} threads: train {r['train_samples_per_second']:8.0f} "
                  f"samples/s, exact top-5 {r.get('predict_rows_per_second', float('nan')):7.0f} rows/s")
        r = c["roofline"]
        print(f"[cores] roofline: {r['measured_samples_per_second']:.0f} of "
              f"{r['roofline_samples_per_second']:.0f} samples/s ({r['fraction']:.0%} over the "
              f"window, {r['fraction_median_of_rounds']:.0%} in the median round)")
        k = c.get("step_kernels")
        if k:
            top = sorted(k["calls"].items(), key=lambda kv: -kv[1]["us_per_sample"])[:6]
            print("[cores] the step's calls, us a sample: " + ", ".join(
                f"{name} {v['us_per_sample']:.1f}" for name, v in top)
                + f", between calls {k['between_calls_us_per_sample']:.1f}")
    print(f"suite: {s.get('seconds', 0):.0f}s")


if __name__ == "__main__":
    main()
