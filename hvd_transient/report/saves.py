"""What checkpointing cost and wrote during a run, from its save and commit events (pure): the commits,
the seconds each worker's training waited for saves, the bytes written and the failed saves."""
from __future__ import annotations

from typing import Mapping, Sequence

from hvd_transient.report.records import AnyRecord, ProcessKey
from hvd_transient.report.records import of as _of
from hvd_transient.report.run_analysis import Commit, Worker
from hvd_transient.telemetry import schema as ev

#: save kinds whose ``save_end`` seconds the training loop waited for (periodic saves are async)
BLOCKING_SAVE_KINDS = frozenset({"emergency", "final"})


def commits_of(events: Sequence[AnyRecord]) -> tuple[Commit, ...]:
    """Every committed checkpoint, in time order."""
    return tuple(Commit(e.t, e.body.step, e.body.kind, e.host, e.body.size) for e in _of(events, ev.Commit))


def stall_by_worker(by_proc: Mapping[ProcessKey, Sequence[AnyRecord]],
                    workers: Mapping[ProcessKey, Worker]) -> dict[str, float]:
    """Worker label -> seconds its training waited for checkpoints (async stalls and blocking saves)."""
    stall: dict[str, float] = {}
    for key, evs in by_proc.items():
        seconds = sum(e.body.stall_ms for e in _of(evs, ev.AsyncSave)) / 1e3
        seconds += sum(e.body.seconds for e in _of(evs, ev.SaveEnd) if e.body.kind in BLOCKING_SAVE_KINDS)
        stall[workers[key].label] = seconds
    return stall


def bytes_written_of(events: Sequence[AnyRecord]) -> int:
    """Checkpoint bytes the run wrote."""
    # Synchronous saves log each rank's share (save_end); a periodic commit logs its whole step.
    return (sum(e.body.bytes for e in _of(events, ev.SaveEnd))
            + sum(e.body.bytes or 0 for e in _of(events, ev.Commit) if e.body.kind == "periodic"))


def saves_failed_of(events: Sequence[AnyRecord]) -> int:
    """Failed saves, each (step, kind) once although every rank reports it."""
    return len({(e.body.step, e.body.kind) for e in _of(events, ev.SaveFailed)})


__all__ = ["BLOCKING_SAVE_KINDS", "bytes_written_of", "commits_of", "saves_failed_of", "stall_by_worker"]
