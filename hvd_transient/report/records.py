"""Typed event records, as the report's analysers read them (pure)."""
from __future__ import annotations

from typing import Iterable, TypeVar, cast

from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.schema import EventBody, Record

AnyRecord = Record[EventBody]
ProcessKey = tuple[str, int]  # (host, pid): one worker process
B = TypeVar("B", bound=EventBody)

#: events that say where training was: a completed step, or (Ring) training (re)starting at one
TRAINING_KINDS: tuple[type[EventBody], ...] = (ev.FirstStep, ev.Progress, ev.Ring)


def key(e: AnyRecord) -> ProcessKey:
    return (e.host, e.pid)


def step(e: AnyRecord) -> int | None:
    step = getattr(e.body, "step", None)
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def of(events: Iterable[AnyRecord], kind: type[B]) -> list[Record[B]]:
    return [cast(Record[B], e) for e in events if isinstance(e.body, kind)]


def of_any(events: Iterable[AnyRecord], kinds: tuple[type[EventBody], ...]) -> list[AnyRecord]:
    return [e for e in events if isinstance(e.body, kinds)]


__all__ = ["AnyRecord", "ProcessKey", "TRAINING_KINDS", "key", "of", "of_any", "step"]
