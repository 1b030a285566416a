"""``slide`` command line: train, eval, predict, data synth, data stats."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

import numpy as np

from slide.distributed import DEFAULT_EVERY
from slide.labels import labels_present
from slide.signals import EXIT_STATUS, TrainingStopped, stop_on_signals


def _hidden(text):
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hidden takes comma-separated sizes, got {text!r}") from None


def _fractions(text):
    try:
        return tuple(float(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None


def _integer(least: int, what: str):
    """An argparse type: an integer of at least ``least`` (``what`` names it in the error)."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return parse


_positive = _integer(1, "a positive integer")
_count = _integer(0, "a non-negative integer")


def _build_parser() -> argparse.ArgumentParser:
    from slide import __version__
    from slide.config import ACTIVATIONS, HASH_FAMILIES, NEGATIVE_SOURCES
    from slide.selection import FEW_ROWS
    from slide.synthetic import PRESETS
    p = argparse.ArgumentParser(prog="slide", description="Sub-linear extreme-classification training on CPUs.")
    p.add_argument("--version", action="version", version=f"slide {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (the built-in dataset when no file is given)")
    t.add_argument("train", nargs="?", help="training file (XMC repository or libsvm format)")
    t.add_argument("--test", help="test file, scored after every epoch for the record (never used "
                                  "for stopping or model selection)")
    t.add_argument("--engine", choices=["slide", "dense"], default="slide",
                   help="the sparse engine, or the dense reference (gpu_ref)")
    t.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                   help="device of the dense engine, or of the GPU worker with --mode hetero")
    t.add_argument("--mode", choices=["cpu", "hetero"], default="cpu",
                   help="hetero: CPU threads and a GPU worker train the model together")
    t.add_argument("--policy", choices=["hogbatch", "adaptive"], default="adaptive",
                   help="hetero batch-size policy")
    t.add_argument("--negatives", type=_count, default=None,
                   help="random output rows a batch: the dense engine's sampled softmax "
                        "(default: the full softmax), or the GPU worker's with --mode hetero "
                        "(default 4096)")
    t.add_argument("--mined-negatives", type=_count, default=0,
                   help="each row's best-scoring output rows by the exact product, beside the "
                        "random ones, for the dense engine or the GPU worker (default 0)")
    t.add_argument("--epochs", type=_positive, default=None,
                   help="total epochs (the most, with early stopping; with --resume counting the "
                        "checkpoint's); default: from the data's size")
    t.add_argument("--hidden", type=_hidden, default=None,
                   help="hidden sizes, e.g. 512 or 256,128 (default: from the data's shape)")
    t.add_argument("--sparsity", type=float, default=None, help="active fraction of outputs (default: auto)")
    t.add_argument("--hard-negatives", type=int, default=None,
                   help="most hard negatives per sample in the output's active set, from the "
                        "LSH tables or the label clusters (default: auto)")
    t.add_argument("--negatives-from", choices=NEGATIVE_SOURCES, default=None,
                   help="where a sample's hard negatives come from: the output layer's LSH "
                        "tables, or its label clusters' best-scoring labels (default: the "
                        "clusters up to 65,536 labels, the tables above)")
    t.add_argument("--hidden-sparsity", type=_fractions, default=None,
                   help="active fraction per hidden layer, e.g. 1,0.05 (default: all dense)")
    t.add_argument("--activation", choices=ACTIVATIONS, default=None,
                   help="hidden layers' activation (default: identity where the output is "
                        "sampled, relu where it is computed whole)")
    t.add_argument("--hash-family", choices=HASH_FAMILIES, default="dwta",
                   help="LSH family of the output layer's tables (default: dwta, densified WTA)")
    t.add_argument("--lr", type=float, default=None,
                   help="Adam learning rate (default: 1e-3, or 4e-3 when the output is sampled "
                        "or most non-zeros are in rare features; with a sampled output, under "
                        "50,000 rows and 5 positives a label, 1e-3 is also tried on the held-out "
                        "slice)")
    t.add_argument("--weight-decay", type=float, default=None,
                   help="decoupled weight decay, a multiple of the learning rate (default: 1, or "
                        "from the share of output rows a step touches when the output is sampled "
                        "or most non-zeros are in rare features)")
    t.add_argument("--tfidf", action=argparse.BooleanOptionalAction, default=None,
                   help="weight features by idf, fitted on TRAIN (default: chosen on the "
                        f"validation slice below {FEW_ROWS:,} rows, else off)")
    t.add_argument("--no-norm", action="store_true", help="keep rows as given (default: L2-normalised)")
    t.add_argument("--no-early-stopping", action="store_true",
                   help="train every epoch on all rows (default: hold out a validation slice, "
                        "stop when it stops improving, keep the best epoch)")
    t.add_argument("--refit", action=argparse.BooleanOptionalAction, default=None,
                   help="after early stopping, train again on every row for the kept epochs "
                        "(a fresh run; default: below 10,000 training rows)")
    t.add_argument("--validation-fraction", type=float, default=0.1,
                   help="share of the training rows held out for early stopping (at most 5,000)")
    t.add_argument("--beta1", type=float, default=0.9,
                   help="Adam's first-moment decay, the explicit momentum (default: 0.9)")
    t.add_argument("--plan", choices=["default", "auto"], default="default",
                   help="auto: time ways of running this job (thread counts) on its first "
                        "batches and train by the one predicted to reach the default's "
                        "validation score soonest (docs/planner.md)")
    t.add_argument("--batch-size", type=_positive, default=None,
                   help="default: 32 to 128 by training-set size")
    t.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    t.add_argument("--seed", type=int, default=0,
                   help="fixes initialisation, validation slice and data order (one thread repeats exactly)")
    t.add_argument("--distributed", choices=["sync", "local", "delayed", "labels"], default=None,
                   help="training under mpiexec. Data-parallel: each rank reads its shard of TRAIN; "
                        "sync averages gradients every step, local averages weights every "
                        "--average-every steps, delayed overlaps that average with --delay steps. "
                        "labels: the output layer sharded by label, each rank holding its slice "
                        "of the labels and reading all of TRAIN (models wider than one machine)")
    t.add_argument("--replicas", type=_positive, default=None, metavar="R",
                   help="--distributed labels: ranks as shards x R data replicas (sync across "
                        "replicas, each reading its shard of TRAIN; default 1)")
    t.add_argument("--memory-limit", default=None, metavar="BYTES",
                   help="memory each process may use (e.g. 12G; default: what the machine has "
                        "available); a model that needs more is refused up front")
    t.add_argument("--average-every", type=_positive, default=None, metavar="STEPS",
                   help=f"local/delayed: steps between weight averages (default: {DEFAULT_EVERY})")
    t.add_argument("--delay", type=_positive, default=None, metavar="STEPS",
                   help="delayed: steps an average is in flight (default: half of --average-every)")
    t.add_argument("--mpi-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="end the job when another rank does not answer for this long (default: 300)")
    t.add_argument("--metrics-json", help="write per-epoch metrics here")
    t.add_argument("--save", help="checkpoint directory (saved after every epoch)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in --save (its settings; --epochs is the total, "
                        "counting the checkpoint's epochs); metrics are appended to --metrics-json")
    t.add_argument("--save-every", type=_positive, default=None, metavar="BATCHES",
                   help="also checkpoint every BATCHES batches inside an epoch (a resumed run "
                        "continues from there, so a kill loses at most that many)")
    t.add_argument("--overwrite", action="store_true",
                   help="replace a model already in --save (refused otherwise)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--plot", metavar="IMAGE", help="draw loss and P@k per epoch into IMAGE (.png, "
                                                    ".svg, .pdf; needs matplotlib)")

    e = sub.add_parser("eval", help="evaluate a saved model on a test file")
    e.add_argument("model", help="model directory (written by train --save)")
    e.add_argument("test", help="labelled file in the model's feature and label space")
    e.add_argument("--k", type=_positive, default=5,
                   help="report P@j and nDCG@j at j = 1, 3, 5 (up to k) and at k (default: 5)")
    e.add_argument("--mode", choices=["exact", "lsh", "ann"], default="exact",
                   help="exact: score every label; lsh: only the hash tables' candidates (faster, "
                        "lower recall); ann: the labels of the clusters that score best")
    e.add_argument("--threads", type=_positive, default=None,
                   help="CPU threads (default: the model's setting, all cores where it has none)")

    pr = sub.add_parser("predict", help="write each row's top-k labels and scores",
                        description="Writes the Extreme Classification Repository score-matrix format: "
                                    "a header 'N L', then one line per row of 'id:score' pairs, best first.")
    pr.add_argument("model", help="model directory (written by train --save)")
    pr.add_argument("input", help="file of rows to label (its label fields, if any, are ignored)")
    pr.add_argument("--top-k", type=_positive, default=5, help="labels per row (default: 5)")
    pr.add_argument("--mode", choices=["exact", "lsh", "ann"], default="exact",
                    help="exact: score every label; lsh: only the hash tables' candidates; ann: the "
                         "labels of the clusters that score best")
    pr.add_argument("--threads", type=_positive, default=None,
                    help="CPU threads (default: the model's setting, all cores where it has none)")
    pr.add_argument("--proba", action="store_true",
                    help="scores as softmax probabilities over every label (exact mode) instead of logits")
    pr.add_argument("--label-names", help="file with one label name per line (line i names label i): "
                                          "write 'name:score' instead of 'id:score'")
    pr.add_argument("--output", "-o", help="output file (default: stdout)")

    pl = sub.add_parser("plot", help="draw loss and P@k per epoch from a --metrics-json file")
    pl.add_argument("metrics", help="a file written by train --metrics-json")
    pl.add_argument("--output", "-o", default=None, help="image file (default: METRICS with .png)")

    x = sub.add_parser("export", help="write a model for inference only (without optimizer "
                                      "state), or with --embeddings its vectors for other tools")
    x.add_argument("model", help="model directory (written by train --save)")
    x.add_argument("out", help="new directory")
    x.add_argument("--embeddings", action="store_true",
                   help="write label vectors (output rows with the bias) as labels.npy, their "
                        "label ids, and an inner-product index for hnswlib / FAISS where installed")
    x.add_argument("--queries", default=None, metavar="FILE",
                   help="with --embeddings, also the query vectors of FILE's rows (queries.npy)")

    d = sub.add_parser("data", help="dataset utilities")
    dsub = d.add_subparsers(dest="data_command", required=True)
    s = dsub.add_parser("synth", help="generate a synthetic dataset: OUT_PREFIX_{train,test}.txt")
    s.add_argument("preset", choices=list(PRESETS), help="shape to imitate: " + ", ".join(PRESETS))
    s.add_argument("out_prefix", help="writes OUT_PREFIX_train.txt and OUT_PREFIX_test.txt")
    s.add_argument("--train", type=_positive, default=None)
    s.add_argument("--test", type=_positive, default=None)
    s.add_argument("--seed", type=int, default=0)
    st = dsub.add_parser("stats", help="print a dataset's shape and label statistics")
    st.add_argument("file")
    return p


def _load_model(path, threads=None):
    """The model saved in directory ``path``, its queries on ``threads`` threads where given."""
    from slide.estimator import SlideClassifier
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such model directory")
    model = SlideClassifier.load(path)
    return model if threads is None else model.set_params(threads=threads)


def _fixed_on_resume() -> dict:
    """``slide train`` flag → setting, for the settings fixed after fitting
    (:data:`slide.config.FIXED_AFTER_FIT`) that have a flag: a resumed run keeps the
    checkpoint's, so giving another value is an error rather than silently ignored."""
    from slide.config import FIXED_AFTER_FIT
    flags = vars(_build_parser().parse_args(["train"]))
    named = {"norm": "no_norm"}  # the flag that sets it, where its name differs
    return {named.get(k, k): k for k in FIXED_AFTER_FIT if named.get(k, k) in flags}


def _check_outputs(a):
    """Refuse, before any data is read or trained on, outputs that could not be written."""
    if a.resume and not a.save:
        raise ValueError("--resume needs --save DIR")
    if a.save_every and not a.save:
        raise ValueError("--save-every needs --save DIR")
    if a.save:
        if os.path.exists(a.save) and not os.path.isdir(a.save):
            raise ValueError(f"--save {a.save}: exists and is not a directory")
        from slide.shards import is_sharded
        has_model = os.path.exists(os.path.join(a.save, "config.json")) or is_sharded(a.save)
        if a.resume and not has_model:
            raise ValueError(f"--resume: no model in {a.save}")
        if has_model and not (a.resume or a.overwrite):
            raise ValueError(f"--save {a.save}: a model is already there; "
                             "pass --resume to continue it or --overwrite to replace it")
        parent = os.path.dirname(os.path.abspath(a.save))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ValueError(f"--save {a.save}: cannot create it in {parent}")
    if getattr(a, "plot", None):
        parent = os.path.dirname(os.path.abspath(a.plot))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ValueError(f"--plot {a.plot}: directory {parent} is missing or not writable")
    if a.metrics_json:
        parent = os.path.dirname(os.path.abspath(a.metrics_json))
        if os.path.isdir(a.metrics_json):
            raise ValueError(f"--metrics-json {a.metrics_json}: is a directory")
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ValueError(f"--metrics-json {a.metrics_json}: directory {parent} is missing or not writable")


def _check_resume_flags(a, model):
    """Architecture flags given with --resume must agree with the checkpoint's settings (the
    dense engine's sampled softmax too: its random and mined rows)."""
    defaults = vars(_build_parser().parse_args(["train"]))
    saved = model.get_params()
    fixed = _fixed_on_resume()
    if a.engine == "dense":
        fixed.update(negatives="negatives", mined_negatives="mined_negatives")
    for flag, param in fixed.items():
        given = getattr(a, flag)
        if given == defaults.get(flag):
            continue
        value = ("l2" if not given else None) if flag == "no_norm" else given
        if isinstance(value, (list, tuple)):
            value = tuple(value)
        have = saved.get(param)
        if flag == "tfidf" and have is None:  # chosen on the validation slice: as it trained
            have = model.preprocessor_.tfidf
        if flag in ("activation", "negatives_from") and have is None:  # the rule's: as it trained
            have = model.resolved_.get(param)
        if isinstance(have, list):
            have = tuple(have)
        if value != have:
            raise ValueError(f"--resume: --{flag.replace('_', '-')} {given} differs from the "
                             f"checkpoint's {param}={have}; a resumed model keeps its architecture")


def _distributed(a):
    """The DataParallel for ``--distributed`` (None without it), after checking the flags."""
    if a.replicas and a.distributed != "labels":
        raise ValueError("--replicas needs --distributed labels")
    if not a.distributed:
        if a.average_every or a.delay:
            raise ValueError("--average-every and --delay need --distributed local or delayed")
        return None
    if a.engine != "slide" or a.mode != "cpu":
        raise ValueError("--distributed trains the slide engine on CPU ranks (--engine slide --mode cpu)")
    if a.train is None:
        raise ValueError("--distributed needs a TRAIN file: each rank reads its own shard of it")
    if a.distributed == "labels":
        if a.average_every or a.delay:
            raise ValueError("--average-every and --delay need --distributed local or delayed")
        from slide.shards import LabelShards
        return LabelShards(timeout=a.mpi_timeout, replicas=a.replicas or 1)
    from slide.distributed import DataParallel
    return DataParallel(mode=a.distributed, every=a.average_every, delay=a.delay, timeout=a.mpi_timeout)


def _read_shards(a, dp):
    """This rank's shard of TRAIN (label shards: its replica's); TEST on the ranks that score
    it (data parallelism: rank 0, which alone scores and writes; label shards: every rank)."""
    from slide.data import DataFormatError, read_dataset, read_shard
    labels = dp.mode == "labels"
    part, parts = (dp.replica, dp.replicas) if labels else (dp.rank, dp.size)
    Xtr, Ytr, declared = read_shard(a.train, part, parts)
    Xtr, Ytr = dp.agree_shapes(Xtr, Ytr)
    total = dp.total(Xtr.shape[0])
    if declared is not None and total != declared:
        raise DataFormatError(f"{a.train}:1: header declares {declared} rows but the file has {total}")
    Xte = Yte = None
    if a.test is not None and (labels or dp.rank == 0):
        Xte, Yte = read_dataset(a.test, n_features=Xtr.shape[1], n_labels=Ytr.shape[1])
    return Xtr, Ytr, Xte, Yte, total


def _planner(a, log):
    if a.plan != "auto":
        return None
    if a.engine != "slide":
        raise ValueError("--plan auto plans the slide engine's runs")
    from slide.planner import Planner
    return Planner(log=log)


def _cmd_train(a):
    from slide.train import load_train_test, run_training
    if a.mode == "hetero" and a.engine != "slide":
        raise ValueError("--mode hetero trains the slide engine together with a GPU worker")
    if a.engine == "slide" and a.mode != "hetero" and (a.negatives is not None
                                                       or a.mined_negatives):
        raise ValueError("--negatives and --mined-negatives are the dense engine's and the GPU "
                         "worker's (--engine dense or --mode hetero); the slide engine's active "
                         "set is --sparsity and --hard-negatives")
    if a.memory_limit is not None:
        from slide.resources import MEMORY_LIMIT_ENV, parse_bytes
        os.environ[MEMORY_LIMIT_ENV] = str(parse_bytes(a.memory_limit))
    dp = _distributed(a)
    lead = dp is None or dp.rank == 0  # the rank that prints and writes the metrics
    # label shards hold one model between them: every rank reads every row, scores the test
    # file and writes its shard of the checkpoint
    whole = dp is None or dp.mode == "labels"
    _check_outputs(a)
    if dp is None or (dp.mode == "labels" and dp.replicas == 1):
        Xtr, Ytr, Xte, Yte = load_train_test(a.train, a.test, seed=a.seed)
        n_rows = Xtr.shape[0]
    else:
        Xtr, Ytr, Xte, Yte, n_rows = _read_shards(a, dp)
    log = print if lead else (lambda *args, **kw: None)
    if a.resume:
        from slide.shards import is_sharded
        if a.engine == "slide" and dp is not None and dp.mode == "labels" and is_sharded(a.save):
            from slide.estimator import SlideClassifier
            model = dp.load(SlideClassifier, a.save)
        elif a.engine == "slide":
            model = _load_model(a.save)
        else:
            from gpu_ref import DenseClassifier
            model = DenseClassifier.load(a.save, a.device)
        if getattr(model, "inference_only_", False):
            raise ValueError(f"--resume: {a.save} was exported for inference only (no optimizer state)")
        _check_resume_flags(a, model)
        log(f"resuming from {a.save} at epoch {model.epoch_}")
    else:
        common = dict(hidden=a.hidden, activation=a.activation, batch_size=a.batch_size,
                      seed=a.seed, lr=a.lr, beta1=a.beta1, weight_decay=a.weight_decay, tfidf=a.tfidf,
                      norm=None if a.no_norm else "l2",
                      early_stopping=not a.no_early_stopping,
                      validation_fraction=a.validation_fraction, refit=a.refit, epochs=a.epochs)
        if a.engine == "slide":
            from slide.estimator import SlideClassifier
            model = SlideClassifier(sparsity=a.sparsity, hidden_sparsity=a.hidden_sparsity,
                                    hard_negatives=a.hard_negatives,
                                    negatives_from=a.negatives_from, hash_family=a.hash_family,
                                    threads=a.threads, **common)
        else:
            from gpu_ref import DenseClassifier
            model = DenseClassifier(device=a.device, negatives=a.negatives,
                                    mined_negatives=a.mined_negatives, **common)
    runner = None
    if a.mode == "hetero":
        from gpu_ref.hetero import HeteroConfig, HeteroTrainer
        pool = {} if a.negatives is None else {"gpu_pool": a.negatives}
        runner = HeteroTrainer(model, HeteroConfig(policy=a.policy, device=a.device,
                                                   gpu_mined=a.mined_negatives, **pool))
    used = "" if dp is not None else f" ({int(labels_present(Ytr).sum())} with a training positive)"
    log(f"train: {n_rows} samples, {Xtr.shape[1]} features, {Ytr.shape[1]} labels{used}; "
        f"engine={a.engine}, mode={a.mode}"
        + (f"; {dp.ranks} ranks, {dp!r}, {Xtr.shape[0]} rows on rank 0" if dp is not None else ""))
    try:
        with stop_on_signals(log=log):
            doc = run_training(model, Xtr, Ytr, Xte, Yte, epochs=a.epochs,
                               metrics_json=a.metrics_json if lead else None,
                               checkpoint_dir=a.save if lead or whole else None,
                               progress=lead and not a.no_progress, resume=a.resume,
                               save_every=a.save_every, log=log, distributed=dp, runner=runner,
                               planner=_planner(a, log))
    except TrainingStopped as e:
        epoch, position = e.position or (0, 0)
        where = f"after epoch {epoch}" + (f", {position:,} samples into the next" if position else "")
        kept = (f"checkpoint of this position saved to {a.save} (--resume continues from it)"
                if e.saved else f"the last complete checkpoint in {a.save} is kept" if a.save
                else "nothing saved (no --save)")
        log(f"slide train: stopped by {signal.Signals(e.signum).name} {where}; {kept}")
        return EXIT_STATUS[e.signum]
    if not lead:
        return 0
    stop = doc["stopping"]
    if stop.get("choice"):
        c = stop["choice"]
        scores = ", ".join(f"{k}: {v:.4f}" for k, v in c["validation_scores"].items())
        print(f"settings chosen on the validation set: {c['chosen']}, the best score of those "
              f"tried ({scores})")
    print(f"kept epoch {stop['kept_epoch']}: {stop['reason']}")
    if stop.get("refit"):
        r = stop["refit"]
        print(f"then trained again on all {r['rows']} rows for {r['epochs']} epochs "
              f"({r['seconds']:.1f}s)")
    if "test" in doc:
        t = doc["test"]
        print(f"final: P@1={t['P@1']:.4f}  P@3={t['P@3']:.4f}  P@5={t['P@5']:.4f}  "
              f"nDCG@5={t['nDCG@5']:.4f}  ({doc['wall_seconds']:.1f}s, peak RSS {doc.get('peak_rss_mb', 0):.0f} MiB)")
    kept = "the refit's" if stop.get("refit") else f"epoch {stop['kept_epoch']}'s"
    print(f"model saved to {a.save} ({kept} weights)" if a.save else
          "model not saved: pass --save DIR to keep it")
    if a.plot:
        from slide.plot import plot_metrics
        plot_metrics(doc, a.plot)
        print(f"wrote {a.plot}")
    return 0


def _cmd_plot(a):
    import json
    from slide.plot import plot_metrics
    try:
        with open(a.metrics) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"{a.metrics}: cannot read it as JSON ({e})") from None
    out = a.output or os.path.splitext(a.metrics)[0] + ".png"
    plot_metrics(doc, out)
    print(f"wrote {out}")
    return 0


def _cmd_eval(a):
    from slide.data import read_dataset
    model = _load_model(a.model, a.threads)
    X, Y = read_dataset(a.test, n_features=model.n_features_in_, n_labels=model.n_labels_)
    res = model.evaluate(X, Y, k=a.k, mode=a.mode)
    print("  ".join(f"{k}={v:.4f}" for k, v in res.items()))
    return 0


def _label_names(path, n_labels):
    with open(path, encoding="utf-8") as fh:
        names = [line.rstrip("\n") for line in fh]
    if len(names) < n_labels:
        raise ValueError(f"{path}: {len(names)} label names, the model has {n_labels} labels")
    bad = [i for i, n in enumerate(names[:n_labels]) if not n or any(c.isspace() for c in n)]
    if bad:
        raise ValueError(f"{path}:{bad[0] + 1}: a label name must be non-empty without spaces")
    return names


def _cmd_predict(a):
    from slide.data import read_dataset
    if a.proba and a.mode != "exact":
        raise ValueError("--proba needs --mode exact (LSH mode does not score every label)")
    if a.output and os.path.isdir(a.output):
        raise ValueError(f"--output {a.output}: is a directory")
    model = _load_model(a.model, a.threads)
    names = _label_names(a.label_names, model.n_labels_) if a.label_names else None
    X, _ = read_dataset(a.input, n_features=model.n_features_in_)
    if a.proba:
        ids, scores = model.predict_topk_proba(X, a.top_k)
    else:
        ids, scores = model.predict_topk(X, a.top_k, mode=a.mode)
    out = open(a.output, "w") if a.output else sys.stdout
    try:
        out.write(f"{ids.shape[0]} {model.n_labels_}\n")
        for row_ids, row_scores in zip(ids, scores):  # formatting output, not inference
            out.write(" ".join(f"{names[i] if names else i}:{s:.6g}"
                               for i, s in zip(row_ids, row_scores) if i >= 0) + "\n")
        out.flush()
    except BrokenPipeError:  # the reader stopped early (| head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        if a.output:
            out.close()
    return 0


def _cmd_export(a):
    if os.path.exists(a.out):
        raise ValueError(f"{a.out}: already exists")
    model = _load_model(a.model)
    if a.embeddings:
        from slide.export import export_embeddings
        from slide.data import read_dataset
        X = None
        if a.queries:
            X, _ = read_dataset(a.queries, n_features=model.n_features_in_, n_labels=model.n_labels_)
        record = export_embeddings(model, a.out, X)
        print(f"wrote {a.out}: {', '.join(record['files'].values())} ({record['rows']} labels "
              f"of dimension {record['dim']})")
        return 0
    if a.queries:
        raise ValueError("--queries applies with --embeddings")
    model.save(a.out, inference_only=True)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(a.out) for f in fs)
    print(f"wrote {a.out}: {size / 2 ** 20:.1f} MiB, for inference only")
    return 0


def _cmd_data(a):
    from slide.data import read_dataset, write_xmc
    from slide.synthetic import make_dataset
    if a.data_command == "synth":
        Xtr, Ytr, Xte, Yte = make_dataset(a.preset, a.train, a.test, a.seed)
        for split, X, Y in (("train", Xtr, Ytr), ("test", Xte, Yte)):
            path = f"{a.out_prefix}_{split}.txt"
            write_xmc(path, X, Y)
            print(f"wrote {path}: {X.shape[0]} samples, {X.shape[1]} features, {Y.shape[1]} labels")
        return 0
    X, Y = read_dataset(a.file)
    lab = np.diff(Y.indptr)
    feat = np.diff(X.indptr)
    freq = np.bincount(Y.indices, minlength=Y.shape[1])
    print(f"{a.file}: {X.shape[0]} samples, {X.shape[1]} features, {Y.shape[1]} labels")
    print(f"features/sample: mean {feat.mean():.1f}, max {feat.max()}")
    print(f"labels/sample: mean {lab.mean():.2f}, max {lab.max()}, empty {int((lab == 0).sum())}")
    print(f"labels used: {int((freq > 0).sum())}; most frequent label covers {freq.max() / X.shape[0]:.2%}")
    return 0


def main(argv=None) -> int:
    args = _build_parser().parse_args(argv)
    from slide.runtime import configure_threading
    configure_threading()  # before the first parallel kernel, once
    from slide.checkpoint import CheckpointError
    from slide.data import DataFormatError
    from slide.resources import ModelTooLargeError
    try:
        return {"train": _cmd_train, "eval": _cmd_eval, "predict": _cmd_predict, "export": _cmd_export, "plot": _cmd_plot,
                "data": _cmd_data}[args.command](args)
    except (DataFormatError, CheckpointError, ModelTooLargeError, FileNotFoundError, ValueError,
            RuntimeError) as e:
        print(f"slide: error: {e}", file=sys.stderr)
        _end_other_ranks(args)
        return 2
    except KeyboardInterrupt:  # before training started (it stops at a batch boundary)
        print("slide: interrupted", file=sys.stderr)
        return EXIT_STATUS[signal.SIGINT]
    except Exception:
        if getattr(args, "distributed", None):
            traceback.print_exc()
            _end_other_ranks(args)
        raise


def _end_other_ranks(args):
    """Under ``--distributed`` an error on one rank ends the job: the other ranks would
    otherwise wait for it in their next collective."""
    if getattr(args, "distributed", None) and "mpi4py" in sys.modules:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(2)


if __name__ == "__main__":
    sys.exit(main())
