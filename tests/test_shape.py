"""The code's shape holds: no package configures anything on import, no module imports
another's private names, no class grows past 400 lines, and every cached kernel can be
loaded from numba's cache."""
import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("slide", "lsh", "gpu_ref")


def _modules():
    for package in PACKAGES:
        for path in sorted((REPO / package).glob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def test_importing_configures_nothing_until_threads_are_asked_for():
    code = ("import numba; before = numba.config.THREADING_LAYER\n"
            "import slide, lsh, gpu_ref, slide.estimator, gpu_ref.hetero, slide.cli\n"
            "print(before == numba.config.THREADING_LAYER)\n"
            "from slide.runtime import set_num_threads\n"
            "set_num_threads(1)\n"
            "print(numba.config.THREADING_LAYER, numba.threading_layer())\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMBA_THREADING_LAYER"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=env, check=True).stdout.split()
    assert out[0] == "True", out
    assert out[1] == "threadsafe" and out[2] in ("omp", "tbb"), out


def test_no_module_imports_another_modules_private_names():
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] in PACKAGES:
                found += [f"{path.relative_to(REPO)}: {node.module}.{a.name}"
                          for a in node.names
                          if a.name.startswith("_") and not a.name.endswith("__")]
    assert not found, found


def test_no_class_passes_400_lines():
    long = [f"{path.relative_to(REPO)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _modules() for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400]
    assert not long, long


def test_no_cached_kernel_closes_over_another_kernel():
    """numba keys a closure's cache entry by its cells, and a kernel (a dispatcher, an
    intrinsic) pickles differently in every process: a cached kernel made by a function that
    closes over kernels is compiled again by every process (the clusters' query kernels were,
    23 s a process). Every cached kernel of the packages, module-level or held in a dict, has
    cells of plain values only."""
    import importlib
    from numba.core.dispatcher import Dispatcher
    from numba.core.extending import _Intrinsic
    from numba.core.caching import NullCache
    found, seen = [], 0
    for path, _ in _modules():
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            for kernel in (value.values() if isinstance(value, dict) else (value,)):
                if not isinstance(kernel, Dispatcher) or isinstance(kernel._cache, NullCache):
                    continue
                seen += 1
                cells = kernel.py_func.__closure__ or ()
                if any(isinstance(c.cell_contents, (Dispatcher, _Intrinsic)) for c in cells):
                    found.append(f"{name}.{attr}")
    assert seen > 50 and not found, found
