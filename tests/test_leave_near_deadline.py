"""``leave="near_deadline"``: a VM under notice trains on through its window and leaves only
``leave_lead_s`` before its deadline, with the emergency checkpoint still taken at the notice.

Discovery's ``leave_at`` filtering is pure; the protocol runs on in-process ranks with the fake
collectives (every rank must run the same collectives); the report reads the actual leave.
"""
from __future__ import annotations

import json
import time
import uuid

import pytest
from fake_collectives import FakeCollectives, FakeWatcher, ThreadGroup
from test_protocol_agreement import events, make_ranks, notice, published, step_all
from test_report import T0, preempted_worker_log

from ckpt_service.deadline import Deadline
from ckpt_service.errors import CheckpointError, StoreDeadlineError
from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import MemoryStore
from hvd_transient.core.config import DEFAULT_LEAVE_LEAD_S, LeaveConfigError, TransientConfig
from hvd_transient.core.interfaces import Clocks
from hvd_transient.core.membership import (
    LATE_RECORD_S,
    LeavingRecord,
    excluded,
    leaving_hosts,
    prune_leaving,
    publish_leaving,
    publish_leaving_until,
    read_leaving,
)
from hvd_transient.core.ring import RunState
from hvd_transient.core.transient import TransientImpl
from hvd_transient.discovery.hosts import Host, exclude_leaving
from hvd_transient.report.analysis import analyze

pytestmark = pytest.mark.timed  # bounds wall-clock times

HOSTS = [Host("h0"), Host("h1"), Host("h2")]


def listed(records: list[LeavingRecord], now: float) -> list[str]:
    """What the discovery script prints at ``now`` (host names only)."""
    return [h.name for h in exclude_leaving(HOSTS, records, now, grace_s=60)]


# ------------------------------------------------------------------ discovery (pure)

def test_a_record_with_leave_at_keeps_its_host_listed_until_then() -> None:
    record = LeavingRecord("h2", published_at=1000.0, deadline=1030.0, leave_at=1020.0)
    assert listed([record], 1000.0) == ["h0", "h1", "h2"]
    assert listed([record], 1019.9) == ["h0", "h1", "h2"]
    assert listed([record], 1020.0) == ["h0", "h1"]
    assert listed([record], 1089.0) == ["h0", "h1"]        # until deadline + grace, as without leave_at
    assert listed([record], 1090.1) == ["h0", "h1", "h2"]  # the VM it described is gone
    assert excluded([record], {}, 1010.0) == set() and excluded([record], {}, 1025.0) == {"h2"}


def test_a_record_without_leave_at_means_now() -> None:
    """Records of writers before ``leave_at`` existed drop their host at once."""
    old = json.dumps({"host": "h1", "reason": "preemption-notice", "published_at": 1000.0,
                      "deadline": 1030.0}).encode()
    record = LeavingRecord.from_json("h1", old)
    assert record.leave_at is None and record.leaves_by(1000.0)
    assert listed([record], 1000.5) == ["h0", "h2"]
    garbled = LeavingRecord.from_json("h1", json.dumps({"published_at": 1000.0, "leave_at": "soon"}).encode())
    assert garbled.leave_at is None  # not a number: leave now rather than never


def test_a_pending_record_round_trips_and_is_not_pruned_before_its_host_left() -> None:
    store = MemoryStore()
    written = publish_leaving(store, "h2", deadline=2030.0, now=2000.0, leave_at=2020.0)
    assert read_leaving(store) == [written] and written.leave_at == 2020.0
    assert leaving_hosts(store, now=2010.0) == set()
    assert prune_leaving(store, now=2010.0) == []  # pending, not expired: kept
    assert leaving_hosts(store, now=2020.0) == {"h2"}
    assert prune_leaving(store, now=2100.0) == ["h2"]


@pytest.mark.parametrize("bad", [{"leave": "later"}, {"leave": "near_deadline", "leave_lead_s": -1.0},
                                 {"leave_lead_s": float("nan")}])
def test_bad_leave_options_fail_with_a_typed_error(bad: dict[str, object]) -> None:
    with pytest.raises(LeaveConfigError, match="leave") as info:
        TransientConfig(store="memory://x", **bad)  # type: ignore[arg-type]
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("bad", [{"notice_window_s": float("nan")}, {"notice_window_s": 0.0},
                                 {"notice_window_s": float("inf")}, {"leave_margin_s": float("nan")},
                                 {"leave_lead_s": float("inf")}])
def test_a_window_or_margin_that_no_deadline_can_be_planned_from_is_refused(bad: dict[str, object]) -> None:
    """A NaN window compares false with every time, so every plan built on it would pass as in time."""
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        TransientConfig(store="memory://x", **bad)  # type: ignore[arg-type]


def test_the_lead_is_one_wait_for_a_step_boundary_plus_a_departure_fixed_when_given_else_measured() -> None:
    """The departure's part: 10 s until a departure was timed, then twice the slowest timed plus 2 s, which may
    be longer than 10 s on a cluster that leaves slowly; a number is used as it is. Before it, one wait for a
    step at which the VM can leave: the check interval at fast steps, the slowest step at slow ones."""
    measured = TransientConfig(store="memory://x", leave="near_deadline")
    assert measured.leave_lead_s is None and measured.check_interval_s == 1.0
    assert measured.departure_allowance_s(None) == DEFAULT_LEAVE_LEAD_S == 10.0
    assert measured.lead_s(None) == 11.0 and measured.lead_s(None, 0.05) == 11.0
    assert measured.lead_s(None, 15.0) == 25.0
    assert measured.lead_s(1.5) == pytest.approx(6.0) and measured.lead_s(6.0, 3.0) == pytest.approx(17.0)
    assert measured.lead_s(0.0) == pytest.approx(3.0)
    fixed = TransientConfig(store="memory://x", leave="near_deadline", leave_lead_s=7.0)
    assert fixed.lead_s(None) == fixed.lead_s(1.5) == fixed.lead_s(60.0) == 8.0
    assert fixed.lead_s(None, 15.0) == 22.0
    every_3 = TransientConfig(store="memory://x", leave="near_deadline", leave_lead_s=7.0, check_every_steps=3)
    assert every_3.lead_s(None, 2.0) == 13.0  # a host check every third step


def test_a_departure_is_timed_from_its_leave_at_to_the_ring_that_no_longer_has_it() -> None:
    run = RunState()
    run.start_ring(0, [["h0", False, "a"], ["h1", False, "b"], ["h2", False, "c"], ["h3", False, "d"]], now=0.0)
    run.handled_leavers |= {"h1", "h2", "h3"}
    run.leave_at_of = {"h1": 100.0, "h2": 103.0, "h3": 200.0}
    # h1 left, h2 left before its leave_at (its VM died: not timed), h3 still trains on to its leave_at
    run.start_ring(5, [["h0", False, "e"], ["h3", True, "f"]], now=1.0)
    assert run.time_departures(101.5) == {"h1": pytest.approx(1.5)} and run.departure_s == pytest.approx(1.5)
    assert run.leave_at_of == {"h3": 200.0}
    # a later, faster departure keeps the slowest; a host back under its own name is a new VM, not timed
    run.start_ring(9, [["h0", False, "g"]], now=2.0)
    assert run.time_departures(200.5) == {"h3": pytest.approx(0.5)} and run.departure_s == pytest.approx(1.5)
    run.leave_at_of = {"h0": 300.0}
    run.start_ring(12, [["h0", False, "h"]], now=3.0)
    assert run.time_departures(301.0) == {} and run.leave_at_of == {}


def test_the_measured_lead_is_agreed_by_every_rank_and_taught_to_a_vm_that_joined() -> None:
    """h2 trains on to its leave_at (10 s before its deadline: nothing timed yet) and the ring re-forms
    without it 1.5 s later; h3 joins. At the next round every rank, h3 too, holds 1.5 s, and h3's own
    notice then leaves 2 x 1.5 + 2 = 5 s before its deadline (and one of these fakes' instant steps)."""
    t = {"wall": time.time()}
    clocks = Clocks(wall=lambda: t["wall"])
    t0 = t["wall"]
    group, impls, url = make_ranks(leave="near_deadline", clocks=clocks)
    impls[2].watcher.notice = notice(30.0, now=t0)
    outcomes = step_all(group, impls, 1)
    assert outcomes[2].leave_at == pytest.approx(t0 + 20.0)
    assert [impl.run.leave_at_of for impl in impls] == [{"h2": pytest.approx(t0 + 20.0)}] * 3
    step_all(group, impls, 2)
    # Horovod re-forms the ring at leave_at + 1.5 s: h0, h1 and a new VM, h3
    t["wall"] = t0 + 21.5
    newcomer = TransientImpl(impls[0].config, FakeCollectives(ThreadGroup(1), 0), host="h3", watcher=FakeWatcher(),
                             clocks=clocks)
    ring = [impls[0], impls[1], newcomer]
    group2 = ThreadGroup(3, timeout_s=10)
    for rank, impl in enumerate(ring):
        impl.comm = FakeCollectives(group2, rank)
    group2.run(lambda r: ring[r].begin(3))
    assert [impl.run.departure_s for impl in ring] == [pytest.approx(1.5, abs=0.05)] * 2 + [None]
    step_all(group2, ring, 4)  # a round
    assert len({impl.run.departure_s for impl in ring}) == 1
    assert newcomer.run.departure_s == pytest.approx(1.5, abs=0.05)
    t["wall"] = t0 + 30.0
    newcomer.watcher.notice = notice(30.0, now=t0 + 30.0)
    outcomes = step_all(group2, ring, 5)
    assert outcomes[2].leaving and outcomes[2].leave_at == pytest.approx(t0 + 55.0, abs=0.1)  # less one fake step
    published([newcomer])
    assert {r.host: r.leave_at for r in read_leaving(impls[0].manager.store)}["h3"] == outcomes[2].leave_at
    [leave] = events(newcomer, "leave_published")
    assert leave["deadline"] - leave["leave_at"] == pytest.approx(5.0, abs=0.1)
    for impl in (*impls, newcomer):
        impl.close()


def test_the_protocols_default_leaves_at_the_notice() -> None:
    """The framework-free default suits static (MPI) jobs; the Keras callback picks near_deadline for elastic ones."""
    assert TransientConfig(store="memory://x").leave == "at_notice"
    group, impls, _ = make_ranks()
    deadline = time.time() + 30
    impls[2].watcher.notice = notice(30.0, now=deadline - 30)
    outcomes = step_all(group, impls, 1)
    assert outcomes[2].leaving and outcomes[2].leave_at is None
    published(impls)
    [record] = read_leaving(impls[0].manager.store)
    assert record.leave_at is None and listed([record], time.time()) == ["h0", "h1"]
    assert "leave_at" not in events(impls[2], "leave_published")[0]


# ------------------------------------------------------------------ the protocol

def test_near_deadline_checkpoints_at_the_notice_and_trains_on_until_leave_at() -> None:
    group, impls, url = make_ranks(leave="near_deadline", leave_lead_s=10.0)
    t0 = time.time()
    impls[2].watcher.notice = notice(30.0, now=t0)
    outcomes = step_all(group, impls, 1)
    # the checkpoint is taken and committed at the notice, as without the option
    assert [o.emergency_step for o in outcomes] == [1, 1, 1] and all(o.committed for o in outcomes)
    assert CheckpointManager(url).all_steps() == [1]
    assert [o.leaving for o in outcomes] == [False, False, True]
    assert outcomes[2].leave_at == pytest.approx(t0 + 20.0, abs=0.5)
    assert outcomes[0].leave_at is None and outcomes[1].leave_at is None
    impls[2].publishing.result(timeout=10)  # type: ignore[union-attr]
    [record] = read_leaving(impls[0].manager.store)
    assert (record.host, record.deadline, record.leave_at) == ("h2", pytest.approx(t0 + 30), outcomes[2].leave_at)
    [published] = events(impls[2], "leave_published")
    assert published["leave_at"] == pytest.approx(t0 + 20.0, abs=0.5)
    # discovery keeps h2 in the ring until leave_at, then drops it
    assert listed([record], time.time()) == ["h0", "h1", "h2"]
    assert listed([record], record.leave_at) == ["h0", "h1"]  # type: ignore[arg-type]
    # meanwhile the noticed rank keeps training with the others: no second emergency, same collectives
    for step in range(2, 6):
        later = step_all(group, impls, step)
        assert [o.emergency_step for o in later] == [None, None, None]
        assert [o.leaving for o in later] == [False, False, True]
    assert group.calls[0] == group.calls[1] == group.calls[2]
    assert CheckpointManager(url).all_steps() == [1]


class HeldUpdates:
    """A rank's host updates (HostUpdates): ``held`` until a step's outcome says the host check ran."""

    def __init__(self) -> None:
        self.held = False

    def pending(self) -> bool:
        return self.held


@pytest.mark.parametrize("leave", ["near_deadline", "at_notice"])
def test_the_host_check_runs_at_every_step_only_for_a_departure_at_once(leave: str) -> None:
    """Horovod's host check is a collective: every rank must run it at the same steps. A departure
    at the notice is looked for at every step; one that waits for its leave_at is not looked for before
    it (discovery keeps the VM until then), so the window's steps pay no broadcast; a host update that
    rank 0 holds is taken at the next notice round (here every 3rd step), by every rank."""
    group, impls, _ = make_ranks(leave=leave, leave_lead_s=10.0, check_every_steps=3)
    updates = HeldUpdates()
    impls[0].host_updates = updates
    assert [o.check_hosts for o in step_all(group, impls, 1)] == [False] * 3  # nobody leaving
    impls[2].watcher.notice = notice(30.0)
    outcomes = step_all(group, impls, 3)
    assert [o.emergency_step for o in outcomes] == [3] * 3 and all(o.check_hosts for o in outcomes)
    checked = []
    for step in range(4, 13):
        updates.held = updates.held or step == 8  # the driver tells rank 0 of a join between two rounds
        later = step_all(group, impls, step)
        assert len({o.check_hosts for o in later}) == 1, f"step {step}: the ranks disagree"
        checked.append(later[0].check_hosts)
        updates.held = updates.held and not later[0].check_hosts  # the check took it
    if leave == "near_deadline":  # the round at step 9 found it held (the check would take it there)
        assert checked == [False] * 5 + [True] + [False] * 3
    else:
        assert checked == [True] * 9


def test_a_host_update_is_taken_at_the_next_round_with_nobody_under_notice() -> None:
    """A join (Horovod's driver tells rank 0) is taken at the next notice round, whatever the script commits."""
    group, impls, _ = make_ranks(leave="near_deadline", check_every_steps=3)
    updates = HeldUpdates()
    impls[0].host_updates = updates
    assert [step_all(group, impls, s)[0].check_hosts for s in range(1, 7)] == [False] * 6
    updates.held = True
    outcomes = [step_all(group, impls, s) for s in range(7, 10)]
    assert [[o.check_hosts for o in step] for step in outcomes] == [[False] * 3, [False] * 3, [True] * 3]


def test_a_wave_that_takes_every_host_makes_the_host_check_per_step_again() -> None:
    """Notices that end up covering every host of the ring leave at once: the check is per step."""
    group, impls, _ = make_ranks(leave="near_deadline", leave_lead_s=10.0, check_every_steps=3, size=3)
    impls[2].watcher.notice = notice(30.0)
    step_all(group, impls, 3)
    assert [o.check_hosts for o in step_all(group, impls, 4)] == [False] * 3
    impls[0].watcher.notice = notice(30.0)  # the rest of the ring: a wave that takes all but h1
    step_all(group, impls, 6)
    assert [o.check_hosts for o in step_all(group, impls, 7)] == [False] * 3  # h1 carries the state
    impls[1].watcher.notice = notice(30.0)  # now every host: the checkpoint is what counts
    step_all(group, impls, 9)
    assert [o.check_hosts for o in step_all(group, impls, 10)] == [True] * 3


def test_a_master_under_notice_that_trains_on_is_never_elected_again() -> None:
    """h0 (the master) gets a notice and stays; a later notice to h1 must elect h2, not h0."""
    group, impls, url = make_ranks(leave="near_deadline", leave_lead_s=10.0)
    t0 = time.time()
    impls[0].watcher.notice = notice(30.0, now=t0)
    step_all(group, impls, 1)
    assert [impl.run.master for impl in impls] == [1, 1, 1]
    step_all(group, impls, 2)
    impls[1].watcher.notice = notice(30.0, now=t0 + 1)
    outcomes = step_all(group, impls, 3)
    assert [o.emergency_step for o in outcomes] == [3, 3, 3] and all(o.committed for o in outcomes)
    assert [impl.run.master for impl in impls] == [2, 2, 2]
    assert [e["new_master_host"] for e in events(impls[2], "election")] == ["h1", "h2"]
    assert CheckpointManager(url).all_steps() == [1, 3]


def test_a_notice_to_every_host_of_the_ring_leaves_at_once() -> None:
    """A whole-ring wave has no survivor to carry the state: checkpoint, then leave, as before."""
    memory = MemoryStore.named(uuid.uuid4().hex)
    group, impls, url = make_ranks(stores=[memory] * 3, leave="near_deadline", leave_lead_s=10.0)
    t0 = time.time()
    for impl in impls:
        impl.watcher.notice = notice(30.0, now=t0)
    outcomes = step_all(group, impls, 1)
    assert all(o.committed and o.leaving and o.leave_at is None for o in outcomes)
    assert CheckpointManager(url).all_steps() == [1]
    for impl in impls:
        impl.publishing.result(timeout=10)  # type: ignore[union-attr]
    records = read_leaving(memory)
    assert sorted(r.host for r in records) == ["h0", "h1", "h2"] and all(r.leave_at is None for r in records)
    assert listed(records, time.time()) == []


def test_a_window_shorter_than_the_lead_leaves_at_once() -> None:
    group, impls, _ = make_ranks(leave="near_deadline", leave_lead_s=10.0)
    impls[2].watcher.notice = notice(8.0)
    outcomes = step_all(group, impls, 1)
    assert outcomes[2].leaving and outcomes[2].leave_at is None


class _Bounded:
    """A view of a store that refuses a call once its deadline has passed, as the GCS store does."""

    def __init__(self, inner: MemoryStore, deadline: Deadline) -> None:
        self.inner, self.deadline = inner, deadline

    def put(self, key: str, data: bytes, **kw: object) -> int:
        if self.deadline.expired(time.time()):
            raise StoreDeadlineError(f"put {key}: no time left before the deadline; not sent", attempted=False)
        return self.inner.put(key, data, **kw)  # type: ignore[arg-type]


class StoreWithDeadlines(MemoryStore):
    def within(self, deadline: Deadline) -> _Bounded:  # type: ignore[override]
        return _Bounded(self, deadline)


def test_a_record_whose_deadline_has_passed_is_still_written_within_a_bound_of_its_own() -> None:
    store = StoreWithDeadlines(uuid.uuid4().hex)
    t0 = time.monotonic()
    record = publish_leaving_until(store, "h2", until=time.time() - 3.0, deadline=time.time() - 3.0)
    assert time.monotonic() - t0 < LATE_RECORD_S
    assert read_leaving(store) == [record] and listed([record], time.time()) == ["h0", "h1"]


def test_a_deadline_already_past_when_agreed_writes_the_record_and_leaves_at_once() -> None:
    """A notice whose deadline has passed when the ranks agree on it (dated from a read long after it came):
    the record is still written, so discovery drops the host; the VM leaves at once, its host looked for at
    every step; and should it stay in the ring past its deadline and grace anyway, the departure that cannot
    happen stops holding periodic saves off."""
    t = {"wall": time.time()}
    clocks = Clocks(wall=lambda: t["wall"])
    group, impls, _ = make_ranks(leave="near_deadline", clocks=clocks, save_every_steps=2)
    impls[2].watcher.notice = notice(-3.0, now=t["wall"])  # its deadline was 3 s ago
    outcomes = step_all(group, impls, 1)
    assert outcomes[2].leaving and outcomes[2].leave_at is None and all(o.departure_pending for o in outcomes)
    published(impls)
    [record] = read_leaving(impls[0].manager.store)
    assert (record.host, record.leave_at) == ("h2", None)
    assert listed([record], time.time()) == ["h0", "h1"]
    assert events(impls[2], "leave_published")
    later = step_all(group, impls, 2)
    assert all(o.check_hosts for o in later)  # looked for at every step, as at the notice
    assert not any(events(impl, "async_save") for impl in impls)  # the ring is about to re-form
    t["wall"] += 3.0 + 60.0 + 1.0  # still in the ring past its deadline and the records' grace
    step_all(group, impls, 3)
    assert not any(impl.run.departure_pending for impl in impls)
    step_all(group, impls, 4)
    assert all(events(impl, "async_save") for impl in impls)


# ------------------------------------------------------------------ the report

def test_the_report_times_the_departure_from_the_actual_leave() -> None:
    """C published at 5.5 s but trained on until its leave_at, 7.5 s; the survivors resumed at 8.5 s."""
    log = preempted_worker_log()
    [published] = [e for e in log.events if e["event"] == "leave_published"]
    published["leave_at"] = T0 + 7.5
    (p,) = analyze(log.events).preemptions
    assert p.departed_at == pytest.approx(T0 + 7.5)
    assert p.resume_ms == pytest.approx(1000.0, abs=1)
    assert p.steps_rolled_back == 0 and p.checkpoint_committed
    assert p.leave_lead_s == pytest.approx(35.0 - 7.5)  # its deadline less its leave_at


# ------------------------------------------------------------------ the goodput benchmark

def test_the_goodput_bench_passes_the_leave_option_to_our_workers_only() -> None:
    from dataclasses import fields

    import bench.goodput as goodput

    args = goodput.build_parser().parse_args(["--leave", "at_notice", "--leave-lead", "8"])
    cfg = goodput.Config(**{f.name: getattr(args, f.name) for f in fields(goodput.Config)})
    ours = goodput.worker_command("ours", "/store", cfg, 30.0)
    assert ours[ours.index("--leave"):ours.index("--leave") + 4] == ("--leave", "at_notice", "--leave-lead", "8")
    assert "--leave" not in goodput.worker_command("horovod_elastic", "/store", cfg, 30.0)
    # by default ours measures its lead: the option is not passed
    args = goodput.build_parser().parse_args([])
    cfg = goodput.Config(**{f.name: getattr(args, f.name) for f in fields(goodput.Config)})
    ours = goodput.worker_command("ours", "/store", cfg, 30.0)
    assert ours[ours.index("--leave"):ours.index("--leave") + 2] == ("--leave", "near_deadline")
    assert "--leave-lead" not in ours and (args.leave, args.leave_lead) == ("near_deadline", None)


# ------------------------------------------------------------------ the Keras callback

def test_the_keras_callback_passes_the_options_and_a_static_job_leaves_at_the_notice(tmp_path) -> None:
    import hvd_transient.keras as hvdt

    class Elastic:  # what the callback asks of Horovod's elastic state here
        def register_reset_callbacks(self, callbacks: object) -> None:
            pass

    store = str(tmp_path / "store")
    elastic = hvdt.TransientCallback(Elastic(), store=store, leave="near_deadline", leave_lead_s=7.0)
    assert (elastic.config.leave, elastic.config.leave_lead_s) == ("near_deadline", 7.0)
    # a static job is relaunched at the notice: a host still listed would be given to the relaunch
    assert hvdt.TransientCallback(None, store=store, leave="near_deadline").config.leave == "at_notice"
    # the default: an elastic job trains through its window, a static one leaves at the notice
    assert hvdt.TransientCallback(Elastic(), store=store).config.leave == "near_deadline"
    assert hvdt.TransientCallback(None, store=store).config.leave == "at_notice"
    assert hvdt.TransientCallback(Elastic(), store=store, leave="at_notice").config.leave == "at_notice"
    with pytest.raises(LeaveConfigError, match="'later'"):
        hvdt.TransientCallback(None, store=store, leave="later")


def test_a_leave_is_planned_again_earlier_when_steps_grow_slower_after_the_notice() -> None:
    """A round at every step. Planned at the notice with 0.1 s steps (leave_at = deadline - 0.1 s - 10 s), then
    every step takes 8 s: a leave still at that leave_at could start an 8 s step it cannot finish before
    the deadline, so the next round moves it 7.9 s earlier (and writes the record again); at 25 s steps, a
    lead no longer fits and the VM leaves at once. A leave is never moved later."""
    t = {"wall": time.time(), "mono": 1000.0}
    clocks = Clocks(wall=lambda: t["wall"], monotonic=lambda: t["mono"])
    group, impls, url = make_ranks(leave="near_deadline", clocks=clocks)

    def steps(first: int, last: int, step_s: float) -> list:
        out: list = []
        for step in range(first, last + 1):
            t["wall"] += step_s
            t["mono"] += step_s
            out = step_all(group, impls, step)
        return out

    steps(1, 5, 0.1)
    impls[2].watcher.notice = notice(60.0, now=t["wall"])
    deadline = t["wall"] + 60.0
    outcomes = steps(6, 6, 0.1)
    first = outcomes[2].leave_at
    assert first == pytest.approx(deadline - 0.1 - DEFAULT_LEAVE_LEAD_S, abs=0.05)
    published(impls)
    steps(7, 8, 8.0)  # steps slow down: at the round of step 8 the job has timed an 8 s step
    assert [impl.run.leave_at_of["h2"] for impl in impls] == [pytest.approx(first - 7.9, abs=0.05)] * 3
    impls[2].publishing.result(timeout=10)  # type: ignore[union-attr]
    [record] = read_leaving(impls[0].manager.store)
    assert record.leave_at == pytest.approx(first - 7.9, abs=0.05) and record.deadline == pytest.approx(deadline)
    steps(9, 9, 0.1)  # faster again: never later
    assert impls[0].run.leave_at_of["h2"] == pytest.approx(first - 7.9, abs=0.05)
    steps(10, 10, 25.0)  # now no lead fits before the deadline: at once, and the host check runs at every step
    assert all("h2" not in impl.run.leave_at_of for impl in impls)
    impls[2].publishing.result(timeout=10)  # type: ignore[union-attr]
    [record] = read_leaving(impls[0].manager.store)
    assert record.leave_at is None
    assert all(o.check_hosts for o in steps(11, 11, 0.1))
    assert len(events(impls[2], "leave_published")) == 1  # the leave itself is logged once
    for impl in impls:
        impl.close()
