"""Attacks on the leaving record's writer, third round: one writer writes a VM's record, its versions in
order (the latest last, whatever the writer was doing when a version came); ``leave_published`` is logged
once, and a later round's move is logged (``leave_moved``) so the report dates the departure by the leave
discovery read; a close that drops the queued writer leaves no writer marked running. The real
``Departure``, ``Emergency.replan``, ``BackgroundCalls`` and ``publish_leaving_until`` over a memory store
whose record puts are slow or fail."""
from __future__ import annotations

import json
import random
import threading
import time
from types import SimpleNamespace

import pytest

from ckpt_service.errors import StoreUnavailableError
from ckpt_service.stores.memory import MemoryStore
from hvd_transient.core.background import BackgroundCalls
from hvd_transient.core.config import TransientConfig
from hvd_transient.core.election import NoticeRound
from hvd_transient.core.emergency import Emergency
from hvd_transient.core.interfaces import Clocks
from hvd_transient.core.leaving import Departure
from hvd_transient.core.membership import read_leaving
from hvd_transient.core.ring import RunState
from hvd_transient.telemetry import schema as ev

pytestmark = [pytest.mark.timeout(90), pytest.mark.timed]  # bounds wall-clock times


class Events:
    durable_wait_s = 0.1

    def __init__(self):
        self.published = []
        self.moved = []

    def emit(self, event, **k):
        if isinstance(event, ev.LeavePublished):
            self.published.append(event)
        if isinstance(event, ev.LeaveMoved):
            self.moved.append(event)


class Store(MemoryStore):
    """Each leaving put takes put_s; fails while `failing` is set; history of leave_at that landed."""

    def __init__(self, put_s=0.0, rng=None):
        super().__init__("writer")
        self.put_s, self.rng = put_s, rng
        self.failing = threading.Event()
        self.history = []
        self.guard = threading.Lock()

    def put(self, key, data, *, if_generation_match=None):
        if key.startswith("hosts/leaving/"):
            d = self.put_s if self.rng is None else self.rng.random() * self.put_s
            time.sleep(d)
            if self.failing.is_set():
                raise StoreUnavailableError("store down")
            with self.guard:
                gen = super().put(key, data, if_generation_match=if_generation_match)
                self.history.append(json.loads(data).get("leave_at"))
                return gen
        return super().put(key, data, if_generation_match=if_generation_match)


def make(store, bg=None):
    bg = bg or BackgroundCalls()
    events = Events()
    parts = SimpleNamespace(config=TransientConfig(store="memory://x", leave="near_deadline"),
                            run=RunState(hosts=["h0", "h1"], handled_leavers={"h1"}), host="h1", clocks=Clocks(),
                            events=events, manager=SimpleNamespace(store=store), watcher=None,
                            comm=SimpleNamespace(rank=lambda: 1, size=lambda: 2))
    return Departure(parts, bg), bg, events


def replan_earlier(dep, deadline, step_s):
    """A later round whose slowest step is ``step_s``: Emergency.replan moves h1's leave earlier."""
    emergency = Emergency(dep.p, saves=None, warnings=None, departure=dep)
    later = NoticeRound(leaving=(1,), deadline=deadline, vm_deadlines=(None, deadline), step_s=step_s,
                        at=time.time())
    emergency.replan(9, later)
    return dep.p.run.leave_at_of.get("h1")


@pytest.mark.parametrize("seed", range(3))
def test_versions_published_around_the_writers_exit_all_land_in_order(seed):
    rng = random.Random(seed)
    store = Store(put_s=0.01, rng=random.Random(seed + 100))
    dep, bg, _ = make(store)
    deadline = time.time() + 60
    futures = []
    for i in range(40):  # leave_at moves earlier each version
        dep.publish_record(i, deadline, False, until=deadline, leave_at=deadline - 10 - i)
        futures.append(dep.publishing)
        time.sleep(rng.choice([0.0, 0.0, 0.005, 0.01, 0.012]))
    for f in set(futures):
        f.result(timeout=30)
    (rec,) = read_leaving(store)
    bg.shutdown()
    assert rec.leave_at == deadline - 10 - 39, f"discovery reads {deadline - rec.leave_at:.0f} s lead"
    order = [deadline - x for x in store.history]
    assert order == sorted(order), f"a version landed after a newer one: {order}"


def test_leave_published_once_when_v1_lands_only_via_a_replan_after_leave():
    store = Store(put_s=0.05)
    store.failing.set()
    dep, bg, events = make(store)
    deadline = time.time() + 30
    first = deadline - 12
    dep.p.run.leave_at_of["h1"] = first
    dep.publish_record(5, deadline, True, until=deadline, leave_at=first)
    dep.leave(5, until=deadline, own_deadline=deadline, was_master=True, leave_at=first, wrote_record=True)
    assert events.published == []  # not landed yet: leave() waited its share and went on
    store.failing.clear()
    moved = replan_earlier(dep, deadline, step_s=8.0)
    assert moved is not None and moved < first
    dep.publishing.result(timeout=10)
    bg.shutdown()
    (rec,) = read_leaving(store)
    assert rec.leave_at == moved
    assert len(events.published) == 1, events.published  # the first version's, logged when the newer landed
    assert [e.leave_at for e in events.moved] == [moved], "the move is logged: the report dates the leave by it"


def test_leave_published_once_when_v1_landed_before_leave_and_a_replan_follows():
    store = Store()
    dep, bg, events = make(store)
    deadline = time.time() + 30
    dep.publish_record(5, deadline, True, until=deadline, leave_at=deadline - 12)
    dep.publishing.result(timeout=5)
    dep.leave(5, until=deadline, own_deadline=deadline, was_master=True, leave_at=deadline - 12, wrote_record=True)
    dep.publish_record(9, deadline, False, until=deadline, leave_at=deadline - 15)
    dep.publishing.result(timeout=5)
    bg.shutdown()
    assert len(events.published) == 1, events.published
    assert [r.leave_at for r in read_leaving(store)] == [deadline - 15]


def test_a_close_that_drops_the_queued_writer_leaves_none_marked_running():
    """BackgroundCalls has 2 threads; two other calls hold them when the writer is queued; the owner
    closes (stopping, then shutdown drops the queued calls, by design: nothing waits at a close)."""
    store = Store()
    dep, bg, events = make(store)
    hold = threading.Event()
    busy = [bg.submit(lambda: hold.wait(5)) for _ in range(2)]
    deadline = time.time() + 30
    dep.publish_record(5, deadline, True, until=deadline, leave_at=None)
    writer = dep.publishing
    bg.stopping.set()
    bg.shutdown()
    hold.set()
    for f in busy:
        f.result(timeout=5)
    assert writer.cancelled() and not dep._writing, "a dropped writer must not stay marked as running"


def test_the_latest_leave_logged_is_the_one_discovery_reads_after_a_replan():
    """Common path: the first record landed before leave(); a later round moves leave_at earlier. The
    report's departure time (report/departures.py) reads the latest of leave_published and leave_moved."""
    store = Store()
    dep, bg, events = make(store)
    deadline = time.time() + 30
    first = deadline - 12
    dep.p.run.leave_at_of["h1"] = first
    dep.publish_record(5, deadline, True, until=deadline, leave_at=first)
    dep.publishing.result(timeout=5)
    dep.leave(5, until=deadline, own_deadline=deadline, was_master=True, leave_at=first, wrote_record=True)
    moved = replan_earlier(dep, deadline, step_s=8.0)
    dep.publishing.result(timeout=5)
    bg.shutdown()
    (rec,) = read_leaving(store)
    assert [e.leave_at for e in events.published] == [first]
    assert [e.leave_at for e in events.moved] == [rec.leave_at] == [moved]
