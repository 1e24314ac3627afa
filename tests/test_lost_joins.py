"""Joins that Horovod's driver announced to nobody (hvd_transient/frontend/lost_joins.py), and the host updates a
rank holds: the rule is pure, the rest runs against Horovod's own elastic state and a real store."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from horovod.common.elastic import State
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult

from ckpt_service.stores import LocalStore
from hvd_transient.discovery.ready import ReadyRecord, publish_ready
from hvd_transient.frontend.host_updates import HOSTS_ADDED, HorovodHostUpdates, check_host_updates_and_sync
from hvd_transient.frontend.lost_joins import (
    READY_AFTER_S,
    READY_BEFORE_S,
    LostJoins,
    MemberSeen,
    RingSeen,
    lost_joins,
)


def seen(*hosts: str) -> list[MemberSeen]:
    """Members known by their host alone."""
    return [MemberSeen(frozenset({h})) for h in hosts]


RING = RingSeen(tuple(seen("a", "b")), 1000.0)


def rec(host: str, ready_at: float) -> ReadyRecord:
    return ReadyRecord(host=host, ready_at=ready_at)


def test_a_vm_ready_as_the_ring_formed_and_not_in_it_is_lost() -> None:
    found = lost_joins([rec("c", 999.5)], RING, last_in_ring={}, announced=())
    assert [r.host for r in found] == ["c"]


@pytest.mark.parametrize("ready_at", [1000.0 - READY_BEFORE_S - 0.1, 1000.0 + READY_AFTER_S + 0.1])
def test_a_vm_ready_long_before_or_after_the_ring_formed_is_not_looked_for(ready_at: float) -> None:
    """Before: the ring formed with it listed. After: the driver's message reached rank 0."""
    assert lost_joins([rec("c", ready_at)], RING, last_in_ring={}, announced=()) == []


def test_a_vm_in_the_ring_or_in_a_ring_since_it_was_ready_or_announced_is_not_lost() -> None:
    records = [rec("a", 999.0), rec("c", 990.0), rec("d", 995.0)]
    found = lost_joins(records, RING, last_in_ring={"name:c": 992.0}, announced={("d", 995.0)})
    assert found == []  # a: in the ring; c: it joined a ring that began after it was ready (then left); d: done


class Bcast:
    """Horovod's broadcast of rank 0's view, for a world of one (the state's only collective)."""

    def __call__(self, obj: Any) -> Any:
        return obj


def horovod_state() -> State:
    return State(bcast_object=Bcast(), get_rank=lambda: 0)


def test_the_added_value_is_horovods() -> None:
    assert HOSTS_ADDED == HostUpdateResult.added


def test_an_announced_join_makes_horovods_host_check_raise_and_sync() -> None:
    """Horovod's own state: nothing pending, nothing raised; announced, the check raises an interrupt that syncs."""
    state = horovod_state()
    updates = HorovodHostUpdates(state)
    assert not updates.pending()
    check_host_updates_and_sync(state.check_host_updates)  # nothing to take
    updates.announce(["c"])
    assert updates.pending()
    with pytest.raises(HostsUpdatedInterrupt) as raised:
        check_host_updates_and_sync(state.check_host_updates)
    assert raised.value.skip_sync is False
    assert not updates.pending()
    check_host_updates_and_sync(state.check_host_updates)  # taken once


def test_an_announce_does_not_hide_the_drivers_next_message() -> None:
    """The driver dates its messages in whole seconds: one that comes a second after the last one checked
    still raises after an announce was taken."""
    state = horovod_state()
    state.on_hosts_updated(1000, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt):
        state.check_host_updates()
    HorovodHostUpdates(state).announce(["c"])
    with pytest.raises(HostsUpdatedInterrupt):
        state.check_host_updates()
    state.on_hosts_updated(1001, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt):
        state.check_host_updates()


def test_rank_0_finds_a_lost_join_in_the_store_and_its_next_round_takes_it(tmp_path: Path) -> None:
    """A real store: a standby published ready as the ring formed; rank 0's look finds it after the ring
    began, the next pending() announces it once, and the host check raises."""
    store = LocalStore(str(tmp_path / "store"))
    clock = [1000.0]
    looked = threading.Event()

    class Observed(LostJoins):
        def look(self, ring: RingSeen, records: Any) -> None:
            super().look(ring, records)
            looked.set()

    lost = Observed(clock=lambda: clock[0], look_after_s=0.05)
    state = horovod_state()
    updates = HorovodHostUpdates(state, lost)
    publish_ready(store, "c", now=999.0)
    publish_ready(store, "a", now=998.0)  # in the ring
    updates.ring_began(seen("a", "b"), rank=0, store=store)
    assert looked.wait(10.0)
    assert updates.pending()
    with pytest.raises(HostsUpdatedInterrupt):
        check_host_updates_and_sync(state.check_host_updates)
    # the same record is not announced again, on this ring or the next one without it
    assert not updates.pending()
    looked.clear()
    clock[0] = 1010.0
    updates.ring_began(seen("a", "b"), rank=0, store=store)
    assert looked.wait(10.0)
    assert not updates.pending()
    updates.close()


def test_only_rank_0_looks_and_a_ring_that_changed_drops_the_look(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path / "store"))
    publish_ready(store, "c", now=999.0)
    lost = LostJoins(clock=lambda: 1000.0, look_after_s=3600.0)
    lost.ring_began(seen("a", "b"), rank=1, store=store)
    assert lost._timer is None  # noqa: SLF001  (rank 1 never reads the store)
    lost.ring_began(seen("a", "b"), rank=0, store=store)
    old_ring = RingSeen(tuple(seen("a", "b")), 1000.0)
    lost.ring_began(seen("a", "b", "c"), rank=0, store=store)  # the ring changed before the look
    lost.look(old_ring, [rec("c", 999.0)])
    assert lost.take() == []
    lost.close()


def test_a_store_that_fails_the_look_announces_nothing(tmp_path: Path) -> None:
    class Broken(LocalStore):
        def list(self, prefix: str = "") -> Any:
            raise OSError("the store is down")

    store = Broken(str(tmp_path / "store"))
    lost = LostJoins(clock=lambda: 1000.0, look_after_s=0.0)
    done = threading.Event()
    original = lost._look  # noqa: SLF001

    def observed(ring: RingSeen, s: Any) -> None:
        original(ring, s)
        done.set()

    lost._look = observed  # type: ignore[method-assign]  # noqa: SLF001
    lost.ring_began(seen("a"), rank=0, store=store)
    assert done.wait(10.0)
    assert lost.take() == []


# ---- removals the driver's message lost (core/leave_plan.lost_removals, TransientImpl._announce_lost_removals)

def test_a_vm_still_in_the_ring_well_after_it_was_due_and_its_record_landed_is_a_lost_removal() -> None:
    from hvd_transient.core.leave_plan import LOST_REMOVAL_AFTER_S, RemovalAnnounced, lost_removals

    due = {"c": 100.0, "d": 100.0, "e": 100.0, "f": float("nan"), "g": 100.0}
    landed = {"c": 100.5, "d": 100.5, "e": 100.5, "f": 100.5}  # g: its record is not in the store
    after = LOST_REMOVAL_AFTER_S
    ring = {"ring": "r2", "ring_began_at": 90.0}
    once = {"e": RemovalAnnounced(100.0, 2, "r1")}
    # c: still in the ring; d: gone; e: announced as often as it may be; f: no time; g: not dropped by discovery yet
    assert lost_removals(due, landed, ["a", "c", "e", "f", "g"], once, 100.6 + after, **ring) == ["c"]
    assert lost_removals(due, landed, ["c"], {}, 100.5 + after, **ring) == []  # counted from its record's landing
    # a second announce: not on the ring of the first, nor before a later ring ran `after`
    first = {"c": RemovalAnnounced(100.0, 1, "r2")}
    assert lost_removals(due, landed, ["c"], first, 110.0, **ring) == []
    assert lost_removals(due, landed, ["c"], first, 109.0, ring="r3", ring_began_at=108.0) == []
    assert lost_removals(due, landed, ["c"], first, 110.5, ring="r3", ring_began_at=108.0) == ["c"]
    # due again, later (a replan): announced anew
    assert lost_removals({"e": 104.0}, {"e": 104.5}, ["e"], once, 110.0, **ring) == ["e"]


def test_an_announced_removal_makes_horovods_host_check_raise_and_sync() -> None:
    state = horovod_state()
    updates = HorovodHostUpdates(state)
    updates.announce_removal(["c"])
    assert updates.pending()
    with pytest.raises(HostsUpdatedInterrupt) as raised:
        check_host_updates_and_sync(state.check_host_updates)
    assert raised.value.skip_sync is False  # a removal alone would skip it; the driver may add a host too


def test_members_say_every_name_of_their_vm_and_old_members_only_their_host() -> None:
    from hvd_transient.core.ring import RunState

    run = RunState()
    run.start_ring(0, [["10.0.0.2", False, "t0", ["10.0.0.2", "w-0"], "4521"], ["10.0.0.3", False, "t1"]], now=0.0)
    assert run.member_names == [("10.0.0.2", "w-0"), ("10.0.0.3",)] and run.member_ids == ["4521", None]
