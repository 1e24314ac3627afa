"""Event-log segment names: every log's segments are its own, so no log overwrites another's, and
segments named by older versions still read."""
from __future__ import annotations

import json
import os
import uuid

from ckpt_service.stores.memory import MemoryStore
from hvd_transient.store_keys import EVENTS_PREFIX
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import FINAL_SEQ, EventLog, read_events, read_records


def fresh_store() -> MemoryStore:
    return MemoryStore.named(uuid.uuid4().hex)


def progress_steps(store: MemoryStore) -> list[int]:
    return sorted(r.body.step for r in read_records(store) if isinstance(r.body, ev.Progress))


def test_two_logs_of_one_host_in_one_process_keep_all_their_events() -> None:
    """A second log in a process (or a process reusing a pid on one host) writes segments of its own."""
    store = fresh_store()
    first, second = (EventLog(store, "h0", min_flush_interval_s=0.0) for _ in range(2))
    for step in range(3):
        first.emit(ev.Progress(step=step, size=2))
    first.close()
    for step in range(10, 12):
        second.emit(ev.Progress(step=step, size=2))
    second.close()
    assert progress_steps(store) == [0, 1, 2, 10, 11]
    assert first.key != second.key and first.log_id != second.log_id


def test_sealed_and_final_segments_of_two_logs_stay_apart() -> None:
    store = fresh_store()
    logs = [EventLog(store, "h0", min_flush_interval_s=0.0, segment_events=2) for _ in range(2)]
    for step in range(5):
        for i, log in enumerate(logs):
            log.emit(ev.Progress(step=100 * i + step, size=2))
            log.flush()
    for log in logs:
        assert log.write_final(5.0)
        log.close()
    assert progress_steps(store) == [*range(5), *range(100, 105)]  # the final copies count once
    keys = list(store.list(EVENTS_PREFIX))
    assert all(k.startswith(f"{EVENTS_PREFIX}h0.{os.getpid()}.") for k in keys)
    assert sum(k.endswith(f".{FINAL_SEQ:06d}.jsonl") for k in keys) == 2


def test_segments_named_by_older_versions_still_read() -> None:
    store = fresh_store()
    old = {"t": 1.0, "event": "progress", "host": "h1", "pid": 7, "step": 1, "size": 2}
    store.put(f"{EVENTS_PREFIX}h1.7.000000.jsonl", json.dumps(old).encode() + b"\n")  # <host>.<pid>.<seq>
    store.put(f"{EVENTS_PREFIX}h1.8.jsonl", json.dumps({**old, "pid": 8, "step": 2}).encode() + b"\n")
    log = EventLog(store, "h1", min_flush_interval_s=0.0)
    log.emit(ev.Progress(step=3, size=2))
    log.close()
    assert progress_steps(store) == [1, 2, 3]
    assert len(read_events(store)) == 3
