"""An emergency save never waits behind a background save; the lease survives a fence whose reply
comes after a release; a new ring abandons the save its predecessor left in flight.

Faults come from store wrappers that hold a request until the test lets it go (or slow every
request down), on the real manager, lease and protocol with in-process ranks.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest
from ckpt_helpers import PutSeenStore
from fake_collectives import FakeCollectives, ThreadGroup
from test_protocol_agreement import STATE, events, make_ranks, notice, step_all

from ckpt_service import layout
from ckpt_service.cancel import CancelToken
from ckpt_service.deadline import Deadline
from ckpt_service.errors import (
    CheckpointError,
    LeaseLostError,
    SaveAbandonedError,
    SaveCancelledError,
    StoreDeadlineError,
)
from ckpt_service.lease import Lease
from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import MemoryStore
from ckpt_service.stores.base import ObjectStore
from ckpt_service.testing.delegating import DelegatingStore

pytestmark = pytest.mark.timed  # bounds wall-clock times

BIG = {"w": np.arange(64 * 1024, dtype=np.float32)}  # 256 KiB: 16 chunks of 16 KiB
CHUNK = 16 * 1024


def step_of(key: str) -> int | None:
    if not key.startswith(layout.STEPS_PREFIX):
        return None
    return layout.parse_step_dir(key[len(layout.STEPS_PREFIX):].split("/", 1)[0])


class StepPausingStore(DelegatingStore):
    """Puts of one step's files wait until ``resume`` is set; counts them."""

    def __init__(self, inner: ObjectStore, step: int) -> None:
        super().__init__(inner)
        self.step = step
        self.resume = threading.Event()
        self.paused = threading.Event()  # set once a put is held
        self.puts = 0
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if step_of(key) == self.step:
            with self._lock:
                self.puts += 1
            self.paused.set()
            assert self.resume.wait(30), "the test never resumed the paused put"
        return super().put(key, data, if_generation_match=if_generation_match)


class SlowStepStore(DelegatingStore):
    """Every put of one step's files takes ``delay_s`` longer (a store under load); counts them."""

    def __init__(self, inner: ObjectStore, step: int, delay_s: float) -> None:
        super().__init__(inner)
        self.step, self.delay_s = step, delay_s
        self.started = threading.Event()
        self.puts = 0
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if step_of(key) == self.step:
            with self._lock:
                self.puts += 1
            self.started.set()
            time.sleep(self.delay_s)  # the fault injected, not synchronisation
        return super().put(key, data, if_generation_match=if_generation_match)


class LateFenceStore(DelegatingStore):
    """A write of the lease from a background save's thread is applied at once, but its reply is held
    until ``deliver`` is set (a fence whose answer comes seconds late)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.holding = threading.Event()  # set once a reply is held
        self.deliver = threading.Event()

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        generation = super().put(key, data, if_generation_match=if_generation_match)
        if key == layout.LEASE_KEY and threading.current_thread().name.startswith(("ckpt-persist", "fence")):
            self.holding.set()
            assert self.deliver.wait(30), "the test never delivered the held reply"
        return generation


def memory() -> MemoryStore:
    return MemoryStore.named(uuid.uuid4().hex)


# ------------------------------------------------------------------ the manager

def test_a_cancelled_save_is_a_typed_abandoned_save() -> None:
    assert issubclass(SaveCancelledError, SaveAbandonedError)
    assert issubclass(SaveCancelledError, CheckpointError) and issubclass(SaveCancelledError, TimeoutError)


def test_a_cancel_token_fires_whether_it_is_waited_on_before_or_after_the_cancel() -> None:
    before, after = CancelToken(), CancelToken()
    waiting = before.fired  # made before the cancel: the cancel fails it
    assert not before.cancelled and not waiting.done() and before.reason == ""
    for token in (before, after):
        assert token.cancel("first") and not token.cancel("second")
        assert token.cancelled and token.reason == "first"
        assert isinstance(token.fired.exception(timeout=0), SaveCancelledError)  # after: made already failed
        t0 = time.monotonic()
        token.sleep(30)  # a poll's pause ends at once
        assert time.monotonic() - t0 < 5
        with pytest.raises(SaveCancelledError, match=r"step 3: the save was cancelled here \(first\)"):
            token.check(3, "here")
    assert before.fired is waiting


def test_an_uncancelled_token_sleeps_its_pause() -> None:
    token = CancelToken()
    t0 = time.monotonic()
    token.sleep(0.05)
    assert time.monotonic() - t0 >= 0.04 and not token.cancelled
    token.check(1, "here")  # does not raise


def test_cancel_inflight_without_a_save_in_flight_does_nothing() -> None:
    with CheckpointManager(memory()) as mgr:
        assert mgr.cancel_inflight() is False
        assert mgr.save_async(1, STATE)
        mgr.wait(timeout=30)
        assert mgr.cancel_inflight() is False  # over already: nothing to cancel
        assert mgr.all_steps() == [1]


def test_an_emergency_save_during_a_slow_background_save_meets_its_deadline() -> None:
    """The background save would take about 10 s (16 uploads of 1.25 s, two at a time)."""
    slow = SlowStepStore(memory(), step=1, delay_s=1.25)
    with CheckpointManager(slow, io_threads=2, chunk_bytes=CHUNK) as mgr:
        outcome: dict[str, Any] = {}
        assert mgr.save_async(1, BIG, on_done=lambda m, e: outcome.update(manifest=m, error=e))
        assert slow.started.wait(10)
        t0 = time.monotonic()
        assert mgr.cancel_inflight("an emergency save needs the store")
        manifest = mgr.save(2, BIG, deadline=time.time() + 3.0)
        assert manifest is not None and time.monotonic() - t0 < 3.0
        with pytest.raises(SaveCancelledError, match="an emergency save needs the store"):
            mgr.wait(timeout=10)  # only the two uploads already sent were left to end
        assert isinstance(outcome["error"], SaveCancelledError) and outcome["manifest"] is None
        assert slow.puts <= 4  # nothing queued behind the cancel was sent
        assert mgr.all_steps() == [2]
        assert mgr.last_stats is not None and mgr.last_stats.step == 2


def test_a_deadline_save_does_not_queue_behind_a_stuck_background_save() -> None:
    """Not cancelled: every upload thread of the background save is stuck, the deadline save has its own."""
    stuck = StepPausingStore(memory(), step=2)
    with CheckpointManager(stuck, io_threads=1, chunk_bytes=CHUNK) as mgr:
        assert mgr.save_async(2, BIG)
        assert stuck.paused.wait(10)
        try:
            assert mgr.save(1, BIG, deadline=time.time() + 3.0) is not None
        finally:
            stuck.resume.set()
        mgr.wait(timeout=30)
        assert mgr.all_steps() == [1, 2]


def test_a_cancel_between_uploads_sends_no_further_upload() -> None:
    stuck = StepPausingStore(memory(), step=1)
    with CheckpointManager(stuck, io_threads=1, chunk_bytes=CHUNK) as mgr:
        assert mgr.save_async(1, BIG)
        assert stuck.paused.wait(10)
        assert mgr.cancel_inflight("stop")
        stuck.resume.set()
        with pytest.raises(SaveCancelledError, match="step 1: the save was cancelled"):
            mgr.wait(timeout=10)
        assert stuck.puts == 1  # 16 chunks planned, one sent before the cancel
        assert mgr.all_steps() == []


def test_a_cancel_ends_a_gather_waiting_for_a_rank_that_never_comes() -> None:
    seen = PutSeenStore(memory(), lambda key: "/records/" in key)  # a shard record of the save
    with CheckpointManager(seen, gather_timeout_s=300) as mgr:
        assert mgr.save_async(1, STATE, rank=0, world_size=2, attempt="a-1")
        assert seen.seen.wait(10)  # rank 0 wrote its record and polls for rank 1's
        t0 = time.monotonic()
        assert mgr.cancel_inflight("the ring is gone")
        with pytest.raises(SaveCancelledError, match="while the coordinator waited for the shard records"):
            mgr.wait(timeout=10)
        assert time.monotonic() - t0 < 2.0  # not at the gather's 300 s timeout
        assert mgr.all_steps() == []


def test_a_cancel_during_the_fence_commits_nothing() -> None:
    late = LateFenceStore(memory())
    lease = Lease(late, "h0:1")
    lease.acquire()
    with CheckpointManager(late) as mgr:
        assert mgr.save_async(1, STATE, lease=lease)
        assert late.holding.wait(10)
        assert mgr.cancel_inflight("stop")
        late.deliver.set()
        with pytest.raises(SaveCancelledError, match="before its commit marker was written"):
            mgr.wait(timeout=10)
        assert mgr.all_steps() == []
        assert lease.held  # the fence itself went through: the lease is this process's still


# ------------------------------------------------------------------ the lease across threads

def fence_in_background(lease: Lease) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def fence() -> None:
        try:
            result["generation"] = lease.fence()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            result["error"] = exc

    thread = threading.Thread(target=fence, name="fence")
    thread.start()
    return thread, result


def test_a_fence_answered_after_a_release_does_not_make_the_lease_held_again() -> None:
    late = LateFenceStore(memory())
    lease = Lease(late, "h0:1")
    lease.acquire()
    thread, result = fence_in_background(lease)
    assert late.holding.wait(10)  # the fence was applied; its reply is on its way
    lease.release()  # the training thread, at an election
    assert not lease.held
    late.deliver.set()
    thread.join(10)
    assert isinstance(result.get("error"), LeaseLostError)
    assert not lease.held and lease.generation is None
    record, _ = lease.read()
    assert record is not None and record.released  # the fence's record was released, not left held
    Lease(late.inner, "h1:2").acquire()  # so a successor takes it without stealing


def test_a_fence_answered_after_a_steal_by_this_process_keeps_the_steal() -> None:
    late = LateFenceStore(memory())
    lease = Lease(late, "h0:1")
    lease.acquire()
    thread, result = fence_in_background(lease)
    assert late.holding.wait(10)
    taken = lease.acquire(steal=True)
    late.deliver.set()
    thread.join(10)
    assert isinstance(result.get("error"), LeaseLostError)
    assert lease.generation == taken == lease.acquired_generation


def test_a_second_fence_of_one_process_waits_for_the_first_and_never_loses_to_it() -> None:
    late = LateFenceStore(memory())
    lease = Lease(late, "h0:1")
    lease.acquire()
    thread, result = fence_in_background(lease)  # a background save's fence, its reply late
    assert late.holding.wait(10)
    with pytest.raises(StoreDeadlineError, match="another fence of the lease was still in flight"):
        lease.fence(deadline=Deadline(time.time() + 0.75))  # an emergency save's, bounded by its deadline
    assert lease.held  # not mistaken for a lost lease
    late.deliver.set()
    thread.join(10)
    first = result["generation"]
    assert lease.fence(deadline=Deadline(time.time() + 5)) > first  # made on top of the first one


@pytest.mark.parametrize("seed", range(5))
def test_fences_on_other_threads_never_leave_the_lease_believed_held_when_it_is_not(seed: int) -> None:
    """Two save threads fence while the training thread releases and steals at random: once all are
    done, the lease is believed held exactly when the stored record is this holder's, unreleased,
    at the generation believed, and a fence then succeeds."""
    import random

    store = memory()
    lease = Lease(store, "h0:1")
    lease.acquire()
    stop = threading.Event()
    fenced = [0, 0]

    def fencer(i: int) -> None:
        while not stop.is_set():
            try:
                lease.fence()
                fenced[i] += 1
            except LeaseLostError:
                pass

    threads = [threading.Thread(target=fencer, args=(i,), name=f"fence-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    rng = random.Random(seed)
    give_up = time.monotonic() + 30
    try:
        # at least 150 moves, and on until the fencers have fenced (a loaded machine may starve them);
        # a steal retries its compare-and-swap for as long as the hammering fencers keep winning it
        for n in itertools.count():
            if n >= 150 and (sum(fenced) > 0 or time.monotonic() > give_up):
                break
            lease.release() if rng.random() < 0.5 else lease.acquire(steal=True, attempts=1000)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    record, generation = lease.read()
    held = lease.generation
    if held is not None:
        assert record is not None and record.holder == "h0:1" and not record.released
        assert held == generation
        assert lease.fence() > held
    else:
        assert record is not None and record.released  # a successor takes it without stealing
        Lease(store, "h1:2").acquire()
    assert sum(fenced) > 0


# ------------------------------------------------------------------ the protocol

def test_an_old_master_elected_again_takes_the_lease_its_late_fence_would_have_faked() -> None:
    """The old master's background commit fences; the reply comes late, on its persist thread.
    Meanwhile a notice moves the master away and the training thread releases the lease. When the
    rest of the wave puts every rank under notice, the old master is elected again: it must take the
    lease, and the wave's emergency save must commit."""
    inner = memory()
    late = LateFenceStore(inner)
    group, impls, url = make_ranks(stores=[late, inner, inner], save_every_steps=2)
    try:
        step_all(group, impls, 2)  # the periodic save of step 2
        assert late.holding.wait(10)  # rank 0 (master) fenced; the reply is held
        impls[0].watcher.notice = notice(60)
        outcomes = step_all(group, impls, 3)
        assert [o.committed for o in outcomes] == [True, True, True]
        assert [impl.run.master for impl in impls] == [1, 1, 1]
        assert not impls[0].lease.held
    finally:
        late.deliver.set()  # the late reply arrives
    with pytest.raises((LeaseLostError, SaveCancelledError)):
        impls[0].manager.wait(timeout=10)
    assert not impls[0].lease.held  # the late reply did not write its generation back
    impls[1].watcher.notice = notice(60)
    impls[2].watcher.notice = notice(60)
    outcomes = step_all(group, impls, 4)
    assert [impl.run.master for impl in impls] == [0, 0, 0]  # every rank leaving: rank 0 commits
    assert [o.committed for o in outcomes] == [True, True, True]
    assert not events(impls[0], "lease_error")
    with CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [3, 4]  # the periodic step 2 never committed
        assert mgr.commit_marker(4).fence == impls[0].lease.generation


def test_the_emergency_cancels_a_stuck_background_save_instead_of_waiting_for_it() -> None:
    inner = memory()
    stuck = StepPausingStore(inner, step=2)  # rank 1's background save of step 2 hangs
    group, impls, url = make_ranks(stores=[inner, stuck, inner], save_every_steps=2)
    try:
        step_all(group, impls, 2)
        assert stuck.paused.wait(10)
        impls[2].watcher.notice = notice(30)  # the old protocol waited (30 - 1) / 3 s here
        t0 = time.monotonic()
        outcomes = step_all(group, impls, 3)
        assert time.monotonic() - t0 < 5.0
        assert [o.committed for o in outcomes] == [True, True, True]
        for impl in impls:
            assert [(e["step"], e["reason"]) for e in events(impl, "inflight_cancelled")] in (
                [], [(3, "emergency")])
        assert [e["step"] for e in events(impls[1], "inflight_cancelled")] == [3]
        assert not events(impls[1], "wait_inflight")
    finally:
        stuck.resume.set()
    for impl in impls:
        try:
            impl.manager.wait(timeout=10)
        except SaveAbandonedError:
            pass  # cancelled, or its coordinator gave up on the cancelled rank
    with CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [3]


def test_a_new_ring_abandons_the_save_its_predecessor_left_in_flight() -> None:
    """Rank 2's share never arrives, and the ring re-forms without it: the coordinator's gather must not
    keep the save in flight (every periodic save skipped, every emergency waiting) for 300 s."""
    inner = memory()
    stuck = StepPausingStore(inner, step=2)
    group, impls, url = make_ranks(stores=[inner, inner, stuck], save_every_steps=2,
                                   async_gather_timeout_s=300)
    try:
        step_all(group, impls, 2)
        assert stuck.paused.wait(10)
        assert impls[0].manager.save_in_flight  # the coordinator waits for rank 2's record
        ring = ThreadGroup(2, timeout_s=10)
        survivors = impls[:2]
        for r, impl in enumerate(survivors):
            impl.comm = FakeCollectives(ring, r)
        t0 = time.monotonic()
        ring.run(lambda r: survivors[r].begin(3))
        with pytest.raises(SaveCancelledError, match="a new ring began at step 3"):
            impls[0].manager.wait(timeout=10)
        assert time.monotonic() - t0 < 3.0
        assert [(e["step"], e["reason"]) for e in events(impls[0], "inflight_cancelled")] == [(3, "new_ring")]
        for impl in survivors:  # rank 1's part of the cancelled save may still be winding down
            with contextlib.suppress(SaveCancelledError):
                impl.manager.wait(timeout=10)
        assert time.monotonic() - t0 < 3.0
        assert not survivors[0].manager.save_in_flight and not survivors[1].manager.save_in_flight
        step_all(ring, survivors, 4)  # the new ring's periodic save is not skipped
        for impl in survivors:
            assert not [e for e in events(impl, "save_skipped") if e["step"] == 4]
            impl.manager.wait(timeout=30)
    finally:
        stuck.resume.set()
    with CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [4]
