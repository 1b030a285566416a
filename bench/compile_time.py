"""numba's compile time in a first training run, kernel by kernel.

    python -m bench.compile_time --out bench/results/compile_time.json

Runs ``slide train`` (on the built-in dataset unless ``--train-args`` says otherwise) in a child
process whose numba cache is an empty temporary folder, so that every kernel the run needs is
compiled as on a fresh install. numba's compile events are recorded there. The report has the
run's wall time, the compile time in all, and each function's own compile time: its events
less the compiles nested in them (a kernel compiles the kernels it calls, and numba's own
helpers, inside its own event), with how many signatures it was compiled for.

Writes the figures as JSON to the path given with ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from bench.common import machine, write_json

DEFAULT_ARGS = "train --epochs 1 --no-early-stopping"


def own_times(events) -> dict:
    """{function: [own seconds, compiles]} from numba's ``numba:compile`` events, (timestamp,
    event) pairs in order: each compile's time less the compiles nested in it."""
    stack, own = [], defaultdict(lambda: [0.0, 0])
    for ts, ev in events:
        f = ev.data["dispatcher"].py_func
        name = f"{f.__module__}.{f.__qualname__}"
        if ev.is_start:
            stack.append([name, ts, 0.0])
        else:
            name, start, nested = stack.pop()
            own[name][0] += ts - start - nested
            own[name][1] += 1
            if stack:
                stack[-1][2] += ts - start
    return dict(own)


def _child(train_args: str, out: str) -> None:
    from numba.core import event

    from slide.cli import main
    with event.install_recorder("numba:compile") as rec:
        t0 = time.perf_counter()
        try:
            main(train_args.split())
        except SystemExit as e:
            if e.code:
                raise
        wall = time.perf_counter() - t0
    with open(out, "w") as fh:
        json.dump({"wall_seconds": wall, "functions": own_times(rec.buffer)}, fh)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-args", default=DEFAULT_ARGS, help="the arguments of the slide command")
    p.add_argument("--top", type=int, default=15, help="functions printed")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.train_args, args.child)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        env = {**os.environ, "NUMBA_CACHE_DIR": os.path.join(tmp, "numba")}
        child = subprocess.run([sys.executable, "-m", "bench.compile_time", "--train-args",
                                args.train_args, "--child", result], env=env, capture_output=True,
                               text=True)
        if child.returncode:
            sys.exit(f"slide {args.train_args} failed:\n{child.stderr[-4000:]}")
        with open(result) as fh:
            doc = json.load(fh)
    functions = sorted(doc["functions"].items(), key=lambda kv: -kv[1][0])
    compile_s = sum(s for s, _ in doc["functions"].values())
    print(f"slide {args.train_args}: {doc['wall_seconds']:.1f} s, of which numba compiled "
          f"{compile_s:.1f} s")
    for name, (seconds, n) in functions[:args.top]:
        print(f"{seconds:7.2f} s  x{n}  {name}")
    if args.out:
        write_json(args.out, {"machine": machine(), "args": vars(args),
                              "wall_seconds": doc["wall_seconds"], "compile_seconds": compile_s,
                              "functions": [{"name": k, "own_seconds": s, "compiles": n}
                                            for k, (s, n) in functions]})


if __name__ == "__main__":
    main()
