"""Structured JSON-lines event log, one object per process under the run's store prefix.

Object stores cannot append, so each log writes rolling segments,
``events/<host>.<pid>.<log>.<seq>.jsonl``: a flush rewrites only the current segment,
and a segment that holds ``segment_events`` events is sealed once written and
dropped from memory, so neither memory nor the bytes of a flush grow with the
length of the run. ``log`` is random per :class:`EventLog`: a second log in one
process, or a process that reuses a pid on one host (a container), never
overwrites another's segments. Readers take every ``.jsonl`` under ``events/``,
so older names (``<host>.<pid>.<seq>``) still read. A background thread
does the writing, rate limited (GCS allows about one write per second per
object) except for the events others follow while the job runs. The few that
matter when a machine is about to disappear (durable kinds) are written at once,
and ``emit`` waits for that write, but only up to ``durable_wait_s``: a slow or
unreachable store delays the caller (the training thread, inside a notice) by at
most that bound, and every write is itself bounded by ``write_timeout_s``, so a
stalled request never holds the log up for the store's whole retry budget.
A process about to end with no Python after it (a worker Horovod resets out of
the ring) copies its last events in one bounded write of their own to segment
``FINAL_SEQ`` (:meth:`EventLog.write_final`), not waiting behind a slow write.
The report and the benchmarks read every file back and merge them by time; an
event found in two segments counts once.

The kinds of event and their fields are declared in :mod:`hvd_transient.telemetry.schema`:
``emit`` takes one of its dataclasses (``log.emit(Progress(step=10, size=4))``), and
:func:`read_records` gives the log back as typed :class:`~hvd_transient.telemetry.schema.Record`
objects (:func:`read_events`: the same as plain dicts). On disk every event is one JSON
object with ``t`` (epoch seconds), ``event`` (the kind), ``host``, ``pid`` and its fields.
Reading checks each event against its kind's declared field types
(:mod:`hvd_transient.telemetry.parsing`): one that fails, or a line that is no JSON
object, is skipped and counted (:func:`read_log`).
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import secrets
import threading
import time
from typing import Any, Iterator, Mapping, TypeVar

from ckpt_service.deadline import Deadline
from ckpt_service.stores.base import ObjectStore
from hvd_transient.store_keys import EVENTS_PREFIX, EVENTS_SUFFIX, is_events_key
from hvd_transient.telemetry.parsing import UNREADABLE_LINE, ParsedLog, is_real, parse_log
from hvd_transient.telemetry.parsing import parse_records as parse_records  # where callers have found it
from hvd_transient.telemetry.schema import KINDS, EventBody, Record, to_json_dict

log = logging.getLogger(__name__)

#: written at once, emit() waiting (boundedly) for the write: the process may vanish right
#: after these (a leaving worker is aborted by Horovod once the ring is reset without it)
DURABLE = frozenset(name for name, cls in KINDS.items() if cls.durable)
#: written at once by the background writer, bypassing the rate limit (the report and the
#: benchmarks follow these while the job runs)
URGENT = frozenset(name for name, cls in KINDS.items() if cls.urgent)

B = TypeVar("B", bound=EventBody)


#: how long emit() waits for a durable event's write by default
DURABLE_WAIT_S = 1.0
#: the longest one write of the log may take, retries included
WRITE_TIMEOUT_S = 10.0
#: after a failed write, the background writer tries again this much later
RETRY_AFTER_S = 1.0
#: the segment a process about to end copies its last events to (:meth:`EventLog.write_final`)
FINAL_SEQ = 999_999


def segment_key(host: str, pid: int, log_id: str, seq: int) -> str:
    """Segment ``seq`` of the event log ``log_id`` of process ``pid`` on ``host``."""
    return f"{EVENTS_PREFIX}{host}.{pid}.{log_id}.{seq:06d}{EVENTS_SUFFIX}"


class EventLog:
    """Events of one process; a background thread writes them, so ``emit`` waits on the store
    only for a durable event, and then at most ``durable_wait_s``."""

    def __init__(self, store: ObjectStore | None, host: str, *, min_flush_interval_s: float = 2.0,
                 segment_events: int = 1000, durable_wait_s: float = DURABLE_WAIT_S,
                 write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        if segment_events < 1:
            raise ValueError(f"segment_events must be at least 1, not {segment_events}")
        if durable_wait_s < 0 or write_timeout_s <= 0:
            raise ValueError(f"durable_wait_s must be >= 0 and write_timeout_s > 0, not {durable_wait_s} "
                             f"and {write_timeout_s}")
        self.store, self.host = store, host
        self.min_flush_interval_s = min_flush_interval_s
        self.segment_events = segment_events
        self.durable_wait_s, self.write_timeout_s = durable_wait_s, write_timeout_s
        #: tells this log's segments apart from any other's of the same host and pid
        self.log_id = secrets.token_hex(4)
        self._seq = 0
        self._events: list[dict[str, Any]] = []  # the current segment's, not yet sealed
        self._emitted = 0  # events emitted so far, and how many of them are in the store
        self._stored = 0
        self._lock = threading.Condition()   # guards the list, the counts and the flags
        self._write_lock = threading.Lock()  # one store write at a time, in order
        self._last_flush = -math.inf  # the first write is never held back
        self._dirty = False
        self._urgent = False
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._writer: threading.Thread | None = None
        atexit.register(self.flush)  # rate-limited events must still reach the store

    def emit(self, body: B, *, wait_s: float | None = None) -> Record[B]:
        """Log one event (a dataclass of :mod:`hvd_transient.telemetry.schema`) and return it as logged.

        A durable event is written at once; the call waits for that write up to ``wait_s``
        (default ``durable_wait_s``), and returns whether or not it is done by then.
        """
        if not isinstance(body, EventBody) or KINDS.get(body.event) is not type(body):
            raise TypeError(f"not a declared event kind: {body!r}")
        record = Record(time.time(), self.host, os.getpid(), body)
        event = to_json_dict(record)
        with self._lock:
            self._events.append(event)
            self._emitted += 1
            mine = self._emitted
            self._dirty = True
            self._urgent |= body.urgent or body.durable
        log.info("event %s", body)
        if self._closed.is_set():
            self.flush()
            return record
        self._start_writer()
        self._wake.set()
        if body.durable:
            self.wait_stored(mine, self.durable_wait_s if wait_s is None else wait_s)
        return record

    def wait_stored(self, count: int, timeout_s: float) -> bool:
        """Wait until the first ``count`` events emitted are in the store, at most ``timeout_s``."""
        if self.store is None:
            return True
        with self._lock:
            done = self._lock.wait_for(lambda: self._stored >= count, timeout=max(0.0, timeout_s))
        if not done:
            log.warning("the event log's write to %s is taking longer than %.1f s; training goes on",
                        self.store.url, timeout_s)
        return done

    def write_final(self, timeout_s: float) -> bool:
        """For a process about to end with no Python after it: copy the current segment's events
        to a segment of their own (``FINAL_SEQ``) in one write bounded by ``timeout_s``, on the
        calling thread, so they do not wait behind a slow write in flight. Readers drop the
        copies of events another segment holds too. Returns whether the write was answered."""
        if self.store is None:
            return True
        with self._lock:
            events = list(self._events)
        body = "".join(json.dumps(e, default=str) + "\n" for e in events).encode()
        try:
            self.store.within(Deadline(time.time() + timeout_s, margin_s=0.0)).put(
                segment_key(self.host, os.getpid(), self.log_id, FINAL_SEQ), body)
        except Exception as exc:  # the log must never break the caller
            log.warning("could not write the last events to %s: %s", self.store.url, exc)
            return False
        return True

    def flush(self) -> bool:
        """Write every event so far to the store now (on the calling thread), within ``write_timeout_s``;
        returns whether the store has them all."""
        if self.store is None:
            return True
        with self._write_lock:
            with self._lock:
                if not self._dirty:
                    return True
                written = list(self._events)
                upto = self._emitted
                key = self.key
                self._dirty = self._urgent = False
                self._last_flush = time.monotonic()
            body = "".join(json.dumps(e, default=str) + "\n" for e in written).encode()
            try:
                self.store.within(Deadline(time.time() + self.write_timeout_s, margin_s=0.0)).put(key, body)
            except Exception as exc:  # the log must never break training
                log.warning("could not write the event log to %s: %s", self.store.url, exc)
                with self._lock:
                    self._dirty = True
                return False
            with self._lock:
                self._stored = max(self._stored, upto)
                self._lock.notify_all()
                if len(written) >= self.segment_events:
                    # sealed: what came after the snapshot opens the next segment
                    self._events = self._events[len(written):]
                    self._seq += 1
                    self._dirty = self._dirty or bool(self._events)
        return True

    @property
    def key(self) -> str:
        """The current segment's object."""
        return segment_key(self.host, os.getpid(), self.log_id, self._seq)

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
            if not self.flush() and not self._closed.wait(RETRY_AFTER_S):
                self._wake.set()  # the store failed: try again soon, not only at the next event

    @property
    def events(self) -> list[dict[str, Any]]:
        """This process's events still in memory (the current segment; earlier ones are in the store)."""
        with self._lock:
            return list(self._events)


def read_log(store: ObjectStore) -> ParsedLog:
    """Every process's events as typed records (see :func:`parse_log`), with the unreadable lines counted."""
    events, unreadable = _read_objects(store)
    parsed = parse_log(events)
    if not unreadable:
        return parsed
    return ParsedLog(parsed.records, dict(sorted({**parsed.skipped, UNREADABLE_LINE: unreadable}.items())))


def read_records(store: ObjectStore) -> list[Record[EventBody]]:
    """Every process's events as typed records, merged and sorted by time; what cannot be read is
    skipped (:func:`read_log` counts it)."""
    return list(read_log(store).records)


def read_events(store: ObjectStore) -> list[dict[str, Any]]:
    """Every process's events (every segment) as the logged dicts, merged and sorted by time;
    an event found in two segments (a final copy, :meth:`EventLog.write_final`) counts once."""
    return _read_objects(store)[0]


def _read_objects(store: ObjectStore) -> tuple[list[dict[str, Any]], int]:
    """:func:`read_events`, and how many lines were no JSON object."""
    events: list[dict[str, Any]] = []
    seen: set[str] = set()
    unreadable = 0
    for key in store.list(EVENTS_PREFIX):
        if is_events_key(key):
            for event in _parse_lines(store.get(key)):
                if event is None:
                    unreadable += 1
                    continue
                identity = json.dumps(event, sort_keys=True, default=str)
                if identity not in seen:
                    seen.add(identity)
                    events.append(event)
    return sorted(events, key=_sort_time), unreadable


def _sort_time(event: Mapping[str, Any]) -> float:
    # an event without a usable time sorts last (parsing skips it), never fails the sort
    t = event.get("t")
    return float(t) if is_real(t) else math.inf


def _parse_lines(data: bytes) -> Iterator[dict[str, Any] | None]:
    """Each line's object; None for a line that is no JSON object."""
    for line in data.decode(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            log.warning("skipping an unreadable event line: %.80s", line)
            yield None
            continue
        yield event if isinstance(event, dict) else None
