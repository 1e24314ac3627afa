"""SIGKILL a writer process at seeded points of a save: the last commit always survives."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from ckpt_helpers import assert_same_state, sample_state

from ckpt_service.manager import CheckpointManager

HERE = Path(__file__).resolve().parent
TRIALS = 6


def run_writer(url: str, kill_at: int, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(HERE / "crash_writer.py"), url, str(kill_at), *extra],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(params=["local", "gcs"])
def store_url(request, tmp_path):
    if request.param == "local":
        return lambda: str(tmp_path / f"store-{uuid.uuid4().hex[:6]}")
    emu = request.getfixturevalue("gcs_emulator_session")
    bucket = emu.new_bucket("crash")
    return lambda: f"gs://{bucket}/run-{uuid.uuid4().hex[:6]}"


def test_sigkill_at_random_points_never_loses_the_last_commit(store_url) -> None:
    probe = run_writer(store_url(), 0)
    assert probe.returncode == 0, probe.stderr
    total = int(probe.stdout.strip().split("=")[1])
    assert total > 5
    rng = random.Random(1234)
    points = sorted(set(rng.sample(range(1, total + 1), TRIALS - 1)) | {total})  # incl. the commit itself
    for kill_at in points:
        url = store_url()
        result = run_writer(url, kill_at)
        assert result.returncode == -signal.SIGKILL, (kill_at, result.stderr)
        with CheckpointManager(url, max_to_keep=None) as mgr:
            # the commit marker is the last write of a save: killed at or before it, step 2 never exists
            assert mgr.all_steps() == [1], (kill_at, total)
            assert mgr.verify(1).ok
            ckpt = mgr.restore()
            assert ckpt.step == 1 and ckpt.metadata == {"step": 1}
            assert_same_state(ckpt.tensors, sample_state(1, scale=8))


def test_gc_sweeps_what_writes_killed_midway_left_on_a_local_store(tmp_path) -> None:
    """Killed between writing a temp file and publishing it, a save leaves temp files that no
    listing shows; gc removes them (and folders left empty) once older than abandoned_after_s,
    and never a young one, which may be a write in progress."""
    total = int(run_writer(str(tmp_path / "probe"), 0).stdout.strip().split("=")[1])
    rng = random.Random(99)
    points = sorted(set(rng.sample(range(1, total + 1), TRIALS - 1)) | {total})
    for kill_at in points:
        root = tmp_path / f"store-{kill_at}"
        result = run_writer(str(root), kill_at, "inside")
        assert result.returncode == -signal.SIGKILL, (kill_at, result.stderr)
        stray = [p for p in root.rglob(".tmp-*")]
        assert stray, f"killed inside write {kill_at}, a temp file must be left"
        with CheckpointManager(str(root), max_to_keep=None) as mgr:
            mgr.gc()  # default abandoned_after_s: the temp file is young, it stays
            assert list(root.rglob(".tmp-*")) == stray
        with CheckpointManager(str(root), max_to_keep=None, abandoned_after_s=0) as mgr:
            mgr.gc()
            assert list(root.rglob(".tmp-*")) == []
            assert mgr.all_steps() == [1] and mgr.verify(1).ok
            assert_same_state(mgr.restore().tensors, sample_state(1, scale=8))
        # folders that held only temp files went with them (published pieces of the uncommitted
        # step 2 stay: it is newer than the latest commit, so it may still be being written)
        assert [d for d in root.rglob("*") if d.is_dir() and not any(d.iterdir())] == []
