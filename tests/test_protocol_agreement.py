"""The notice protocol agrees on every outcome: failures on one rank, slow stores, busy ranks,
leaving records, early warnings and the time bound of the check cadence, with in-process ranks.

The fake group fails any test whose ranks call different collectives (or one rank none) at
the same point, so each test here also checks that every rank ran the same collectives.
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Iterable, Iterator

import numpy as np
import pytest
from fake_collectives import Call, CollectiveMismatch, CollectiveTimeout, FakeCollectives, FakeWatcher, ThreadGroup

from ckpt_service import layout
from ckpt_service.errors import StoreUnavailableError
from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import MemoryStore
from ckpt_service.stores.base import ObjectStore
from ckpt_service.testing.delegating import DelegatingStore
from hvd_transient import store_keys as keys
from hvd_transient.core.config import TransientConfig
from hvd_transient.core.control import request_stop
from hvd_transient.core.election import decode_notice, encode_notice, steps_until_next_check
from hvd_transient.core.interfaces import Clocks
from hvd_transient.core.membership import read_leaving
from hvd_transient.core.transient import TransientImpl
from hvd_transient.watchers import Notice

pytestmark = pytest.mark.timed  # bounds wall-clock times

HOSTS = ["h0", "h1", "h2"]
STATE = {"w": np.arange(3000, dtype=np.float32), "b": np.ones(7, dtype=np.float64)}


class PausingStore(DelegatingStore):
    """Puts of a step's files wait until ``resume`` is set (a rank whose background save is stuck)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.resume = threading.Event()
        self.paused = threading.Event()  # set once a put is held

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if key.startswith(layout.STEPS_PREFIX):
            self.paused.set()
            self.resume.wait(30)
        return super().put(key, data, if_generation_match=if_generation_match)


class SlowStore(DelegatingStore):
    """Every put and get takes ``delay_s`` longer (a store under load)."""

    def __init__(self, inner: ObjectStore, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        time.sleep(self.delay_s)  # the fault injected, not synchronisation
        return super().put(key, data, if_generation_match=if_generation_match)

    def get(self, key: str) -> bytes:
        time.sleep(self.delay_s)
        return super().get(key)


class BlindStore(DelegatingStore):
    """Sees no stop request (a rank that is not the master never looks)."""

    def exists(self, key: str) -> bool:
        return False if key == keys.STOP_KEY else self.inner.exists(key)

    def stat(self, key: str) -> Any:
        return None if key == keys.STOP_KEY else super().stat(key)


class FailingListStore(DelegatingStore):
    """The next ``failures`` listings fail (a store that is briefly unreachable)."""

    def __init__(self, inner: ObjectStore, failures: int = 1) -> None:
        super().__init__(inner)
        self.failures = failures

    def list(self, prefix: str = "") -> Iterator[str]:
        if self.failures > 0:
            self.failures -= 1
            raise StoreUnavailableError("the store did not answer (injected)")
        return super().list(prefix)


class CountingStore(DelegatingStore):
    """Counts the puts of each key."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.puts: dict[str, int] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        with self._lock:
            self.puts[key] = self.puts.get(key, 0) + 1
        return super().put(key, data, if_generation_match=if_generation_match)


def notice(deadline_in: float = 30.0, *, now: float | None = None) -> Notice:
    now = time.time() if now is None else now
    return Notice("test", "vm", now, now + deadline_in, "preempted")


def make_ranks(*, stores: list[ObjectStore] | None = None, size: int = 3, timeout_s: float = 10.0,
               clocks: Clocks | None = None, timed_job: bool = True,
               **config: Any) -> tuple[ThreadGroup, list[TransientImpl], str]:
    """Ranks of a ring begun at step 0. ``timed_job``: of a job whose ranks timed steps on earlier rings, so a
    notice at this ring's first step plans its leave as at any other; else a fresh job, whose VM under notice
    leaves at once where no step was timed yet (``plan_for_round``)."""
    url = stores[0].url if stores is not None else f"memory://{uuid.uuid4().hex}"
    group = ThreadGroup(size, timeout_s=timeout_s)
    settings: dict[str, Any] = {"save_every_steps": None, "leave_margin_s": 1.0, "check_every_steps": 1}
    settings.update(config)
    cfg = TransientConfig(store=url, **settings)
    impls = []
    for r in range(size):
        manager = CheckpointManager(stores[r]) if stores is not None else None
        impls.append(TransientImpl(cfg, FakeCollectives(group, r), host=HOSTS[r], watcher=FakeWatcher(),
                                   manager=manager, **({"clocks": clocks} if clocks else {})))
    group.run(lambda r: impls[r].begin(0))
    for impl in impls:
        impl.run.job_slowest_step_s = 0.0 if timed_job else None
    return group, impls, url


def step_all(group: ThreadGroup, impls: list[TransientImpl], step: int, snapshot: Any = None,
             share: Any = None) -> list[Any]:
    def one(r: int) -> Any:
        snap = snapshot(r) if snapshot is not None else (lambda: STATE)
        return impls[r].after_step(step, snap, lambda: {"step": step}, share(r) if share else None)
    return group.run(one)


def events(impl: TransientImpl, name: str) -> list[dict[str, Any]]:
    return [e for e in impl.events.events if e["event"] == name]


def published(impls: Iterable[TransientImpl], timeout_s: float = 30.0) -> None:
    """Wait until every leaving record these ranks write in the background has landed (or given up)."""
    for impl in impls:
        if impl.publishing is not None:
            impl.publishing.result(timeout=timeout_s)


def wait_all(impls: list[TransientImpl]) -> None:
    for impl in impls:
        try:
            impl.manager.wait(timeout=30)
        except Exception:  # noqa: BLE001 - the test looks at the outcome through the store
            pass


# ------------------------------------------------------------------ the fake group itself

def test_the_fake_group_names_both_ranks_calls_when_they_disagree() -> None:
    group = ThreadGroup(2, timeout_s=5)
    comms = [FakeCollectives(group, r) for r in range(2)]

    def call(r: int) -> Any:
        if r == 0:
            return comms[0].allreduce_sum(np.ones(2))
        return comms[1].broadcast_json("x", 1, name="save-outcome")

    with pytest.raises(CollectiveMismatch, match=r"rank 0 called allreduce_sum\('notice'\), "
                                                 r"rank 1 called broadcast_json\('save-outcome', root=1\)"):
        group.run(call)


def test_the_fake_group_fails_fast_when_a_rank_never_arrives() -> None:
    group = ThreadGroup(2, timeout_s=0.5)
    comms = [FakeCollectives(group, r) for r in range(2)]
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"ranks \[1\] did not reach the collective .*rank 0 in "):
        group.run(lambda r: comms[r].allgather_json(r) if r == 0 else None)
    assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------ one rank failing before a collective

@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_snapshot_failing_on_one_rank_fails_the_emergency_save_on_every_rank(failing: int) -> None:
    """Rank 2 is under notice; ``failing`` cannot take its snapshot (master, writer, leaver)."""
    group, impls, url = make_ranks()
    impls[2].watcher.notice = notice()

    def snapshot(r: int) -> Any:
        def take() -> Any:
            if r == failing:
                raise MemoryError("host memory exhausted")
            return STATE
        return take

    outcomes = step_all(group, impls, 3, snapshot)
    assert [o.emergency_step for o in outcomes] == [3, 3, 3]
    assert [o.committed for o in outcomes] == [False, False, False]
    assert [o.leaving for o in outcomes] == [False, False, True]
    for impl in impls:
        [failed] = events(impl, "save_failed")
        assert f"rank {failing} could not take its snapshot of step 3" in failed["error"]
        assert not events(impl, "commit")
    assert CheckpointManager(url).all_steps() == []
    published(impls)
    assert {r.host for r in read_leaving(impls[0].manager.store)} == {"h2"}  # it still leaves
    assert group.calls[0] == group.calls[1] == group.calls[2]
    assert [c.name for c in group.calls[0][-3:]] == ["notice", "gather", "save-outcome"]
    step_all(group, impls, 4)  # the ring goes on together


def test_bad_metadata_on_one_rank_fails_the_emergency_save_on_every_rank() -> None:
    group, impls, url = make_ranks()
    impls[1].watcher.notice = notice()

    def one(r: int) -> Any:
        meta = {"step": 5, "opaque": object()} if r == 2 else {"step": 5}  # not JSON: refused
        return impls[r].after_step(5, lambda: STATE, lambda: meta)

    outcomes = group.run(one)
    assert [o.committed for o in outcomes] == [False, False, False]
    assert CheckpointManager(url).all_steps() == []


def test_a_share_failing_on_one_rank_fails_the_periodic_save_without_raising() -> None:
    group, impls, url = make_ranks(save_every_steps=2)

    def share(r: int) -> Any:
        def take(plan: Any, rank: int) -> Any:
            raise OSError("device lost") if r == 1 else None
        return take if r == 1 else None

    step_all(group, impls, 2, share=share)  # no rank raises, so no rank waits on another
    wait_all(impls)
    assert CheckpointManager(url).all_steps() == []
    assert any("device lost" in e["error"] for e in events(impls[1], "save_failed"))
    step_all(group, impls, 4)
    wait_all(impls)
    assert CheckpointManager(url).all_steps() == [4]


def test_a_failing_latest_step_on_the_master_is_shared_with_every_rank() -> None:
    """The final save's question goes to the master's store; its failure is broadcast, and every
    rank saves (an already committed step would be reported as skipped)."""
    memory = MemoryStore.named(uuid.uuid4().hex)
    flaky = FailingListStore(memory, failures=0)
    group, impls, url = make_ranks(stores=[flaky, memory, memory])
    assert group.run(lambda r: impls[r].final_save_needed(0)) == [True, True, True]  # nothing committed yet
    group.run(lambda r: impls[r].save_now(7, STATE, {"step": 7}, coordinator=0, deadline=None, kind="final"))
    assert group.run(lambda r: impls[r].final_save_needed(7)) == [False, False, False]
    flaky.failures = 1
    assert group.run(lambda r: impls[r].final_save_needed(7)) == [True, True, True]
    assert group.calls[1][-1] == Call("broadcast_json", "final-save", 0)
    # every rank saves, and learns that the step was already there
    committed = group.run(lambda r: impls[r].save_now(7, STATE, {"step": 7}, coordinator=0, deadline=None,
                                                       kind="final"))
    assert committed == [True, True, True]
    assert [e["reason"] for e in events(impls[0], "save_skipped")] == ["already committed"]
    assert [e["step"] for e in events(impls[0], "commit")] == [7]  # one commit, not a second one


# ------------------------------------------------------------------ busy ranks, stop, slow store

def test_one_rank_still_busy_makes_every_rank_skip_the_save() -> None:
    memory = MemoryStore.named(uuid.uuid4().hex)
    stuck = PausingStore(memory)
    group, impls, url = make_ranks(stores=[memory, stuck, memory], save_every_steps=2)
    step_all(group, impls, 2)
    assert stuck.paused.wait(10)
    try:
        step_all(group, impls, 4)  # rank 1's background save is still writing
        for impl in impls:
            assert [(e["step"], e["reason"]) for e in events(impl, "save_skipped")] == [
                (4, "previous save still in flight")]
            assert [e["step"] for e in events(impl, "async_save")] == [2]
    finally:
        stuck.resume.set()
    wait_all(impls)
    step_all(group, impls, 6)
    wait_all(impls)
    assert CheckpointManager(url).all_steps() == [2, 6]


def test_a_stop_request_only_the_master_sees_stops_every_rank() -> None:
    memory = MemoryStore.named(uuid.uuid4().hex)
    now = {"t": 0.0}
    group, impls, _ = make_ranks(stores=[memory, BlindStore(memory), BlindStore(memory)],
                                 clocks=Clocks(monotonic=lambda: now["t"]))
    poller = impls[0].stop_poller
    poller.interval_s = 0.02
    assert not any(o.stop for o in step_all(group, impls, 1))  # the master's first round starts its poller
    request_stop(memory)
    for _ in range(100):  # the master's background look finds it (the blind ranks never can)
        poller.polled.clear()
        if poller.requested:
            break
        assert poller.polled.wait(10)
    now["t"] += 1.0
    outcomes = step_all(group, impls, 2)
    assert [o.stop for o in outcomes] == [True, True, True]
    for impl in impls:
        assert [e["step"] for e in events(impl, "stop_requested")] == [2]


def test_a_slow_store_during_a_notice_still_commits_on_every_rank() -> None:
    memory = MemoryStore.named(uuid.uuid4().hex)
    slow = SlowStore(memory, delay_s=0.05)
    group, impls, url = make_ranks(stores=[memory, slow, memory])
    impls[1].watcher.notice = notice()
    outcomes = step_all(group, impls, 3)
    assert [o.committed for o in outcomes] == [True, True, True]
    assert CheckpointManager(url).all_steps() == [3]
    published(impls)
    assert [r.host for r in read_leaving(memory)] == ["h1"]
    assert group.calls[0] == group.calls[1] == group.calls[2]


def test_a_store_too_slow_for_the_deadline_abandons_on_every_rank() -> None:
    memory = MemoryStore.named(uuid.uuid4().hex)
    slow = SlowStore(memory, delay_s=0.5)
    group, impls, url = make_ranks(stores=[slow, memory, memory])
    impls[2].watcher.notice = notice(deadline_in=2.5)  # 1.5 s for the save after the leave margin
    outcomes = step_all(group, impls, 3)
    assert [o.committed for o in outcomes] == [False, False, False]
    assert CheckpointManager(url).all_steps() == []
    assert all(events(impl, "save_failed") for impl in impls)


# ------------------------------------------------------------------ leaving records

def test_each_leaving_record_carries_its_own_deadline_and_is_written_once() -> None:
    """h2 gets a 30 s notice; 2 s later, before the ring re-forms, h1 gets a 150 s one (AWS)."""
    counting = CountingStore(MemoryStore.named(uuid.uuid4().hex))
    group, impls, _ = make_ranks(stores=[counting] * 3)
    t0 = time.time()
    impls[2].watcher.notice = notice(30.0, now=t0)
    assert step_all(group, impls, 1)[2].leaving
    impls[1].watcher.notice = notice(150.0, now=t0 + 2)
    outcomes = step_all(group, impls, 2)
    assert [o.emergency_step for o in outcomes] == [2, 2, 2]
    published(impls)
    records = {r.host: r.deadline for r in read_leaving(counting)}
    assert records == {"h2": pytest.approx(t0 + 30), "h1": pytest.approx(t0 + 152)}
    assert counting.puts[keys.leaving_key("h2")] == 1 and counting.puts[keys.leaving_key("h1")] == 1
    # the second save still had to end before h2, one of its writers, is gone
    agreed = events(impls[0], "notice_agreed")
    assert [e["leaving"] for e in agreed] == [["h2"], ["h1"]]
    assert agreed[1]["deadline"] == pytest.approx(t0 + 30 - 1.0)
    assert events(impls[1], "leave_published")[0]["deadline"] == pytest.approx(t0 + 152)


def test_a_later_shorter_notice_does_not_rewrite_an_earlier_record() -> None:
    counting = CountingStore(MemoryStore.named(uuid.uuid4().hex))
    group, impls, _ = make_ranks(stores=[counting] * 3)
    t0 = time.time()
    impls[1].watcher.notice = notice(150.0, now=t0)
    step_all(group, impls, 1)
    impls[2].watcher.notice = notice(30.0, now=t0 + 2)
    step_all(group, impls, 2)
    published(impls)
    records = {r.host: r.deadline for r in read_leaving(counting)}
    assert records == {"h1": pytest.approx(t0 + 150), "h2": pytest.approx(t0 + 32)}
    assert counting.puts[keys.leaving_key("h1")] == 1


def test_ranks_of_one_vm_publish_one_record_with_that_vms_deadline() -> None:
    summed = sum(encode_notice(r, 4, {1: 100.0, 3: 90.0, 0: 120.0}.get(r)) for r in range(4))
    round_ = decode_notice(summed, 4, ["vm0", "vm0", "vm1", "vm2"])
    assert round_.leaving == (0, 1, 3) and round_.deadline == 90.0
    assert [round_.deadline_of(r) for r in range(4)] == [100.0, 100.0, None, 90.0]


# ------------------------------------------------------------------ early warnings

def warning() -> Notice:
    return Notice("aws", "vm", time.time(), time.time() + 120, "rebalance-recommendation", early=True)


def test_a_warning_and_a_notice_in_one_round_take_only_the_emergency_save() -> None:
    group, impls, url = make_ranks()
    impls[1].watcher.warning = warning()
    impls[2].watcher.notice = notice()
    assert all(o.committed for o in step_all(group, impls, 1))
    for step in range(2, 5):  # the leaving rank is no writer of an early save
        step_all(group, impls, step)
    wait_all(impls)
    assert CheckpointManager(url).all_steps() == [1]
    assert [(e["step"], e["kind"]) for e in events(impls[0], "commit")] == [(1, "emergency")]
    # the ring re-forms without h2: the emergency checkpoint answered h1's warning, no early save
    group2 = ThreadGroup(2, timeout_s=10)
    survivors = impls[:2]
    for rank, impl in enumerate(survivors):
        impl.comm = FakeCollectives(group2, rank)
    group2.run(lambda r: survivors[r].begin(5))
    for step in range(6, 9):
        step_all(group2, survivors, step)
    wait_all(survivors)
    assert CheckpointManager(url).all_steps() == [1]


def test_a_failed_early_save_is_retried_at_a_later_round() -> None:
    group, impls, url = make_ranks()
    impls[1].watcher.warning = warning()
    fail = {"armed": True}

    def share(r: int) -> Any:
        def take(plan: Any, rank: int) -> Any:
            if fail["armed"]:
                fail["armed"] = False
                raise OSError("device busy")
            from ckpt_service.manager import prepare_share
            return [flat for _, flat in prepare_share(plan, rank, STATE)]
        return take if r == 2 else None

    step_all(group, impls, 1, share=share)  # the early save starts, and fails on rank 2
    wait_all(impls)
    assert CheckpointManager(url).all_steps() == []
    for step in range(2, 6):
        step_all(group, impls, step, share=share)
        wait_all(impls)
    # round 2 shows that step 1 did not commit (no rank busy, the master knows no commit): the
    # warning is pending again, and round 3 takes the checkpoint again; then it is answered
    assert CheckpointManager(url).all_steps() == [3]
    assert [(e["step"], e["kind"]) for e in events(impls[0], "commit")] == [(3, "early")]  # then answered


# ------------------------------------------------------------------ the check cadence's time bound

def run_clocked(group: ThreadGroup, impls: list[TransientImpl], now: dict[str, float], step: int,
                step_s: float) -> Any:
    now["t"] += step_s
    return step_all(group, impls, step)


def test_a_notice_after_steps_slow_down_is_handled_within_seconds() -> None:
    """Steps of 10 ms, then of 1 s starting just before a round; a 30 s notice right after it."""
    now = {"t": 0.0}
    group, impls, _ = make_ranks(check_every_steps=None, check_interval_s=1.0,
                                 clocks=Clocks(monotonic=lambda: now["t"]))
    step = 0
    while step < 300 or impls[0].run.next_check_step - step != 2:
        step += 1
        run_clocked(group, impls, now, step, 0.01)
    assert impls[0].run.next_check_step - step == 2  # a round of 10 ms steps is two steps away
    for _ in range(2):  # the slowdown starts: two 1 s steps, the second one with the round
        step += 1
        run_clocked(group, impls, now, step, 1.0)
    impls[1].watcher.notice = notice()
    noticed_at = now["t"]
    while True:
        step += 1
        outcomes = run_clocked(group, impls, now, step, 1.0)
        if outcomes[0].emergency_step is not None:
            break
        assert now["t"] - noticed_at < 30, "the notice was not handled in its window"
    assert now["t"] - noticed_at <= 2.0
    assert all(o.committed for o in outcomes)


def test_a_ring_that_was_slow_before_checks_within_the_allowance_when_it_slows_again() -> None:
    now = {"t": 0.0}
    group, impls, _ = make_ranks(check_every_steps=None, check_interval_s=1.0, check_slowdown_allowance=4.0,
                                 clocks=Clocks(monotonic=lambda: now["t"]))
    step = 0
    for _ in range(3):  # a slow phase: 1 s steps
        step += 1
        run_clocked(group, impls, now, step, 1.0)
    for _ in range(400):  # fast again: rounds grow apart, but no further than 4 s of 1 s steps
        step += 1
        run_clocked(group, impls, now, step, 0.01)
        assert impls[0].run.next_check_step - impls[0].run.last_round_step <= 4
    while impls[0].run.next_check_step != step + 1:
        step += 1
        run_clocked(group, impls, now, step, 0.01)
    step += 1
    run_clocked(group, impls, now, step, 0.01)  # a round, right before the slowdown
    impls[2].watcher.notice = notice()
    noticed_at = now["t"]
    while True:
        step += 1
        if run_clocked(group, impls, now, step, 1.0)[0].emergency_step is not None:
            break
    assert now["t"] - noticed_at <= 4.0


@pytest.mark.parametrize("slowest,ring,expected", [
    (0.0, 0.0, 100),   # only the mean rate: 10 ms steps
    (1.0, 1.0, 1),     # one slow step in the interval: every step
    (0.02, 0.5, 20),   # the ring was slow once: at most 10 intervals at that speed
])
def test_steps_until_next_check_takes_the_slowest_step(slowest: float, ring: float, expected: int) -> None:
    assert steps_until_next_check(1.0, 100, 1.0, 1000, slowest_step_s=slowest, ring_slowest_step_s=ring) == expected


def test_a_slowdown_allowance_below_one_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="check_slowdown_allowance must be at least 1"):
        TransientConfig(store="memory://x", check_slowdown_allowance=0.5)


def test_the_first_step_of_a_ring_does_not_count_as_slow() -> None:
    """The first step after begin also pays for the ring's set-up (state sync, tracing)."""
    now = {"t": 0.0}
    group, impls, _ = make_ranks(check_every_steps=None, check_interval_s=1.0,
                                 clocks=Clocks(monotonic=lambda: now["t"]))
    run_clocked(group, impls, now, 1, 5.0)
    for step in range(2, 30):
        run_clocked(group, impls, now, step, 0.01)
    assert impls[0].run.ring_slowest_step_s == pytest.approx(0.01)


# ------------------------------------------------------------------ lifetime

def test_close_closes_the_manager_it_made_only() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    config = TransientConfig(store=url, save_every_steps=None)
    own = TransientImpl(config, FakeCollectives(ThreadGroup(1), 0), host="h0", watcher=FakeWatcher())
    given = CheckpointManager(url)
    lent = TransientImpl(config, FakeCollectives(ThreadGroup(1), 0), host="h0", watcher=FakeWatcher(),
                         manager=given)
    own.close()
    own.close()  # twice is harmless
    lent.close()
    with pytest.raises(RuntimeError):
        own.manager.save(1, STATE)
    given.save(1, STATE)
    assert CheckpointManager(url).all_steps() == [1]


class LeaseBreakingStore(DelegatingStore):
    """Refuses any write of the checkpoint-master lease with an error that is no CheckpointError."""

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if key == layout.LEASE_KEY:
            raise OSError("disk full (injected)")
        return super().put(key, data, if_generation_match=if_generation_match)


def test_a_lease_hand_over_failing_on_the_new_master_fails_the_save_on_every_rank() -> None:
    memory = MemoryStore.named(uuid.uuid4().hex)
    group, impls, url = make_ranks(stores=[memory, LeaseBreakingStore(memory), memory])
    impls[0].watcher.notice = notice()  # rank 1 becomes the master, and cannot take the lease
    outcomes = step_all(group, impls, 3)
    assert [o.committed for o in outcomes] == [False, False, False]
    assert CheckpointManager(url).all_steps() == []
    assert [e["error"] for e in events(impls[1], "lease_error")] == ["disk full (injected)"]
    step_all(group, impls, 4)  # the ring goes on together
