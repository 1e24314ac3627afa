"""A notice's deadline, whatever the watcher saw and whenever it looked: never later than the cloud
stops the VM. Through the real metadata emulator (HTTP on 127.0.0.1), plus the pure dating rules."""
from __future__ import annotations

import time

import pytest
import test_watchers as shared

from hvd_transient.telemetry import schema as ev
from hvd_transient.watchers import deadline

pytestmark = [pytest.mark.timeout(120), pytest.mark.timed]  # bounds wall-clock times

emu, watchers = shared.emu, shared.watchers  # the fixtures
PREEMPTED, WAIT = shared.PREEMPTED, shared.WAIT
hits, make, seen = shared.hits, shared.make, shared.seen


# ---- GCE: instance/preempted gives no time -------------------------------------------------------
@pytest.mark.parametrize("fault", ["503", "lose", "hang"])
def test_gce_notice_during_errors_is_dated_by_the_last_read_that_said_false(emu, watchers, fault):
    """The server fails for 4 s and the notice comes 1 s into that spell: the watcher sees it only
    when the server answers again, but dates it from before the spell, so the VM leaves before
    the cloud stops it (dating from the first good read would be 3 s late)."""
    w = make("gce", emu, "a", window=30)
    watchers.append(w.start())
    assert hits(emu, "a", PREEMPTED, 2)  # a read said FALSE; a long-poll is parked
    spell_start = time.time()
    spell = emu.set_fault("a", fault, duration=4.0)
    emu.preempt("a", at=spell_start + 1.0, window=30)
    notice = seen(w)
    state = emu.instance("a")
    assert state.notice_at is not None and state.deadline is not None
    assert notice.detected_at >= spell.fault_until  # only seen once the server answered again
    assert notice.deadline_basis == deadline.LAST_CLEAR_READ
    assert notice.deadline <= spell_start + 30 < state.deadline  # dated before the spell
    assert state.deadline - notice.deadline < 10  # by no more than the spell and a read or two


@pytest.mark.parametrize("ago", [5.0, 15.0, 45.0])
def test_gce_watcher_started_after_the_notice_leaves_at_once(emu, watchers, ago):
    """A worker started late, a relaunch or a standby: its first read already says TRUE. Nothing
    tells when the notice came, so its window may be over: the deadline is that read."""
    emu.preempt("b", ago=ago, window=30)
    before = time.time()
    w = make("gce", emu, "b")
    watchers.append(w.start())
    notice = seen(w)
    assert notice.deadline_basis == deadline.FIRST_READ
    assert before <= notice.deadline <= notice.detected_at
    assert notice.deadline <= emu.instance("b").deadline or ago > 30  # (past it: the VM is gone anyway)


def test_gce_first_read_after_errors_only_is_no_history(emu, watchers):
    """Reads that failed say nothing about the notice: the first good read saying TRUE leaves at once."""
    spell = emu.set_fault("c", "503", duration=2.0)
    w = make("gce", emu, "c")
    watchers.append(w.start())
    assert emu.wait_for(lambda s: s["c"].fault_hits.get("503", 0) >= 2, timeout=WAIT)
    emu.preempt("c", at=spell.fault_until - 1.0, window=30)
    notice = seen(w)
    assert notice.deadline_basis == deadline.FIRST_READ and notice.deadline <= notice.detected_at


# ---- the cloud's own time, where it gives one ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["aws", "azure"])
def test_a_cloud_time_is_the_deadline_even_for_a_watcher_started_late(emu, watchers, kind):
    window = 120.0 if kind == "aws" else 30.0
    emu.preempt("a", ago=10.0, window=window)
    w = make(kind, emu, "a", instance="a")
    watchers.append(w.start())
    notice = seen(w)
    assert notice.deadline_basis == deadline.CLOUD_TIME
    assert notice.deadline == int(emu.instance("a").deadline)  # whole seconds on the wire
    assert notice.deadline - notice.detected_at < window - 9


# ---- Azure: an event that has started is under way ----------------------------------------------------
def test_azure_event_started_early_leaves_now(emu, watchers):
    """``EventStatus: Started`` with a blank ``NotBefore``: not a fresh 30 s window, leave now."""
    emu.preempt("b", window=30)
    emu.start_azure_event("b")
    w = make("azure", emu, "b", instance="b")
    watchers.append(w.start())
    notice = seen(w)
    assert notice.deadline_basis == deadline.EVENT_STARTED
    assert notice.deadline <= notice.detected_at < emu.instance("b").deadline


def test_azure_event_past_its_not_before_has_started(emu, watchers):
    emu.preempt("c", ago=40.0, window=30)  # NotBefore passed 10 s ago: Azure shows it Started
    w = make("azure", emu, "c", instance="c")
    watchers.append(w.start())
    notice = seen(w)
    assert notice.deadline_basis == deadline.EVENT_STARTED and notice.deadline <= notice.detected_at


# ---- the rules themselves (pure) ---------------------------------------------------------------------
def test_history_bounds_the_deadline():
    assert deadline.from_history(100.0, 90.0, 30.0) == deadline.Deadline(120.0, deadline.LAST_CLEAR_READ)
    assert deadline.from_history(100.0, None, 30.0) == deadline.Deadline(100.0, deadline.FIRST_READ)
    # a clear read "after" the one that saw the notice (a clock step): nothing to trust, leave now
    assert deadline.from_history(100.0, 101.0, 30.0) == deadline.Deadline(100.0, deadline.FIRST_READ)
    assert deadline.from_cloud(150.0, 100.0, None, 30.0) == deadline.Deadline(150.0, deadline.CLOUD_TIME)
    assert deadline.from_cloud(None, 100.0, 95.0, 30.0) == deadline.Deadline(125.0, deadline.LAST_CLEAR_READ)


def test_the_notice_event_carries_the_basis_and_older_logs_still_load():
    record = ev.Record(t=1.0, host="h", pid=1, body=ev.Notice(source="gce", reason="preempted", detected_at=1.0,
                                                              deadline=2.0, deadline_basis=deadline.FIRST_READ))
    raw = ev.to_json_dict(record)
    assert raw["deadline_basis"] == deadline.FIRST_READ
    loaded = ev.from_json_dict(raw)
    assert loaded is not None and loaded.body == record.body
    del raw["deadline_basis"]  # a log written before the field existed
    old = ev.from_json_dict(raw)
    assert old is not None and isinstance(old.body, ev.Notice) and old.body.deadline_basis is None
