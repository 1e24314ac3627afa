"""Second attack round on the host check (commits 5a3019d, 7afa6ae): (A) rank 0 announces a removal that Horovod's
driver never told the ring of (core/transient.py ``_announce_lost_removals``, core/leave_plan.py ``lost_removals``);
(B) ring members say every name their VM goes by, and a ready record counts as in the ring where any of them
matches (frontend/lost_joins.py). Tests named ``test_held_...`` are attacks the code withstood; the others
reproduce a violation of what docs/reliability.md, docs/keras-and-mpi.md and the modules' docstrings promise,
and fail on the code they attack."""
from __future__ import annotations

import time
from typing import Any

import pytest
from horovod.common.elastic import State
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult
from test_protocol_agreement import make_ranks, notice, step_all

from hvd_transient.core.interfaces import Clocks
from hvd_transient.core.leave_plan import MAX_REMOVAL_ANNOUNCES
from hvd_transient.core.ring import RunState
from hvd_transient.discovery.ready import ReadyRecord
from hvd_transient.frontend.host_updates import HorovodHostUpdates, check_host_updates_and_sync
from hvd_transient.frontend.lost_joins import READY_AFTER_S, MemberSeen, RingSeen, lost_joins


def horovod_state() -> State:
    """Horovod's own elastic state, rank 0 of a world whose broadcast gives rank 0's view (as it does)."""
    return State(bcast_object=lambda obj: obj, get_rank=lambda: 0)


class CountingUpdates(HorovodHostUpdates):
    """Rank 0's host updates, counting the removals it announces."""

    def __init__(self, state: Any) -> None:
        super().__init__(state)
        self.removals = 0

    def announce_removal(self, hosts: Any) -> None:
        self.removals += 1
        super().announce_removal(hosts)


def counting_ranks(t: dict[str, float], **kwargs: Any) -> tuple[Any, list[Any], State, CountingUpdates]:
    """``make_ranks`` on the fake wall clock ``t``, rank 0 holding Horovod's state and counting its announces."""
    group, impls, _ = make_ranks(clocks=Clocks(wall=lambda: t["wall"]), **kwargs)
    state = horovod_state()
    updates = CountingUpdates(state)
    impls[0].host_updates = updates
    return group, impls, state, updates


def _leave_at_notice(t: dict[str, float]) -> tuple[Any, list[Any], State, CountingUpdates, float]:
    """A ring of h0-h2 (check every step) on a fake wall clock; h2 gets a notice (``at_notice``, 30 s window)
    at step 1; rank 0 holds Horovod's state. Returns group, impls, state, rank 0's updates, the deadline."""
    clocks = Clocks(wall=lambda: t["wall"])
    group, impls, _ = make_ranks(leave="at_notice", clocks=clocks)
    state = horovod_state()
    updates = CountingUpdates(state)
    impls[0].host_updates = updates
    impls[2].watcher.notice = notice(30.0, now=t["wall"])
    outcomes = step_all(group, impls, 1)
    assert all(o.check_hosts for o in outcomes)
    check_host_updates_and_sync(state.check_host_updates)  # discovery has not dropped h2 yet: nothing
    return group, impls, state, updates, t["wall"] + 30.0


def _step_until_reset(group: Any, impls: list[Any], state: State, t: dict[str, float], step: int,
                      until: float) -> tuple[int, float | None]:
    """Step every 0.5 s (fake wall) until ``until``, running Horovod's host check where the ranks agreed to;
    returns the last step and the wall time it raised at (None: it never did)."""
    while t["wall"] < until:
        step += 1
        t["wall"] += 0.5
        outcomes = step_all(group, impls, step)
        assert len({o.check_hosts for o in outcomes}) == 1
        if outcomes[0].check_hosts:
            try:
                check_host_updates_and_sync(state.check_host_updates)
            except HostsUpdatedInterrupt:
                return step, t["wall"]
    return step, None


# ------------------------------------------------------------------ rule A: lost removals (violations)

def test_an_announce_before_discovery_dropped_the_vm_then_a_lost_driver_message_keeps_it_past_its_deadline() -> None:
    """ATTACKS rule A's "a VM whose driver message was lost still leaves before its deadline" together with
    "once per VM and due time". The announce fires ``LOST_REMOVAL_AFTER_S`` after the VM was due by the ring's
    clock, whether or not discovery has dropped it: a leaving record that takes > 2 s to land (a slow store,
    its background retries) or a discovery clock behind the ring's (round.at is the max wall clock of the
    ranks) makes it premature. The reset it causes re-forms the ring with the VM still listed (in it,
    leaving), and the driver's real message comes right then, as the record lands: while the ring re-forms,
    so it is dropped (the premise of the rule itself). The announce was spent on that due time, so nothing
    tells the new ring again: h2 trains on to its deadline (killed inside the ring: a failure reset, steps
    rolled back)."""
    t = {"wall": time.time()}
    group, impls, state, updates, deadline = _leave_at_notice(t)
    # the ranks look at every step; discovery still lists h2 (its record not written yet): nothing raises
    # until rank 0 announces, 2 s after h2 was due
    step, raised_at = _step_until_reset(group, impls, state, t, 1, deadline)
    assert raised_at is not None and updates.removals == 1
    # the ring re-forms; the record lands, discovery drops h2 and the driver tells rank 0 once, before
    # its on_reset (lost); the driver had assigned the new ring with h2, still listed then
    state.on_hosts_updated(int(t["wall"]) + 1, HostUpdateResult.removed)
    state.on_reset()
    group.run(lambda r: impls[r].begin(step))
    _, left_at = _step_until_reset(group, impls, state, t, step, deadline)
    for impl in impls:
        impl.close()
    assert left_at is not None, \
        f"h2 was still in the ring at its deadline: one announce ({updates.removals}) was spent before " \
        "discovery dropped it, and the driver's message was lost as the ring re-formed"


# ------------------------------------------------------------------ rule B: names (violations)

def test_two_vms_sharing_a_machine_name_hide_a_lost_join() -> None:
    """ATTACKS rule B's "a lost join is still announced (two VMs sharing a machine name)". GCE instance names
    are unique per zone only; a multi-zone cluster (discovery lists IPs, docs/keras-and-mpi.md) may run w-3 in
    zone a (in the ring: it says 10.0.0.5, w-3 and its instance id 111) and a new w-3 in zone b, whose standby
    publishes under its name and instance id 222. The ready record names a different VM (its instance id
    differs from the member's), yet its host "w-3" matches a member's machine name: the lost join is hidden."""
    began = 1_764_000_000.0
    ring = RingSeen((MemberSeen(frozenset({"10.0.0.2", "w-0"}), "100"),
                     MemberSeen(frozenset({"10.0.0.5", "w-3"}), "111")), began)
    record = ReadyRecord(host="w-3", ready_at=began + 1.0, pid=7, instance_id="222")
    found = lost_joins([record], ring, last_in_ring={}, announced=())
    assert found == [record], "a VM that is not in the ring was taken for one of its members by a shared name"


def test_two_vms_sharing_a_machine_name_last_in_ring_hides_a_lost_join() -> None:
    """ATTACKS ``last_in_ring`` keyed by every name, with two VMs named w-3 (zones a and b, instance ids 111 and
    222). Zone a's w-3 was in the previous ring (it began 1 s before this one, then w-3 of zone a left); zone
    b's w-3 became ready 2 s before this ring began and is in neither ring. ``last_in_ring['w-3']`` (zone a's)
    is later than its ready_at, so the record counts as taken by a ring since: the lost join is hidden."""
    began = 1_764_000_000.0
    ring = RingSeen((MemberSeen(frozenset({"10.0.0.2", "w-0"}), "100"),), began)
    record = ReadyRecord(host="w-3", ready_at=began - 2.0, instance_id="222")
    # what rank 0 kept of the rings it saw (LostJoins.ring_began: a member's instance id, where it said one)
    last_in_ring = {"id:100": began, "id:111": began - 1.0}
    assert lost_joins([record], ring, last_in_ring=last_in_ring, announced=()) == [record]


def test_a_member_whose_names_are_malformed_breaks_the_rings_start() -> None:
    """ATTACKS rule B's "a member whose names list is malformed" (``RunState.start_ring``): a member that says
    ``None`` for its names (a version that sends no list, a name lookup that failed) makes every rank's
    ``begin`` raise TypeError: the whole job fails at each ring's start, instead of that member counting by its
    host alone. A member whose names came as one string has it split into characters ('w', '-', '3'), names
    no VM goes by."""
    members: list[Any] = [["h0", False, "t0", ["h0", "w-0"]], ["h1", False, "t1", None], ["h2", False, "t2", "w-3"]]
    run = RunState()
    run.start_ring(0, members, now=0.0)  # TypeError: 'NoneType' object is not iterable
    assert run.member_names[1] == ("h1",)
    assert run.member_names[2] in (("h2",), ("h2", "w-3"))


# ------------------------------------------------------------------ attacks that held

def test_held_a_lost_removal_at_notice_is_announced_once_while_the_vm_stays_listed() -> None:
    """ATTACKS rule A's "no reset storms": after the announce, four more rings re-form with h2 still listed
    (discovery has not dropped it); rank 0 announces at most once more for the same due time (on a ring that
    ran 2 s: MAX_REMOVAL_ANNOUNCES), and every rank agrees at every step on running the check."""
    t = {"wall": time.time()}
    group, impls, state, updates, deadline = _leave_at_notice(t)
    step, raised_at = _step_until_reset(group, impls, state, t, 1, deadline)
    assert raised_at is not None and raised_at - (deadline - 30.0) <= 3.5  # 2 s after its record landed + a step
    resets = 0
    for _ in range(4):
        state.on_reset()
        group.run(lambda r: impls[r].begin(step))
        step, again = _step_until_reset(group, impls, state, t, step, t["wall"] + 5.0)
        resets += again is not None
    assert updates.removals == MAX_REMOVAL_ANNOUNCES and resets == MAX_REMOVAL_ANNOUNCES - 1
    for impl in impls:
        impl.close()


def test_held_a_lost_removal_near_deadline_is_announced_before_the_deadline() -> None:
    """ATTACKS rule A on a near_deadline VM (leave_lead_s=4, so the announce comes 2 s after leave_at): the
    driver's message of h2's drop at its leave_at is lost in a reset; rank 0's announce resets the ring
    before the deadline."""
    t = {"wall": time.time()}
    t0 = t["wall"]
    group, impls, _ = make_ranks(leave="near_deadline", leave_lead_s=4.0, clocks=Clocks(wall=lambda: t["wall"]))
    state = horovod_state()
    impls[0].host_updates = HorovodHostUpdates(state)
    impls[2].watcher.notice = notice(30.0, now=t0)
    leave_at = step_all(group, impls, 1)[2].leave_at
    assert leave_at is not None
    step = 1
    while t["wall"] < leave_at - 1.0:
        step += 1
        t["wall"] += 0.5
        assert not any(o.check_hosts for o in step_all(group, impls, step))
    t["wall"] = leave_at + 0.2
    state.on_hosts_updated(int(t["wall"]), HostUpdateResult.removed)
    state.on_reset()  # lost: another change reset the ring as discovery dropped h2
    group.run(lambda r: impls[r].begin(step))
    _, left_at = _step_until_reset(group, impls, state, t, step, t0 + 30.0)
    for impl in impls:
        impl.close()
    assert left_at is not None and left_at < t0 + 30.0 - 1.0


def test_held_only_rank_0_announces_and_a_static_job_never_does() -> None:
    """ATTACKS "static jobs unaffected" and "rank 0 only": no host updates (a static job) on any rank, or
    host updates on rank 1 only; a VM past its due time by far: nothing is announced, nothing raises."""
    t = {"wall": time.time()}
    group, impls, _ = make_ranks(leave="at_notice", clocks=Clocks(wall=lambda: t["wall"]))
    state = horovod_state()
    impls[1].host_updates = CountingUpdates(state)
    impls[2].watcher.notice = notice(30.0, now=t["wall"])
    for step in range(1, 20):
        t["wall"] += 1.0
        step_all(group, impls, step)
    assert impls[1].host_updates.removals == 0 and state._host_messages.empty()  # noqa: SLF001
    for impl in impls:
        impl.close()


def test_held_lost_joins_by_names_edge_cases() -> None:
    """ATTACKS rule B's matching: an empty or None instance id on the record, a member of an older version
    (no names), and a record of a VM that is really missing stay a lost join; a VM that joined under its IP
    whose record names its machine or its instance id is not."""
    began = 1_764_000_000.0
    run = RunState()
    run.start_ring(0, [["10.0.0.2", False, "t0", ["10.0.0.2", "w-0"], "100"], ["10.0.0.3", False, "t1"]], now=0.0)
    assert run.member_names == [("10.0.0.2", "w-0"), ("10.0.0.3",)]
    ring = RingSeen(tuple(MemberSeen(frozenset(n), i) for n, i in zip(run.member_names, run.member_ids)), began)
    missing = [ReadyRecord("w-9", began + 1.0, instance_id=None), ReadyRecord("w-8", began, instance_id="")]
    joined = [ReadyRecord("w-0", began + 1.0, instance_id="100"), ReadyRecord("other", began, instance_id="100")]
    assert lost_joins(missing + joined, ring, last_in_ring={}, announced=()) == missing
    # ready just after READY_AFTER_S: not this ring's lost join (the driver tells rank 0 normally)
    late = ReadyRecord("w-7", began + READY_AFTER_S + 0.5)
    assert lost_joins([late], ring, last_in_ring={}, announced=()) == []


@pytest.mark.parametrize("lead", [0.0, 1.0])
def test_held_a_short_lead_announces_at_most_once(lead: float) -> None:
    """ATTACKS a departure_allowance of 0 or 1 s (leave_lead_s): the announce comes at once after the due
    time, and only once for it on a ring that has not run LOST_REMOVAL_AFTER_S since (here 5 s, then the
    second and last)."""
    t = {"wall": time.time()}
    group, impls, state, updates = counting_ranks(t, leave="at_notice", leave_lead_s=lead)
    impls[2].watcher.notice = notice(30.0, now=t["wall"])
    step_all(group, impls, 1)
    step, raised_at = _step_until_reset(group, impls, state, t, 1, t["wall"] + 10.0)
    assert raised_at is not None
    state.on_reset()
    group.run(lambda r: impls[r].begin(step))
    _step_until_reset(group, impls, state, t, step, t["wall"] + 5.0)
    assert updates.removals <= MAX_REMOVAL_ANNOUNCES
    for impl in impls:
        impl.close()


def test_held_a_removal_the_driver_dated_in_the_same_second_as_the_last_is_still_announced() -> None:
    """ATTACKS rule A with the driver's whole-second timestamps: a join's message (second S) reset the ring;
    discovery drops h2 within that same second, and Horovod's own check ignores that message (not later than
    S). Rank 0's announce (S + 1 ms) still resets the ring before the deadline, and the driver's next message
    (S + 1) is not hidden by it."""
    t = {"wall": float(int(time.time())) + 0.1}
    group, impls, state, updates, deadline = _leave_at_notice(t)
    second = int(t["wall"])
    state.on_hosts_updated(second, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt):
        check_host_updates_and_sync(state.check_host_updates)
    state.on_reset()
    group.run(lambda r: impls[r].begin(1))
    state.on_hosts_updated(second, HostUpdateResult.removed)  # same second: Horovod takes it for old
    step, raised_at = _step_until_reset(group, impls, state, t, 1, deadline)
    assert raised_at is not None and raised_at < deadline and updates.removals == 1
    state.on_hosts_updated(second + 1, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt):
        state.check_host_updates()
    for impl in impls:
        impl.close()
