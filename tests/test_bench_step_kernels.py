"""The step's call timer: what it counts, and that it leaves the engine as it found it."""
import json
import types

import pytest

from bench.step_kernels import CallTimer, main, step_targets


def test_timer_counts_outermost_calls_and_puts_the_attributes_back():
    ns = types.SimpleNamespace()
    ns.inner = lambda x: x + 1
    ns.outer = lambda x: ns.inner(x) * 2
    plain_inner, plain_outer = ns.inner, ns.outer
    timer = CallTimer()
    with timer.wrap([(ns, "inner", "inner"), (ns, "outer", "outer")]):
        assert ns.outer(1) == 4 and ns.inner(1) == 2
        assert ns.outer is not plain_outer
    # the inner call made by outer is outer's time, not a call of its own
    assert len(timer.seconds["outer"]) == 1 and len(timer.seconds["inner"]) == 1
    assert ns.inner is plain_inner and ns.outer is plain_outer


def test_a_method_timed_on_an_instance_is_its_class_method_again():
    class Tables:
        def rehash(self):
            return "rehashed"

    t = Tables()
    timer = CallTimer()
    with timer.wrap([(t, "rehash", "rehash")]):
        assert "rehash" in vars(t) and t.rehash() == "rehashed"
    assert "rehash" not in vars(t) and t.rehash() == "rehashed"
    assert len(timer.seconds["rehash"]) == 1


def test_timer_puts_the_attributes_back_after_an_error():
    ns = types.SimpleNamespace(f=lambda: 1 / 0)
    plain = ns.f
    timer = CallTimer()
    with pytest.raises(ZeroDivisionError), timer.wrap([(ns, "f", "f")]):
        ns.f()
    assert ns.f is plain and len(timer.seconds["f"]) == 1


def test_a_window_of_a_sampled_step(tmp_path, capsys):
    import slide.kernels as kernels
    plain = kernels.output_step
    out = tmp_path / "calls.json"
    main(["--preset", "demo", "--n-train", "1024", "--threads", "1", "--warm-steps", "2",
          "--steps", "3", "--out", str(out)])
    assert kernels.output_step is plain
    got = json.loads(out.read_text())
    calls = got["calls"]
    # one call a batch of each of the output layer's kernels, and of the lookup of its hard
    # negatives (the demo's 8,936 labels take them from the label clusters)
    for name in ("select_active", "mark_rows", "output_step", "pool_logits", "pool_gradients",
                 "backward_hidden", "lookup"):
        assert calls[name]["calls_per_batch"] == 1.0, name
    assert "rehash" not in calls or calls["rehash"]["calls_per_batch"] < 1
    # the calls are inside the step: together they take less than it
    step_us = 1e6 / got["samples_per_second"]
    assert 0 < sum(c["us_per_sample"] for c in calls.values()) < step_us
    assert got["between_calls_us_per_sample"] > 0
    assert "output_step" in capsys.readouterr().out


def test_targets_are_the_kernels_module_own_compiled_functions():
    import slide.kernels as kernels
    from slide.estimator import SlideClassifier
    from slide.synthetic import make_dataset
    X, Y, _, _ = make_dataset("demo", n_train=512, n_test=8, seed=0)
    model = SlideClassifier(threads=1, epochs=1, early_stopping=False, seed=0).fit(X, Y)
    names = {name for owner, _, name in step_targets(model) if owner is kernels}
    assert {"output_step", "select_active", "mark_rows"} <= names
    # imported helpers (numba's or lsh's) are not the step's calls to time
    assert not names & {"fetch_add", "claim", "query_union", "gemm", "fmax"}
    assert all(not name.startswith("_") for name in names)
