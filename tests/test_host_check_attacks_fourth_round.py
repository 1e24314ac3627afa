"""Fourth attack round on the host check (commits f886604, b21b9bd): (1) at most ``MAX_REMOVAL_ANNOUNCES``
announces of a lost removal per VM and due time (core/leave_plan.py ``lost_removals``/``after_announcing``);
(2) what rank 0 remembers of them (``RunState.removals_announced``) pruned at each ring's start to the hosts still
in the ring (core/ring.py ``time_departures``); (3) every announce a ``host_update_announced`` event by rank 0,
counted by the report. Tests named ``test_held_...`` are attacks the code withstood; the others reproduce a
violation of what docs/keras-and-mpi.md ("At most twice per VM and due time ... at most two extra resets, not a
reset storm"), docs/reliability.md and the modules' docstrings promise, and failed on the code they attacked.
Both are fixed: every rank keeps the count rank 0 keeps (the round that decides it is agreed), and a new ring
merges what its members say they remember (core/leave_plan.py ``merged_announces``), so a new rank 0, or a
newcomer that becomes it, goes on from the ring's count."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fake_collectives import FakeCollectives, FakeWatcher, ThreadGroup
from horovod.common.elastic import State
from test_host_check_attacks_second_round import CountingUpdates, _leave_at_notice, _step_until_reset
from test_protocol_agreement import events, make_ranks, notice, step_all

from ckpt_service.stores.local import LocalStore
from hvd_transient.core.interfaces import Clocks
from hvd_transient.core.leave_plan import (
    LOST_REMOVAL_AFTER_S,
    MAX_REMOVAL_ANNOUNCES,
    RemovalAnnounced,
    after_announcing,
    announces_said,
    departures_said,
    lost_removals,
)
from hvd_transient.core.ring import RunState
from hvd_transient.core.transient import TransientImpl
from hvd_transient.report.analysis import analyze
from hvd_transient.report.render import render_summary, to_json
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import EventLog, read_log, read_records


def _state() -> State:
    """One worker's Horovod elastic state (each worker holds its own; the driver tells rank 0's only)."""
    return State(bcast_object=lambda obj: obj, get_rank=lambda: 0)


def _every_rank_holds_updates(impls: list[Any]) -> list[CountingUpdates]:
    """As Session does on an elastic job: every rank's protocol holds its own worker's host updates."""
    out = []
    for impl in impls:
        impl.host_updates = CountingUpdates(_state())
        out.append(impl.host_updates)
    return out


def _step_until_rank0_raises(group: Any, impls: list[Any], t: dict[str, float], step: int,
                             until: float) -> tuple[int, float | None]:
    """``_step_until_reset`` with the check run on the state of whoever is rank 0 now."""
    return _step_until_reset(group, impls, impls[0].host_updates.state, t, step, until)


def _reform(group: Any, impls: list[Any], step: int) -> None:
    for impl in impls:
        impl.host_updates.state.on_reset()
    group.run(lambda r: impls[r].begin(step))


def _rings_until(group: Any, impls: list[Any], t: dict[str, float], step: int, until: float,
                 rings: int) -> tuple[int, list[float]]:
    """Up to ``rings`` rings, each stepped until rank 0's host check raises (then re-formed) or ``until``; returns
    the last step and how long each ring that raised had run."""
    ages = []
    for _ in range(rings):
        began = t["wall"]
        step, raised_at = _step_until_rank0_raises(group, impls, t, step, until)
        if raised_at is None:
            break
        ages.append(raised_at - began)
        _reform(group, impls, step)
    return step, ages


# ------------------------------------------------------------------ rule 1/2: violations

def test_rank_0_changing_hands_gives_a_vm_two_more_announces_for_the_same_due_time() -> None:
    """ATTACKS claims 1 and 2 ("at most twice per VM and due time"; "[pruning] can never let a VM be announced
    more than twice for the same due time"). What was announced is remembered by the process that was rank 0
    (``RunState.removals_announced`` is written only where ``comm.rank() == 0``), not by the ring: every other
    rank's copy stays empty. Sequence: ring h0,h1,h2 (at_notice); h2 gets a notice at step 1; discovery keeps
    listing h2 (its driver message lost): rank 0 (h0) announces h2 at 2 s, the ring re-forms with h2, h0
    announces it again on a ring that ran 2 s: 2 announces, the cap. Then h0 is gone (killed, or its own notice:
    a correlated preemption) and the driver forms h1,h2: h1 is now rank 0 with nothing remembered, and h2 is
    still under notice with the same agreed due time on every rank. h1 announces h2 a third time at that ring's
    first step (0.5 s in: no ring-age check, as nothing is remembered), and a fourth on the next ring: four
    announces (four extra resets) for one VM and one due time, the third on a ring that ran 0.5 s."""
    t = {"wall": time.time()}
    group, impls, _ = make_ranks(leave="at_notice", clocks=Clocks(wall=lambda: t["wall"]))
    updates = _every_rank_holds_updates(impls)
    impls[2].watcher.notice = notice(30.0, now=t["wall"])
    deadline = t["wall"] + 30.0
    step_all(group, impls, 1)
    step = 1
    for _ in range(MAX_REMOVAL_ANNOUNCES):  # rank 0 (h0) spends both announces; discovery still lists h2
        step, raised_at = _step_until_rank0_raises(group, impls, t, step, deadline)
        assert raised_at is not None
        _reform(group, impls, step)
    due = impls[0].run.removals_announced["h2"].due
    assert impls[0].run.removals_announced["h2"].count == MAX_REMOVAL_ANNOUNCES
    # (fixed: every rank keeps the count rank 0 keeps, from the agreed round, and a new ring merges what its
    # members say they remember, so whichever process is rank 0 next goes on from it)
    assert impls[1].run.removals_announced == impls[0].run.removals_announced
    # h0 is gone: the driver forms h1 (now rank 0), h2 (still listed, still leaving)
    impls[0].close()
    survivors = impls[1:]
    group2 = ThreadGroup(2, timeout_s=10.0)
    for r, impl in enumerate(survivors):
        impl.comm = FakeCollectives(group2, r)
    _reform(group2, survivors, step)
    assert survivors[0].run.due_at_of["h2"] == due  # the same due time, agreed on every rank
    step, ages = _rings_until(group2, survivors, t, step, deadline, rings=2)
    for impl in survivors:
        impl.close()
    total = sum(u.removals for u in updates)
    announced_events = sum(len(events(impl, "host_update_announced")) for impl in impls)
    assert announced_events == total  # claim 3's count does follow the announces
    assert total <= MAX_REMOVAL_ANNOUNCES, \
        f"h2 was announced {total} times for the one due time {due:.3f} (h0: {updates[0].removals}, " \
        f"h1 as the new rank 0: {updates[1].removals}, {', '.join(f'{a:.1f}' for a in ages)} s into its rings)"


def test_rank_0_leaving_under_its_own_notice_lets_the_new_rank_0_announce_a_vm_a_third_time() -> None:
    """ATTACKS claim 1 ("at most twice per VM and due time") with no kill, a correlated preemption only: h0
    (rank 0) and h2 get their notices in the same round (at_notice). 2 s after their records landed rank 0
    announces both (h2's first announce). The driver's new ring drops h0 (its message came) but still lists h2
    (lost), with the same agreed due time for h2 on every rank. h1 is the new rank 0, its
    ``removals_announced`` empty: it announces h2 2 s into that ring and again on the next one that ran 2 s:
    three announces of h2 for one due time."""
    t = {"wall": time.time()}
    group, impls, _ = make_ranks(leave="at_notice", clocks=Clocks(wall=lambda: t["wall"]))
    updates = _every_rank_holds_updates(impls)
    deadline = t["wall"] + 30.0
    impls[0].watcher.notice = notice(30.0, now=t["wall"])
    impls[2].watcher.notice = notice(30.0, now=t["wall"])
    step_all(group, impls, 1)
    step, raised_at = _step_until_rank0_raises(group, impls, t, 1, deadline)
    assert raised_at is not None
    assert set(impls[0].run.removals_announced) == {"h0", "h2"}
    due = impls[0].run.removals_announced["h2"].due
    impls[0].close()  # h0 is gone with its own departure
    survivors = impls[1:]
    group2 = ThreadGroup(2, timeout_s=10.0)
    for r, impl in enumerate(survivors):
        impl.comm = FakeCollectives(group2, r)
    _reform(group2, survivors, step)
    assert survivors[0].run.due_at_of["h2"] == due
    step, _ = _rings_until(group2, survivors, t, step, deadline, rings=3)
    for impl in survivors:
        impl.close()
    h2_announces = sum(e["hosts"].count("h2") for impl in impls for e in events(impl, "host_update_announced"))
    assert h2_announces <= MAX_REMOVAL_ANNOUNCES, \
        f"h2 was announced {h2_announces} times for one due time (h0: {updates[0].removals}, " \
        f"h1 as the new rank 0: {updates[1].removals})"


# ------------------------------------------------------------------ rule 1/2: attacks that held

def test_held_ring_re_forming_quickly_never_announces_twice_on_a_ring_or_early() -> None:
    """ATTACKS "never twice on one ring; the second only on a ring that ran 2 s": after the first announce the
    ring re-forms five times in a row, each after 0.5-1.5 s (a reset storm from elsewhere), then runs: the
    second announce comes only on a ring that ran LOST_REMOVAL_AFTER_S, and no third."""
    t = {"wall": time.time()}
    group, impls, state, updates, deadline = _leave_at_notice(t)
    step, raised_at = _step_until_reset(group, impls, state, t, 1, deadline)
    assert raised_at is not None and updates.removals == 1
    for run_s in (0.5, 1.0, 1.5, 0.5, 1.5):
        state.on_reset()
        group.run(lambda r: impls[r].begin(step))
        began = t["wall"]
        step, again = _step_until_reset(group, impls, state, t, step, began + run_s)
        assert again is None, f"announced again on a ring that ran {t['wall'] - began:.1f} s"
    assert updates.removals == 1
    for _ in range(3):
        state.on_reset()
        group.run(lambda r: impls[r].begin(step))
        began = t["wall"]
        step, again = _step_until_reset(group, impls, state, t, step, began + 6.0)
        if again is not None:
            assert again - began > LOST_REMOVAL_AFTER_S
    for impl in impls:
        impl.close()
    assert updates.removals == MAX_REMOVAL_ANNOUNCES


def test_held_a_vm_absent_from_one_ring_then_back_counts_again_only_for_a_new_due_time() -> None:
    """ATTACKS claim 2's "a VM gone from the ring is forgotten": h2 is announced twice, a ring forms without it,
    then it is back (a new process, not leaving) and reads the same notice (same deadline) again. Its
    forgotten count restarts, but only for a new due time (the round that agreed the notice again), never
    the one announced twice."""
    t = {"wall": time.time()}
    group, impls, state, updates, deadline = _leave_at_notice(t)
    step = 1
    for _ in range(MAX_REMOVAL_ANNOUNCES):
        step, raised_at = _step_until_reset(group, impls, state, t, step, deadline)
        assert raised_at is not None
        state.on_reset()
        group.run(lambda r: impls[r].begin(step))
    first_due = impls[0].run.removals_announced["h2"].due
    # a ring without h2
    group.size = 2
    group.run(lambda r: impls[r].begin(step))
    assert impls[0].run.removals_announced == {}
    # h2 back: a new process on the same VM, under the same notice
    impls[2].close()
    newcomer = TransientImpl(impls[0].config, FakeCollectives(group, 2), host="h2", watcher=FakeWatcher(),
                             clocks=Clocks(wall=lambda: t["wall"]))
    impls[2] = newcomer
    group.size = 3
    newcomer.watcher.notice = notice(deadline - t["wall"], now=t["wall"])
    state.on_reset()
    group.run(lambda r: impls[r].begin(step))
    step, raised_at = _step_until_reset(group, impls, state, t, step, deadline)
    for impl in impls:
        impl.close()
    assert raised_at is not None
    again = impls[0].run.removals_announced["h2"]
    assert again.due != first_due and again.count == 1


def test_held_lost_removals_pure_edges() -> None:
    """ATTACKS ``lost_removals``/``after_announcing`` directly: a count for an older due time does not block
    the new one; the cap, the same ring and a ring younger than after_s each block the same due time; a due
    time or landing that is no number, or a VM not in the ring, is never announced."""
    now = 1000.0
    due, landed = {"a": 990.0}, {"a": 991.0}
    assert lost_removals(due, landed, ["a"], {}, now, ring="r1", ring_began_at=900.0) == ["a"]
    one = after_announcing({}, ["a"], due, ring="r1")
    assert one == {"a": RemovalAnnounced(990.0, 1, "r1")}
    assert lost_removals(due, landed, ["a"], one, now, ring="r1", ring_began_at=900.0) == []
    assert lost_removals(due, landed, ["a"], one, now, ring="r2", ring_began_at=now - 1.0) == []
    assert lost_removals(due, landed, ["a"], one, now, ring="r2", ring_began_at=now - 3.0) == ["a"]
    two = after_announcing(one, ["a"], due, ring="r2")
    assert two["a"].count == 2
    assert lost_removals(due, landed, ["a"], two, now, ring="r3", ring_began_at=0.0) == []
    assert lost_removals({"a": 995.0}, landed, ["a"], two, now, ring="r3", ring_began_at=0.0) == ["a"]
    for bad_due, bad_landed in ((float("nan"), 991.0), (990.0, float("inf")), (float("-inf"), 991.0)):
        assert lost_removals({"a": bad_due}, {"a": bad_landed}, ["a"], {}, now, ring="r", ring_began_at=0.0) == []
    assert lost_removals(due, landed, ["b"], {}, now, ring="r", ring_began_at=0.0) == []


def test_held_pruning_keeps_a_vm_in_the_ring_and_drops_one_gone() -> None:
    """ATTACKS ``RunState.time_departures``'s pruning with a VM of two ranks (h1 twice), hosts reordered, and a
    member that says it is not leaving: what was announced of h1 and h2 is kept while they are in the ring,
    in any order; dropped for h2 once gone."""
    run = RunState()
    run.start_ring(0, [["h0", False, "t"], ["h1", True, "t"], ["h1", True, "t"], ["h2", True, "t"]], now=0.0)
    run.removals_announced = {"h1": RemovalAnnounced(5.0, 2, "x"), "h2": RemovalAnnounced(6.0, 1, "x")}
    run.due_at_of = {"h1": 5.0, "h2": 6.0}
    said = announces_said(run.removals_announced)  # what every member says at the next ring's start
    times = departures_said(run.due_at_of, {}, {})

    def member(host: str, leaving: bool, token: str) -> list[Any]:
        return [host, leaving, token, [host], None, 0.0, said, times]

    run.start_ring(1, [member("h2", False, "u"), member("h1", True, "u"), member("h0", False, "u"),
                       member("h1", False, "u")], now=1.0)
    run.time_departures(10.0)
    assert set(run.removals_announced) == {"h1", "h2"}
    run.start_ring(2, [member("h0", False, "v"), member("h1", True, "v")], now=2.0)
    run.time_departures(11.0)
    assert set(run.removals_announced) == {"h1"}


# ------------------------------------------------------------------ rule 3: events and the report

def test_held_only_rank_0_emits_and_the_count_follows_every_announce() -> None:
    """ATTACKS claim 3 with host updates on every rank: through two announces of h2 (and a ring re-formed
    between), only rank 0 emits ``host_update_announced``; one event per announce, h2 alone each time."""
    t = {"wall": time.time()}
    group, impls, _ = make_ranks(leave="at_notice", clocks=Clocks(wall=lambda: t["wall"]))
    updates = _every_rank_holds_updates(impls)
    impls[2].watcher.notice = notice(30.0, now=t["wall"])
    step_all(group, impls, 1)
    step = 1
    for _ in range(3):
        step, raised_at = _step_until_rank0_raises(group, impls, t, step, t["wall"] + 6.0)
        _reform(group, impls, step)
    for impl in impls:
        impl.close()
    assert [u.removals for u in updates] == [MAX_REMOVAL_ANNOUNCES, 0, 0]
    assert [e["hosts"] for e in events(impls[0], "host_update_announced")] == [["h2"], ["h2"]]
    assert not any(events(impl, "host_update_announced") for impl in impls[1:])


def test_held_a_rank_that_was_rank_0_never_announces_a_join_found_for_its_old_ring() -> None:
    """ATTACKS claim 3's "no other rank emits it" on the join path: rank 0's look found a lost join (h9) for its
    ring, but before any round took it the ring re-formed and this process is rank 1 now; a late look for the
    old ring lands after that. Nothing is taken or emitted on rank 1."""
    from hvd_transient.discovery.ready import ReadyRecord
    from hvd_transient.frontend.host_updates import HorovodHostUpdates
    from hvd_transient.frontend.lost_joins import LostJoins, MemberSeen

    began = 1_764_000_000.0
    lost = LostJoins(clock=lambda: began, look_after_s=3600.0)
    updates = HorovodHostUpdates(_state(), lost)
    store = LocalStore("/nonexistent-never-read")
    emitted: list[Any] = []

    class Log:
        def emit(self, body: Any, **_: Any) -> None:
            emitted.append(body)

    updates.events = Log()  # type: ignore[assignment]
    record = ReadyRecord(host="h9", ready_at=began + 1.0)
    updates.ring_began([MemberSeen(frozenset({"h0"}), None)], rank=0, store=store)
    old_ring = lost._ring  # noqa: SLF001
    lost.look(old_ring, [record])  # found for the old ring
    updates.ring_began([MemberSeen(frozenset({"h5"}), None), MemberSeen(frozenset({"h0"}), None)], rank=1,
                       store=store)
    lost.look(old_ring, [record])  # a late look for the old ring
    assert not updates.pending() and emitted == []
    assert updates.state._host_messages.empty()  # noqa: SLF001
    updates.close()


def _write_raw(store: LocalStore, lines: list[dict[str, Any]]) -> None:
    store.put("events/h0.1.raw.0.jsonl", "\n".join(json.dumps(x) for x in lines).encode())


def test_held_damaged_announce_events_are_skipped_not_fatal(tmp_path: Path) -> None:
    """ATTACKS claim 3's "a damaged event (wrong types) is skipped, not fatal": hosts as one string, as a list
    holding a number or null, a map, no hosts, a change that is a number or null: each skipped and counted; the
    good ones counted by change; summary, JSON and timeline render."""
    store = LocalStore(str(tmp_path / "store"))
    log = EventLog(store, "h0")
    log.emit(ev.Start(step=0, rank=0, size=3, crc=1, full_crc=1, restored_step=None))
    log.emit(ev.HostUpdateAnnounced(change=ev.ANNOUNCED_REMOVAL, hosts=("h2",)))
    log.emit(ev.HostUpdateAnnounced(change=ev.ANNOUNCED_JOIN, hosts=("h7", "h8")))
    log.close()
    t0 = time.time()
    base = {"t": t0, "event": "host_update_announced", "host": "h0", "pid": 1}
    damaged = [
        {**base, "change": "removal", "hosts": "h1,h2"},
        {**base, "change": "removal", "hosts": ["h1", 3]},
        {**base, "change": "removal", "hosts": [None]},
        {**base, "change": "removal", "hosts": {"h1": 1}},
        {**base, "change": "removal"},
        {**base, "change": 3, "hosts": ["h1"]},
        {**base, "change": None, "hosts": ["h1"]},
        {**base, "change": ["removal"], "hosts": ["h1"]},
        {**base, "t": "soon", "change": "removal", "hosts": ["h1"]},
    ]
    _write_raw(store, damaged)
    parsed = read_log(store)
    assert parsed.skipped.get("host_update_announced") == len(damaged)
    analysis = analyze(read_records(store))
    assert analysis.host_updates_announced == {"join": 2, "removal": 1}
    summary = render_summary(analysis)
    assert "driver messages lost: 2 joins, 1 removal announced by rank 0" in summary
    assert to_json(analysis, None)["host_updates_announced"] == {"join": 2, "removal": 1}
    assert sum("driver lost the" in e.text for e in analysis.timeline) == 2
