"""The event log: what reaches the store when, that emit() never waits on a slow store, and the schema
every event is emitted and read back with."""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from ckpt_service.stores import LocalStore
from ckpt_service.stores.memory import MemoryStore
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import DURABLE, URGENT, EventLog, read_events, read_records

pytestmark = pytest.mark.timed  # bounds wall-clock times

REAL_LOG = Path(__file__).resolve().parent / "data" / "report_events"


class GatedStore(MemoryStore):
    """A store whose writes block until the test opens the gate; every write is announced."""

    def __init__(self) -> None:
        super().__init__("events-test")
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.written = threading.Condition()
        self.puts: list[list[str]] = []

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        self.entered.set()
        self.gate.wait(30)
        generation = super().put(key, data, if_generation_match=if_generation_match)
        with self.written:
            self.puts.append([json.loads(line)["event"] for line in data.decode().splitlines()])
            self.written.notify_all()
        return generation

    def wait_for_put(self, predicate: Callable[[list[str]], bool], timeout: float = 10.0) -> bool:
        with self.written:
            return self.written.wait_for(lambda: any(predicate(p) for p in self.puts), timeout)


def test_durable_events_are_in_the_store_when_emit_returns() -> None:
    store = GatedStore()
    log = EventLog(store, "h1", min_flush_interval_s=60.0)
    log.emit(ev.Progress(step=1, size=2))
    log.emit(ev.LeavePublished(step=2, deadline=None))
    assert [e["event"] for e in read_events(store)] == ["progress", "leave_published"]
    log.close()


def test_a_durable_event_waits_for_a_stuck_store_only_up_to_its_bound() -> None:
    store = GatedStore()
    store.gate.clear()                     # the store hangs (a slow GCS inside a notice)
    log = EventLog(store, "h1", min_flush_interval_s=60.0, durable_wait_s=0.3)
    t0 = time.monotonic()
    log.emit(ev.Notice(source="gce", reason="preempted", detected_at=1.0, deadline=31.0))
    log.emit(ev.NoticeAgreed(step=5, leaving=("h1",), deadline=26.0, size=2), wait_s=0.1)
    waited = time.monotonic() - t0
    assert 0.4 - 0.05 <= waited < 3.0      # each emit waited its own bound, then training went on
    assert store.puts == []
    store.gate.set()                       # the store recovers: both are written without another emit
    assert store.wait_for_put(lambda events: events == ["notice", "notice_agreed"])
    log.close()


def test_a_failed_write_is_retried_without_waiting_for_another_event() -> None:
    class Flaky(MemoryStore):
        fails = 2

        def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
            if self.fails:
                self.fails -= 1
                raise OSError("store unreachable")
            return super().put(key, data, if_generation_match=if_generation_match)

    store = Flaky("flaky")
    log = EventLog(store, "h1", min_flush_interval_s=0.0, durable_wait_s=5.0)
    log.emit(ev.LeavePublished(step=1, deadline=None))   # waits through two failed writes and the retries
    assert [e["event"] for e in read_events(store)] == ["leave_published"]
    log.close()


def test_emit_does_not_wait_for_a_slow_store() -> None:
    store = GatedStore()
    store.gate.clear()                     # every write hangs until the gate opens
    log = EventLog(store, "h1", min_flush_interval_s=0.0)
    log.emit(ev.Progress(step=1, size=2))           # the background writer takes this one and hangs
    assert store.entered.wait(10)
    for step in range(2, 50):              # returns although the store is stuck
        log.emit(ev.Progress(step=step, size=2))
    log.emit(ev.AsyncSave(step=50, stall_ms=1.0, size=2))
    assert store.puts == []
    store.gate.set()
    assert store.wait_for_put(lambda events: events[-1:] == ["async_save"] and len(events) == 50)
    log.close()


def test_urgent_events_bypass_the_rate_limit_and_carry_earlier_ones() -> None:
    store = GatedStore()
    log = EventLog(store, "h1", min_flush_interval_s=3600.0)
    log.emit(ev.Progress(step=1, size=2))          # first write: nothing to rate-limit yet
    assert store.wait_for_put(lambda events: events == ["progress"])
    log.emit(ev.Progress(step=2, size=2))          # held back by the rate limit ...
    log.emit(ev.Commit(step=2, kind="periodic", size=1, lease_generation=1))  # ... until an urgent one
    assert store.wait_for_put(lambda events: events == ["progress", "progress", "commit"])


def test_close_writes_what_the_rate_limit_held_back() -> None:
    store = GatedStore()
    log = EventLog(store, "h1", min_flush_interval_s=3600.0)
    log.emit(ev.Progress(step=1, size=2))
    assert store.wait_for_put(lambda events: events == ["progress"])
    log.emit(ev.Progress(step=2, size=2))
    log.close()
    assert [e["step"] for e in read_events(store)] == [1, 2]
    log.emit(ev.Progress(step=3, size=2))          # after close: written at once
    assert [e["step"] for e in read_events(store)] == [1, 2, 3]


def test_a_failing_store_never_raises_into_training() -> None:
    class Broken(MemoryStore):
        def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
            raise OSError("store unreachable")

    log = EventLog(Broken("broken"), "h1", min_flush_interval_s=0.0, durable_wait_s=0.2)
    log.emit(ev.LeavePublished(step=1, deadline=None))   # durable: waits its bound, never raises
    log.emit(ev.Progress(step=2, size=2))
    log.close()
    assert [e["event"] for e in log.events] == ["leave_published", "progress"]


def test_a_long_run_writes_rolling_segments_with_bounded_memory_and_flushes() -> None:
    """A multi-day run's progress events: memory and each flush stay bounded by the segment size,
    and reading the log back gives every event, in order, from all segments."""
    store = MemoryStore()
    sizes: list[int] = []

    class Recording(MemoryStore):
        def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
            sizes.append(len(data))
            return store.put(key, data, if_generation_match=if_generation_match)

    log = EventLog(Recording(), "h1", min_flush_interval_s=0.0, segment_events=50)
    for step in range(1, 1001):
        log.emit(ev.Progress(step=step * 10, size=4))
        if step % 7 == 0:
            log.flush()
        assert len(log.events) <= 50 + 7
    log.close()
    keys = sorted(store.list("events/"))
    assert 1000 // 57 <= len(keys) <= 20  # each sealed segment holds 50 events and what came during its write
    assert all(k.startswith(f"events/h1.{os.getpid()}.") for k in keys)
    assert max(sizes) < 57 * 100  # a flush carries at most one segment, however long the run
    events = read_events(store)
    assert [e["step"] for e in events] == [step * 10 for step in range(1, 1001)]


# --------------------------------------------------------------------------- the schema


def test_emit_takes_only_declared_kinds_with_their_exact_fields() -> None:
    log = EventLog(None, "h1")
    with pytest.raises(TypeError):
        log.emit("progress", step=1)  # type: ignore[call-arg, type-var]
    with pytest.raises(TypeError):
        ev.Progress(step=1, sise=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        ev.Reset(step=1, rolled_back=0)  # type: ignore[call-arg]

    @dataclasses.dataclass(frozen=True)
    class Undeclared(ev.Progress):
        extra: int = 0

    with pytest.raises(TypeError):
        log.emit(Undeclared(step=1, size=2))
    record = log.emit(ev.NoticeAgreed(step=3, leaving=("b",), deadline=None, size=2))
    assert record.event == "notice_agreed" and record.host == "h1" and record.pid == os.getpid()
    assert log.events == [{"t": record.t, "event": "notice_agreed", "host": "h1", "pid": os.getpid(), "step": 3,
                           "leaving": ["b"], "deadline": None, "size": 2}]


def test_durable_and_urgent_kinds() -> None:
    assert DURABLE == {"notice", "early_warning", "notice_agreed", "leave_published", "leave_moved", "train_end",
                       "weights"}
    assert URGENT == {"election", "commit", "save_failed", "restore", "reset", "start", "ring", "async_save",
                      "stop_requested"}


def test_every_kind_round_trips_through_json() -> None:
    values: dict[str, Any] = {"int": 3, "float": 1.5, "str": "x", "bool": True, "tuple[str, ...]": ("a", "b")}
    for name, cls in ev.KINDS.items():
        fields = {}
        for f in dataclasses.fields(cls):
            kind = str(f.type).split(" | ")[0]
            fields[f.name] = values[kind]
        record = ev.Record(12.5, "h", 7, cls(**fields))
        on_disk = json.loads(json.dumps(ev.to_json_dict(record)))
        assert on_disk["event"] == name
        assert ev.from_json_dict(on_disk) == record, name


def test_reading_is_lenient() -> None:
    base = {"t": 1.0, "host": "h", "pid": 1}
    # extra fields are ignored, optional ones take their default
    record = ev.from_json_dict({**base, "event": "progress", "step": 5, "size": 2, "from_the_future": 1})
    assert record == ev.Record(1.0, "h", 1, ev.Progress(step=5, size=2, samples=None))
    assert ev.from_json_dict({**base, "event": "no_such_kind", "step": 5}) is None
    assert ev.from_json_dict({**base, "event": "reset", "step": 5}) is None   # rolled_back, last_step missing
    assert ev.from_json_dict({"event": "progress", "step": 5, "size": 2}) is None  # no time


def test_the_committed_run_log_parses_completely() -> None:
    """Every line of the real run's log is a declared kind with its fields."""
    raw = read_events(LocalStore(REAL_LOG))
    records = read_records(LocalStore(REAL_LOG))
    assert len(records) == len(raw) > 100
    assert [ev.to_json_dict(r) for r in records] == raw
