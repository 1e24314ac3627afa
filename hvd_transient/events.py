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

Every event has ``t`` (epoch seconds), ``event``, ``host`` and ``pid``; the kinds:

=================  ==================================================================
start              a worker process began training: step, rank, size, crc (replicated
                   state), full_crc, restored_step (rank 0 of a cold restart)
ring               (every rank) training (re)started on a ring: step, rank, size, master,
                   master_host, previous_master, lease_generation (master only)
lr                 learning rate set for the ring: lr, size, mode
resume_at          (every rank) fit resumed at: step, epoch, batch, steps_per_epoch, samples
                   (global sample offset, with elastic_dataset; else null)
first_step         first step completed on a new ring: step, size, samples (if tracked)
progress           every N steps: step, size, samples (if tracked)
notice             this host's watcher saw a notice: source, reason, detected_at, deadline
notice_agreed      (every rank) step at which all ranks acted: step, leaving (hosts),
                   deadline (commit deadline), size
wait_inflight      an in-flight background save was waited for before the emergency save
election           master moved: step, old_master(_host), new_master(_host), lease_generation
save_start/_end    step, kind (emergency|periodic|final), seconds, bytes (this rank's share)
async_save         a periodic background save started: step, stall_ms, size
save_skipped       a periodic save was skipped: reason (one still in flight | already committed)
commit             (master) step, kind, size, lease_generation, bytes (periodic: whole step)
save_failed        step, kind, error
leave_published    this host published itself as leaving: step, deadline
leaving_pruned     (master, when a ring begins) expired leaving records deleted: hosts
reset              Horovod reset the ring: step (after), rolled_back, last_step
stop_requested     (every rank) an operator stop was agreed at: step
train_end          step
weights            step, crc (replicated state), size, rank
restore            (rank 0) a checkpoint was restored: step, writers, bytes
lease_error        error
=================  ==================================================================
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from typing import Any, Iterator

from ckpt_service.stores.base import ObjectStore

log = logging.getLogger(__name__)

EVENTS_PREFIX = "events/"
#: written to the store before emit() returns: the process may vanish right after these
#: (a leaving worker is aborted by Horovod once the ring is reset without it)
DURABLE = frozenset({"notice", "notice_agreed", "leave_published", "train_end", "weights"})
#: written at once by the background writer, bypassing the rate limit (the report and the
#: benchmarks follow these while the job runs)
URGENT = frozenset({"election", "commit", "save_failed", "restore", "reset", "start", "ring", "async_save",
                    "stop_requested"})


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
        self._last_flush = 0.0
        self._dirty = False
        self._urgent = False
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._writer: threading.Thread | None = None
        atexit.register(self.flush)  # rate-limited events must still reach the store

    def emit(self, kind: str, /, **fields: Any) -> dict[str, Any]:
        event = {"t": time.time(), "event": kind, "host": self.host, "pid": os.getpid(), **fields}
        with self._lock:
            self._events.append(event)
            self._dirty = True
            self._urgent |= kind in URGENT
        log.info("event %s %s", kind, {k: v for k, v in fields.items()})
        if kind in DURABLE or self._closed.is_set():
            self.flush()
        else:
            self._start_writer()
            self._wake.set()
        return event

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
        return f"{EVENTS_PREFIX}{self.host}.{os.getpid()}.{self._seq:06d}.jsonl"

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


def read_events(store: ObjectStore) -> list[dict[str, Any]]:
    """Every process's events (every segment), merged and sorted by time."""
    events: list[dict[str, Any]] = []
    for key in store.list(EVENTS_PREFIX):
        if key.endswith(".jsonl"):
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
