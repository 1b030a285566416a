"""The settings ``fit`` chooses on the held-out slice, as one table, and the routine that runs it.

Each row of :data:`CANDIDATES` is a setting the rule would otherwise fix: when it is offered
(a condition over the settings given and the data's shape), the change it makes, and what it
builds on (the rule's own settings, a rung before it that must be the best run so far, or the
best run so far). :func:`select` trains the rule's own settings and each offered candidate in
the table's order, each from scratch with early stopping on the same held-out slice, and keeps
the run with the best validation score (ties: the earlier). Every threshold lives here; the
evidence behind each is in docs/ (named in the table).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from slide.config import OUTPUT_STATE_BYTES, checked_choice
from slide.resources import ModelTooLargeError

__all__ = ["Candidate", "CANDIDATES", "offered", "offered_to", "select", "choice_name", "checked_choice",
           "WIDE_HIDDEN", "LIGHT_DECAYS", "FEW_ROWS", "LOW_RATE",
           "LOW_RATE_POSITIVES"]

#: the wider hidden layer tried where the output is computed whole and the refit runs
#: (docs/hidden-width.md)
WIDE_HIDDEN = 2048
#: the lighter weight decays tried, in order, where the rule gives a whole output decay 1
#: (docs/weight-decay.md)
LIGHT_DECAYS = (0.3, 0.1, 0.03)
#: below this many training rows a run costs seconds to a minute, and the slice may try idf
#: weighting on the best run (docs/tfidf.md) and a sampled output's lower rate (LOW_RATE)
FEW_ROWS = 50_000
#: the lower rate tried where the output is sampled, rows are few and labels have at least
#: LOW_RATE_POSITIVES positives on average (docs/slow-rows.md)
LOW_RATE = 1e-3
LOW_RATE_POSITIVES = 5


@dataclass(frozen=True)
class Shape:
    """What a candidate's condition reads: the settings given, the rule's resolved settings,
    and the training data's shape (rows after the held-out slice)."""
    config: object
    resolved: dict
    n_features: int
    n_labels: int
    n_train: int
    labels_per_row: float | None = None


def _wide_hidden(s: Shape) -> bool:
    # where a run costs seconds to a minute, and the wide layer's state fits the budget
    wide_fits = 16 * WIDE_HIDDEN * (s.n_features + s.n_labels) <= OUTPUT_STATE_BYTES
    return (s.config.hidden is None and not s.resolved["sampled"] and s.resolved["refit"]
            and wide_fits)


def _light_decay(s: Shape) -> bool:
    return (s.config.weight_decay is None and not s.resolved["sampled"]
            and s.resolved["weight_decay"] == 1.0)


def _low_rate(s: Shape) -> bool:
    # the sampled output's 4e-3 suits some data of few rows and overshoots on other (real
    # text of a few thousand labels); a label of fewer positives learns from too few updates
    # for the lower rate
    positives = (s.labels_per_row or 0.0) * s.n_train / max(s.n_labels, 1)
    return (s.config.lr is None and s.resolved["sampled"] and s.resolved["lr"] > LOW_RATE
            and s.n_train < FEW_ROWS and positives >= LOW_RATE_POSITIVES)


def _idf(s: Shape) -> bool:
    return s.config.tfidf is None and s.n_train < FEW_ROWS


@dataclass(frozen=True)
class Candidate:
    """One row of the table: ``change`` (settings instead of the rule's), offered where
    ``when(shape)`` holds, built on ``on``: ``"rule"`` (the rule's own settings), ``"best"``
    (the best run so far, the change added to its settings) or the name of the candidate
    before it, tried only where that one's run is the best so far."""
    change: dict
    when: Callable[[Shape], bool]
    on: str = "rule"

    @property
    def name(self) -> str:
        return choice_name(self.change)


CANDIDATES = (
    Candidate({"width": WIDE_HIDDEN}, _wide_hidden),
    Candidate({"weight_decay": LIGHT_DECAYS[0]}, _light_decay),
    Candidate({"weight_decay": LIGHT_DECAYS[1]}, _light_decay, on=f"decay {LIGHT_DECAYS[0]:g}"),
    Candidate({"weight_decay": LIGHT_DECAYS[2]}, _light_decay, on=f"decay {LIGHT_DECAYS[1]:g}"),
    Candidate({"lr": LOW_RATE}, _low_rate),
    Candidate({"tfidf": True}, _idf, on="best"),
)


def choice_name(choice: dict) -> str:
    """How records and logs name a choice: "rule" for the rule's own settings, else e.g.
    "hidden 2048", "lr 0.001", "decay 0.3" or "decay 0.3, tf-idf"."""
    names = {"width": "hidden", "lr": "lr", "weight_decay": "decay"}
    return ", ".join("tf-idf" if k == "tfidf" else f"{names[k]} {v:g}"
                     for k, v in choice.items() if v is not False) or "rule"


def offered(config, resolved: dict, n_features: int, n_labels: int, n_train: int,
            labels_per_row: float | None = None) -> list:
    """The candidates of :data:`CANDIDATES` offered for this shape (none without early
    stopping); the selection runs where there is one. ``labels_per_row``: the training rows'
    mean label count (None: unknown, and the candidates that read it are not offered)."""
    if not config.early_stopping:
        return []
    shape = Shape(config, resolved, n_features, n_labels, n_train, labels_per_row)
    return [c for c in CANDIDATES if c.when(shape)]


def offered_to(model) -> list:
    """:func:`offered` for an initialised model: its settings as given and resolved, and its
    data's shape (input columns, output rows, training rows, labels a row)."""
    return offered(model.config_, model.resolved_, model.n_features_in_,
                   model.n_outputs_fitted_, model.n_train_, model.labels_per_row_)


def _ranked(score: float) -> float:
    return -math.inf if math.isnan(score) else score


def select(train: Callable[[dict], float], candidates: list, hold: Callable[[], object]):
    """Run the rule's own settings and then ``candidates`` in order; returns
    ``(best choice, {name: score}, held)``.

    ``train(choice)`` trains a fresh run with ``choice`` and returns its validation score (a
    run whose loss diverged scores NaN and ranks below any other); ``hold()`` is called after
    each run that is the best so far, and ``held`` is what it returned for the chosen run. A
    candidate whose run does not fit in memory is skipped (the rule's own must fit).
    """
    scores, best, held = {}, None, None
    for candidate in [None, *candidates]:
        if candidate is None:
            choice = {}
        elif candidate.on == "best":
            choice = {**best, **candidate.change}
        elif candidate.on == "rule":
            choice = dict(candidate.change)
        elif best is not None and choice_name(best) == candidate.on:
            choice = dict(candidate.change)
        else:
            continue  # the rung it builds on is not the best so far
        name = choice_name(choice)
        try:
            scores[name] = train(choice)
        except ModelTooLargeError:
            if candidate is None:  # the rule's own settings do not fit: nothing to choose from
                raise
            continue
        if best is None or _ranked(scores[name]) > _ranked(scores[choice_name(best)]):
            best = choice
            held = hold()
    return best, scores, held

