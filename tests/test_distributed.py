"""Data-parallel training on 2 MPI ranks (``slide.distributed``), each case a separate
``mpiexec -n 2`` job (``tests/mpi_cases.py``), plus the shard reader in one process."""
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import scipy.sparse as sp

from slide.data import DataFormatError, read_dataset, read_shard, write_xmc
from slide.estimator import SlideClassifier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def _mpi_missing():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "the mpi extra is not installed (pip install -e '.[mpi]')"
    return None if MPIEXEC else "no mpiexec on PATH (pip install mpich)"


needs_mpi = pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))


def _mpiexec(*args, timeout=120, ranks=2):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    out = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - t0


def _case(name, *args, ranks=2):
    out, _ = _mpiexec("-m", "tests.mpi_cases", name, *args, ranks=ranks)
    assert out.returncode == 0 and "OK " in out.stdout, out.stdout + out.stderr
    return out.stdout


@needs_mpi
def test_sync_equals_one_process_on_the_union_batches():
    _case("sync_equals_union")


@needs_mpi
def test_local_every_step_is_the_mean_of_the_ranks_local_steps():
    _case("local_every_step_is_the_mean_of_local_steps")


@needs_mpi
@pytest.mark.parametrize("mode", ["delayed", "local"])
def test_averaging_modes_learn_like_one_process(mode):
    _case("delayed_learns_like_one_process", mode)


@needs_mpi
@pytest.mark.parametrize("how, says", [("raises", "rank 1 of 2: training failed"),
                                       ("dies", "signal 9"),
                                       ("hangs", "no answer from the other ranks within 3 s")])
@pytest.mark.parametrize("kind", ["sync", "labels"])
def test_a_failing_rank_ends_the_job(how, says, kind):
    out, seconds = _mpiexec("-m", "tests.mpi_cases", "rank_fails", how, kind, timeout=90)
    assert out.returncode != 0
    assert says in out.stdout + out.stderr, out.stdout + out.stderr
    assert seconds < 60


def _write_set(path, n, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 12, n)
    X = sp.random(n, 80, density=0.08, format="csr", random_state=seed, dtype=np.float32)
    X = (X + sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), labels * 5)), shape=(n, 80))).tocsr()
    Y = sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), labels)), shape=(n, 12))
    write_xmc(path, X, Y)


@needs_mpi
def test_cli_two_ranks_checkpoint_loads_and_resumes_in_one_process(tmp_path):
    train, test, model = tmp_path / "train.txt", tmp_path / "test.txt", tmp_path / "model"
    _write_set(train, 801, 0)
    _write_set(test, 300, 1)
    metrics = tmp_path / "m.json"
    out, _ = _mpiexec("-m", "slide.cli", "train", str(train), "--test", str(test), "--distributed",
                      "delayed", "--average-every", "4", "--epochs", "2", "--save", str(model),
                      "--metrics-json", str(metrics), "--no-progress", "--hidden", "16")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("train: 801 samples") == 1  # rank 0 alone speaks
    doc = json.loads(metrics.read_text())
    assert [r["ranks"] for r in doc["epochs"]] == [2, 2]
    m = SlideClassifier.load(model)
    Xte, Yte = read_dataset(test)
    assert m.epoch_ == 2
    assert m.threads is None  # the ranks' share of the cores is not saved as the model's setting
    assert abs(m.evaluate(Xte, Yte)["P@1"] - doc["test"]["P@1"]) < 1e-6
    from slide.cli import main
    assert main(["train", str(train), "--test", str(test), "--resume", "--save", str(model),
                 "--epochs", "3", "--no-progress"]) == 0
    assert SlideClassifier.load(model).epoch_ == 3
    # and back to 2 ranks, in sync mode this time
    out, _ = _mpiexec("-m", "slide.cli", "train", str(train), "--distributed", "sync", "--resume",
                      "--save", str(model), "--epochs", "4", "--no-progress")
    assert out.returncode == 0 and "resuming from" in out.stdout, out.stdout + out.stderr
    assert SlideClassifier.load(model).epoch_ == 4


@needs_mpi
def test_label_shards_compute_what_one_process_does():
    """Every output active, one thread: 2 label shards equal one process (rows, hidden layers,
    losses, predictions, validation loss); the sharded checkpoint loads whole and resumes."""
    _case("labels_equal_one_process")


@needs_mpi
def test_label_shards_times_data_replicas_compute_what_one_process_does():
    """4 ranks = 2 label shards x 2 sync replicas: one process on the union batches."""
    _case("labels_replicas_equal_one_process", ranks=4)


@needs_mpi
def test_label_shards_learn_like_one_process():
    _case("labels_learn_like_one_process")


@needs_mpi
def test_cli_label_shards_train_save_and_evaluate_in_one_process(tmp_path):
    train, test, model = tmp_path / "train.txt", tmp_path / "test.txt", tmp_path / "model"
    _write_set(train, 801, 0)
    _write_set(test, 300, 1)
    metrics = tmp_path / "m.json"
    out, _ = _mpiexec("-m", "slide.cli", "train", str(train), "--test", str(test), "--distributed",
                      "labels", "--epochs", "2", "--save", str(model), "--metrics-json",
                      str(metrics), "--no-progress", "--hidden", "16")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("train: 801 samples") == 1
    doc = json.loads(metrics.read_text())
    assert [r["ranks"] for r in doc["epochs"]] == [2, 2]
    assert "shards.json" in os.listdir(model)
    whole = SlideClassifier.load(model)
    Xte, Yte = read_dataset(test)
    assert whole.epoch_ == 2 and whole.n_outputs_ == 12
    assert abs(whole.evaluate(Xte, Yte)["P@1"] - doc["test"]["P@1"]) < 1e-6
    # the same 2 shards, each now in 2 replicas (each reading half the rows)
    out, _ = _mpiexec("-m", "slide.cli", "train", str(train), "--distributed", "labels",
                      "--replicas", "2", "--resume", "--save", str(model), "--epochs", "3",
                      "--no-progress", ranks=4)
    assert out.returncode == 0 and "resuming from" in out.stdout, out.stdout + out.stderr
    assert "replicas=2" in out.stdout
    assert SlideClassifier.load(model).epoch_ == 3
    steps = [d for d in os.listdir(model) if d.startswith("step-")]
    assert len(steps) == 1  # the earlier steps' shards are gone once the manifest moved on


@needs_mpi
def test_cli_distributed_flag_errors(tmp_path, capsys):
    from slide.cli import main
    assert main(["train", "--distributed", "sync"]) == 2
    assert "needs a TRAIN file" in capsys.readouterr().err
    assert main(["train", "x.txt", "--average-every", "4"]) == 2
    assert "need --distributed" in capsys.readouterr().err


def test_shards_partition_the_file_and_errors_name_the_file_line(tmp_path):
    path = tmp_path / "d.txt"
    _write_set(path, 301, 2)
    X, Y = read_dataset(path)
    for n in (1, 2, 3, 8):
        parts = [read_shard(path, r, n) for r in range(n)]
        assert all(p[2] == 301 for p in parts)
        assert (sp.vstack([p[0] for p in parts]) != X).nnz == 0
        assert (sp.vstack([p[1] for p in parts]) != Y).nnz == 0
        assert max(p[0].shape[0] for p in parts) - min(p[0].shape[0] for p in parts) <= 301 // n
    lines = path.read_text().split("\n")
    lines[250] = lines[250].replace(":", ":x", 1)
    path.write_text("\n".join(lines))
    with pytest.raises(DataFormatError, match=r"d\.txt:251: malformed value"):
        read_shard(path, 1, 2)
    one = tmp_path / "one.txt"
    one.write_text("1 3 2\n0 1:1\n")
    with pytest.raises(DataFormatError, match="shard 1 of 2 holds no rows"):
        read_shard(one, 1, 2)


@needs_mpi
def test_settings_are_checked_and_one_rank_trains_like_no_mpi():
    from slide.distributed import DataParallel
    for kw, says in [({"mode": "allreduce"}, "mode must be one of"),
                     ({"mode": "sync", "every": 4}, "sync averages every step"),
                     ({"mode": "local", "delay": 2}, "delay applies to the delayed mode"),
                     ({"mode": "delayed", "every": 4, "delay": 5}, "delay must be an integer from 1"),
                     ({"mode": "local", "every": 0}, "every must be a positive integer"),
                     ({"timeout": 0}, "timeout must be positive")]:
        with pytest.raises(ValueError, match=says):
            DataParallel(**kw)
    rng = np.random.default_rng(0)
    X = sp.random(150, 40, density=0.1, format="csr", random_state=0, dtype=np.float32)
    Y = sp.csr_matrix((np.ones(150, np.float32), (np.arange(150), rng.integers(0, 6, 150))), shape=(150, 6))
    settings = dict(hidden=(8,), threads=1, batch_size=16, epochs=2, seed=1, refit=False, tfidf=False)
    alone = SlideClassifier(**settings).fit(X, Y)
    with pytest.raises(ValueError, match="refit"):  # the ranks train on shards: no refit
        SlideClassifier(**{**settings, "refit": True}).fit(X, Y, distributed=DataParallel())
    for mode in ("sync", "local", "delayed"):
        dp = DataParallel(mode=mode, every=None if mode == "sync" else 2)
        one = SlideClassifier(**settings).fit(X, Y, distributed=dp)
        for k in alone.params_:
            np.testing.assert_array_equal(one.params_[k], alone.params_[k])


def test_round_rows_are_gathered_and_merged_in_the_row_blocks_alone(tiny_data):
    """A round's rows go out of, and the average back into, a training model's weights, which
    are the leading columns of their row blocks: the moments beside them are never touched."""
    from slide.distributed import _merge_rows, _Parts
    Xtr, Ytr = tiny_data[0][:500], tiny_data[1][:500]
    model = SlideClassifier(hidden=(16,), sparsity=0.5, seed=0, epochs=1, early_stopping=False)
    model.fit(Xtr, Ytr)
    p = model.params_
    assert not p["W"].flags.c_contiguous  # a view into its row block
    before = {k: np.array(v) for k, v in {**p, **{f"m_{k}": v for k, v in model.moments_.items()}}.items()}
    out_ids = np.array([0, 3, 7, model.n_outputs_ - 1], np.int32)
    in_ids = np.array([1, 2, Xtr.shape[1] - 1], np.int32)
    parts = _Parts(p, out_ids, in_ids, lambda n: np.empty(n, np.float32))
    parts.gather()
    np.testing.assert_array_equal(parts.views[0], before["W"][out_ids])
    np.testing.assert_array_equal(parts.views[1][:, 0], before["b"][out_ids])
    np.testing.assert_array_equal(parts.views[2], before["W0"][in_ids])
    # an average of zeros from ranks that sent these rows: each row becomes its progress since
    # (zero), and nothing else moves
    for (rows, ids), sent in zip(parts.pieces, parts.views):
        _merge_rows(rows, ids, np.zeros_like(sent), sent, np.float32(0.5))
    for name, ids in (("W", out_ids), ("W0", in_ids)):
        expect = before[name].copy()
        expect[ids] = 0.0
        np.testing.assert_array_equal(p[name], expect)
    for k in model.moments_:
        np.testing.assert_array_equal(model.moments_[k], before[f"m_{k}"])


@needs_mpi
@pytest.mark.parametrize("sparsity", [1.0, 0.4])
def test_one_label_shard_trains_as_one_process(sparsity, tmp_path):
    """One rank of LabelShards runs the sharded step over the whole layer (its normaliser from
    logit_stats, its label weights from the targets): the same model as without MPI, up to the
    order of a sum; its checkpoint is a manifest of one shard."""
    from slide.shards import LabelShards
    rng = np.random.default_rng(0)
    X = sp.random(200, 40, density=0.1, format="csr", random_state=0, dtype=np.float32)
    rows = np.repeat(np.arange(200), 2)
    Y = sp.csr_matrix((np.ones(400, np.float32), (rows, rng.integers(0, 30, 400))), shape=(200, 30))
    Y.sum_duplicates()
    Y.data[:] = 1.0
    settings = dict(hidden=(8,), threads=1, batch_size=16, epochs=2, seed=1, refit=False,
                    tfidf=False, sparsity=sparsity, early_stopping=False)
    alone = SlideClassifier(**settings).fit(X, Y)
    one = SlideClassifier(**settings).fit(X, Y, distributed=LabelShards())
    for k in alone.params_:
        np.testing.assert_allclose(one.params_[k], alone.params_[k], atol=2e-5)
    assert abs(one.history_[-1]["loss"] - alone.history_[-1]["loss"]) < 1e-5
    np.testing.assert_array_equal(one.predict_topk(X, 3)[0], alone.predict_topk(X, 3)[0])
    one.decision_function(X[:2])  # one shard is the whole layer
    one.save(tmp_path / "m")
    assert os.path.exists(tmp_path / "m" / "shards.json")
    np.testing.assert_array_equal(SlideClassifier.load(tmp_path / "m").params_["W"], one.params_["W"])
