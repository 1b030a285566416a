"""Hostile conditions during a run: signals, a disk that fails while checkpoints are written,
queries from many threads while the model is replaced. (Hostile files and checkpoints:
test_fuzz.py; a label space far larger than the rows use: test_labels.py.)"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from slide import SlideClassifier
from slide.cli import main
from slide.signals import TrainingStopped, request_stop, stop_on_signals
from tests.test_distributed import MPIEXEC, needs_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    assert main(["data", "synth", "eurlex-4k", str(d / "eur"), "--train", "3000", "--test", "300"]) == 0
    return d


def _train(synth, save, *extra, launcher=()):
    """``slide train`` in a process of its own, on many epochs: a run to interrupt."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [*launcher, sys.executable, "-m", "slide.cli", "train", str(synth / "eur_train.txt"), "--epochs", "400",
         "--no-early-stopping", "--no-progress", "--threads", "1", "--save", str(save), *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_checkpoint(proc, save, timeout=240):
    """Until the run has written its first checkpoint (the kernels are compiled by then)."""
    t0 = time.monotonic()
    while not (save / "config.json").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, "no checkpoint written"
        time.sleep(0.05)
    time.sleep(0.3)  # into the next epoch


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_run_at_a_batch_with_a_checkpoint_of_it(tmp_path, synth, signum, status):
    save = tmp_path / "m"
    proc = _train(synth, save)
    _wait_for_checkpoint(proc, save)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == status, out + err
    assert "Traceback" not in out + err
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"slide train: stopped by {signal.Signals(signum).name} after epoch")
    assert f"checkpoint of this position saved to {save}" in last
    model = SlideClassifier.load(save)
    assert 0 < model.epoch_ < 400 and (model.epoch_position_ > 0) == ("samples into" in last)
    # it resumes from there
    assert main(["train", str(synth / "eur_train.txt"), "--epochs", str(model.epoch_ + 1),
                 "--no-early-stopping", "--no-progress", "--threads", "1", "--save", str(save),
                 "--resume"]) == 0
    assert SlideClassifier.load(save).epoch_ == model.epoch_ + 1


@needs_mpi
def test_every_rank_stops_after_the_same_batch_on_a_signal(tmp_path, synth):
    """mpiexec passes Ctrl-C to the ranks; they agree on the batch to stop after, and rank 0
    saves that position: no rank is left waiting in a collective."""
    save = tmp_path / "m"
    proc = _train(synth, save, "--distributed", "sync", launcher=(MPIEXEC, "-n", "2"))
    _wait_for_checkpoint(proc, save)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err
    assert "checkpoint of this position saved" in out
    assert SlideClassifier.load(save).epoch_ >= 1


def test_a_second_interrupt_exits_at_once():
    """The first SIGINT asks for a stop; the second exits with 130 where the process is."""
    script = ("import os, signal, time\n"
              "from slide.signals import stop_on_signals\n"
              "with stop_on_signals():\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    time.sleep(0.5)\n"
              "    print('asked', flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    time.sleep(5)\n"
              "print('not reached')\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 130 and "asked" in out.stdout and "not reached" not in out.stdout
    assert "stopping after this batch" in out.stderr and "exiting now" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_stop_request_ends_fit_between_batches_with_the_position(tiny_data):
    """In process: the request (what the handler does) raises at the next batch boundary,
    with the record's position at the batches done."""
    X, Y = tiny_data[0][:1000], tiny_data[1][:1000]
    m = SlideClassifier(hidden=(8,), batch_size=100, epochs=3, threads=1, early_stopping=False)
    seen = []

    def on_epoch(model, entry):
        seen.append(entry["epoch"])
        if entry["epoch"] == 1:
            request_stop(signal.SIGTERM)

    with stop_on_signals(log=lambda message: None):
        with pytest.raises(TrainingStopped) as stop:
            m.fit(X, Y, on_epoch=on_epoch)
    assert stop.value.signum == signal.SIGTERM and seen == [1]
    assert m.epoch_ == 1 and m.epoch_position_ == 100  # one batch of epoch 2
    assert m.step_ == 11


def test_a_failed_save_during_a_run_keeps_the_previous_checkpoint(tmp_path, synth, monkeypatch):
    """The disk fills after the first epoch's checkpoint: the run stops with an error that
    says so (exit 2, no traceback) and the first checkpoint still loads."""
    import slide.checkpoint as checkpoint
    real = np.savez
    calls = []

    def full_after_one(*args, **kw):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(checkpoint.np, "savez", full_after_one)
    save = tmp_path / "m"
    rc = main(["train", str(synth / "eur_train.txt"), "--epochs", "3", "--no-early-stopping",
               "--no-progress", "--threads", "1", "--save", str(save)])
    assert rc == 2
    assert SlideClassifier.load(save).epoch_ == 1
    assert not [f for f in os.listdir(save) if ".tmp" in f]


def test_queries_from_eight_threads_while_a_clone_trains_and_is_swapped_in(tiny_data):
    """A server thread trains a clone with partial_fit and swaps it in; eight threads query
    whichever model is current and each answer equals a single-threaded query of the model
    version that gave it."""
    import copy
    X, Y = tiny_data[0][:1500], tiny_data[1][:1500]
    current = SlideClassifier(hidden=(16,), epochs=1, threads=1, seed=0).fit(X[:1000], Y[:1000])
    versions = {id(current): current}
    stop = threading.Event()
    answers, errors, latencies = [], [], []

    def trainer():
        nonlocal current
        try:
            for lo in range(1000, 1500, 100):
                clone = copy.deepcopy(current)
                clone.partial_fit(X[lo:lo + 100], Y[lo:lo + 100])
                versions[id(clone)] = clone
                current = clone  # one assignment: a query takes the old or the new model
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            stop.set()

    def query(seed):
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set() or len(answers) < 64:
                model, row = current, int(rng.integers(0, 300))
                t0 = time.perf_counter()
                ids, scores = model.predict_topk(X[row], 5)
                latencies.append(time.perf_counter() - t0)
                answers.append((id(model), row, ids[0].copy(), scores[0].copy()))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=query, args=(i,)) for i in range(8)]
    threads.append(threading.Thread(target=trainer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert len({a[0] for a in answers}) >= 1 and len(versions) == 6
    for key, row, ids, scores in answers[::7]:
        want_ids, want_scores = versions[key].predict_topk(X[row], 5)
        assert ids.tolist() == want_ids[0].tolist()
        np.testing.assert_allclose(scores, want_scores[0], rtol=1e-5)
    assert np.percentile(latencies, 99) > 0
