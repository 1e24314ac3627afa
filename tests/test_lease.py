"""Checkpoint-master lease and fencing, on every store backend."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from ckpt_helpers import BACKENDS, make_backend_store

from ckpt_service.errors import LeaseLostError, StoreUnavailableError
from ckpt_service.lease import Lease, LeaseHeldError
from ckpt_service.manager import CheckpointManager, CommitConflictError
from ckpt_service.stores.base import WriteOutcomeUnknownError
from ckpt_service.testing.store_conformance import LostReplies


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    return make_backend_store(request.param, tmp_path, request)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_acquire_renew_release(store) -> None:
    a = Lease(store, "host-a", ttl_s=30)
    g1 = a.acquire()
    assert a.held
    assert a.fence() > g1
    with pytest.raises(LeaseHeldError, match="host-a"):
        Lease(store, "host-b").acquire()
    a.release()
    assert not a.held
    assert Lease(store, "host-b").acquire() > 0


def test_expired_lease_can_be_taken_and_old_holder_is_fenced(store) -> None:
    clock = FakeClock()
    old = Lease(store, "old", ttl_s=10, clock=clock)
    old.acquire()
    clock.now += 11
    new = Lease(store, "new", ttl_s=10, clock=clock)
    new.acquire()
    with pytest.raises(LeaseLostError, match="another master was elected"):
        old.fence()
    new.fence()


def test_elected_successor_steals_and_zombie_cannot_commit(store) -> None:
    mgr = CheckpointManager(store, max_to_keep=None)
    try:
        master = Lease(store, "rank0")
        master.acquire()
        mgr.save(1, {"w": np.ones(4, np.float32)}, lease=master)
        successor = Lease(store, "rank1")
        successor.acquire(steal=True)  # all ranks agreed rank0 is leaving
        with pytest.raises(LeaseLostError):
            mgr.save(2, {"w": np.full(4, 2, np.float32)}, lease=master)  # the zombie
        assert mgr.all_steps() == [1]
        mgr.save(2, {"w": np.full(4, 3, np.float32)}, lease=successor)
        ckpt = mgr.restore()
        assert ckpt.step == 2 and ckpt.tensors["w"][0] == 3
        assert mgr.commit_marker(2).fence == successor.generation
    finally:
        mgr.close()


def test_racing_would_be_masters_exactly_one_commit_per_step(store) -> None:
    """Two processes both believe they are master; every step is committed, and what stands is the
    commit of the newest lease holder to commit it: a holder that stole the lease after the other's
    commit of the step replaces that commit (made before its tenure) instead of conflicting."""
    mgr = CheckpointManager(store, max_to_keep=None)
    barrier = threading.Barrier(2)
    outcomes: dict[str, list[str]] = {"a": [], "b": []}
    generations: dict[int, list[int]] = {step: [] for step in range(1, 6)}

    def master(name: str) -> None:
        lease = Lease(store, name)
        for step in range(1, 6):
            barrier.wait(timeout=30)
            try:
                if not lease.held:
                    lease.acquire(steal=True)
                mgr.save(step, {"w": np.full(8, step, np.float32), "who": np.array([ord(name)])}, lease=lease)
                outcomes[name].append("committed")
                generations[step].append(lease.generation)  # the fence's, which its marker carries
            except (LeaseLostError, LeaseHeldError, CommitConflictError) as exc:
                outcomes[name].append(type(exc).__name__)

    try:
        threads = [threading.Thread(target=master, args=(n,)) for n in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert mgr.all_steps() == [1, 2, 3, 4, 5]
        for i in range(5):
            results = [outcomes["a"][i], outcomes["b"][i]]
            assert results.count("committed") >= 1, results
            assert mgr.commit_marker(i + 1).fence == max(generations[i + 1])
        for step in range(1, 6):
            assert mgr.verify(step).ok
            assert mgr.restore(step=step).tensors["w"][0] == step
    finally:
        mgr.close()


# ---- lease writes whose answer is lost ------------------------------------------------------------


def test_acquire_fence_release_applied_but_replies_lost(store) -> None:
    lossy = Lease(LostReplies(store, apply=True), "host-a")
    g1 = lossy.acquire()
    assert lossy.held and store.stat(lossy.key).generation == lossy.object_generation
    g2 = lossy.fence()
    assert g2 > g1 and store.stat(lossy.key).generation == lossy.object_generation
    with pytest.raises(LeaseHeldError, match="host-a"):
        Lease(store, "host-b").acquire()
    lossy.release()
    assert not lossy.held
    assert Lease(store, "host-b").acquire() > g2  # released: no steal needed


def test_fence_never_applied_is_a_store_error_and_keeps_the_lease(store) -> None:
    lease = Lease(store, "host-a")
    g1 = lease.acquire()
    lossy = Lease(LostReplies(store, apply=False), "host-a")
    lossy.adopt(lease)  # the same holder, whose renewals now never reach the store
    with pytest.raises(StoreUnavailableError) as info:
        lossy.fence()
    assert not isinstance(info.value, WriteOutcomeUnknownError)
    assert lossy.generation == g1 and store.stat(lease.key).generation == lease.object_generation
    assert lease.fence() > g1  # nothing changed: the holder still renews it


def test_fence_lost_to_a_successor_while_replies_are_lost(store) -> None:
    zombie = Lease(store, "old")
    zombie.acquire()
    steal = Lease(store, "new")
    zombie.store = LostReplies(store, apply=False, meanwhile=lambda: steal.acquire(steal=True))
    with pytest.raises(LeaseLostError):
        zombie.fence()
    assert not zombie.held and steal.fence() > 0


@pytest.mark.parametrize("applied", [True, False])
def test_fence_whose_outcome_stayed_unknown_is_found_out_by_the_next(store, applied: bool) -> None:
    lease = Lease(store, "host-a")
    g1 = lease.acquire()
    o1 = lease.object_generation
    assert o1 is not None
    lease.store = LostReplies(store, apply=applied, read_back_fails=True)
    with pytest.raises(WriteOutcomeUnknownError):
        lease.fence()
    assert lease.generation == g1  # neither renewed nor lost: not known
    assert (store.stat(lease.key).generation > o1) is applied
    lease.store = store
    g2 = lease.fence()  # on top of the unknown write if it landed, on g1 if not
    assert g2 == g1 + (2 if applied else 1)  # the landed write's number counted too
    assert store.stat(lease.key).generation == lease.object_generation
    with pytest.raises(LeaseHeldError, match="host-a"):
        Lease(store, "host-b").acquire()


def test_an_unknown_write_of_the_holder_is_not_mistaken_for_a_successor(store) -> None:
    """The holder's unknown write landed, then a successor took over: the next fence is lost."""
    lease = Lease(store, "old")
    lease.acquire()
    lease.store = LostReplies(store, apply=True, read_back_fails=True)
    with pytest.raises(WriteOutcomeUnknownError):
        lease.fence()
    lease.store = store
    successor = Lease(store, "new")
    successor.acquire(steal=True)
    with pytest.raises(LeaseLostError):
        lease.fence()
    assert successor.fence() > 0
