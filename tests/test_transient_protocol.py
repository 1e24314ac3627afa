"""The per-step protocol (notice agreement, election, emergency save, leave) with in-process ranks."""
from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from fake_collectives import FakeCollectives, FakeWatcher, ThreadGroup
from test_protocol_agreement import published

from ckpt_service.lease import Lease
from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import MemoryStore
from hvd_transient.core.config import TransientConfig
from hvd_transient.core.control import request_stop
from hvd_transient.core.election import decode_notice, elect_master, encode_notice, steps_until_next_check
from hvd_transient.core.interfaces import Clocks
from hvd_transient.core.lr_scaling import scaled_lr
from hvd_transient.core.membership import leaving_hosts, publish_leaving, read_leaving
from hvd_transient.core.transient import TransientImpl
from hvd_transient.watchers import Notice

HOSTS = ["h0", "h1", "h2"]
STATE = {"w": np.arange(3000, dtype=np.float32), "b": np.ones(7, dtype=np.float64)}


def notice(deadline_in: float = 30.0) -> Notice:
    now = time.time()
    return Notice("test", "vm", now, now + deadline_in, "preempted")


@pytest.fixture
def ranks():
    url = f"memory://{uuid.uuid4().hex}"
    group = ThreadGroup(3)
    config = TransientConfig(store=url, save_every_steps=None, leave_margin_s=1.0, check_every_steps=1)
    impls = [TransientImpl(config, FakeCollectives(group, r), host=HOSTS[r], watcher=FakeWatcher())
             for r in range(3)]
    for host, impl in zip(HOSTS, impls):
        impl.watcher.instance_id = f"id-{host}"
    group.run(lambda r: impls[r].begin(0))
    return group, impls, url


def test_the_master_prunes_expired_leaving_records_when_a_ring_begins(ranks) -> None:
    group, impls, _ = ranks
    store = impls[0].manager.store
    publish_leaving(store, "gone", deadline=time.time() - 120)   # its VM stopped long ago
    publish_leaving(store, "going", deadline=time.time() + 30)   # still in its notice window
    group.run(lambda r: impls[r].begin(5))
    # in the background: a ring's start does not wait on the store
    assert impls[0].pruning is not None and [i.pruning for i in impls[1:]] == [None, None]
    impls[0].pruning.result(timeout=10)
    assert {r.host for r in read_leaving(store)} == {"going"}
    pruned = [e for e in impls[0].events.events if e["event"] == "leaving_pruned"]
    assert [e["hosts"] for e in pruned] == [["gone"]]


def step_all(group, impls, step):
    return group.run(lambda r: impls[r].after_step(step, lambda: STATE, lambda: {"step": step}))


def test_notice_to_a_worker(ranks) -> None:
    group, impls, url = ranks
    assert [i.run.master for i in impls] == [0, 0, 0]
    assert step_all(group, impls, 1)[0].emergency_step is None
    impls[2].watcher.notice = notice()
    outcomes = step_all(group, impls, 2)
    assert {o.emergency_step for o in outcomes} == {2}
    assert all(o.committed for o in outcomes)
    assert [o.leaving for o in outcomes] == [False, False, True]
    assert all(o.departure_pending for o in outcomes)
    store = impls[0].manager.store
    published(impls)
    assert leaving_hosts(store) == {"h2"}
    [record] = read_leaving(store)  # the record names the VM incarnation that left
    assert (record.host, record.instance_id) == ("h2", "id-h2")
    assert record.deadline == pytest.approx(impls[2].watcher.notice.deadline)
    ckpt = CheckpointManager(url).restore()
    assert ckpt.step == 2 and ckpt.manifest.world_size == 3
    np.testing.assert_array_equal(ckpt.tensors["w"], STATE["w"])
    # the notice is acted on once: the next step is an ordinary one
    assert all(o.emergency_step is None for o in step_all(group, impls, 3))


def test_notice_to_the_master_moves_the_lease(ranks) -> None:
    group, impls, url = ranks
    assert impls[0].lease.held
    impls[0].watcher.notice = notice()
    outcomes = step_all(group, impls, 5)
    assert all(o.committed for o in outcomes)
    assert [i.run.master for i in impls] == [1, 1, 1]
    assert not impls[0].lease.held and impls[1].lease.held
    marker = CheckpointManager(url).commit_marker(5)
    assert marker.fence == impls[1].lease.generation
    leave = [e for e in impls[0].events.events if e["event"] == "leave_published"]
    assert len(leave) == 1 and leave[0]["was_master"] is True
    # after the ring shrinks (h0 gone), everyone agrees the master is the new rank 0 (was rank 1)


def test_zombie_master_cannot_commit_after_hand_over(ranks) -> None:
    group, impls, url = ranks
    zombie = Lease(impls[0].manager.store, impls[0].lease.holder)
    zombie.adopt(impls[0].lease)  # what the old master believed it held
    impls[0].watcher.notice = notice()
    step_all(group, impls, 5)
    from ckpt_service.errors import LeaseLostError

    with pytest.raises(LeaseLostError):
        CheckpointManager(url).save(6, STATE, lease=zombie)
    assert CheckpointManager(url).all_steps() == [5]


def test_every_rank_under_notice_still_commits(ranks) -> None:
    group, impls, url = ranks
    for impl in impls:
        impl.watcher.notice = notice()
    outcomes = step_all(group, impls, 9)
    assert all(o.committed and o.leaving for o in outcomes)
    published(impls)
    assert leaving_hosts(impls[0].manager.store) == set(HOSTS)
    assert CheckpointManager(url).latest_step() == 9


def test_a_missed_deadline_abandons_cleanly_on_every_rank(ranks) -> None:
    group, impls, url = ranks
    impls[1].watcher.notice = notice(deadline_in=0.5)  # less than the leave margin: already too late
    outcomes = step_all(group, impls, 4)
    assert [o.committed for o in outcomes] == [False, False, False]
    assert CheckpointManager(url).all_steps() == []
    published(impls)
    assert leaving_hosts(impls[0].manager.store) == {"h1"}  # it still leaves gracefully
    assert any(e["event"] == "save_failed" for e in impls[0].events.events)


def test_periodic_saves_are_agreed(ranks) -> None:
    group, impls, url = ranks
    for impl in impls:
        impl.config = TransientConfig(store=url, save_every_steps=2, check_every_steps=1)
    step_all(group, impls, 2)
    for impl in impls:
        impl.manager.wait(timeout=30)
    assert CheckpointManager(url).all_steps() == [2]


def test_saves_take_the_share_from_a_share_snapshot(ranks) -> None:
    """Periodic and emergency saves pass the share snapshot through; the tensors then only give specs."""
    from ckpt_service.manager import prepare_share
    from ckpt_service.plan import spec_of

    group, impls, url = ranks
    for impl in impls:
        impl.config = TransientConfig(store=url, save_every_steps=2, check_every_steps=1)
    specs = {name: spec_of(name, arr) for name, arr in STATE.items()}
    calls: list[tuple[int, int]] = []

    def share(plan, rank):
        calls.append((plan.world_size, rank))
        return [flat for _, flat in prepare_share(plan, rank, STATE)]

    def step_with_share(step):
        return group.run(lambda r: impls[r].after_step(step, lambda: specs, lambda: {"step": step}, share))

    step_with_share(2)  # periodic
    for impl in impls:
        impl.manager.wait(timeout=30)
    impls[2].watcher.notice = notice()
    assert all(o.committed for o in step_with_share(3))  # emergency
    assert sorted(calls) == [(3, 0), (3, 0), (3, 1), (3, 1), (3, 2), (3, 2)]
    for step in (2, 3):
        ckpt = CheckpointManager(url).restore(step=step)
        np.testing.assert_array_equal(ckpt.tensors["w"], STATE["w"])
        np.testing.assert_array_equal(ckpt.tensors["b"], STATE["b"])


def test_stop_request_is_agreed_at_one_step(ranks) -> None:
    group, impls, url = ranks
    request_stop(impls[0].manager.store)
    outcomes = step_all(group, impls, 1)  # the master's first round starts its background look
    assert impls[0].stop_poller.polled.wait(10)
    if not outcomes[0].stop:
        outcomes = step_all(group, impls, 2)
    assert [o.stop for o in outcomes] == [True, True, True]


def test_begin_after_a_leave_excludes_the_leaver() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    group3 = ThreadGroup(3)
    config = TransientConfig(store=url, save_every_steps=None)
    impls = [TransientImpl(config, FakeCollectives(group3, r), host=HOSTS[r], watcher=FakeWatcher())
             for r in range(3)]
    group3.run(lambda r: impls[r].begin(0))
    impls[0].watcher.notice = notice()
    step_all(group3, impls, 3)
    # the ring re-forms without h0: the survivors are ranks 0 and 1 of a group of 2
    group2 = ThreadGroup(2)
    survivors = impls[1:]
    for rank, impl in enumerate(survivors):
        impl.comm = FakeCollectives(group2, rank)
    group2.run(lambda r: survivors[r].begin(4))
    assert [s.run.master for s in survivors] == [0, 0]
    assert not any(s.run.departure_pending for s in survivors)
    assert survivors[0].lease.held  # h1 was elected at the notice and keeps the lease


def test_notice_vector_round_trip() -> None:
    size = 4
    summed = sum(encode_notice(r, size, 100.0 + r if r in (1, 3) else None, stop=(r == 0), busy=(r == 2))
                 for r in range(size))
    round_ = decode_notice(summed, size)
    assert round_.leaving == (1, 3) and round_.deadline == 101.0 and round_.stop and round_.busy
    quiet = decode_notice(sum(encode_notice(r, size, None) for r in range(size)), size)
    assert not quiet.any and quiet.deadline is None and not quiet.stop and not quiet.busy


def test_a_notice_to_one_rank_of_a_vm_takes_all_its_ranks() -> None:
    """Ranks on one VM leave together, with the earliest deadline given (one watcher may speak for them)."""
    hosts = ["vm0", "vm0", "vm1", "vm2", "vm2"]
    summed = sum(encode_notice(r, 5, {1: 100.0, 3: 90.0}.get(r)) for r in range(5))
    round_ = decode_notice(summed, 5, hosts)
    assert round_.leaving == (0, 1, 3, 4) and round_.deadline == 90.0
    assert decode_notice(summed, 5).leaving == (1, 3)  # without hosts: only the ranks that were told
    assert decode_notice(sum(encode_notice(r, 5, None) for r in range(5)), 5, hosts).leaving == ()


@pytest.mark.parametrize("size,leaving,master", [(3, [], 0), (3, [0], 1), (3, [0, 1], 2), (3, [0, 1, 2], 0)])
def test_elect_master(size, leaving, master) -> None:
    assert elect_master(size, leaving) == master


def test_lr_scaling() -> None:
    assert scaled_lr(0.1, 4, "linear") == pytest.approx(0.4)
    assert scaled_lr(0.1, 4, "sqrt") == pytest.approx(0.2)
    assert scaled_lr(0.1, 4, "none") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="unknown"):
        scaled_lr(0.1, 2, "cubic")
    with pytest.raises(ValueError):
        scaled_lr(0.1, 0)


def test_memory_store_is_isolated_per_url() -> None:
    assert MemoryStore.named("a") is MemoryStore.named("a") and MemoryStore.named("a") is not MemoryStore.named("b")


# ------------------------------------------------------------------ adaptive notice cadence

@pytest.mark.parametrize("timed,expected", [({}, None), ({2: 0.0}, 0.0), ({0: 1.25, 2: 3.5}, 3.5)])
def test_notice_vector_carries_the_slowest_departure_any_rank_timed(timed: dict[int, float],
                                                                      expected: float | None) -> None:
    """A rank that timed none says nothing; one that timed a 0 s departure still counts."""
    summed = sum(encode_notice(r, 3, None, departure_s=timed.get(r)) for r in range(3))
    assert decode_notice(summed, 3).departure_s == (None if expected is None else pytest.approx(expected, abs=1e-6))


def test_notice_vector_carries_the_mean_elapsed_time_exactly() -> None:
    size = 3
    summed = sum(encode_notice(r, size, None, elapsed_s=0.1 * (r + 1)) for r in range(size))
    assert decode_notice(summed, size).elapsed_s == pytest.approx(0.2, abs=1e-6)


@pytest.mark.parametrize("elapsed,steps,interval,cap,expected", [
    (1.0, 10, 1.0, 1000, 10),    # 0.1 s steps: a check every 10 steps is one per second
    (4.0, 2, 1.0, 1000, 1),      # steps slower than the interval: every step
    (0.01, 100, 1.0, 1000, 1000),  # very fast steps: capped
    (0.5, 0, 1.0, 1000, 1),      # nothing measured yet
    (0.0, 5, 1.0, 1000, 1),
])
def test_steps_until_next_check(elapsed, steps, interval, cap, expected) -> None:
    assert steps_until_next_check(elapsed, steps, interval, cap) == expected


def test_adaptive_cadence_is_agreed_and_still_catches_a_notice() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    group = ThreadGroup(3)
    now = {"t": 0.0}
    config = TransientConfig(store=url, save_every_steps=None, leave_margin_s=1.0, check_interval_s=1.0)
    assert config.check_every_steps is None  # adaptive is the default
    # rank 2's clock runs 50% fast: the ranks still pick one cadence from the summed vector
    clocks = [lambda: now["t"], lambda: now["t"], lambda: now["t"] * 1.5]
    impls = [TransientImpl(config, FakeCollectives(group, r), host=HOSTS[r], watcher=FakeWatcher(),
                           clocks=Clocks(monotonic=clocks[r])) for r in range(3)]
    group.run(lambda r: impls[r].begin(0))
    checked_at = []
    for step in range(1, 31):
        now["t"] = step * 0.1  # 0.1 s per step
        before = impls[0].notice_rounds
        step_all(group, impls, step)
        if impls[0].notice_rounds > before:
            checked_at.append(step)
        assert len({i.run.next_check_step for i in impls}) == 1
        assert len({i.notice_rounds for i in impls}) == 1
    # first step of the ring, then every ~1 s of steps at the slowest rank's step (0.15 s -> 6 steps)
    assert checked_at[0] == 1 and len(checked_at) < 8
    assert all(b - a == 6 for a, b in zip(checked_at[1:], checked_at[2:]))
    impls[1].watcher.notice = notice()
    emergency = None
    for step in range(31, 60):
        now["t"] = step * 0.1
        outcomes = step_all(group, impls, step)
        if outcomes[0].emergency_step is not None:
            emergency = step
            break
    assert emergency is not None and emergency - 31 < 9, "the notice waits at most one check interval"
    assert all(o.committed for o in outcomes)


def test_an_early_warning_checkpoints_once_and_nobody_leaves(ranks) -> None:
    """AWS rebalance recommendation on one VM: every rank saves at the next round (kind early),
    training goes on on the whole ring, and the warning is answered once."""
    group, impls, url = ranks
    step_all(group, impls, 1)
    impls[1].watcher.warning = Notice("aws", "vm", time.time(), time.time() + 120, "rebalance-recommendation",
                                      early=True)
    outcomes = step_all(group, impls, 2)
    assert not any(o.leaving or o.departure_pending or o.emergency_step for o in outcomes)
    for impl in impls:
        impl.manager.wait(timeout=30)
    assert CheckpointManager(url).all_steps() == [2]
    for step in range(3, 6):  # answered: no further saves (periodic saves are off here)
        outcomes = step_all(group, impls, step)
        assert not any(o.leaving for o in outcomes)
    for impl in impls:
        impl.manager.wait(timeout=30)
    assert CheckpointManager(url).all_steps() == [2]
    warned = [e for e in impls[1].events.events if e["event"] == "early_warning"]
    assert [(e["source"], e["reason"]) for e in warned] == [("aws", "rebalance-recommendation")]
    assert not any(e["event"] == "early_warning" for e in impls[0].events.events)
    commits = [e for e in impls[0].events.events if e["event"] == "commit"]
    assert [(e["step"], e["kind"]) for e in commits] == [(2, "early")]


def test_a_host_that_left_and_came_back_is_a_member_again(ranks) -> None:
    """The survivors remember the host left; its VM restarted under the same name runs a new
    process that is not leaving. Every rank must take that same view, or they would disagree on
    the master and on which steps run a collective (a hang)."""
    group, impls, _ = ranks
    impls[2].watcher.notice = notice()
    outcomes = step_all(group, impls, 1)
    assert outcomes[2].leaving and impls[0].run.handled_leavers == {HOSTS[2]}
    ring_group = ThreadGroup(3)
    back = TransientImpl(impls[0].config, FakeCollectives(ring_group, 2), host=HOSTS[2], watcher=FakeWatcher())
    ring = [impls[0], impls[1], back]
    for r, impl in enumerate(ring[:2]):
        impl.comm = FakeCollectives(ring_group, r)
    ring_group.run(lambda r: ring[r].begin(10))
    assert [i.run.departure_pending for i in ring] == [False, False, False]
    assert [i.run.master for i in ring] == [0, 0, 0] and impls[0].run.handled_leavers == set()
    outcomes = step_all(ring_group, ring, 11)  # a notice round on every rank, together
    assert not any(o.leaving or o.departure_pending for o in outcomes)


def test_bad_cadence_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="check_every_steps"):
        TransientConfig(store="memory://x", check_every_steps=0)
    with pytest.raises(ValueError, match="check_interval_s"):
        TransientConfig(store="memory://x", check_interval_s=0.0)
