"""The run's step curve and learning-rate changes, from its step and ``lr`` events (pure)."""
from __future__ import annotations

import math
from typing import Sequence

from hvd_transient.report.records import AnyRecord
from hvd_transient.report.records import of as _of
from hvd_transient.report.records import of_any as _of_any
from hvd_transient.report.records import step as _step
from hvd_transient.report.run_analysis import LrChange, ProgressPoint
from hvd_transient.telemetry import schema as ev


def lr_changes_of(events: Sequence[AnyRecord]) -> tuple[LrChange, ...]:
    """Each learning rate set, once until it changes."""
    out: list[LrChange] = []
    for e in _of(events, ev.Lr):
        lr = float(e.body.lr)
        if not out or not math.isclose(out[-1].lr, lr, rel_tol=1e-9):
            out.append(LrChange(e.t, lr, e.body.size))
    return tuple(out)


def progress_of(events: Sequence[AnyRecord]) -> tuple[ProgressPoint, ...]:
    """One point per step a step event reported (the first report of each step, in time order)."""
    points: list[ProgressPoint] = []
    last: tuple[int, int | None] | None = None
    for e in _of_any(events, (ev.FirstStep, ev.Progress, ev.Reset, ev.TrainEnd)):
        step = _step(e)
        if step is None:
            continue
        size = getattr(e.body, "size", None)
        if (step, size) != last:
            points.append(ProgressPoint(e.t, step, size))
            last = (step, size)
    return tuple(points)


__all__ = ["lr_changes_of", "progress_of"]
