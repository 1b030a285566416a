"""The cupy side on a GPU (``pytest -m gpu``); skipped where cupy or a CUDA device is missing."""
import numpy as np
import pytest

from gpu_ref import DenseClassifier, gpu_available, ops
from gpu_ref.dense import uniform_targets
from gpu_ref.hetero import HeteroConfig, HeteroTrainer
from slide.metrics import precision_at_k
from slide.estimator import SlideClassifier

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs cupy and a CUDA device")]


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def test_fused_ops_equal_numpy(cp, rng):
    n, m = 33, 1000
    z = (rng.standard_normal((n, m)) * 4).astype(np.float32)
    import scipy.sparse as sp
    mask = rng.random((n, m)) < 0.01
    mask[1:, 5] = True
    mask[0] = False
    targets = uniform_targets(sp.csr_matrix(mask.astype(np.float32)))
    zc = cp.asarray(z)
    loss_c = ops.softmax_xent_(cp, zc, *(cp.asarray(t) for t in targets))
    loss_n = ops.softmax_xent_(np, z, *targets)
    assert abs(float(loss_c) - float(loss_n)) < 1e-5 * abs(float(loss_n))
    np.testing.assert_allclose(zc.get(), z, rtol=1e-5, atol=1e-8)
    w, mo, v, g = (rng.standard_normal((50, 16)).astype(np.float32) for _ in range(4))
    v = np.abs(v)
    rows = np.array([0, 7, 49], np.int32)
    for fn, args in ((ops.adam_, (g,)), (ops.adam_rows_, (g[:3], rows))):
        host = [a.copy() for a in (w, mo, v)]
        dev = [cp.asarray(a) for a in (w, mo, v)]
        fn(np, *host, *args, 1e-2, 0.9, 0.999, 1e-8, 4, 0.3)
        fn(cp, *dev, *(cp.asarray(a) for a in args), 1e-2, 0.9, 0.999, 1e-8, 4, 0.3)
        for h, d in zip(host, dev):
            np.testing.assert_allclose(d.get(), h, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("negatives, mined", [(None, 0), (64, 0), (64, 4)])
def test_cupy_and_numpy_training_agree(tiny_data, negatives, mined):
    X, Y = tiny_data[0][:1024], tiny_data[1][:1024]
    kw = dict(hidden=(32,), batch_size=128, seed=4, epochs=2, early_stopping=False,
              negatives=negatives, mined_negatives=mined, precision="fp32")
    gpu = DenseClassifier(device="gpu", **kw).fit(X, Y)
    cpu = DenseClassifier(device="cpu", **kw).fit(X, Y)
    for k in cpu.params_:
        np.testing.assert_allclose(gpu.params_[k].get(), cpu.params_[k], rtol=1e-3, atol=1e-5, err_msg=k)
    assert gpu.history_[-1]["loss"] == pytest.approx(cpu.history_[-1]["loss"], rel=1e-4)


def test_tf32_trains_like_fp32(tiny_data):
    Xtr, Ytr, Xte, Yte = tiny_data
    res = {}
    for precision in ("fp32", "tf32"):
        m = DenseClassifier(hidden=(64,), seed=0, epochs=4, early_stopping=False, lr=3e-3,
                            device="gpu", precision=precision).fit(Xtr, Ytr)
        res[precision] = m.evaluate(Xte, Yte)["P@1"]
    assert abs(res["tf32"] - res["fp32"]) < 0.03, res


def test_checkpoints_move_between_devices(tmp_path, tiny_data):
    Xtr, Ytr, Xte, _ = tiny_data
    gpu = DenseClassifier(hidden=(16,), seed=0, epochs=1, device="gpu", precision="fp32").fit(Xtr, Ytr)
    gpu.save(tmp_path / "g")
    cpu = DenseClassifier.load(tmp_path / "g", device="cpu")
    ids_g, s_g = gpu.predict_topk(Xte, 5)
    ids_c, s_c = cpu.predict_topk(Xte, 5)
    np.testing.assert_allclose(s_c, s_g, rtol=1e-4, atol=1e-5)
    assert (ids_c[:, 0] == ids_g[:, 0]).mean() > 0.99
    engine = SlideClassifier.load(tmp_path / "g")  # the engine reads the dense model too
    np.testing.assert_allclose(engine.predict_topk(Xte, 5)[1], s_c, rtol=1e-4, atol=1e-5)
    cpu.set_params(device="gpu")
    cpu.partial_fit(Xtr[:256], Ytr[:256])
    assert not isinstance(cpu.params_["W"], np.ndarray)


@pytest.mark.parametrize("mined", [0, 8])
def test_hetero_with_cupy_worker_learns_and_reports_shares(tiny_data, mined):
    Xtr, Ytr, Xte, Yte = tiny_data
    model = SlideClassifier(hidden=(32,), sparsity=0.25, seed=0, early_stopping=False, lr=3e-3, epochs=4)
    h = HeteroTrainer(model, HeteroConfig(policy="hogbatch", cpu_batch=32, gpu_batch=256, gpu_pool=64,
                                          gpu_mined=mined, gpu_refresh=2, device="gpu",
                                          min_gain=0.0))
    h.fit(Xtr, Ytr, validation=(Xte, Yte))
    if mined:  # the device copy of the output layer, refreshed every other step
        assert h._output_copy[0].shape == h._state.params["W"].shape and h._copy_age <= 2
    rec = h.model.history_[-1]
    assert rec["device"] == "gpu" and rec["gpu_updates"] > 0 and rec["cpu_updates"] > 0
    assert rec["cpu_samples"] + rec["gpu_samples"] == Xtr.shape[0]
    assert 0 < rec["gpu_share"] < 1 and np.isfinite(rec["gpu_loss"])
    popular = np.argsort(-np.bincount(Ytr.indices, minlength=Ytr.shape[1]))[:1]
    base = precision_at_k(Yte, np.tile(popular, (Xte.shape[0], 1)), 1)[0]
    assert rec["val_P@1"] > base + 0.1, (rec, base)


def test_adaptive_hogbatch_moves_batches_with_measured_speeds(tiny_data):
    Xtr, Ytr = tiny_data[0], tiny_data[1]
    model = SlideClassifier(hidden=(32,), sparsity=0.25, seed=0, early_stopping=False, epochs=2)
    cfg = HeteroConfig(policy="adaptive", cpu_batch=64, gpu_batch=256, gpu_pool=64, device="gpu",
                       target_ratio=1.0, threshold=4, min_gain=0.0)
    h = HeteroTrainer(model, cfg).fit(Xtr, Ytr)
    speeds, rec = h.policy_.speeds, h.model.history_[-1]
    # equal update rates want gpu/cpu batch = s_gpu / s_cpu: the GPU's batch moves up when it is
    # faster per sample than that ratio of the initial batches, down otherwise
    wanted = speeds["gpu"] / speeds["cpu"]
    if wanted > 256 / 64 * 1.2:
        assert rec["gpu_final_batch"] > 256 and rec["cpu_final_batch"] < 64, (speeds, rec)
    elif wanted < 256 / 64 / 1.2:
        assert rec["gpu_final_batch"] < 256 and rec["cpu_final_batch"] > 64, (speeds, rec)
