from bench.plan_auto import _markdown, best_of, repeated


def _run(scores, seconds, auto=False):
    """A metrics record of epochs with validation nDCG@5 ``scores``, each epoch taking
    ``seconds`` (training 3/4 of it, scoring 1/4); an auto run's epochs carry the planner's
    clock, 5 s of probes ahead."""
    epochs, clock = [], 5.0 if auto else 0.0
    for i, s in enumerate(scores):
        clock += seconds
        e = {"epoch": i + 1, "val_nDCG@5": s, "train_seconds": 0.75 * seconds,
             "eval_seconds": 0.25 * seconds}
        if auto:
            e["plan_elapsed"] = clock
        epochs.append(e)
    run = {"resolved": {"sampled": True}, "epochs": epochs, "wall_seconds": clock + 1.0}
    if auto:
        run["plan"] = {"chosen": {"seconds": 33.0}}
    return run


def test_each_run_is_read_at_its_first_best_epoch_and_the_medians_are_per_plan():
    d1 = _run([0.1, 0.3, 0.3, 0.2], 10)
    d2 = _run([0.1, 0.2, 0.25, 0.28], 10)
    d3 = _run([0.1, 0.31], 10)
    a1 = _run([0.1, 0.29, 0.3], 10, auto=True)
    a2 = _run([0.2, 0.32], 10, auto=True)
    a3 = _run([0.33], 10, auto=True)
    assert best_of(d1) == {"best": 0.3, "seconds_to_best": 20.0, "seconds": 41.0}
    # an auto run's seconds are the planner's clock: the probes included
    assert best_of(a1) == {"best": 0.3, "seconds_to_best": 35.0, "seconds": 36.0,
                           "predicted": 33.0}
    r = repeated([d1, d2, d3], [a1, a2, a3])
    assert r["default"]["median_best"] == 0.3 and r["default"]["median_seconds_to_best"] == 20.0
    assert r["auto"]["median_best"] == 0.32 and r["auto"]["median_seconds_to_best"] == 25.0
    assert [x["seconds_to_best"] for x in r["default"]["runs"]] == [20.0, 40.0, 20.0]


def test_the_markdown_lists_every_pair_and_the_medians():
    d, a = _run([0.1, 0.3], 10), _run([0.2, 0.31], 10, auto=True)
    figures = {"metric": "val_nDCG@5", "target": 0.3, "default_seconds": 21.0,
               "default_seconds_to_target": 20.0, "auto_seconds": 26.0,
               "auto_seconds_to_target": 25.0, "auto_best": 0.31, "probe_seconds": 5.0,
               "chosen": "default", "reason": "r", "predicted_seconds": 24.0,
               "prediction_error": -0.04, "candidates": []}
    text = _markdown({"train": "t", "machine": {}, "busy": 0, "command": "c",
                      "figures": figures, "repeated": repeated([d, d], [a, a])})
    assert "| default 2 | 0.3000 | 20.0 | 21.0 |  |" in text
    assert "| auto 1 | 0.3100 | 25.0 | 26.0 | 33.0 |" in text
    assert "| auto, median | 0.3100 | 25.0 | | |" in text


def test_a_run_is_read_on_its_own_clock_where_it_records_one():
    run = _run([0.1, 0.3], 10)
    for e, t in zip(run["epochs"], (14.0, 26.0)):  # initialisation before the first epoch
        e["elapsed"] = t
    assert best_of(run)["seconds_to_best"] == 26.0
    del run["epochs"][1]["elapsed"]  # an older record: the epochs' own seconds
    assert best_of(run)["seconds_to_best"] == 20.0


def test_rank_splits_are_read_against_the_default_final_score():
    from bench.plan_auto import _splits_markdown, against, split_plans
    plans = split_plans(16)
    assert [(p.ranks, p.threads, p.mode) for p in plans] == \
        [(2, 8, "local"), (2, 8, "delayed"), (4, 4, "local")]
    assert plans[1].command("t.txt").startswith("mpiexec -n 2 slide train t.txt --threads 8")
    default = _run([0.1, 0.3, 0.28], 10)
    default["stopping"] = {"best_score": 0.3}
    rows = against(default, {"2x8": _run([0.2, 0.25, 0.31], 5), "4x4": _run([0.29], 3)})
    assert [(x["plan"], x["seconds_to_target"], x["best"]) for x in rows] == \
        [("default", 20.0, 0.3), ("2x8", 15.0, 0.31), ("4x4", None, 0.29)]
    text = _splits_markdown({"train": "t", "machine": {}, "command": "c", "splits": rows})
    assert "| 4x4 | not reached | 0.2900 | 3.0 | 4.0 |" in text
