"""Attacks on commit 3a49f3d: (1) Horovod's host check runs at a notice round only where some rank holds a
driver message or a departure is due; (2) rank 0 announces joins that the driver's message lost, from the
standbys' ready records. Each test names what it attacks. Tests that fail on 3a49f3d reproduce a violation
of what docs/reliability.md, docs/keras-and-mpi.md and hvd_transient/frontend/lost_joins.py promise; the
rest are attacks the code withstood."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from horovod.common.elastic import State
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult
from test_protocol_agreement import make_ranks, notice, step_all

from ckpt_service.stores import LocalStore
from hvd_transient.core.interfaces import Clocks
from hvd_transient.discovery.gce import _host as gce_host
from hvd_transient.discovery.ready import JoinGate, publish_ready, read_ready
from hvd_transient.frontend.host_updates import HorovodHostUpdates, check_host_updates_and_sync
from hvd_transient.frontend.lost_joins import LostJoins, MemberSeen, RingSeen


def horovod_state() -> State:
    """Horovod's own elastic state, rank 0 of a world whose broadcast gives rank 0's view (as it does)."""
    return State(bcast_object=lambda obj: obj, get_rank=lambda: 0)


class Observed(LostJoins):
    """LostJoins that says when its look (on the timer thread) is done."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.looked = threading.Event()

    def look(self, ring: RingSeen, records: Any) -> None:
        super().look(ring, records)
        self.looked.set()


class Counting:
    """A rank's host updates that counts how often the protocol asks (HostUpdates)."""

    def __init__(self) -> None:
        self.held = False
        self.calls = 0

    def pending(self) -> bool:
        self.calls += 1
        return self.held


# ------------------------------------------------------------------ rule 2: lost joins (violations)

def test_a_vm_that_joined_under_its_ip_is_announced_again_as_lost(tmp_path: Path) -> None:
    """ATTACKS rule 2's "is not in the ring" (hvd_transient/frontend/lost_joins.py): discovery with
    ``--use-ip`` lists a VM under its internal IP (Horovod's HOROVOD_HOSTNAME, so the ring's hosts are IPs),
    while its standby publishes its ready record under its own name (``default_host()`` on a VM that
    Horovod has not started yet: ``socket.gethostname()``, the instance name). Discovery's JoinGate matches
    the two through the host's aliases; the look does not. A VM that joined normally (the driver told
    rank 0, the ring re-formed with it 6 s after its standby was ready) is taken for a lost join 10 s
    later: one spurious reset of a healthy ring per join."""
    store = LocalStore(str(tmp_path / "store"))
    now = 1_764_000_000.0
    instances = [{"name": f"w-{i}", "networkInterfaces": [{"networkIP": f"10.0.0.{i + 2}"}]} for i in range(3)]
    discovered = [gce_host(inst, slots=1, use_ip=True) for inst in instances]
    assert [h.name for h in discovered] == ["10.0.0.2", "10.0.0.3", "10.0.0.4"]  # what Horovod names the hosts
    publish_ready(store, "w-2", now=now)  # w-2's standby: its own name
    # discovery takes that record for the VM it lists as 10.0.0.4 (JoinGate matches every name of the host)
    assert [h.name for h in JoinGate(standby_since=0.0).admit(discovered, read_ready(store), now + 1)] == \
        ["10.0.0.2", "10.0.0.3", "10.0.0.4"]
    lost = Observed(clock=lambda: now + 6.0, look_after_s=0.01)
    state = horovod_state()
    updates = HorovodHostUpdates(state, lost)
    # the ring that took w-2 (the driver's message reached rank 0): every listed host is in it; each member
    # says every name its VM goes by (core/hostname.host_names: Horovod's, here the IP, and the machine's own)
    updates.ring_began([MemberSeen(frozenset({h.name, inst["name"]})) for h, inst in zip(discovered, instances)],
                       rank=0, store=store)
    assert lost.looked.wait(10.0)
    try:
        assert not updates.pending(), "a VM already in the ring was announced as a lost join"
        check_host_updates_and_sync(state.check_host_updates)  # nothing to reset for
    finally:
        updates.close()


# ------------------------------------------------------------------ rule 1: training through the window

def test_a_removal_lost_as_the_ring_reformed_keeps_a_near_deadline_vm_past_its_deadline() -> None:
    """ATTACKS rule 1's guarantee (docs/reliability.md "Training through the window": a VM under notice that
    trains through its window leaves before its deadline with nothing rolled back). The host check, even run
    at every step once the VM's leave_at has passed, only raises where rank 0 holds a driver message; the
    commit's own premise is that the driver's message is lost where it comes while the ring re-forms (the
    worker drops the messages it holds when it resets: State.on_reset). Here another host change resets the
    ring 1 s before h2's leave_at; the driver assigned the new ring with h2 (still listed), then discovery
    dropped h2 at its leave_at and the driver's one message about it came before on_reset. Nothing tells
    the new ring again: h2 trains on in it past its deadline, the VM is killed inside the ring (a failure
    reset, the steps since the last commit rolled back). Lost joins are announced from the ready records;
    a lost removal (a ring member whose leave_at has passed) is not."""
    t = {"wall": time.time()}
    t0 = t["wall"]
    clocks = Clocks(wall=lambda: t["wall"])
    group, impls, _ = make_ranks(leave="near_deadline", leave_lead_s=10.0, clocks=clocks)
    state = horovod_state()  # rank 0's Horovod state: the driver tells rank 0 only
    impls[0].host_updates = HorovodHostUpdates(state)
    deadline = t0 + 30.0
    impls[2].watcher.notice = notice(30.0, now=t0)
    outcomes = step_all(group, impls, 1)
    leave_at = outcomes[2].leave_at
    assert leave_at is not None and leave_at < deadline - 5.0
    step = 1
    while t["wall"] < leave_at - 1.0:  # train through the window: nothing to take
        step += 1
        t["wall"] += 0.5
        assert not any(o.check_hosts for o in step_all(group, impls, step))
    # another host changes (a join): the driver tells rank 0, the next round takes it, the ring resets
    state.on_hosts_updated(int(t["wall"]), HostUpdateResult.added)
    step += 1
    assert all(o.check_hosts for o in step_all(group, impls, step))
    with pytest.raises(HostsUpdatedInterrupt):
        check_host_updates_and_sync(state.check_host_updates)
    # during the reset: discovery drops h2 at its leave_at and the driver tells rank 0 once, then on_reset
    t["wall"] = leave_at + 0.5
    state.on_hosts_updated(int(t["wall"]), HostUpdateResult.removed)
    state.on_reset()
    group.run(lambda r: impls[r].begin(step))  # the new ring, h2 in it (leaving)
    left_at, checks = None, 0
    while t["wall"] < deadline and left_at is None:
        step += 1
        t["wall"] += 0.5
        if step_all(group, impls, step)[0].check_hosts:  # agreed: every rank runs the check here
            checks += 1
            try:
                check_host_updates_and_sync(state.check_host_updates)
            except HostsUpdatedInterrupt:
                left_at = t["wall"]
    for impl in impls:
        impl.close()
    assert checks > 0  # the departure is due: the ranks look at every step, and find nothing
    assert left_at is not None and left_at < deadline, \
        f"h2 was still in the ring at its deadline ({deadline - t0:.0f} s after the notice, {checks} host " \
        "checks since its leave_at): nothing told the ring"


# ------------------------------------------------------------------ attacks that held

def test_held_a_pending_update_on_a_non_zero_rank_at_a_notice_round_is_agreed() -> None:
    """ATTACKS rule 1's agreement: pending() true on rank 2 only (rank 0 holds nothing), at the very round
    where rank 1 gets a notice, then flipping between rounds; with a fixed and an adaptive cadence. Every rank
    must run the same collectives and the check at the same steps (held: the round's sum carries it)."""
    for every in (3, None):
        group, impls, _ = make_ranks(leave="near_deadline", leave_lead_s=10.0, check_every_steps=every)
        updates = [Counting() for _ in impls]
        for impl, u in zip(impls, updates):
            impl.host_updates = u
        for step in range(1, 30):
            updates[2].held = step in (3, 4, 11, 12)
            if step == 3:
                impls[1].watcher.notice = notice(30.0)
            outcomes = step_all(group, impls, step)
            assert len({o.check_hosts for o in outcomes}) == 1, f"every={every} step {step}: ranks disagree"
        assert group.calls[0] == group.calls[1] == group.calls[2]
        for impl in impls:
            impl.close()


def test_held_plain_steps_never_ask_for_host_updates() -> None:
    """ATTACKS rule 2's "per-step cost unchanged": pending() (which takes the look's findings and reads
    Horovod's queue) runs at the notice rounds only, never at a plain step (adaptive cadence)."""
    group, impls, _ = make_ranks(check_every_steps=None)
    counters = [Counting() for _ in impls]
    for impl, c in zip(impls, counters):
        impl.host_updates = c
    plain = 0
    for step in range(1, 200):
        plain += impls[0].plain_step(step)
        step_all(group, impls, step)
    assert plain > 0
    assert [c.calls for c in counters] == [impl._rounds.count for impl in impls]  # noqa: SLF001
    for impl in impls:
        impl.close()


def test_held_repeated_announces_and_resets_never_hide_the_drivers_next_message() -> None:
    """ATTACKS "an announce never hides a later real driver message": several announces in a row, one
    into the queue that on_reset replaced, one into a state whose last checked message is an announce;
    the driver's next message (whole seconds, the second after its last one) still raises."""
    state = horovod_state()
    updates = HorovodHostUpdates(state)
    driver_t = int(time.time())
    state.on_hosts_updated(driver_t, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt):
        state.check_host_updates()
    for _ in range(5):
        state.on_reset()
        updates.announce(["x"])
        assert updates.pending()
        with pytest.raises(HostsUpdatedInterrupt):
            check_host_updates_and_sync(state.check_host_updates)
    state.on_hosts_updated(driver_t + 1, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt):
        state.check_host_updates()


def test_held_a_look_of_an_old_ring_or_after_close_announces_nothing(tmp_path: Path) -> None:
    """ATTACKS the look's timer: a slow store makes the old ring's look finish after a new ring (same hosts)
    began, and after close(); neither may announce into the new ring."""
    store = LocalStore(str(tmp_path / "store"))
    publish_ready(store, "c", now=999.0)
    release = threading.Event()
    entered = threading.Event()

    class Slow(LocalStore):
        def list(self, prefix: str = "") -> Any:
            entered.set()
            release.wait(10.0)
            return super().list(prefix)

    slow = Slow(str(tmp_path / "store"))
    clock = [1000.0]
    lost = Observed(clock=lambda: clock[0], look_after_s=0.0)
    state = horovod_state()
    updates = HorovodHostUpdates(state, lost)
    updates.ring_began([MemberSeen(frozenset({h})) for h in "ab"], rank=0, store=slow)
    assert entered.wait(10.0)
    clock[0] = 1001.0
    lost._look_after_s = 3600.0  # noqa: SLF001  (the new ring looks much later)
    # same hosts, a new ring (its own look much later)
    updates.ring_began([MemberSeen(frozenset({h})) for h in "ab"], rank=0, store=store)
    updates.close()
    release.set()
    assert lost.looked.wait(10.0)
    assert not updates.pending()
