"""The event log: what reaches the store when, and that emit() never waits on a slow store."""
from __future__ import annotations

import json
import os
import threading

from ckpt_service.stores.memory import MemoryStore
from hvd_transient.events import EventLog, read_events


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

    def wait_for_put(self, predicate, timeout: float = 10.0) -> bool:
        with self.written:
            return self.written.wait_for(lambda: any(predicate(p) for p in self.puts), timeout)


def test_durable_events_are_in_the_store_when_emit_returns() -> None:
    store = GatedStore()
    log = EventLog(store, "h1", min_flush_interval_s=60.0)
    log.emit("progress", step=1)
    log.emit("leave_published", step=2, deadline=None)
    assert [e["event"] for e in read_events(store)] == ["progress", "leave_published"]
    log.close()


def test_emit_does_not_wait_for_a_slow_store() -> None:
    store = GatedStore()
    store.gate.clear()                     # every write hangs until the gate opens
    log = EventLog(store, "h1", min_flush_interval_s=0.0)
    log.emit("progress", step=1)           # the background writer takes this one and hangs
    assert store.entered.wait(10)
    for step in range(2, 50):              # returns although the store is stuck
        log.emit("progress", step=step)
    log.emit("async_save", step=50, stall_ms=1.0, size=2)
    assert store.puts == []
    store.gate.set()
    assert store.wait_for_put(lambda events: events[-1:] == ["async_save"] and len(events) == 50)
    log.close()


def test_urgent_events_bypass_the_rate_limit_and_carry_earlier_ones() -> None:
    store = GatedStore()
    log = EventLog(store, "h1", min_flush_interval_s=3600.0)
    log.emit("progress", step=1)          # first write: nothing to rate-limit yet
    assert store.wait_for_put(lambda events: events == ["progress"])
    log.emit("progress", step=2)          # held back by the rate limit ...
    log.emit("commit", step=2, kind="periodic", size=1, lease_generation=1)  # ... until an urgent one
    assert store.wait_for_put(lambda events: events == ["progress", "progress", "commit"])


def test_close_writes_what_the_rate_limit_held_back() -> None:
    store = GatedStore()
    log = EventLog(store, "h1", min_flush_interval_s=3600.0)
    log.emit("progress", step=1)
    assert store.wait_for_put(lambda events: events == ["progress"])
    log.emit("progress", step=2)
    log.close()
    assert [e["step"] for e in read_events(store)] == [1, 2]
    log.emit("progress", step=3)          # after close: written at once
    assert [e["step"] for e in read_events(store)] == [1, 2, 3]


def test_a_failing_store_never_raises_into_training() -> None:
    class Broken(MemoryStore):
        def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
            raise OSError("store unreachable")

    log = EventLog(Broken("broken"), "h1", min_flush_interval_s=0.0)
    log.emit("leave_published", step=1, deadline=None)   # synchronous path
    log.emit("progress", step=2)                         # background path
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
        log.emit("progress", step=step * 10, size=4)
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
