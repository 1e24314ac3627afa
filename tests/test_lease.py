"""Checkpoint-master lease and fencing, on every store backend."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from ckpt_helpers import BACKENDS, make_backend_store

from ckpt_service.errors import LeaseLostError
from ckpt_service.lease import Lease, LeaseHeldError
from ckpt_service.manager import CheckpointManager, CommitConflictError


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
        assert mgr.commit_marker(2).lease_generation == successor.generation
    finally:
        mgr.close()


def test_racing_would_be_masters_exactly_one_commit_per_step(store) -> None:
    """Two processes both believe they are master; for every step exactly one commit lands."""
    mgr = CheckpointManager(store, max_to_keep=None)
    barrier = threading.Barrier(2)
    outcomes: dict[str, list[str]] = {"a": [], "b": []}

    def master(name: str) -> None:
        lease = Lease(store, name)
        for step in range(1, 6):
            barrier.wait(timeout=30)
            try:
                if not lease.held:
                    lease.acquire(steal=True)
                mgr.save(step, {"w": np.full(8, step, np.float32), "who": np.array([ord(name)])}, lease=lease)
                outcomes[name].append("committed")
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
            assert results.count("committed") == 1, results
        for step in range(1, 6):
            assert mgr.verify(step).ok
            assert mgr.restore(step=step).tensors["w"][0] == step
    finally:
        mgr.close()
