"""One training batch and one inference batch per engine, at Amazon-670K shape and a small shape.

    pytest bench/test_bench_train.py --benchmark-only --benchmark-json bench/results/train.json
    pytest bench/test_bench_train.py --benchmark-only --benchmark-compare   # against the last run

Engines: the sparse engine on 1 and 2 threads and on every core (``slide-all``, when there are
more than 2), the dense reference on numpy, and on cupy when a GPU is present (skipped otherwise):
full softmax (``dense-gpu``) and sampled softmax over the batch's labels plus 4,096 shared random
rows (``dense-gpu-sampled``). Batches of 128; inference is the exact top-5 of 128 rows.
"""
import numba
import pytest

from gpu_ref import DenseClassifier, gpu_available
from slide.estimator import SlideClassifier

BATCH = 128
NEGATIVES = 4096
ENGINES = ["slide-1", "slide-2", "slide-all", "dense-cpu", "dense-gpu", "dense-gpu-sampled"]


def _model(engine, X, Y):
    if engine.startswith("dense-gpu") and not gpu_available():
        pytest.skip("dense-gpu needs cupy and a CUDA device")
    if engine.startswith("slide"):
        cores = numba.config.NUMBA_NUM_THREADS
        threads = cores if engine == "slide-all" else int(engine.split("-")[1])
        if threads > cores or (engine == "slide-all" and cores <= 2):
            pytest.skip(f"needs {threads} threads" if threads > cores else "slide-2 covers every core")
        sparsity = 0.005 if Y.shape[1] > 100_000 else None
        model = SlideClassifier(hidden=(128,), sparsity=sparsity, batch_size=BATCH, threads=threads, seed=0)
    else:
        model = DenseClassifier(hidden=(128,), batch_size=BATCH, seed=0,
                                device="cpu" if engine == "dense-cpu" else "gpu",
                                negatives=NEGATIVES if engine.endswith("sampled") else None)
    model.partial_fit(X[:2 * BATCH], Y[:2 * BATCH])  # initialise and compile
    return model


@pytest.fixture(scope="module", params=ENGINES)
def engine_model(request, shape_data):
    name, (X, Y, Xte, Yte) = shape_data
    return name, request.param, _model(request.param, X, Y), (X, Y, Xte)


def test_train_batch(benchmark, engine_model):
    shape, engine, model, (X, Y, _) = engine_model
    state = {"lo": 0}

    def one_batch():
        lo = state["lo"] % (X.shape[0] - BATCH)
        state["lo"] += BATCH
        model.partial_fit(X[lo:lo + BATCH], Y[lo:lo + BATCH])
        if hasattr(model, "synchronize"):
            model.synchronize()

    rounds = 3 if engine == "dense-cpu" and shape == "amazon-670k" else 20
    benchmark.pedantic(one_batch, rounds=rounds, warmup_rounds=1)
    benchmark.extra_info.update(shape=shape, engine=engine, threads=getattr(model, "threads", None),
                                samples_per_second=BATCH / benchmark.stats.stats.median)


def test_inference_batch(benchmark, engine_model):
    shape, engine, model, (_, _, Xte) = engine_model
    benchmark.pedantic(model.predict_topk, args=(Xte[:BATCH], 5), rounds=5, warmup_rounds=1)
    benchmark.extra_info.update(shape=shape, engine=engine,
                                samples_per_second=BATCH / benchmark.stats.stats.median)
