"""A leaving VM's record under a failing or slow store: written first, retried until the VM's
own deadline, and nothing on the notice path waits on the store past the notice's deadline.

In-process ranks over the test collectives (which also check that every rank runs the same
collectives); faults come from store wrappers.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any, Callable

import pytest
from ckpt_helpers import PutSeenStore
from test_protocol_agreement import events, make_ranks, notice, published, step_all

from ckpt_service import layout
from ckpt_service.deadline import Deadline
from ckpt_service.errors import BadStoreKeyError, StoreDeadlineError, StoreUnavailableError
from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import MemoryStore
from ckpt_service.stores.base import ObjectStore
from ckpt_service.testing.delegating import DelegatingStore
from hvd_transient import store_keys as keys
from hvd_transient.core.membership import leaving_hosts, publish_leaving_until, read_leaving
from hvd_transient.telemetry.events import FINAL_SEQ, read_events

pytestmark = pytest.mark.timed  # bounds wall-clock times


def is_leaving_key(key: str) -> bool:
    return key.startswith(keys.LEAVING_PREFIX)


class FlakyPuts(DelegatingStore):
    """Puts of matching keys fail (``failures`` times, or always with None) as an unreachable store's do."""

    def __init__(self, inner: ObjectStore, match: Callable[[str], bool], failures: int | None) -> None:
        super().__init__(inner)
        self.match, self.failures = match, failures
        self.attempts = 0
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if self.match(key):
            with self._lock:
                self.attempts += 1
                fail = self.failures is None or self.failures > 0
                if fail and self.failures is not None:
                    self.failures -= 1
            if fail:
                raise StoreUnavailableError(f"{key}: the store did not answer (injected)")
        return super().put(key, data, if_generation_match=if_generation_match)


class GatedStore(DelegatingStore):
    """Calls on matching keys wait while ``gate`` is closed (a store that stopped answering them).

    Unlike the plain wrapper, a bounded view (``within``) honours its deadline as a real backend
    does: a held call gives up with StoreDeadlineError when the deadline ends.
    """

    def __init__(self, inner: ObjectStore, match: Callable[[str], bool], *, gate: threading.Event | None = None,
                 held: threading.Event | None = None, deadline: Deadline | None = None) -> None:
        super().__init__(inner)
        self.match, self.deadline = match, deadline
        self.gate = gate or threading.Event()  # closed until the test opens it
        self.held = held or threading.Event()  # set once a call waited at the closed gate

    def within(self, deadline: Deadline) -> ObjectStore:
        return GatedStore(self.inner, self.match, gate=self.gate, held=self.held, deadline=deadline)

    def _wait(self, key: str) -> None:
        if not self.match(key) or self.gate.is_set():
            return
        self.held.set()
        timeout = 60.0 if self.deadline is None else max(0.0, self.deadline.end - time.time())
        if not self.gate.wait(timeout):
            raise StoreDeadlineError(f"{key}: no answer before the deadline (injected)", attempted=True)

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        self._wait(key)
        return super().put(key, data, if_generation_match=if_generation_match)

    def get(self, key: str) -> bytes:
        self._wait(key)
        return super().get(key)

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        self._wait(key)
        return super().get_versioned(key)

    def stat(self, key: str) -> Any:
        self._wait(key)
        return super().stat(key)


# ------------------------------------------------------------------ publish_leaving_until

def test_a_failing_store_is_retried_until_the_record_lands() -> None:
    store = FlakyPuts(MemoryStore(uuid.uuid4().hex), is_leaving_key, failures=3)
    record = publish_leaving_until(store, "w1", until=time.time() + 10, deadline=time.time() + 10)
    assert store.attempts == 4
    assert read_leaving(store) == [record] and leaving_hosts(store) == {"w1"}


def test_a_store_that_never_answers_gives_up_by_the_deadline() -> None:
    store = FlakyPuts(MemoryStore(uuid.uuid4().hex), is_leaving_key, failures=None)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        publish_leaving_until(store, "w1", until=time.time() + 1.5)
    assert time.monotonic() - t0 < 1.5 + 1.0
    assert store.attempts >= 2 and read_leaving(store) == []


def test_a_hanging_call_is_bounded_and_a_fresh_one_lands() -> None:
    """The first call hangs: it is given up after call_s, and the next one goes through."""
    store = GatedStore(MemoryStore(uuid.uuid4().hex), is_leaving_key)

    def open_after_first_hold() -> None:
        store.held.wait(10)
        time.sleep(0.6)  # the fault: the store stays unreachable past the first call's bound
        store.gate.set()

    threading.Thread(target=open_after_first_hold, daemon=True).start()
    t0 = time.monotonic()
    publish_leaving_until(store, "w1", until=time.time() + 10, call_s=0.5)
    assert time.monotonic() - t0 < 5
    assert leaving_hosts(store) == {"w1"}


def test_a_host_name_no_key_can_hold_is_refused_at_once() -> None:
    store = FlakyPuts(MemoryStore(uuid.uuid4().hex), is_leaving_key, failures=0)
    with pytest.raises(BadStoreKeyError):
        publish_leaving_until(store, "../w1", until=time.time() + 10)
    assert store.attempts == 0


def test_a_stop_ends_the_retries() -> None:
    store = FlakyPuts(MemoryStore(uuid.uuid4().hex), is_leaving_key, failures=None)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        publish_leaving_until(store, "w1", until=time.time() + 30, stop=stop)
    assert time.monotonic() - t0 < 3


# ------------------------------------------------------------------ the notice protocol

def test_the_leaving_record_lands_while_the_emergency_save_is_still_writing() -> None:
    """Discovery can drop the host while the save is still writing (Horovod acts at its next check):
    the record is written on its own thread, so it lands while every write of the save is held."""
    memory = MemoryStore.named(uuid.uuid4().hex)
    gated = GatedStore(memory, lambda key: key.startswith(layout.STEPS_PREFIX))
    leaver = PutSeenStore(gated, is_leaving_key)
    group, impls, url = make_ranks(stores=[gated, gated, leaver])
    impls[2].watcher.notice = notice(30.0)
    outcomes: list[Any] = []
    stepping = threading.Thread(target=lambda: outcomes.extend(step_all(group, impls, 1)))
    stepping.start()
    try:
        assert gated.held.wait(10), "the emergency save never wrote"
        # the record, submitted before the leaving rank's save began, must not wait for the save's writes
        # (seen once the put succeeded: the background write may not yet have handed back its future)
        assert leaver.seen.wait(10), "the leaving record did not land while the save's writes were held"
        assert not gated.gate.is_set() and leaving_hosts(memory) == {"h2"}
    finally:
        gated.gate.set()
        stepping.join(30)
    assert [o.committed for o in outcomes] == [True, True, True]
    assert [o.leaving for o in outcomes] == [False, False, True]
    assert [e["step"] for e in events(impls[2], "leave_published")] == [1]


def test_a_record_the_store_refuses_at_first_is_retried_and_logged_once_it_lands() -> None:
    memory = MemoryStore.named(uuid.uuid4().hex)
    flaky = FlakyPuts(memory, is_leaving_key, failures=2)
    group, impls, url = make_ranks(stores=[memory, memory, flaky])
    impls[2].watcher.notice = notice(30.0)
    outcomes = step_all(group, impls, 1)
    assert [o.committed for o in outcomes] == [True, True, True] and outcomes[2].leaving
    assert impls[2].publishing is not None
    impls[2].publishing.result(timeout=10)  # the retries run in the background
    assert flaky.attempts == 3 and leaving_hosts(memory) == {"h2"}
    [published] = events(impls[2], "leave_published")
    assert published["deadline"] == pytest.approx(impls[2].watcher.notice.deadline)


def test_a_record_that_cannot_land_blocks_no_rank_and_is_not_reported_published() -> None:
    """The store refuses the record for the whole window: every rank goes on at once, the
    record is tried until the VM's deadline, and no ``leave_published`` claims it left."""
    memory = MemoryStore.named(uuid.uuid4().hex)
    flaky = FlakyPuts(memory, is_leaving_key, failures=None)
    group, impls, url = make_ranks(stores=[memory, memory, flaky])
    impls[2].watcher.notice = notice(2.0)
    t0 = time.monotonic()
    outcomes = step_all(group, impls, 1)
    assert time.monotonic() - t0 < 2.0
    assert outcomes[2].leaving and [o.departure_pending for o in outcomes] == [True] * 3
    attempts = flaky.attempts
    assert attempts >= 1
    # the retries run in the background until the VM's deadline, then end
    assert impls[2].publishing is not None
    impls[2].publishing.result(timeout=10)
    deadline = impls[2].watcher.notice.deadline
    assert deadline - 2.5 < time.time() < deadline + 0.5  # the last backoff (at most 2.2 s) must fit
    assert flaky.attempts > attempts
    assert read_leaving(memory) == [] and not events(impls[2], "leave_published")


def test_the_lease_move_at_the_election_ends_by_the_notice_deadline() -> None:
    """The master gets a notice and the store stops answering for the lease: the successor's
    takeover gives up at the save's deadline instead of waiting on the store, and every rank
    learns that the emergency save did not commit."""
    memory = MemoryStore.named(uuid.uuid4().hex)
    gated = GatedStore(memory, lambda key: key == layout.LEASE_KEY)
    gated.gate.set()  # healthy while the ring begins
    group, impls, url = make_ranks(stores=[gated] * 3)
    assert impls[0].lease.held
    gated.gate.clear()
    impls[0].watcher.notice = notice(3.5)  # the save's deadline: 2.5 s from now (leave margin 1 s)
    t0 = time.monotonic()
    try:
        outcomes = step_all(group, impls, 1)
    finally:
        gated.gate.set()
    assert time.monotonic() - t0 < 3.5
    assert gated.held.is_set()
    assert [o.committed for o in outcomes] == [False, False, False]
    assert [i.run.master for i in impls] == [1, 1, 1]
    assert events(impls[1], "lease_error"), "the failed takeover must be reported"
    assert CheckpointManager(url).all_steps() == []
    published(impls)
    assert leaving_hosts(memory) == {"h0"}  # the leave itself did not depend on the lease


# ------------------------------------------------------------------ the leaving rank's last events

def test_a_leaving_rank_copies_its_last_events_past_a_write_stuck_in_flight() -> None:
    """The event log's writer is stuck on a write that never ends; as Horovod resets the leaving
    rank out of the ring, its events still get out, at once, in a write of their own."""
    memory = MemoryStore.named(uuid.uuid4().hex)
    final = f".{FINAL_SEQ:06d}.jsonl"
    stuck = GatedStore(memory, lambda key: key.startswith(keys.EVENTS_PREFIX) and not key.endswith(final))
    stuck.gate.set()  # healthy while the ring begins
    group, impls, url = make_ranks(stores=[memory, memory, stuck])
    stuck.gate.clear()  # from now on the log's own writes of rank 2 hang
    impls[2].watcher.notice = notice(30.0)
    outcomes = step_all(group, impls, 1)
    assert outcomes[2].leaving and stuck.held.wait(10)
    t0 = time.monotonic()
    writer = impls[2].before_leaving()
    assert time.monotonic() - t0 < 0.5, "the survivors' reset waits for this rank's"
    writer.join(10)
    stored = [e for e in read_events(memory) if e["host"] == "h2"]
    assert [e["step"] for e in stored if e["event"] == "leave_published"] == [1]
    assert len(stored) == len({json.dumps(e, sort_keys=True) for e in stored})
    stuck.gate.set()
    impls[2].events.flush()  # the log's own segment lands too: every event is still read once
    again = [e for e in read_events(memory) if e["host"] == "h2"]
    assert again == stored + [e for e in again if e["t"] > stored[-1]["t"]]
