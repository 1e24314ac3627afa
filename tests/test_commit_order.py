"""Commits are ordered by their lease fence: once a successor master has committed, nothing the
old master writes becomes what a restore returns; re-commits, rollbacks and out-of-order saves."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from ckpt_helpers import BACKENDS, assert_same_state, flip_one_byte_of_a_chunk, make_backend_store, sample_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_service import layout
from ckpt_service.errors import CheckpointError, CommitConflictError, OutOfOrderSaveError
from ckpt_service.lease import Lease
from ckpt_service.manager import CheckpointManager
from ckpt_service.manifest import Order, superseded_steps
from ckpt_service.reader import list_commits
from ckpt_service.stores.base import ObjectStore
from ckpt_service.testing.delegating import DelegatingStore

WAIT_S = 30.0


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path) -> ObjectStore:
    return make_backend_store(request.param, tmp_path, request)


def state(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(64, step, np.float32), "b": np.arange(step, step + 5, dtype=np.int64)}


class PausedMarker(DelegatingStore):
    """Holds the next create-only commit-marker write (after the fence) until ``release`` is set:
    a master stalled by a GC or VM pause between its fence and its marker."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.armed = False
        self.reached, self.release = threading.Event(), threading.Event()

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if self.armed and key.startswith(layout.COMMITS_PREFIX) and if_generation_match == 0:
            self.armed = False
            self.reached.set()
            assert self.release.wait(WAIT_S), "the test never released the paused marker"
        return self.inner.put(key, data, if_generation_match=if_generation_match)


def stalled_old_master_commits(store: ObjectStore, step: int, successor_steps: list[int]) -> tuple[
        Lease, CheckpointManager]:
    """The old master commits step 10, then fences for ``step`` and stalls before its marker while the
    successor steals the lease and commits ``successor_steps``; then the old marker lands."""
    paused = PausedMarker(store)
    old_lease = Lease(paused, "old-master")
    old_lease.acquire()
    successor = Lease(store, "successor")
    with CheckpointManager(paused, max_to_keep=None) as old, ThreadPoolExecutor(1) as pool:
        old.save(10, state(10), lease=old_lease)
        paused.armed = True
        stalled = pool.submit(old.save, step, state(step), lease=old_lease)
        assert paused.reached.wait(WAIT_S)
        successor.acquire(steal=True)
        mgr = CheckpointManager(store, max_to_keep=None)
        for s in successor_steps:
            mgr.save(s, state(100 + s), lease=successor)
        paused.release.set()
        # the old master's fence came first, so its marker still lands: the commit returns
        assert stalled.result(timeout=WAIT_S) is not None
    assert store.exists(layout.commit_key(step))
    return successor, mgr


def test_stalled_old_master_commit_never_becomes_latest(store: ObjectStore) -> None:
    successor, mgr = stalled_old_master_commits(store, 20, [11])
    try:
        listing = list_commits(store)
        assert listing.superseded == {20}
        assert listing.markers[20].fence < listing.markers[11].fence == successor.generation
        assert mgr.all_steps() == [10, 11] and mgr.latest_step() == 11
        ckpt = mgr.restore()
        assert ckpt.step == 11
        assert_same_state(ckpt.tensors, state(111))
        # asked for by number, the superseded step is still read while its files exist
        assert mgr.restore(step=20).tensors["w"][0] == 20
        assert mgr.gc() == [20]
        assert not store.exists(layout.commit_key(20)) and not list(store.list(layout.step_prefix(20)))
        assert mgr.all_steps() == [10, 11] and mgr.restore().step == 11
    finally:
        mgr.close()


def test_successor_recommits_a_superseded_step(store: ObjectStore) -> None:
    successor, mgr = stalled_old_master_commits(store, 20, [11])
    try:
        manifest = mgr.save(20, state(120), lease=successor)  # the step number the old master used
        assert manifest is not None
        assert mgr.commit_marker(20).fence == successor.generation
        assert mgr.all_steps() == [10, 11, 20]
        assert_same_state(mgr.restore().tensors, state(120))
        mgr.gc()
        assert mgr.verify(20).ok  # the replaced commit's files were young: still there, never in the way
    finally:
        mgr.close()


def test_old_masters_late_marker_of_the_successors_first_step_is_replaced(store: ObjectStore) -> None:
    """The successor's first commit is the very step the old master's late marker took: that marker
    was made before the successor's tenure, so the successor's commit takes its place."""
    successor, mgr = stalled_old_master_commits(store, 20, [])
    try:
        assert mgr.latest_step() == 20  # nothing orders it after a successor commit yet
        mgr.save(20, state(120), lease=successor)
        assert mgr.commit_marker(20).fence == successor.generation
        assert_same_state(mgr.restore().tensors, state(120))
    finally:
        mgr.close()


def test_generations_increase_across_acquire_fence_steal_release(store: ObjectStore) -> None:
    a, b = Lease(store, "a"), Lease(store, "b")
    gens = [a.acquire(), a.fence(), a.fence(), b.acquire(steal=True), b.fence()]
    b.release()
    gens += [a.acquire(), a.fence()]
    assert all(x < y for x, y in zip(gens, gens[1:])), gens


# ---- rollback and out-of-order saves ---------------------------------------------------------


def test_lease_less_save_older_than_the_latest_is_refused(store: ObjectStore) -> None:
    with CheckpointManager(store, max_to_keep=None) as mgr:
        mgr.save(10, state(10))
        with pytest.raises(OutOfOrderSaveError, match="older than step 10") as info:
            mgr.save(5, state(5))
        assert isinstance(info.value, CheckpointError) and isinstance(info.value, ValueError)
        assert not list(store.list(layout.COMMITS_PREFIX + "000000000005"))
        assert not any("manifest" in k for k in store.list(layout.step_prefix(5))), "refused before the manifest"
        assert mgr.all_steps() == [10] and mgr.restore().step == 10


def test_rollback_under_the_lease_supersedes_higher_steps_and_survives_its_retention(store: ObjectStore) -> None:
    lease = Lease(store, "master")
    lease.acquire()
    with CheckpointManager(store, max_to_keep=2) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state(step), lease=lease)
        assert mgr.all_steps() == [20, 30]
        mgr.save(15, state(15), lease=lease)  # restored from an older step and trained again
        assert mgr.all_steps() == [15] and mgr.restore().step == 15
        # its own retention removed the steps it superseded, never itself
        assert [layout.parse_commit_key(k) for k in store.list(layout.COMMITS_PREFIX)] == [15]
        mgr.save(20, state(120), lease=lease)
        assert mgr.all_steps() == [15, 20]
        assert_same_state(mgr.restore().tensors, state(120))


def test_rollback_cannot_supersede_a_step_committed_without_a_lease(store: ObjectStore) -> None:
    lease = Lease(store, "master")
    lease.acquire()
    with CheckpointManager(store, max_to_keep=None) as mgr:
        mgr.save(10, state(10))
        with pytest.raises(OutOfOrderSaveError, match="without a lease"):
            mgr.save(5, state(5), lease=lease)
        assert mgr.all_steps() == [10]


# ---- re-committing a step whose marker exists --------------------------------------------------


def test_valid_existing_commit_still_conflicts(store: ObjectStore) -> None:
    lease = Lease(store, "master")
    lease.acquire()
    with CheckpointManager(store, max_to_keep=None) as mgr:
        mgr.save(3, state(3), lease=lease)
        with pytest.raises(CommitConflictError, match="existing commit stands"):
            mgr.save(3, state(4), lease=lease)
        assert_same_state(mgr.restore().tensors, state(3))


def test_corrupt_latest_step_is_recommitted_not_reported_durable(store: ObjectStore) -> None:
    """Restore falls back from a corrupt latest step; saving that step again must commit it."""
    with CheckpointManager(store, max_to_keep=None, chunk_bytes=4096) as mgr:
        mgr.save(1, sample_state(1))
        mgr.save(2, sample_state(2))
        flip_one_byte_of_a_chunk(store, 2)
        assert mgr.restore().step == 1
        assert mgr.save(2, sample_state(3)) is not None
        ckpt = mgr.restore()
        assert ckpt.step == 2
        assert_same_state(ckpt.tensors, sample_state(3))
        assert mgr.verify(2).ok


def test_step_with_a_missing_manifest_is_recommitted_even_under_a_deadline(store: ObjectStore) -> None:
    with CheckpointManager(store, max_to_keep=None) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
        store.delete(mgr.commit_marker(2).manifest_key)
        assert mgr.save(2, state(22), deadline=time.time() + 60) is not None
        assert_same_state(mgr.restore().tensors, state(22))


def test_save_with_a_deadline_takes_the_place_of_an_unverified_commit(store: ObjectStore) -> None:
    """A save with a deadline cannot read the existing step back: its own complete commit replaces it."""
    with CheckpointManager(store, max_to_keep=None, chunk_bytes=4096) as mgr:
        mgr.save(2, sample_state(2))
        flip_one_byte_of_a_chunk(store, 2)
        assert mgr.save(2, sample_state(5), deadline=time.time() + 60) is not None
        assert_same_state(mgr.restore().tensors, sample_state(5))


# ---- a restore overlapping retention ------------------------------------------------------------


class PausedRead(DelegatingStore):
    """Holds the first read of a data object of ``step`` until ``release`` is set."""

    def __init__(self, inner: ObjectStore, step: int) -> None:
        super().__init__(inner)
        self.prefix = layout.step_prefix(step) + "data/"
        self.reached, self.release = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        if key.startswith(self.prefix):
            with self._lock:
                first = not self.reached.is_set()
                self.reached.set()
            if first:
                assert self.release.wait(WAIT_S), "the test never released the paused read"
        return self.inner.get(key)


def test_restore_overlapping_retention_reads_the_newer_step(store: ObjectStore) -> None:
    paused = PausedRead(store, 1)
    with CheckpointManager(store, max_to_keep=1) as writer, \
            CheckpointManager(paused, max_to_keep=None) as reader, ThreadPoolExecutor(1) as pool:
        writer.save(1, state(1))
        restoring = pool.submit(reader.restore)
        assert paused.reached.wait(WAIT_S)
        writer.save(2, state(2))  # its retention deletes step 1 under the restore
        assert writer.all_steps() == [2]
        paused.release.set()
        ckpt = restoring.result(timeout=WAIT_S)
        assert ckpt.step == 2
        assert_same_state(ckpt.tensors, state(2))


# ---- the ordering rule (pure) ---------------------------------------------------------------------


def test_superseded_steps_examples() -> None:
    at = Order
    # the old master fenced 20 at 3 and stalled; the successor's save of 11 began at 8
    assert superseded_steps({10: at(2, 1), 20: at(3, 2), 11: at(9, 8)}) == {20}
    # a rollback to 15, begun after 30 was fenced
    assert superseded_steps({10: at(2, 1), 20: at(3, 2), 30: at(4, 3), 15: at(9, 4)}) == {20, 30}
    # a slow background save of 100 that began before 105 was fenced supersedes nothing
    assert superseded_steps({100: at(7, 5), 105: at(6, 5)}) == frozenset()
    assert superseded_steps({10: None, 20: at(1, 0), 5: at(7, 6)}) == {20}  # a step without an order is skipped
    assert superseded_steps({10: at(9, 8), 20: None}) == frozenset()  # ... and never superseded
    assert superseded_steps({5: Order(99, 98, "another-run"), 10: Order(2, 1, "this-run")}) == frozenset()
    assert superseded_steps({}) == frozenset()


ORDERS = st.builds(lambda fence, back, lineage: Order(fence, max(0, fence - back), lineage),
                   st.integers(1, 20), st.integers(1, 20), st.sampled_from(["run-a", "run-b"]))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.integers(0, 50), st.one_of(st.none(), ORDERS), max_size=12))
def test_superseded_steps_is_the_definition(orders: dict[int, Order | None]) -> None:
    expected = {s for s, o in orders.items() if o is not None and any(
        t < s and p is not None and p.lineage == o.lineage and p.based_on >= o.fence for t, p in orders.items())}
    assert superseded_steps(orders) == expected
