"""What rank 0 announces to its own host check (a join or a removal whose message Horovod's driver lost) is in
the run's event log, counted by the report, and what it remembers of a VM's removal ends with the VM."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fake_collectives import FakeCollectives, FakeWatcher, ThreadGroup
from horovod.common.elastic import State
from horovod.common.exceptions import HostsUpdatedInterrupt
from test_host_check_attacks_second_round import CountingUpdates, _leave_at_notice, _step_until_reset
from test_protocol_agreement import events

from ckpt_service.stores.local import LocalStore
from hvd_transient.core.interfaces import Clocks
from hvd_transient.core.leave_plan import (
    RemovalAnnounced,
    after_announcing,
    announces_said,
    departures_said,
    merged_announces,
    merged_departures,
)
from hvd_transient.core.transient import TransientImpl
from hvd_transient.discovery.ready import publish_ready
from hvd_transient.frontend.host_updates import HorovodHostUpdates, check_host_updates_and_sync
from hvd_transient.frontend.lost_joins import LostJoins, MemberSeen, RingSeen
from hvd_transient.report.analysis import analyze
from hvd_transient.report.render import render_summary, to_json
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import EventLog, read_records


def test_a_removals_count_goes_on_for_its_due_time_and_starts_again_for_a_new_one() -> None:
    announced = {"a": RemovalAnnounced(100.0, 1, "r1"), "b": RemovalAnnounced(50.0, 2, "r0")}
    after = after_announcing(announced, ["a", "b", "c"], {"a": 100.0, "b": 60.0, "c": 70.0}, ring="r2")
    assert after == {"a": RemovalAnnounced(100.0, 2, "r2"), "b": RemovalAnnounced(60.0, 1, "r2"),
                     "c": RemovalAnnounced(70.0, 1, "r2")}
    assert announced["a"].count == 1  # pure: the mapping given is left as it was


def test_a_lost_removal_is_in_the_event_log_and_forgotten_once_the_vm_is_gone() -> None:
    t = {"wall": time.time()}
    group, impls, state, updates, deadline = _leave_at_notice(t)
    step, raised_at = _step_until_reset(group, impls, state, t, 1, deadline)
    assert raised_at is not None and updates.removals == 1
    (announced,) = events(impls[0], "host_update_announced")
    assert announced["change"] == ev.ANNOUNCED_REMOVAL and announced["hosts"] == ["h2"]
    assert all(not events(impl, "host_update_announced") for impl in impls[1:])  # rank 0's alone
    assert set(impls[0].run.removals_announced) == {"h2"}
    # the driver forms the next ring without h2: rank 0 no longer holds what it announced of it
    survivors = impls[:2]
    for impl in impls[2:]:
        impl.close()
    group.size = 2
    group.run(lambda r: survivors[r].begin(step))
    assert survivors[0].run.removals_announced == {} and survivors[0].run.due_at_of == {}
    for impl in survivors:
        impl.close()


def test_a_lost_join_is_in_the_event_log(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path / "store"))
    looked = threading.Event()

    class Observed(LostJoins):
        def look(self, ring: RingSeen, records: Any) -> None:
            super().look(ring, records)
            looked.set()

    state = State(bcast_object=lambda obj: obj, get_rank=lambda: 0)
    updates = HorovodHostUpdates(state, Observed(clock=lambda: 1000.0, look_after_s=0.0))
    log = EventLog(store, "h0")
    updates.events = log
    publish_ready(store, "h9", now=999.0)
    log.emit(ev.Start(step=0, rank=0, size=1, crc=1, full_crc=1, restored_step=None))
    updates.ring_began([MemberSeen(frozenset({"h0"}), None)], rank=0, store=store)
    assert looked.wait(10.0)
    assert updates.pending()
    with pytest.raises(HostsUpdatedInterrupt):
        check_host_updates_and_sync(state.check_host_updates)
    updates.close()
    log.close()
    analysis = analyze(read_records(store))
    assert analysis.host_updates_announced == {ev.ANNOUNCED_JOIN: 1}
    assert "driver messages lost: 1 join announced by rank 0" in render_summary(analysis)
    assert to_json(analysis, None)["host_updates_announced"] == {"join": 1}
    assert any("lost the join of h9" in e.text for e in analysis.timeline)


def test_the_report_counts_announced_hosts_by_change(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path / "store"))
    log = EventLog(store, "h0")
    body: Any
    for body in (ev.Start(step=0, rank=0, size=3, crc=1, full_crc=1, restored_step=None),
                 ev.HostUpdateAnnounced(change=ev.ANNOUNCED_REMOVAL, hosts=("h1", "h2")),
                 ev.HostUpdateAnnounced(change=ev.ANNOUNCED_REMOVAL, hosts=("h2",))):
        log.emit(body)
    log.close()
    analysis = analyze(read_records(store))
    assert analysis.host_updates_announced == {"removal": 3}
    assert "driver messages lost: 3 removals announced by rank 0" in render_summary(analysis)


def test_a_vm_still_in_the_ring_keeps_its_announce_count_even_where_its_notice_was_not_read_again() -> None:
    """A notice that reads clear for a moment (the VM says it is not leaving as the next ring begins) must not
    give its VM two more announces for the same due time: the count is kept while the VM is in the ring."""
    t = {"wall": time.time()}
    group, impls, state, updates, deadline = _leave_at_notice(t)
    step, raised_at = _step_until_reset(group, impls, state, t, 1, deadline)
    assert raised_at is not None
    impls[2].watcher.notice = None
    group.run(lambda r: impls[r].begin(step))
    assert set(impls[0].run.removals_announced) == {"h2"}
    for impl in impls:
        impl.close()


def test_a_new_ring_merges_what_its_members_remember_and_ignores_what_is_malformed() -> None:
    said_old = announces_said({"h2": RemovalAnnounced(100.0, 2, "r1"), "h9": RemovalAnnounced(50.0, 1, "r0")})
    said_new = announces_said({"h2": RemovalAnnounced(100.0, 1, "r1")})
    junk: list[Any] = ["x", None, [["h2", "soon", 5, "r"]], [["h2", 100.0, True, "r"]], [["h2", 10**400, 3, "r"]],
                       [["h2", 100.0, 0, "r"]], [[7, 100.0, 3, "r"]], [["h2", 100.0, 3]], {"h2": 1},
                       [["h2", 120.0, 5, "r"]]]  # a count for another due time counts for nothing
    merged = merged_announces([said_new, *junk, said_old], {"h1": 90.0, "h2": 100.0})
    assert merged == {"h2": RemovalAnnounced(100.0, 2, "r1")}  # the highest count; h9 is not under notice here
    # what the members know of the VMs under notice, the same on every rank: the earliest due time said (a member
    # that missed a move says a later one), landed where every member saying it says so, and its leave_at
    said = merged_departures([[], "junk", [["h2", 10**400, 1.0], ["h2", 100.0, 101.0, 100.0], ["h1", 90.0, None],
                                           ["h7", 1.0, 2.0]], [["h2", 99.0, 98.0, None], ["h3", 50.0, 51.0, 50.0]],
                              [["h3", 50.0, None, 50.0], ["h2", 99.0, 98.5]]], ["h1", "h2", "h3"])
    assert said.due_at == {"h2": 99.0, "h1": 90.0, "h3": 50.0}
    assert said.landed_at == {"h2": 98.5}  # h3: one member saying its due time does not know it landed
    assert said.leave_at == {"h2": None, "h3": 50.0}  # h1: said by an older member, which says no leave_at
    assert departures_said({"h2": 100.0, "h1": 90.0}, {"h2": 101.0}, {"h2": 100.0}) == [
        ["h1", 90.0, None, None], ["h2", 100.0, 101.0, 100.0]]


def test_a_newcomer_that_becomes_rank_0_goes_on_from_the_count_the_ring_kept() -> None:
    """Rank 0 announced h2 twice; then h0 and h1 are gone and a newcomer h3, which saw none of it, is rank 0 of
    the ring h3, h2 (h2 still listed, still under notice): it learns the count at the ring's start, from h2,
    and announces nothing more for that due time."""
    t = {"wall": time.time()}
    group, impls, state, updates, deadline = _leave_at_notice(t)
    step = 1
    for _ in range(2):
        step, raised_at = _step_until_reset(group, impls, state, t, step, deadline)
        assert raised_at is not None
        state.on_reset()
        group.run(lambda r: impls[r].begin(step))
    assert updates.removals == 2 and impls[2].run.removals_announced["h2"].count == 2
    for impl in impls[:2]:
        impl.close()
    group2 = ThreadGroup(2, timeout_s=10.0)
    newcomer = TransientImpl(impls[2].config, FakeCollectives(group2, 0), host="h3", watcher=FakeWatcher(),
                             clocks=Clocks(wall=lambda: t["wall"]))
    state3 = State(bcast_object=lambda obj: obj, get_rank=lambda: 0)
    newcomer.host_updates = CountingUpdates(state3)
    impls[2].comm = FakeCollectives(group2, 1)
    ring = [newcomer, impls[2]]
    group2.run(lambda r: ring[r].begin(step))
    assert newcomer.run.removals_announced["h2"].count == 2
    _, raised_at = _step_until_reset(group2, ring, state3, t, step, deadline)
    assert raised_at is None and newcomer.host_updates.removals == 0
    for impl in ring:
        impl.close()
