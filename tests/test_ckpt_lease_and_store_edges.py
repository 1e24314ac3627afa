"""The checkpoint service's lease, marker and store rules at their edges: saves begun while the lease
was not held, lease numbers and markers from elsewhere, coarse timestamps across store objects,
compare-and-delete against a re-creation, a partitioned restore whose latest step goes meanwhile.

Each test drives real stores, managers and leases (DelegatingStore wrappers pause or interfere at
one store call) and asserts what docs/checkpoint-service.md promises.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ckpt_helpers import BACKENDS, CoarseLocalStore, PauseAt, make_backend_store, who_saved
from ckpt_helpers import who_state as state

from ckpt_service import layout
from ckpt_service.errors import (
    CheckpointChangedError,
    LeaseLostError,
    NothingToRestoreError,
)
from ckpt_service.lease import Lease
from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import LocalStore, ObjectStore
from ckpt_service.testing.delegating import DelegatingStore

WAIT_S = 20.0


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path) -> ObjectStore:
    return make_backend_store(request.param, tmp_path, request)


@pytest.fixture(params=["memory", "local"])
def near_store(request, tmp_path) -> ObjectStore:
    return make_backend_store(request.param, tmp_path, request)


# ---- a save begun while the lease was not held ------------------------------------------------


def test_save_begun_while_lease_not_held_cannot_commit_after_a_successors_commit(store: ObjectStore) -> None:
    """A released the lease (a ring change); its background save of step 30 (A's state of before) is
    started while A does not hold it, so the save records no ``based_on``. B takes the lease, commits
    step 20 (a newer state), releases; A is elected again. A's save then takes ``based_on`` from the
    lease as it is at commit time (A's *new* tenure), passes the tenure check, fences, and its stale
    step 30 becomes what restore returns, over B's newer commit. The service refuses a save begun before
    its holder took the lease again; this one began before A took it again too."""
    paused = PauseAt(store, lambda k: "/manifest." in k)
    lease_a, lease_b = Lease(paused, "A"), Lease(store, "B")
    lease_a.acquire()
    with CheckpointManager(paused, max_to_keep=None) as a, CheckpointManager(store, max_to_keep=None) as b:
        a.save(10, state(10, who=1), lease=lease_a)
        lease_a.release()
        paused.armed = True
        assert a.save_async(30, state(30, who=1), lease=lease_a)  # begun while A does not hold the lease
        assert paused.reached.wait(WAIT_S)
        lease_b.acquire()
        b.save(20, state(20, who=2), lease=lease_b)
        lease_b.release()
        lease_a.acquire()
        paused.release.set()
        try:
            a.wait(timeout=WAIT_S)
        except LeaseLostError:
            pass  # the right outcome: the save began before this tenure
        ckpt = b.restore()
        assert (ckpt.step, who_saved(ckpt)) == (20, 2), \
            f"restore returned step {ckpt.step} saved by {who_saved(ckpt)} (A's save begun before it took the lease)"


# ---- the lease's fence number vs the markers' ---------------------------------------------------


def _write_lease(store: ObjectStore, fence: int) -> None:
    body = {"holder": "", "expires_at": 0.0, "released": True, "write_id": "reset", "fence": fence}
    store.put(layout.LEASE_KEY, json.dumps(body).encode())


def test_a_lease_object_with_a_number_below_the_markers_never_hides_the_commits_made_after(store) -> None:
    """The lease object is replaced by one holding a low number (an operator resetting a stuck lease
    by hand, a lease object copied in from another run, a bucket restored from an older snapshot of
    lease/): its number is trusted although markers carry higher ones. Every commit made under it
    then has a fence below the based_on of the older steps, so each is superseded the moment it is
    made: restore returns the old step 30 after steps 40 and 50 were committed, and a gc deletes them.
    An absent lease object starts above the highest marker; a present one with a lower number should
    too."""
    lease = Lease(store, "master")
    lease.acquire()
    with CheckpointManager(store, max_to_keep=None) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, state(s), lease=lease)
            for _ in range(3):
                lease.fence()  # renewals between saves: the markers carry numbers well above 1
        lease.release()
        _write_lease(store, 1)  # a lease object with a number, below every marker's
        successor = Lease(store, "successor")
        successor.acquire()
        mgr.save(40, state(40, who=4), lease=successor)
        mgr.save(50, state(50, who=5), lease=successor)
        assert mgr.all_steps()[-1] == 50, f"committed steps {mgr.all_steps()}: 40 and 50 are hidden"
        removed = mgr.gc()
        assert 40 not in removed and 50 not in removed, f"gc deleted {removed}"
        ckpt = mgr.restore()
        assert (ckpt.step, who_saved(ckpt)) == (50, 5), f"restored step {ckpt.step} after 40 and 50 were committed"


# ---- the coarse-store high-water mark, two store objects on one root ------------------------------


def test_coarse_local_two_store_objects_never_reuse_a_generation_after_delete_and_recreate(tmp_path) -> None:
    """Process P1 (its LocalStore has seen truncation) writes a key three times within a second (stamped
    forward to S+2 s) and deletes it; process P2 (another LocalStore on the same root, which has not
    seen truncation yet) creates it again: P2's floor is only the key's own generation (0: absent),
    not the store-wide mark, so it stamps S, a generation the key had before and lower than its last.
    A compare-and-delete or compare-and-swap held on S by a third party then matches the new object."""
    root = tmp_path / "s"
    p1, p2 = CoarseLocalStore(root, fsync=False), CoarseLocalStore(root, fsync=False)
    key = layout.commit_key(7)
    gens = [p1.put(key, b"a"), p1.put(key, b"b"), p1.put(key, b"c")]
    assert gens[0] < gens[1] < gens[2]
    p1.delete(key)
    again = p2.put(key, b"d", if_generation_match=0)
    assert again > gens[-1], f"generation went back from {gens[-1]} to {again} (seen before: {again in gens})"


# ---- LocalStore.delete_if_generation racing a put of the same key -----------------------------------------


class TidyPausesLocalStore(LocalStore):
    """A LocalStore (one process) whose first folder tidy-up after removing ``key``, once armed, waits for
    ``release``: the thread scheduling between delete_if_generation's locked unlink and its tidy-up."""

    def __init__(self, root: Path, key: str) -> None:
        super().__init__(root, fsync=False)
        self.key, self.armed = key, False
        self.reached, self.release = threading.Event(), threading.Event()

    def _tidy(self, path: Path) -> None:
        if self.armed and path == self._path(self.key):
            self.armed = False
            self.reached.set()
            assert self.release.wait(WAIT_S), "never released"
        super()._tidy(path)


def test_local_compare_and_delete_never_removes_an_object_created_after_it(tmp_path) -> None:
    """delete_if_generation(key, g) succeeds (the object at g is gone), then another process creates the
    key anew (create-only, it succeeds: the key was absent). The new object must stay: the delete came
    first: the tidy-up after the locked unlink removes empty folders only."""
    root = tmp_path / "s"
    key = layout.commit_key(7)
    gc_side, writer = TidyPausesLocalStore(root, key), LocalStore(root, fsync=False)
    g = writer.put(key, b"old")
    gc_side.armed = True
    with ThreadPoolExecutor(1) as pool:
        deleting = pool.submit(gc_side.delete_if_generation, key, g)
        assert gc_side.reached.wait(WAIT_S)  # the old object is unlinked; the tidy-up is next
        writer.put(key, b"new", if_generation_match=0)  # create-only: the key is absent now
        gc_side.release.set()
        assert deleting.result(timeout=WAIT_S) is True
    assert writer.exists(key), "the compare-and-delete of the old object deleted the new one"


def test_gc_compare_and_delete_never_removes_a_rollback_commit_made_meanwhile(tmp_path) -> None:
    """The same race through real managers: gc --keep 1 compare-and-deletes step 10's marker; in the
    window before its tidy-up, the master rolls back and commits step 10 again (superseding 20 and
    30, which the rollback's own retention then deletes). gc's tidy-up unlinks the rollback's fresh
    marker: the committed rollback is lost, and with it every step."""
    root = tmp_path / "s"
    main = LocalStore(root, fsync=False)
    lease = Lease(main, "master")
    lease.acquire()
    with CheckpointManager(main, max_to_keep=None) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, state(s), lease=lease)
        gc_store = TidyPausesLocalStore(root, layout.commit_key(10))
        with CheckpointManager(gc_store, max_to_keep=None) as gc, ThreadPoolExecutor(1) as pool:
            gc_store.armed = True
            collecting = pool.submit(gc.gc, 1)
            assert gc_store.reached.wait(WAIT_S)
            manifest = mgr.save(10, state(10, who=7), lease=lease)  # the rollback: committed
            assert manifest is not None
            gc_store.release.set()
            collecting.result(timeout=WAIT_S)
        ckpt = mgr.restore()
        assert (ckpt.step, who_saved(ckpt)) == (10, 7), f"restored step {ckpt.step} by {who_saved(ckpt)}"


# ---- a partitioned restore whose latest step is deleted between its listing and its read -----------------


class BeforeStat(DelegatingStore):
    """Runs ``action`` once, right before the first stat of ``key`` (once armed)."""

    def __init__(self, inner: ObjectStore, key: str, action) -> None:
        super().__init__(inner)
        self.key, self.action, self.armed = key, action, False

    def stat(self, key: str):
        if self.armed and key == self.key:
            self.armed = False
            self.action()
        return self.inner.stat(key)


def test_partitioned_restore_of_a_latest_removed_after_its_listing_is_not_nothing_to_restore(store) -> None:
    """A partitioned restore lists (latest: 30); before it reads step 30, the master rolls back to 15 and
    that save's retention deletes 30 (superseded). The restore must say "read again"
    (CheckpointChangedError) or read a step, never NothingToRestoreError ("no committed checkpoint:
    start from scratch"), while 10 and 15 are committed and verify."""
    lease = Lease(store, "master")
    lease.acquire()
    with CheckpointManager(store, max_to_keep=None) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, state(s), lease=lease)
        hook = BeforeStat(store, layout.commit_key(30), lambda: mgr.save(15, state(15, who=5), lease=lease))
        with CheckpointManager(hook, max_to_keep=None) as reader:
            hook.armed = True
            try:
                got = reader.restore(partition=(0, 2))
                outcome: object = got.step
            except (CheckpointChangedError, NothingToRestoreError) as exc:
                outcome = type(exc)
        assert not store.exists(layout.commit_key(30))  # the rollback's retention did delete it
        assert outcome is not NothingToRestoreError, \
            f"partitioned restore said nothing to restore while {mgr.all_steps()} are committed"


# ---- a step copied in from another run ----------------------------------------------------------------------


def test_a_step_copied_in_from_another_run_never_hides_or_deletes_this_runs_newer_commits(tmp_path) -> None:
    """Run Y has steps 10, 20, 30 under its lease. An operator copies step 5 of run X (a warm start
    seed; X's lease had been written many more times, so its marker carries a high fence and
    based_on) into Y's prefix. Step 5's based_on is above every fence of Y: it "supersedes" 10, 20
    and 30, restore returns X's step 5, and gc deletes Y's three commits, which all verify. A
    committed checkpoint is never lost to bad input; the naive "keep everything, restore the newest
    whole" would give 30."""
    x, y = LocalStore(tmp_path / "x", fsync=False), LocalStore(tmp_path / "y", fsync=False)
    lx = Lease(x, "x-master")
    lx.acquire()
    for _ in range(40):
        lx.fence()  # a long run: its lease has been renewed many times
    with CheckpointManager(x, max_to_keep=None) as mx:
        mx.save(5, state(5, who=9), lease=lx)
    ly = Lease(y, "y-master")
    ly.acquire()
    with CheckpointManager(y, max_to_keep=None) as my:
        for s in (10, 20, 30):
            my.save(s, state(s, who=1), lease=ly)
        for key in list(x.list(layout.step_prefix(5))) + [layout.commit_key(5)]:
            y.put(key, x.get(key))
        removed = my.gc()
        assert removed == [], f"gc deleted {removed}, commits of this run that verify"
        ckpt = my.restore()
        assert (ckpt.step, who_saved(ckpt)) == (30, 1), f"restored step {ckpt.step} of run {who_saved(ckpt)}"
