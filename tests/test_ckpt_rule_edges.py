"""The checkpoint service's ordering, replacement, gc and restore rules at their edges.

Each test drives real stores, managers and leases (with DelegatingStore wrappers to pause or
interfere at one store call) and asserts what docs/checkpoint-service.md promises.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from ckpt_helpers import BACKENDS, CoarseLocalStore, PauseAt, flip_one_byte_of_a_chunk, make_backend_store, who_saved
from ckpt_helpers import who_state as state

from ckpt_service import layout
from ckpt_service.errors import (
    CheckpointChangedError,
    CorruptCheckpointError,
    LeaseLostError,
    StoreListingError,
)
from ckpt_service.lease import Lease
from ckpt_service.manager import CheckpointManager
from ckpt_service.reader import list_commits
from ckpt_service.stores import LocalStore, MemoryStore, ObjectStore
from ckpt_service.testing.delegating import DelegatingStore

WAIT_S = 20.0


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path) -> ObjectStore:
    return make_backend_store(request.param, tmp_path, request)


class BeforeGet(DelegatingStore):
    """Runs ``action`` once, right before the first get whose key ``match`` accepts (once armed)."""

    def __init__(self, inner: ObjectStore, match, action) -> None:
        super().__init__(inner)
        self.match, self.action, self.armed = match, action, False

    def get(self, key: str) -> bytes:
        if self.armed and self.match(key):
            self.armed = False
            self.action()
        return self.inner.get(key)


# ---- verify(N) of a step deleted while it is read ------------------------------------------


def test_verify_of_a_step_deleted_while_read_raises_checkpoint_changed(store: ObjectStore) -> None:
    """verify(N) stats the marker, then reads it: gc deleting step N in between must give
    CheckpointChangedError ("read it again"), as restore(step=N) does."""
    with CheckpointManager(store, max_to_keep=None) as writer:
        writer.save(1, state(1))
        writer.save(2, state(2))
    hook = BeforeGet(store, lambda k: k == layout.commit_key(1), lambda: gc.delete(1))
    gc = CheckpointManager(store, max_to_keep=None)
    try:
        with CheckpointManager(hook, max_to_keep=None) as reader:
            hook.armed = True
            with pytest.raises(CheckpointChangedError):
                reader.verify(1)
    finally:
        gc.close()


def test_restore_step_of_a_step_deleted_while_read_raises_checkpoint_changed(store: ObjectStore) -> None:
    """Control for the test above: restore(step=N) in the same interleaving (holds)."""
    with CheckpointManager(store, max_to_keep=None) as writer:
        writer.save(1, state(1))
        writer.save(2, state(2))
    gc = CheckpointManager(store, max_to_keep=None)
    hook = BeforeGet(store, lambda k: k == layout.commit_key(1), lambda: gc.delete(1))
    try:
        with CheckpointManager(hook, max_to_keep=None) as reader:
            hook.armed = True
            with pytest.raises(CheckpointChangedError):
                reader.restore(step=1)
    finally:
        gc.close()


# ---- gc never deletes the newest restorable commit --------------------------------------------


def test_gc_keep_1_after_latest_damaged_keeps_the_newest_that_verifies(store: ObjectStore) -> None:
    """A manager that verified step 30 in an earlier gc, then step 30 is damaged: gc --keep 1 must
    keep 20 (the newest that verifies now), not trust its memory of 30."""
    with CheckpointManager(store, max_to_keep=None) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, state(s))
        assert mgr.gc() == []  # verifies 30 (and remembers it)
        flip_one_byte_of_a_chunk(store, 30)
        mgr.gc(keep=1)
        assert mgr.restore().step == 20, "the newest commit that verifies was deleted"


def test_fresh_gc_keep_1_after_latest_damaged_keeps_the_newest_that_verifies(store: ObjectStore) -> None:
    """Control: the same with a fresh collector (as `hvd-transient ckpt gc` runs) holds."""
    with CheckpointManager(store, max_to_keep=None) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, state(s))
        flip_one_byte_of_a_chunk(store, 30)
    with CheckpointManager(store, max_to_keep=None) as mgr:
        mgr.gc(keep=1)
        assert mgr.restore().step == 20


# ---- unexpected marker contents -------------------------------------------------------------------


def _rewrite_marker(store: ObjectStore, step: int, **fields) -> None:
    key = layout.commit_key(step)
    body = json.loads(store.get(key))
    body.update(fields)
    store.put(key, json.dumps(body, sort_keys=True).encode())


def test_marker_with_based_on_above_its_fence_does_not_hide_and_delete_newer_steps(store: ObjectStore) -> None:
    """A marker's based_on is the number the lease held before its own fence, so it is always below
    its fence. A marker claiming based_on > fence (damaged, hand-edited) must not hide every higher
    step, nor make gc delete them: the naive choice (keep all, restore the newest whole) gives 30."""
    lease = Lease(store, "master")
    lease.acquire()
    with CheckpointManager(store, max_to_keep=None) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, state(s), lease=lease)
        m10 = mgr.commit_marker(10)
        _rewrite_marker(store, 10, based_on=m10.fence + 10**6)
        mgr.gc()
        assert store.exists(layout.commit_key(30)), "gc deleted the newest verifiable commit"
        assert mgr.restore().step == 30


# ---- zombie: release and re-acquire between a save's start and its fence ---------------------------


def test_save_started_before_release_cannot_commit_over_a_successors_commit(store: ObjectStore) -> None:
    """A asks for a background save of step 30 (its data of before), then releases the lease; B takes
    it, commits step 20 (a newer state, e.g. after restoring 10), releases; A is elected again.
    A's old save, still in flight, must not fence under A's new tenure and become what restore
    returns: its data predates B's commit."""
    paused = PauseAt(store, lambda k: "/manifest." in k)
    lease_a, lease_b = Lease(paused, "A"), Lease(store, "B")
    lease_a.acquire()
    with CheckpointManager(paused, max_to_keep=None) as a, CheckpointManager(store, max_to_keep=None) as b:
        a.save(10, state(10, who=1), lease=lease_a)
        paused.armed = True
        assert a.save_async(30, state(30, who=1), lease=lease_a)
        assert paused.reached.wait(WAIT_S)
        lease_a.release()
        lease_b.acquire()
        b.save(20, state(20, who=2), lease=lease_b)
        lease_b.release()
        lease_a.acquire()
        paused.release.set()
        try:
            a.wait(timeout=WAIT_S)
        except LeaseLostError:
            pass  # the right outcome: a save of an earlier tenure is fenced out
        ckpt = b.restore()
        assert (ckpt.step, who_saved(ckpt)) == (20, 2), \
            f"restore returned step {ckpt.step} saved by {who_saved(ckpt)} (A's pre-release save)"


def test_same_step_save_started_before_release_cannot_replace_a_successors_commit(store: ObjectStore) -> None:
    """As above, with the same step: A's pre-release save of step 20 replaces B's valid commit of
    step 20 ("made before this holder's tenure") although A's data predates B's commit."""
    paused = PauseAt(store, lambda k: "/manifest." in k)
    lease_a, lease_b = Lease(paused, "A"), Lease(store, "B")
    lease_a.acquire()
    with CheckpointManager(paused, max_to_keep=None) as a, CheckpointManager(store, max_to_keep=None) as b:
        a.save(10, state(10, who=1), lease=lease_a)
        paused.armed = True
        assert a.save_async(20, state(20, who=1), lease=lease_a)
        assert paused.reached.wait(WAIT_S)
        lease_a.release()
        lease_b.acquire()
        b.save(20, state(20, who=2), lease=lease_b)
        lease_b.release()
        lease_a.acquire()
        paused.release.set()
        try:
            a.wait(timeout=WAIT_S)
        except Exception:  # any refusal (LeaseLostError, CommitConflictError) is a right outcome
            pass
        ckpt = b.restore()
        assert (ckpt.step, who_saved(ckpt)) == (20, 2), "A's pre-release save replaced B's newer commit"


# ---- LocalStore generations on a filesystem with coarse timestamps -----------------------------


def test_coarse_local_generation_strictly_increases_across_delete_and_recreate(tmp_path) -> None:
    """Generations must strictly increase: a key written three times in a second (stamped forward to
    S+2), deleted and created again gets S again: a generation seen before, lower than the last."""
    store = CoarseLocalStore(tmp_path / "s", fsync=False)
    key = layout.commit_key(7)
    gens = [store.put(key, b"a"), store.put(key, b"b"), store.put(key, b"c")]
    assert gens[0] < gens[1] < gens[2]
    store.delete(key)
    again = store.put(key, b"d", if_generation_match=0)
    assert again > gens[-1], f"generation went back from {gens[-1]} to {again} after delete and create"


@pytest.mark.parametrize("kind", [LocalStore, CoarseLocalStore], ids=["fine-control", "coarse"])
def test_coarse_local_restore_step_deleted_and_recommitted_while_read_raises_changed(tmp_path, kind) -> None:
    """restore(step=2) reads step 2's manifest; before it reads a chunk, gc deletes step 2 and a replay
    commits step 2 again, all within one second on a whole-second filesystem: the new marker gets the
    old one's generation, so the reader takes the vanished chunk for corruption
    (CorruptCheckpointError) instead of CheckpointChangedError."""
    store = kind(tmp_path / "s", fsync=False)
    with CheckpointManager(store, max_to_keep=None) as w:
        w.save(1, state(1))
        w.save(2, state(2))
    before = store.stat(layout.commit_key(2)).generation
    other = CheckpointManager(store, max_to_keep=None)

    def gc_then_replay() -> None:
        other.delete(2)
        other.save(2, state(2, who=2))

    hook = BeforeGet(store, lambda k: k.startswith(layout.step_prefix(2) + "data/") and "/c/" in k, gc_then_replay)
    try:
        with CheckpointManager(hook, max_to_keep=None) as reader:
            hook.armed = True
            try:
                got = reader.restore(step=2)
                outcome: object = ("read", who_saved(got))
            except (CheckpointChangedError, CorruptCheckpointError) as exc:
                outcome = type(exc)
    finally:
        other.close()
    assert store.stat(layout.commit_key(2)).generation > before  # never a generation the key had before
    assert outcome is CheckpointChangedError, f"restore(step=2) gave {outcome}"


# ---- GCS transfer checksum mismatch is read again up to 3 times ---------------------------------


@pytest.fixture
def proxied_gcs(gcs_emulator_session):
    import uuid

    from fault_proxy import FaultProxy
    from google.cloud.storage.retry import DEFAULT_RETRY

    from ckpt_service.stores.gcs import GCSStore

    bucket = gcs_emulator_session.new_bucket("adv")
    with FaultProxy(gcs_emulator_session.url) as proxy:
        client = gcs_emulator_session.client(endpoint=proxy.url)
        retry = DEFAULT_RETRY.with_delay(initial=0.01, maximum=0.1, multiplier=2.0).with_timeout(10.0)
        yield GCSStore(bucket, f"t-{uuid.uuid4().hex[:8]}", client=client, retry=retry), proxy
        client.close()


@pytest.mark.parametrize("bad_reads", [2, 3])
def test_gcs_transfer_checksum_mismatch_is_read_again_up_to_three_times(proxied_gcs, bad_reads: int) -> None:
    """A DataCorruption is read *again* up to 3 times before the object is called corrupt, so
    three bad transfers followed by a good one must still return the bytes (1 read + 3 re-reads)."""
    from fault_proxy import is_download

    store, proxy = proxied_gcs
    payload = bytes(range(256)) * 64
    store.put("steps/000000000001/data/x/c/0", payload)
    proxy.flip_reply_byte_of_next(match=is_download, count=bad_reads)
    assert store.get("steps/000000000001/data/x/c/0") == payload


# ---- checks that held (kept: cheap and meaningful) ----------------------------------------------------


@pytest.mark.parametrize("with_lease_object", [False, True])
def test_prefix_copied_to_another_store_continues_with_fences_above_every_marker(tmp_path, with_lease_object) -> None:
    src = LocalStore(tmp_path / "src", fsync=False)
    lease = Lease(src, "old")
    lease.acquire()
    with CheckpointManager(src, max_to_keep=None) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, state(s), lease=lease)
    lease.release()
    dst = MemoryStore()
    for key in src.list(""):
        if with_lease_object or not key.startswith("lease/"):
            dst.put(key, src.get(key))
    top = max(m.fence for m in list_commits(dst).markers.values())
    new = Lease(dst, "new")
    taken = new.acquire()
    if with_lease_object:  # the same lineage goes on, above its markers
        assert taken > top and new.lineage == lease.lineage
    else:  # a new lineage: the copied markers neither supersede nor are superseded by its commits
        assert new.lineage != lease.lineage
    with CheckpointManager(dst, max_to_keep=None) as mgr:
        mgr.save(40, state(40, who=3), lease=new)
        assert mgr.all_steps() == [10, 20, 30, 40]
        ckpt = mgr.restore()
        assert (ckpt.step, who_saved(ckpt)) == (40, 3)


def test_two_coarse_local_processes_fencing_within_one_second_never_both_hold(tmp_path) -> None:
    root = tmp_path / "s"
    pa, pb = CoarseLocalStore(root, fsync=False), CoarseLocalStore(root, fsync=False)
    a, b = Lease(pa, "a"), Lease(pb, "b")
    numbers = [a.acquire(), a.fence(), b.acquire(steal=True)]
    with pytest.raises(LeaseLostError):
        a.fence()
    numbers += [b.fence(), b.fence()]
    b.release()
    numbers += [a.acquire(), a.fence()]
    assert all(x < y for x, y in zip(numbers, numbers[1:])), numbers


def test_listing_error_during_a_saves_retention_and_gc(tmp_path, monkeypatch) -> None:
    """An unreadable step folder (EACCES from scandir, as for a non-root user): the save's commit
    stands, gc raises StoreListingError and deletes nothing."""
    store = LocalStore(tmp_path / "s", fsync=False)
    with CheckpointManager(store, max_to_keep=1) as mgr:
        mgr.save(10, state(10))
        bad = str(store.root / "steps" / f"{10:012d}")
        real = os.scandir

        def scandir(path="."):
            if os.fspath(path).startswith(bad):
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real(path)

        monkeypatch.setattr(os, "scandir", scandir)
        assert mgr.save(20, state(20)) is not None
        assert mgr.all_steps() == [10, 20] or mgr.all_steps() == [20]
        with pytest.raises(StoreListingError):
            mgr.gc(keep=1)
        monkeypatch.setattr(os, "scandir", real)
        assert mgr.restore().step == 20


def test_old_master_stalled_before_fence_with_successor_deadline_save(store: ObjectStore) -> None:
    """Old master stalls before its fence; the successor steals and commits the same step with a
    deadline; the old master resumes: LeaseLostError, the successor's commit stands."""
    paused = PauseAt(store, lambda k: k == layout.LEASE_KEY)
    old, new = Lease(paused, "old"), Lease(store, "new")
    old.acquire()
    import time as _time
    with CheckpointManager(paused, max_to_keep=None) as a, CheckpointManager(store, max_to_keep=None) as b, \
            ThreadPoolExecutor(1) as pool:
        a.save(10, state(10, who=1), lease=old)
        paused.armed = True
        stalled = pool.submit(a.save, 20, state(20, who=1), lease=old)
        assert paused.reached.wait(WAIT_S)
        new.acquire(steal=True)
        b.save(20, state(20, who=2), lease=new, deadline=_time.time() + 10)
        paused.release.set()
        with pytest.raises(LeaseLostError):
            stalled.result(timeout=WAIT_S)
        ckpt = b.restore()
        assert (ckpt.step, who_saved(ckpt)) == (20, 2)
