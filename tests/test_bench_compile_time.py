"""The compile-time report's own seconds per function, against a hand-computed nesting."""
from types import SimpleNamespace

import pytest

from bench.compile_time import own_times


def _fn(name):
    return SimpleNamespace(py_func=SimpleNamespace(__module__="m", __qualname__=name))


def _events(spec):
    """(timestamp, event) pairs from (time, name, is_start) triples."""
    return [(t, SimpleNamespace(data={"dispatcher": _fn(name)}, is_start=start))
            for t, name, start in spec]


def test_nested_compiles_count_once_each_in_their_own_function():
    # outer 0-10 holds inner 2-5 (which holds helper 3-4) and helper 6-8; then outer again 20-21
    events = _events([(0, "outer", True), (2, "inner", True), (3, "helper", True),
                      (4, "helper", False), (5, "inner", False), (6, "helper", True),
                      (8, "helper", False), (10, "outer", False),
                      (20, "outer", True), (21, "outer", False)])
    own = own_times(events)
    assert own["m.outer"] == pytest.approx([10 - 3 - 2 + 1, 2])
    assert own["m.inner"] == pytest.approx([3 - 1, 1])
    assert own["m.helper"] == pytest.approx([1 + 2, 2])
    # every second is counted once
    assert sum(s for s, _ in own.values()) == pytest.approx(11)
