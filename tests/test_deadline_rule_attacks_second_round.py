"""Attacks on the deadline rules, second round: the name lookup before a metadata request, Azure's names
and several events, the leaving record written again by a re-plan, a record for a deadline already past
on a slow store, and an epoch's end (an evaluation) inside the window. Real watchers against the real
metadata emulator (behind the per-path fault front of ``test_deadline_rule_edges``), the real
``Departure``/``Emergency`` and store writes, and real protocol ranks on fake clocks. Each test states the
rule it attacks; each failed before its fix."""
from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import test_watchers as shared
from test_deadline_rule_edges import Front, _events, _preempt, _rfc1123, static
from test_lead_gap_attacks import notice_then_plan
from test_protocol_agreement import make_ranks, step_all

from ckpt_service.errors import StoreDeadlineError, StoreUnavailableError
from ckpt_service.stores.memory import MemoryStore
from hvd_transient.core.background import BackgroundCalls
from hvd_transient.core.config import TransientConfig
from hvd_transient.core.election import NoticeRound
from hvd_transient.core.emergency import Emergency
from hvd_transient.core.interfaces import Clocks
from hvd_transient.core.leaving import Departure
from hvd_transient.core.membership import publish_leaving_until, read_leaving
from hvd_transient.core.ring import RunState
from hvd_transient.watchers import AzureWatcher, GceWatcher
from hvd_transient.watchers.azure import soonest_event
from hvd_transient.watchers.errors import WatcherError
from hvd_transient.watchers.metadata_http import MetadataClient

pytestmark = [pytest.mark.timeout(60), pytest.mark.timed]  # bounds wall-clock times

emu, watchers = shared.emu, shared.watchers  # the fixtures
FAST = {"initial_backoff": 0.05, "max_backoff": 0.3}


# --------------------------------------------------------------------------- dns
# Rule 4: every metadata request is bounded in its TOTAL time. Name resolution (getaddrinfo) of the
# metadata host (GCE's default is the name metadata.google.internal) is outside the bound.

SLOW_NAME = "metadata.slow-resolver.test"
RESOLVE_S = 3.0


def _slow_resolver(monkeypatch):
    real = socket.getaddrinfo

    def getaddrinfo(host, *a, **k):
        if host == SLOW_NAME:  # a resolver that answers after 3 s (a DNS server timing out once)
            time.sleep(RESOLVE_S)
            host = "127.0.0.1"
        return real(host, *a, **k)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_1s_request_ends_within_its_total_even_while_the_name_resolves_slowly(emu, monkeypatch):
    _slow_resolver(monkeypatch)
    url = emu.gce_base_url("a").replace("127.0.0.1", SLOW_NAME) + "instance/preempted"
    client = MetadataClient(connect_timeout=0.5, total_timeout=1.0)
    start = time.monotonic()
    try:
        client.get(url, headers={"Metadata-Flavor": "Google"})
    except WatcherError:
        pass
    took = time.monotonic() - start
    assert took <= 1.8, f"a request with a 1 s total took {took:.2f} s"


def test_gce_notice_seen_within_about_2s_while_the_name_resolves_slowly(emu, watchers, monkeypatch):
    _slow_resolver(monkeypatch)
    base = emu.gce_base_url("a").replace("127.0.0.1", SLOW_NAME)
    w = GceWatcher(base, long_poll_timeout=1, request_margin=0.5, window=30, initial_backoff=0.05, max_backoff=0.3)
    watchers.append(w.start())
    time.sleep(2 * RESOLVE_S + 0.5)  # the watcher is polling
    emu.preempt("a", window=30)
    appeared = time.time()
    notice = w.wait(10)
    assert notice is not None
    late = notice.detected_at - appeared
    assert late <= 2.5, f"notice seen {late:.1f} s after it appeared (every request bounded at 1.5 s)"


# --------------------------------------------------------------------------- azure_names
# Rule 4: Azure matches events on the VM's own names from IMDS. One IMDS compute reply that names no VM
# (200, a JSON object without a usable ``name``: a partial document) is taken as the final answer: the names
# are never asked again, so the watcher goes blind for good.

COMPUTE, EVENTS = "/i/a/metadata/instance/compute", "/i/a/metadata/scheduledevents"
GOOD = json.dumps({"name": "vmss_3", "osProfile": {"computerName": "vmss000003"}})
PARTIAL = json.dumps({"vmId": "0f0e", "location": "eastus"})  # no name: nothing to match on
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def front(emu):
    f = Front(emu.url)
    yield f
    f.stop()


def test_azure_without_a_host_name_is_not_blinded_by_one_partial_compute_reply(emu, front, watchers, monkeypatch):
    import hvd_transient.watchers.azure as az
    monkeypatch.setattr(az, "NAMES_RETRY_S", 1.0)  # 10 s in the product; only the length changes
    front.rules[COMPUTE] = static(200, PARTIAL, JSON)
    front.rules[EVENTS] = _events()
    w = AzureWatcher(front.url(emu.root_url("a")), interval=0.05, request_timeout=1.0, **FAST)
    watchers.append(w.start())
    front.wait_hits(COMPUTE, 1)
    time.sleep(0.5)
    front.rules[COMPUTE] = static(200, GOOD, JSON)  # IMDS answers properly from now on
    front.rules[EVENTS] = _events(_preempt("e1", ["vmss_3"], _rfc1123(time.time() + 40)))
    notice = w.wait(15)
    assert notice is not None, (f"no notice 15 s after an eviction naming this VM; IMDS compute asked "
                                f"{front.hits[COMPUTE]} time(s), events {front.hits[EVENTS]} time(s)")


def test_azure_with_a_host_name_is_not_blinded_to_its_vm_name_by_one_partial_compute_reply(emu, front, watchers,
                                                                                           monkeypatch):
    import hvd_transient.watchers.azure as az
    monkeypatch.setattr(az, "NAMES_RETRY_S", 1.0)
    front.rules[COMPUTE] = static(200, PARTIAL, JSON)
    front.rules[EVENTS] = _events()
    w = AzureWatcher(front.url(emu.root_url("a")), instance="10.0.0.5", interval=0.05, request_timeout=1.0, **FAST)
    watchers.append(w.start())
    front.wait_hits(COMPUTE, 1)
    time.sleep(0.5)
    front.rules[COMPUTE] = static(200, GOOD, JSON)
    front.rules[EVENTS] = _events(_preempt("e1", ["vmss_3"], _rfc1123(time.time() + 40)))
    notice = w.wait(15)
    assert notice is not None, (f"no notice 15 s after an eviction naming this VM by its Azure name; "
                                f"names matched: {w.vm_names} + {w.instance!r}; compute asked {front.hits[COMPUTE]}x")


# --------------------------------------------------------------------------- azure_two_events
# Rule 2: a deadline is never later than the real one. Two Preempt events name this VM: one whose
# NotBefore cannot be read, one due in 8 s. ``event_for`` picks the unreadable one as "due first" (-inf),
# and its deadline, dated from the last clear read plus the 30 s window, is ~22 s later than the other
# event's NotBefore.



def test_pure_the_earliest_deadline_of_the_events_for_this_vm_is_taken():
    read = 1_800_000_000.0
    unreadable = _preempt("e-odd", ["a"], "soon")
    due = _preempt("e-due", ["a"], _rfc1123(read + 8))
    event, d = soonest_event([unreadable, due], {"a"}, ("Preempt",), read, read - 0.05, 30.0)
    assert event is due
    assert d.at <= read + 8, f"deadline {d.at - read:.1f} s after the read ({d.basis}); an event says 8 s"


def test_watcher_the_earliest_deadline_of_the_events_for_this_vm_is_taken(emu, front, watchers):
    events = "/i/a/metadata/scheduledevents"
    w = AzureWatcher(front.url(emu.root_url("a")), instance="a", interval=0.05, request_timeout=1.0, window=30, **FAST)
    watchers.append(w.start())
    front.wait_hits(events, 3)  # clear reads
    due = int(time.time()) + 8
    front.rules[events] = _events(_preempt("e-odd", ["a"], "soon"), _preempt("e-due", ["a"], _rfc1123(due)))
    notice = w.wait(5)
    assert notice is not None
    assert notice.deadline <= due, (f"deadline {notice.deadline - due:+.1f} s after an event's NotBefore "
                                    f"(basis {notice.deadline_basis})")


# --------------------------------------------------------------------------- replan_record
# Rule 1: later notice rounds re-plan the leave: it may move earlier, never later. The leaving record
# of the first plan is written in the background and retried; a re-plan writes the earlier ``leave_at`` on
# another background thread. A put of the first record whose reply was lost (it landed; the client retries
# it, as publish_leaving_until says it does) lands again AFTER the re-planned record: discovery then reads
# the first, later ``leave_at`` and the leave moves later.

HOSTS = ["h0", "h1", "h2"]


class LostReplyOnce(MemoryStore):
    """The first put of a leaving record lands, then its reply is lost after 0.4 s (a slow GCS reply)."""

    def __init__(self) -> None:
        super().__init__("lost-reply")
        self.first = True
        self.first_landed = threading.Event()
        self.guard = threading.Lock()

    def put(self, key, data, *, if_generation_match=None):
        gen = super().put(key, data, if_generation_match=if_generation_match)
        record = key.startswith("hosts/leaving/")
        with self.guard:
            first = self.first and record
            self.first = self.first and not record
        if first:
            self.first_landed.set()
            time.sleep(0.4)
            raise StoreUnavailableError("connection reset before the reply (the put landed)")
        return gen


class Events:
    def emit(self, *a, **k):
        pass
    durable_wait_s = 0.1


def test_a_replanned_earlier_leave_is_what_discovery_reads():
    now = time.time()
    deadline = now + 60.0
    config = TransientConfig(store="memory://x", leave="near_deadline")
    store = LostReplyOnce()
    bg = BackgroundCalls()
    run = RunState(hosts=list(HOSTS), handled_leavers={"h1"})
    parts = SimpleNamespace(config=config, run=run, host="h1", clocks=Clocks(), events=Events(),
                            manager=SimpleNamespace(store=store), watcher=None,
                            comm=SimpleNamespace(rank=lambda: 1, size=lambda: 3))
    departure = Departure(parts, bg)
    emergency = Emergency(parts, saves=None, warnings=None, departure=departure)
    # the notice round: steps of 0.2 s -> a lead of 1 + 10 s
    l1 = config.lead_s(None, 0.2)
    leave_at_1 = deadline - l1
    run.leave_at_of["h1"] = leave_at_1
    departure.publish_record(10, deadline, False, until=deadline, leave_at=leave_at_1)
    assert store.first_landed.wait(5)
    # a later round: a step of 8 s was timed -> the leave must come 7 s earlier
    later = NoticeRound(leaving=(1,), deadline=deadline, vm_deadlines=(None, deadline, None), step_s=8.0,
                        at=now + 0.1)
    emergency.replan(20, later)
    replanned = run.leave_at_of["h1"]
    assert replanned < leave_at_1 - 5
    departure.publishing.result(timeout=10)  # the writer wrote every version, the latest last
    (record,) = read_leaving(store)
    bg.shutdown()
    assert record.leave_at is not None and record.leave_at <= replanned + 0.01, (
        f"discovery reads leave_at = deadline - {deadline - record.leave_at:.1f} s; the re-plan moved it to "
        f"deadline - {deadline - replanned:.1f} s (the leave moved later again)")


# --------------------------------------------------------------------------- late_record
# Rule 2: a deadline already past when agreed: the leaving record is still written. A GCE worker that
# started on a VM already under notice dates its deadline by its first read (``first_read_unknown_start``:
# leave at once); the VM may live for most of its window yet, but its record gets only LATE_RECORD_S (5 s).
# On a store that answers each write in 6 s (the project's own slow-store scenario adds 2-10 s per request)
# the record is never written, and discovery keeps listing the host.

PUT_S = 6.0


class SixSecondPuts(MemoryStore):
    def __init__(self):
        super().__init__("slow-puts")

    def within(self, deadline):
        store = self

        class View:
            def put(self, key, data, **kw):
                left = deadline.end - time.time()
                if left < PUT_S:
                    time.sleep(max(0.0, left))
                    raise StoreDeadlineError(f"put of {key} needs {PUT_S} s, {left:.1f} s left", attempted=True)
                time.sleep(PUT_S)
                return store.put(key, data, **kw)
        return View()


def test_a_record_dated_by_the_first_read_is_still_written_on_a_slow_store():
    store = SixSecondPuts()
    first_read = time.time() - 1.0  # the deadline: the read that saw the notice (leave at once)
    try:
        publish_leaving_until(store, "w-3", until=first_read, deadline=first_read)
    except Exception as exc:  # noqa: BLE001
        print("publish_leaving_until gave up:", type(exc).__name__, exc)
    assert [r.host for r in read_leaving(store)] == ["w-3"], "no leaving record: discovery keeps listing w-3"


# --------------------------------------------------------------------------- epoch_gap
# Rule 1: training through the window must never do worse than leaving at the notice, and the lead must
# cover the wait for a step boundary at which the VM can leave. The Keras callback times no step over an
# epoch's end (validation, other callbacks: ``before_step`` in ``on_epoch_begin``), so the lead never
# covers that gap, yet no host check (hence no departure) can happen inside it. A VM under notice whose
# ``leave_at`` falls in an epoch-end evaluation is still in the ring at its deadline; at_notice would have
# left at the notice round. Real TransientImpl ranks on the tests' fake collectives and fake clocks.

STEP_S, EVAL_S, WINDOW_S = 0.2, 20.0, 30.0


def first_departure_chance(leave: str, eval_s: float = EVAL_S) -> tuple[float, float, float | None]:
    now = {"t": 1_700_000_000.0}
    clocks = Clocks(monotonic=lambda: now["t"], wall=lambda: now["t"])
    group, impls, _ = make_ranks(check_every_steps=None, check_interval_s=1.0, clocks=clocks, leave=leave)
    group.run(lambda r: impls[r].before_step())  # on_epoch_begin of the first epoch
    step = 0
    for epoch in range(2):  # two epochs' steps, 0.2 s each, with an evaluation between them
        if epoch:
            now["t"] += eval_s
            group.run(lambda r: impls[r].before_step())
        for _ in range(50):
            step += 1
            now["t"] += STEP_S
            step_all(group, impls, step)
    step, handled, deadline = notice_then_plan(now, group, impls, step, STEP_S, WINDOW_S)
    leave_at = handled.leave_at
    if handled.check_hosts and leave_at is None:
        return now["t"], deadline, None  # at once: the host check of this step sees it gone
    # train on until 5 s before leave_at, then the epoch ends: validation for EVAL_S (no step, no check)
    while now["t"] < leave_at - 5.0:
        step += 1
        now["t"] += STEP_S
        step_all(group, impls, step)
    now["t"] += eval_s
    group.run(lambda r: impls[r].before_step())  # on_epoch_begin of the next epoch
    while True:
        step += 1
        now["t"] += STEP_S
        outcomes = step_all(group, impls, step)
        if outcomes[2].check_hosts and now["t"] >= leave_at:  # discovery has dropped it: it can leave here
            return now["t"], deadline, leave_at


@pytest.mark.parametrize("eval_s", [EVAL_S, 16.0])  # no lead fits (it leaves at once); one fits, the gap in it
def test_near_deadline_leaves_before_its_deadline_across_an_epoch_end(eval_s):
    at, deadline, leave_at = first_departure_chance("near_deadline", eval_s)
    at_notice, deadline_n, _ = first_departure_chance("at_notice", eval_s)
    if eval_s < EVAL_S:
        assert leave_at is not None, "a lead that covers the gap fits: the VM trains on"
    assert at <= deadline - 1.0, (
        f"near_deadline: first host check after leave_at (deadline - {deadline - leave_at:.1f} s) comes "
        f"{at - deadline:+.1f} s from the deadline; at_notice's came {at_notice - deadline_n:+.1f} s from it")
