"""gc that is safe under races: concurrent collectors, skewed clocks, orphaned pieces."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from ckpt_helpers import BACKENDS, assert_same_state, flip_one_byte_of_a_chunk, make_backend_store, sample_state

from ckpt_service import layout
from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import LocalStore
from ckpt_service.stores.base import ObjectStore

ABANDONED_S = 600.0
WAIT_S = 60.0
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path) -> ObjectStore:
    return make_backend_store(request.param, tmp_path, request)


def deep_state(step: int) -> dict[str, np.ndarray]:
    """Several dtype groups, so every step has several nested folders for gcs to remove."""
    return {f"t{i}": np.full(300, step, dtype) for i, dtype in
            enumerate([np.float32, np.float64, np.int32, np.int64, np.int16, np.uint8])}


# ---- two collectors on one directory --------------------------------------------------------------


def test_two_gcs_and_a_save_loop_on_one_directory(tmp_path: Path) -> None:
    """Saves (each followed by its retention) and a second manager's gc loop run at once on one
    directory: each removes folders the other is walking; neither may fail for it."""
    root = tmp_path / "store"
    steps = range(1, 41)
    done = threading.Event()
    errors: list[BaseException] = []

    def save_loop() -> None:
        try:
            with CheckpointManager(LocalStore(root, fsync=False), max_to_keep=1, chunk_bytes=256) as mgr:
                for step in steps:
                    mgr.save(step, deep_state(step))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
            raise
        finally:
            done.set()

    def gc_loop() -> int:
        rounds = 0
        with CheckpointManager(LocalStore(root, fsync=False), max_to_keep=1) as mgr:
            while not done.is_set():
                mgr.gc()
                rounds += 1
        return rounds

    with ThreadPoolExecutor(2) as pool:
        saver = pool.submit(save_loop)
        collector = pool.submit(gc_loop)
        saver.result(timeout=300)  # raises the save's error with its traceback
        assert collector.result(timeout=300) > 0
    assert not errors
    with CheckpointManager(LocalStore(root, fsync=False), max_to_keep=1) as mgr:
        assert mgr.all_steps() == [steps[-1]]
        assert_same_state(mgr.restore().tensors, deep_state(steps[-1]))


def test_two_gcs_at_once_on_many_retired_steps(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with CheckpointManager(LocalStore(root, fsync=False), max_to_keep=None, chunk_bytes=256) as mgr:
        for step in range(1, 31):
            mgr.save(step, deep_state(step))
    barrier = threading.Barrier(2)

    def gc() -> list[int]:
        with CheckpointManager(LocalStore(root, fsync=False), max_to_keep=1, abandoned_after_s=0.0) as mgr:
            barrier.wait(timeout=WAIT_S)
            return mgr.gc()

    with ThreadPoolExecutor(2) as pool:
        removed = [f.result(timeout=300) for f in [pool.submit(gc), pool.submit(gc)]]
    assert set(removed[0]) | set(removed[1]) == set(range(1, 30))
    assert sorted(os.listdir(root / "steps")) == [f"{30:012d}"]


# ---- a manager whose clock runs an hour ahead ------------------------------------------------------

SKEWED_GC = textwrap.dedent("""
    import sys, time
    _real = time.time
    time.time = lambda: _real() + 3600.0  # this VM's clock runs an hour ahead
    from ckpt_service.manager import CheckpointManager
    with CheckpointManager(sys.argv[1], max_to_keep=None, abandoned_after_s=float(sys.argv[2])) as mgr:
        print("removed", mgr.gc())
""")


def run_skewed_gc(root: Path) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", SKEWED_GC, str(root), str(ABANDONED_S)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp-*") if p.is_file()]


def test_skewed_clock_gc_spares_a_slow_concurrent_save(tmp_path: Path) -> None:
    """Another process's save is slow (its writes wait on the store lock, their temp files written);
    a manager whose clock runs an hour ahead runs gc meanwhile. It must take nothing of that save
    (temp files, nor the pieces of a step older than the latest) for abandoned."""
    root = tmp_path / "store"
    store = LocalStore(root, fsync=False)
    with CheckpointManager(store, max_to_keep=None) as mgr:
        mgr.save(1, sample_state(1))
    # a multi-writer save of step 0 still writing its pieces (its coordinator will be refused later)
    young_piece = layout.step_prefix(0) + "data/float32/00000.abc/zarr.json"
    store.put(young_piece, b"{}")
    with open(root / ".hvdt.lock", "a+b") as lock, CheckpointManager(store, max_to_keep=None) as slow, \
            ThreadPoolExecutor(1) as pool:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the slow part: every write waits here with its temp file written
        try:
            saving = pool.submit(slow.save, 2, sample_state(2))
            end = time.monotonic() + WAIT_S
            while not temp_files(root):  # no event to wait on inside the store: the file is the signal
                assert time.monotonic() < end, "the slow save never started writing"
                time.sleep(0.01)
            stray = temp_files(root)
            assert "removed []" in run_skewed_gc(root)
            assert all(p.exists() for p in stray), "the skewed gc swept a write in flight"
            assert store.exists(young_piece), "the skewed gc took a step being written for abandoned"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        assert saving.result(timeout=WAIT_S) is not None
    with CheckpointManager(store, max_to_keep=None) as mgr:
        assert mgr.all_steps() == [1, 2] and mgr.verify(2).ok
        assert_same_state(mgr.restore().tensors, sample_state(2))


# ---- orphaned pieces ---------------------------------------------------------------------------------


def killed_attempt_then_commit(mgr: CheckpointManager, step: int) -> set[str]:
    """A save of ``step`` killed after its pieces were written, then one that commits it; returns the
    keys the killed attempt left."""
    before = set(mgr.store.list(layout.step_prefix(step)))

    def killed(_record: bytes) -> list[bytes]:
        raise RuntimeError("killed before the commit")

    with pytest.raises(RuntimeError):
        mgr.save(step, sample_state(step), gather=killed)
    left = set(mgr.store.list(layout.step_prefix(step))) - before
    assert left
    mgr.save(step, sample_state(step))
    return left


def test_orphaned_pieces_of_a_committed_step_go_once_old(store: ObjectStore) -> None:
    with CheckpointManager(store, max_to_keep=None, chunk_bytes=4096, abandoned_after_s=ABANDONED_S) as mgr:
        orphans = killed_attempt_then_commit(mgr, 3)
        referenced = set(store.list(layout.step_prefix(3))) - orphans
        mgr.gc()
        assert orphans <= set(store.list(layout.step_prefix(3))), "young: a save may still be writing them"
    later = time.time() + ABANDONED_S + 1
    with CheckpointManager(store, max_to_keep=None, abandoned_after_s=ABANDONED_S, clock=lambda: later) as mgr:
        assert mgr.gc() == []
        assert set(store.list(layout.step_prefix(3))) == referenced
        assert mgr.verify(3).ok
        assert_same_state(mgr.restore().tensors, sample_state(3))


def test_replaced_commit_files_go_once_old(store: ObjectStore) -> None:
    """A re-commit of a corrupt step leaves the replaced manifest and pieces: gc removes them, old."""
    with CheckpointManager(store, max_to_keep=None, chunk_bytes=4096) as mgr:
        mgr.save(1, sample_state(1))
        flip_one_byte_of_a_chunk(store, 1)
        replaced = set(store.list(layout.step_prefix(1)))
        mgr.save(1, sample_state(2))
        assert replaced <= set(store.list(layout.step_prefix(1)))
    later = time.time() + 601
    with CheckpointManager(store, max_to_keep=None, clock=lambda: later) as mgr:
        mgr.gc()
        assert not replaced & set(store.list(layout.step_prefix(1)))
        assert mgr.verify(1).ok
        assert_same_state(mgr.restore().tensors, sample_state(2))
