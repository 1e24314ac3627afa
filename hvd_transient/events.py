"""Structured JSON-lines event log, one object per process under the run's store prefix.

Object stores cannot append, so each process writes rolling segments,
``events/<host>.<pid>.<seq>.jsonl``: a flush rewrites only the current segment,
and a segment that holds ``segment_events`` events is sealed once written and
dropped from memory, so neither memory nor the bytes of a flush grow with the
length of the run. A background thread
does the writing, rate limited (GCS allows about one write per second per
object) except for the events others follow while the job runs; the few that
matter when a machine is about to disappear are written before ``emit`` returns.
The report and the benchmarks read every file back and merge them by time.

The kinds of event and their fields are declared in :mod:`hvd_transient.event_schema`:
``emit`` takes one of its dataclasses (``log.emit(Progress(step=10, size=4))``), and
:func:`read_records` gives the log back as typed :class:`~hvd_transient.event_schema.Record`
objects (:func:`read_events`: the same as plain dicts). On disk every event is one JSON
object with ``t`` (epoch seconds), ``event`` (the kind), ``host``, ``pid`` and its fields.
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import threading
import time
from typing import Any, Iterable, Iterator, Mapping, TypeVar

from ckpt_service.layout import EVENTS_PREFIX, events_key, is_events_key
from ckpt_service.stores.base import ObjectStore
from hvd_transient.event_schema import KINDS, EventBody, Record, from_json_dict, to_json_dict

log = logging.getLogger(__name__)

#: written to the store before emit() returns: the process may vanish right after these
#: (a leaving worker is aborted by Horovod once the ring is reset without it)
DURABLE = frozenset(name for name, cls in KINDS.items() if cls.durable)
#: written at once by the background writer, bypassing the rate limit (the report and the
#: benchmarks follow these while the job runs)
URGENT = frozenset(name for name, cls in KINDS.items() if cls.urgent)

B = TypeVar("B", bound=EventBody)


class EventLog:
    """Events of one process; a background thread writes them so ``emit`` never waits on the store."""

    def __init__(self, store: ObjectStore | None, host: str, *, min_flush_interval_s: float = 2.0,
                 segment_events: int = 1000) -> None:
        if segment_events < 1:
            raise ValueError(f"segment_events must be at least 1, not {segment_events}")
        self.store, self.host = store, host
        self.min_flush_interval_s = min_flush_interval_s
        self.segment_events = segment_events
        self._seq = 0
        self._events: list[dict[str, Any]] = []  # the current segment's, not yet sealed
        self._lock = threading.Lock()        # guards the list and the flags
        self._write_lock = threading.Lock()  # one store write at a time, in order
        self._last_flush = -math.inf  # the first write is never held back
        self._dirty = False
        self._urgent = False
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._writer: threading.Thread | None = None
        atexit.register(self.flush)  # rate-limited events must still reach the store

    def emit(self, body: B) -> Record[B]:
        """Log one event (a dataclass of :mod:`hvd_transient.event_schema`) and return it as logged."""
        if not isinstance(body, EventBody) or KINDS.get(body.event) is not type(body):
            raise TypeError(f"not a declared event kind: {body!r}")
        record = Record(time.time(), self.host, os.getpid(), body)
        event = to_json_dict(record)
        with self._lock:
            self._events.append(event)
            self._dirty = True
            self._urgent |= body.urgent
        log.info("event %s", body)
        if body.durable or self._closed.is_set():
            self.flush()
        else:
            self._start_writer()
            self._wake.set()
        return record

    def flush(self) -> None:
        """Write every event so far to the store now (on the calling thread)."""
        if self.store is None:
            return
        with self._write_lock:
            with self._lock:
                if not self._dirty:
                    return
                written = list(self._events)
                key = self.key
                self._dirty = self._urgent = False
                self._last_flush = time.monotonic()
            body = "".join(json.dumps(e, default=str) + "\n" for e in written).encode()
            try:
                self.store.put(key, body)
            except Exception as exc:  # the log must never break training
                log.warning("could not write the event log to %s: %s", self.store.url, exc)
                with self._lock:
                    self._dirty = True
                return
            if len(written) >= self.segment_events:
                with self._lock:  # sealed: what came after the snapshot opens the next segment
                    self._events = self._events[len(written):]
                    self._seq += 1
                    self._dirty = self._dirty or bool(self._events)

    @property
    def key(self) -> str:
        """The current segment's object."""
        return events_key(self.host, os.getpid(), self._seq)

    def close(self) -> None:
        """Stop the background writer and write what is left."""
        self._closed.set()
        self._wake.set()
        if self._writer is not None and self._writer is not threading.current_thread():
            self._writer.join(timeout=30)
        self.flush()

    def _start_writer(self) -> None:
        if self._writer is None and self.store is not None:
            with self._lock:
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write_loop, name="hvdt-events", daemon=True)
                    self._writer.start()

    def _write_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._closed.is_set():  # close() flushes what is left itself: don't sit out the rate limit
                return
            with self._lock:
                dirty, urgent = self._dirty, self._urgent
                wait = self._last_flush + self.min_flush_interval_s - time.monotonic()
            if not dirty:
                continue
            if not urgent and wait > 0:
                # rate limit (GCS takes about one write per second per object); an urgent
                # event arriving meanwhile cuts the wait short
                if self._wake.wait(wait):
                    continue  # re-evaluate with the newer state; _wake stays set so no event is missed
            self.flush()

    @property
    def events(self) -> list[dict[str, Any]]:
        """This process's events still in memory (the current segment; earlier ones are in the store)."""
        with self._lock:
            return list(self._events)


def read_records(store: ObjectStore) -> list[Record[EventBody]]:
    """Every process's events as typed records, merged and sorted by time (see
    :func:`~hvd_transient.event_schema.from_json_dict` for what is skipped)."""
    return parse_records(read_events(store))


def parse_records(events: Iterable[Record[EventBody] | Mapping[str, Any]]) -> list[Record[EventBody]]:
    """Typed records of logged objects (records pass through), sorted by time."""
    out: list[Record[EventBody]] = []
    for e in events:
        record = e if isinstance(e, Record) else from_json_dict(e) if isinstance(e, Mapping) else None
        if record is not None:
            out.append(record)
    return sorted(out, key=lambda r: r.t)


def read_events(store: ObjectStore) -> list[dict[str, Any]]:
    """Every process's events (every segment) as the logged dicts, merged and sorted by time."""
    events: list[dict[str, Any]] = []
    for key in store.list(EVENTS_PREFIX):
        if is_events_key(key):
            events.extend(_parse_lines(store.get(key)))
    return sorted(events, key=lambda e: e.get("t", 0.0))


def _parse_lines(data: bytes) -> Iterator[dict[str, Any]]:
    for line in data.decode(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            log.warning("skipping an unreadable event line: %.80s", line)
            continue
        if isinstance(event, dict):
            yield event
