"""SIGKILL a writer process at seeded points of a save: the last commit always survives."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import crash_writer
import pytest
from ckpt_helpers import assert_same_state, sample_state

from ckpt_service.manager import CheckpointManager

HERE = Path(__file__).resolve().parent
TRIALS = 6
REPEATED_TRIALS = 20
ABANDONED_S = 600.0


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


def later(seconds: float):
    """A wall clock ``seconds`` ahead: what gc sees when everything on disk is that much older."""
    return lambda: time.time() + seconds


def stray_temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob(".tmp-*"))


def empty_dirs(root: Path) -> list[Path]:
    return [d for d in root.rglob("*") if d.is_dir() and not any(d.iterdir())]


def test_gc_sweeps_what_writes_killed_midway_left_on_a_local_store(tmp_path) -> None:
    """Killed between writing a temp file and publishing it, a save leaves temp files that no
    listing shows; gc removes them (and folders left empty) once older than abandoned_after_s,
    and never a young one, which may be a write in progress."""
    total = int(run_writer(str(tmp_path / "probe"), 0).stdout.strip().split("=")[1])
    rng = random.Random(99)
    points = sorted(set(rng.sample(range(1, total + 1), TRIALS - 1)) | {total})
    for kill_at in points:
        root = tmp_path / f"store-{kill_at}"
        result = run_writer(str(root), kill_at, "--inside")
        assert result.returncode == -signal.SIGKILL, (kill_at, result.stderr)
        stray = stray_temp_files(root)
        assert stray, f"killed inside write {kill_at}, a temp file must be left"
        with CheckpointManager(str(root), max_to_keep=None) as mgr:
            mgr.gc()  # the temp file is young: it may belong to a write in flight, it stays
            assert stray_temp_files(root) == stray
        with CheckpointManager(str(root), max_to_keep=None, clock=later(ABANDONED_S + 1),
                               abandoned_after_s=ABANDONED_S) as mgr:
            mgr.gc()
            assert stray_temp_files(root) == []
            assert mgr.all_steps() == [1] and mgr.verify(1).ok
            assert_same_state(mgr.restore().tensors, sample_state(1, scale=8))
        # folders that held only temp files went with them (published pieces of the uncommitted
        # step 2 stay: it is newer than the latest commit, so it may still be being written)
        assert empty_dirs(root) == []


def test_repeated_kills_on_one_store_leave_nothing_after_gc(tmp_path) -> None:
    """A job preempted again and again on one store (retention keeps 3): saves killed inside a
    write pile up temp files, some under commits/ and some in step folders that retention later
    retires; one gc removes every old one and every folder they leave empty, and every committed
    step still restores bit-exactly."""
    root = tmp_path / "store"
    probe = run_writer(str(root), 0, "--next")  # commits step 1 and counts a save's writes
    assert probe.returncode == 0, probe.stderr
    total = int(probe.stdout.strip().split("=")[1])
    rng = random.Random(2024)
    committed, inside_kills = [1], 0
    for trial in range(REPEATED_TRIALS):
        phase = trial % 4  # each step number: killed three times (twice inside a write), then committed
        if phase == 3:
            result = run_writer(str(root), 0, "--next")
            assert result.returncode == 0, result.stderr
            committed.append(committed[-1] + 1)
            continue
        # the first kill inside a write dies inside the commit marker's own write
        kill_at = total if inside_kills == 0 else rng.randint(1, total)
        inside = phase < 2
        result = run_writer(str(root), kill_at, "--next", *(["--inside"] if inside else []))
        assert result.returncode == -signal.SIGKILL, (trial, kill_at, result.stderr)
        inside_kills += inside
    kept = committed[-crash_writer.KEEP:]

    stray = stray_temp_files(root)
    assert len(stray) == inside_kills  # the leak: nothing ever listed them
    assert [p.parent.name for p in stray].count("commits") == 1
    step_dirs = {int(d.name) for d in (root / "steps").iterdir()}
    assert step_dirs - set(kept), "retired steps' folders should still hold the killed saves' temp files"

    with CheckpointManager(str(root), max_to_keep=crash_writer.KEEP) as mgr:
        mgr.gc()  # all of it is younger than abandoned_after_s: a save may still be writing it
        assert stray_temp_files(root) == stray
    with CheckpointManager(str(root), max_to_keep=crash_writer.KEEP, abandoned_after_s=ABANDONED_S,
                           clock=later(ABANDONED_S + 1)) as mgr:
        mgr.gc()
        assert stray_temp_files(root) == []
        assert empty_dirs(root) == []
        assert sorted(int(d.name) for d in (root / "steps").iterdir()) == kept
        assert sorted(p.name for p in (root / "commits").iterdir()) == [f"{s:012d}.json" for s in kept]
        assert mgr.all_steps() == kept
        for step in kept:
            assert mgr.verify(step).ok
            ckpt = mgr.restore(step=step)
            assert ckpt.metadata == {"step": step}
            assert_same_state(ckpt.tensors, sample_state(step, scale=8))
