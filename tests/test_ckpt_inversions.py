"""The newest good checkpoint is never hidden or deleted: orders that could invert (a stalled old master
with a deadline, a slow background save, a run moved between stores, coarse file timestamps), gc against
a replay, a damaged latest step, listing and transfer errors, readers that could disagree."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ckpt_helpers import CoarseLocalStore, flip_one_byte_of_a_chunk, make_backend_store
from fault_proxy import FaultProxy, Request, is_download

from ckpt_service import layout
from ckpt_service.errors import (
    CheckpointChangedError,
    CommitConflictError,
    CorruptCheckpointError,
    LeaseLostError,
    StoreListingError,
)
from ckpt_service.lease import Lease
from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import LocalStore, MemoryStore, ObjectStore
from ckpt_service.testing.delegating import DelegatingStore

WAIT_S = 30.0
CLI = str(Path(sys.executable).with_name("hvd-transient"))


def state(fill: int) -> dict[str, np.ndarray]:
    return {"w": np.full(300, fill, np.float32), "b": np.arange(fill, fill + 40, dtype=np.int64),
            "v": np.full((20, 10), fill, np.float64)}


def assert_state(mgr: CheckpointManager, step: int, fill: int) -> None:
    got = mgr.restore()
    assert got.step == step, f"restored step {got.step}, expected {step}"
    for name, want in state(fill).items():
        np.testing.assert_array_equal(got.tensors[name], want, err_msg=name)


class HoldFirst(DelegatingStore):
    """Holds the first put whose key ``match`` accepts (once armed) until ``release`` is set: a process
    paused at that point of its save."""

    def __init__(self, inner: ObjectStore, match: Callable[[str, int | None], bool]) -> None:
        super().__init__(inner)
        self.match, self.armed = match, False
        self.reached, self.release = threading.Event(), threading.Event()

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if self.armed and self.match(key, if_generation_match):
            self.armed = False
            self.reached.set()
            assert self.release.wait(WAIT_S), "the test never released the paused call"
        return self.inner.put(key, data, if_generation_match=if_generation_match)


def is_marker(key: str, match: int | None) -> bool:
    return key.startswith(layout.COMMITS_PREFIX)


def is_manifest(key: str, match: int | None) -> bool:
    return "/manifest." in key


@pytest.fixture(params=["memory", "local", "gcs"])
def store(request, tmp_path) -> ObjectStore:
    return make_backend_store(request.param, tmp_path, request)


@pytest.fixture(params=["memory", "local"])
def near_store(request, tmp_path) -> ObjectStore:
    return make_backend_store(request.param, tmp_path, request)


# ---- orders that could invert ---------------------------------------------------------------------


def test_a_stalled_old_master_with_a_deadline_never_replaces_its_successors_commit(store: ObjectStore) -> None:
    held = HoldFirst(store, is_marker)
    old_lease, successor = Lease(held, "old-master"), Lease(store, "successor")
    old_lease.acquire()
    with CheckpointManager(held, max_to_keep=None) as old, CheckpointManager(store, max_to_keep=None) as mgr, \
            ThreadPoolExecutor(1) as pool:
        old.save(10, state(10), lease=old_lease)
        held.armed = True
        stalled = pool.submit(old.save, 20, state(666), lease=old_lease, deadline=time.time() + 60)
        assert held.reached.wait(WAIT_S)
        successor.acquire(steal=True)
        mgr.save(11, state(11), lease=successor)
        mgr.save(20, state(20), lease=successor)
        held.release.set()
        with pytest.raises(CommitConflictError):
            stalled.result(timeout=WAIT_S)
        assert_state(mgr, 20, 20)
        assert mgr.gc() == []  # nothing superseded: the successor's 11 and 20 both stay
        assert mgr.all_steps() == [10, 11, 20]
        assert_state(mgr, 20, 20)


def test_a_slow_background_save_never_supersedes_the_step_committed_after_it_began(store: ObjectStore) -> None:
    held = HoldFirst(store, is_manifest)
    lease = Lease(held, "master")
    lease.acquire()
    with CheckpointManager(held, max_to_keep=2) as mgr:
        mgr.save(90, state(90), lease=lease)
        held.armed = True
        assert mgr.save_async(100, state(100), lease=lease)
        assert held.reached.wait(WAIT_S)  # its pieces are written; its manifest and fence wait
        mgr.save(105, state(105), lease=lease, deadline=time.time() + 60)  # a final save that did not wait
        held.release.set()
        assert mgr.wait(timeout=WAIT_S) is not None  # it commits, after 105, under a newer fence
        assert mgr.commit_marker(100).fence > mgr.commit_marker(105).fence
        assert mgr.all_steps() == [100, 105]  # its retention kept 105, the newest
        assert_state(mgr, 105, 105)
        mgr.gc()
        assert mgr.all_steps() == [100, 105]
        assert_state(mgr, 105, 105)


def copy_prefix(src: ObjectStore, dst: ObjectStore, *, with_lease: bool) -> None:
    for key in src.list(""):
        if with_lease or not key.startswith("lease/"):
            dst.put(key, src.get(key))


@pytest.mark.parametrize("with_lease", [True, False], ids=["with-lease", "without-lease"])
@pytest.mark.parametrize("route", ["local-to-gcs", "local-to-memory", "memory-to-local"])
def test_a_run_moved_to_another_kind_of_store_goes_on_in_order(route: str, with_lease: bool, tmp_path, request) -> None:
    src_kind, dst_kind = route.split("-to-")
    src = make_backend_store(src_kind, tmp_path / "src", request)
    dst = make_backend_store(dst_kind, tmp_path / "dst", request)
    lease = Lease(src, "first-run")
    lease.acquire()
    with CheckpointManager(src, max_to_keep=None) as mgr:
        for step in (100, 200, 250):
            mgr.save(step, state(step), lease=lease)
        mgr.save(150, state(150), lease=lease)  # a rollback: 200 and 250 are superseded
        assert mgr.all_steps() == [100, 150]
    copy_prefix(src, dst, with_lease=with_lease)
    resumed = Lease(dst, "second-run")
    resumed.acquire(steal=True)
    with CheckpointManager(dst, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [100, 150]
        mgr.save(300, state(300), lease=resumed)
        assert mgr.all_steps() == [150, 300]
        assert_state(mgr, 300, 300)
        mgr.gc()
        assert 300 in mgr.all_steps()
        assert_state(mgr, 300, 300)


def test_fencing_holds_on_a_filesystem_with_one_second_timestamps(tmp_path: Path) -> None:
    store = CoarseLocalStore(tmp_path / "store", fsync=False)
    old, new = Lease(store, "old"), Lease(store, "new")
    old.acquire()
    new.acquire(steal=True)  # within the same second as the old master's write
    with pytest.raises(LeaseLostError):
        old.fence()
    assert new.fence() > new.acquired_generation
    generations = []
    for _ in range(5):
        new.fence()
        generations.append(store.stat(new.key).generation)
    assert all(g % 10**9 == 0 for g in generations)  # the timestamps really are coarse
    assert all(a < b for a, b in zip(generations, generations[1:]))
    with CheckpointManager(store, max_to_keep=None) as mgr:
        mgr.save(1, state(1), lease=new)
        with pytest.raises(LeaseLostError):
            mgr.save(2, state(2), lease=old)
        assert_state(mgr, 1, 1)


# ---- gc and retention that must not lose the good step ----------------------------------------------


def test_gc_during_a_replay_keeps_the_replays_files(store: ObjectStore) -> None:
    lease = Lease(store, "master")
    lease.acquire()
    held = HoldFirst(store, is_marker)
    with CheckpointManager(held, max_to_keep=None, abandoned_after_s=3600) as mgr, \
            CheckpointManager(store, max_to_keep=None, abandoned_after_s=3600) as other, \
            ThreadPoolExecutor(1) as pool:
        for step in (100, 200):
            mgr.save(step, state(step), lease=lease)
        mgr.save(150, state(150), lease=lease, deadline=time.time() + 60)  # the rollback commit
        assert mgr.all_steps() == [100, 150]
        held.armed = True
        replay = pool.submit(mgr.save, 200, state(2000), lease=lease)
        assert held.reached.wait(WAIT_S)  # the replay's pieces and manifest are written
        assert 200 in other.gc()  # the superseded 200 goes; the replay's fresh files stay
        held.release.set()
        assert replay.result(timeout=WAIT_S) is not None
        assert mgr.verify(200).ok
        assert_state(mgr, 200, 2000)


def test_a_damaged_latest_step_is_kept_with_the_newest_step_that_verifies(store: ObjectStore, tmp_path) -> None:
    with CheckpointManager(store, max_to_keep=None) as mgr:
        for step in (100, 150, 200):
            mgr.save(step, state(step))
        flip_one_byte_of_a_chunk(store, 200)
        assert_state(mgr, 150, 150)  # restore falls back
        if isinstance(store, LocalStore):  # the operator's command, as run
            done = subprocess.run([CLI, "ckpt", "gc", str(store.root), "--keep", "1"], capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, done.stderr
        else:
            mgr.gc(keep=1)
        assert mgr.all_steps() == [150, 200]  # the damaged latest and the only step that verifies
        assert_state(mgr, 150, 150)
        # a job without a lease that resumed from 150 goes on below the damaged 200
        mgr.save(160, state(160))
        mgr.save(190, state(190))
        assert_state(mgr, 190, 190)
        mgr.gc(keep=1)
        assert 190 in mgr.all_steps()
        assert_state(mgr, 190, 190)


def test_a_damaged_rollback_commit_does_not_hide_the_step_it_replaced(near_store: ObjectStore) -> None:
    lease = Lease(near_store, "master")
    lease.acquire()
    with CheckpointManager(near_store, max_to_keep=None) as mgr:
        for step in (100, 200):
            mgr.save(step, state(step), lease=lease)
        mgr.save(150, state(150), lease=lease, deadline=time.time() + 60)  # supersedes 200; no retention yet
        flip_one_byte_of_a_chunk(near_store, 150)
        assert_state(mgr, 200, 200)  # the newest commit that verifies
        assert mgr.gc() == []  # 200's only superseder fails verification: it stays
        assert_state(mgr, 200, 200)
        assert mgr.restorable_step() == 200


def test_a_listing_error_is_never_read_as_an_empty_store(tmp_path: Path, monkeypatch) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    lease = Lease(store, "master")
    lease.acquire()
    with CheckpointManager(store, max_to_keep=None) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, state(step), lease=lease)
    unreadable = str(store.root / "commits")
    real_scandir = os.scandir

    def scandir(path: Any = ".") -> Any:  # the folder is unreadable (permissions, an NFS EIO or ESTALE)
        if os.fspath(path) == unreadable:
            raise PermissionError(13, "Permission denied", unreadable)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    fresh = Lease(store, "fresh-job")
    with CheckpointManager(store, max_to_keep=1) as mgr:
        with pytest.raises(StoreListingError, match="commits"):
            mgr.latest_step()
        with pytest.raises(StoreListingError):
            mgr.restore()
        with pytest.raises(StoreListingError):
            mgr.gc()
        with pytest.raises(StoreListingError):  # it starts above the markers it must see
            fresh.acquire(steal=True)
    monkeypatch.setattr(os, "scandir", real_scandir)
    with CheckpointManager(store, max_to_keep=None) as mgr:
        assert mgr.all_steps() == [100, 200, 300]
        assert_state(mgr, 300, 300)


def is_chunk_download(req: Request) -> bool:
    return is_download(req) and "%2Fdata%2F" in req.path and "zarr.json" not in req.path


@pytest.mark.parametrize("faults", [1, 2])
def test_a_transfer_checksum_mismatch_is_read_again_not_taken_for_corruption(
        faults: int, gcs_emulator_session) -> None:
    from ckpt_service.stores.gcs import GCSStore

    bucket = gcs_emulator_session.new_bucket("flip")
    with FaultProxy(gcs_emulator_session.url) as proxy:
        client = gcs_emulator_session.client(endpoint=proxy.url)
        store = GCSStore(bucket, "run", client=client)
        with CheckpointManager(store, max_to_keep=None) as mgr:
            for step in (200, 300):
                mgr.save(step, state(step))
            proxy.flip_reply_byte_of_next(match=is_chunk_download, count=faults)
            assert_state(mgr, 300, 300)
            assert proxy.outcomes(is_chunk_download).count("flipped-reply") == faults
        client.close()


# ---- readers that must not disagree --------------------------------------------------------------------


def test_partitioned_readers_never_fall_back_alone(near_store: ObjectStore) -> None:
    with CheckpointManager(near_store, max_to_keep=None, chunk_bytes=256) as mgr:
        mgr.save(100, state(100))
        mgr.save(200, state(200))
        damaged = flip_one_byte_of_a_chunk(near_store, 200)
        outcomes: list[Any] = []
        for reader in range(2):
            try:
                outcomes.append(mgr.restore(partition=(reader, 2)).step)
            except CorruptCheckpointError as exc:
                assert "restorable_step" in str(exc)
                outcomes.append(None)
        assert None in outcomes and 100 not in outcomes, (damaged, outcomes)  # one raises, none falls back
        step = mgr.restorable_step()
        assert step == 100
        merged: dict[str, np.ndarray] = {}
        for reader in range(2):
            merged.update(mgr.restore(step, partition=(reader, 2)).tensors)
        for name, want in state(100).items():
            np.testing.assert_array_equal(merged[name], want, err_msg=name)


class DeleteOnFirstChunkRead(DelegatingStore):
    def __init__(self, inner: ObjectStore, meanwhile: Callable[[], None]) -> None:
        super().__init__(inner)
        self.meanwhile, self.done = meanwhile, False

    def get(self, key: str) -> bytes:
        if not self.done and "/data/" in key and "/c/" in key:
            self.done = True
            self.meanwhile()
        return self.inner.get(key)


def test_a_step_deleted_while_read_by_number_says_read_again() -> None:
    inner = MemoryStore("deleted-while-read")
    with CheckpointManager(inner, max_to_keep=None) as writer:
        writer.save(100, state(100))
        writer.save(101, state(101))
        reading = DeleteOnFirstChunkRead(inner, lambda: writer.delete(100))
        with CheckpointManager(reading, max_to_keep=None) as reader:
            with pytest.raises(CheckpointChangedError, match="read it again"):
                reader.restore(step=100)
        reading = DeleteOnFirstChunkRead(inner, lambda: writer.delete(101))
        with CheckpointManager(reading, max_to_keep=None) as reader:
            with pytest.raises(CheckpointChangedError):
                reader.verify(101)


def test_a_replaced_commits_files_are_aged_from_the_replacement(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    first, second = Lease(store, "first"), Lease(store, "second")
    first.acquire()
    with CheckpointManager(store, max_to_keep=None, abandoned_after_s=600) as mgr:
        mgr.save(100, state(100), lease=first)
        old_pieces = [k for k in store.list(layout.step_prefix(100))]
        long_ago = time.time() - 3600
        for key in old_pieces:  # written an hour ago
            os.utime(store.root / key, (long_ago, long_ago))
        second.acquire(steal=True)
        mgr.save(100, state(1000), lease=second)  # made before its tenure: replaced now
        mgr.gc()
        # a restore that began reading the replaced commit still finds its pieces
        left = set(store.list(layout.step_prefix(100)))
        assert {k for k in old_pieces if "/data/" in k} <= left
        assert_state(mgr, 100, 1000)
