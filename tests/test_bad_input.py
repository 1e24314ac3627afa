"""Bad input and damaged stores get a typed error that names the argument or the damaged object.

The API cases run on the memory and local stores; the damaged-store cases also through the real
``hvd-transient ckpt`` console script, on a local directory, as an operator would meet them: one
line on stderr, a non-zero status where the command failed, never a traceback. Wherever a store
is involved, the checkpoint committed before the bad input still restores afterwards.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from ckpt_helpers import assert_same_state, make_backend_store

from ckpt_service import layout
from ckpt_service.errors import (
    BadCompressionError,
    BadDeadlineError,
    BadNamesError,
    BadStepError,
    CorruptCheckpointError,
    StoreUnavailableError,
)
from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import LocalStore, ObjectStore, open_store

CLI = str(Path(sys.executable).parent / "hvd-transient")
STATE = {"weights": np.arange(1000, dtype=np.float32), "bias": np.ones((3, 4), dtype=np.int64)}
#: small chunks, so that a piece has several and its last one is partial (both read paths run)
CHUNK_BYTES = 1024


def state(step: int) -> dict[str, np.ndarray]:
    return {name: array + step for name, array in STATE.items()}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "ckpt", *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def assert_no_traceback(out: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in out.stdout + out.stderr, out.stderr


def error_line(out: subprocess.CompletedProcess[str]) -> str:
    """The command's one error line (log lines, such as a warning about an unreadable marker, may precede it)."""
    assert_no_traceback(out)
    lines = [line for line in out.stderr.splitlines() if ": error: " in line]
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture(params=["memory", "local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    return make_backend_store(request.param, tmp_path, request)


@pytest.fixture
def mgr(store: ObjectStore) -> Iterator[CheckpointManager]:
    """A manager over ``store``, in which steps 10 and 20 are committed."""
    with CheckpointManager(store, max_to_keep=None, chunk_bytes=CHUNK_BYTES) as manager:
        for step in (10, 20):
            manager.save(step, state(step))
        yield manager


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """A local store directory in which steps 10 and 20 are committed."""
    root = tmp_path / "ckpts"
    with CheckpointManager(str(root), max_to_keep=None, chunk_bytes=CHUNK_BYTES) as manager:
        for step in (10, 20):
            manager.save(step, state(step))
    return root


def assert_intact(store: ObjectStore | str, steps: tuple[int, ...] = (10, 20)) -> None:
    """Each of ``steps`` is committed, verifies and restores to the state it was saved with."""
    with CheckpointManager(store, max_to_keep=None) as manager:
        assert set(steps) <= set(manager.all_steps())
        for step in steps:
            assert manager.verify(step).ok
            assert_same_state(manager.restore(step).tensors, state(step))


def snapshot(store: ObjectStore) -> dict[str, bytes]:
    return {key: store.get(key) for key in store.list("")}


# ---- a chunk object that is a folder -------------------------------------------------------------


def chunk_as_folder(root: Path, step: int, which: str) -> str:
    """Replace the first (a whole chunk) or the last (a partial one) chunk file of a piece of
    ``step`` by a folder; returns the piece's key."""
    store = LocalStore(root)
    chunk_files = sorted(k for k in store.list(layout.step_prefix(step) + "data/") if "/c/" in k)
    piece = chunk_files[0].rsplit("/c/", 1)[0]
    indices = sorted(int(k.rsplit("/", 1)[1]) for k in chunk_files if k.startswith(piece + "/c/"))
    assert len(indices) > 1, "the piece should have several chunks"
    path = root / f"{piece}/c/{indices[0] if which == 'first' else indices[-1]}"
    path.unlink()
    path.mkdir()
    return piece


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_chunk_that_is_a_folder_is_a_corrupt_piece(tmp_path: Path, which: str) -> None:
    # a folder can only stand where an object belongs on the local store
    root = tmp_path / "store"
    with CheckpointManager(str(root), max_to_keep=None, chunk_bytes=CHUNK_BYTES) as mgr:
        for step in (10, 20):
            mgr.save(step, state(step))
        piece = chunk_as_folder(root, 20, which)
        report = mgr.verify(20)
        assert not report.ok
        assert len(report.problems) == 1 and "is a folder" in report.problems[0] and piece in report.problems[0]
        for names, partition in ((None, None), (["weights"], (0, 1))):
            with pytest.raises(CorruptCheckpointError, match="c/") as caught:
                mgr.restore(20, names=names, partition=partition)
            assert piece in str(caught.value)
        assert mgr.restore().step == 10
    assert_intact(str(root), (10,))


def test_the_cli_verify_reports_a_chunk_that_is_a_folder_as_corrupt(store_dir: Path) -> None:
    chunk_as_folder(store_dir, 20, "first")
    out = run_cli("verify", str(store_dir))
    assert_no_traceback(out)
    assert out.returncode == 1 and "step 20: CORRUPT" in out.stdout and "is a folder" in out.stdout
    assert "step 10: OK" in out.stdout
    assert_intact(str(store_dir), (10,))


# ---- commit marker names that are not a step's -----------------------------------------------


FOREIGN_MARKERS = ["commits/².json", "commits/٣.json", "commits/0000000000²0.json", "commits/1234567890123.json",
                   "commits/20.json"]


def test_parse_commit_key_takes_only_the_keys_commit_key_writes() -> None:
    assert layout.parse_commit_key(layout.commit_key(20)) == 20
    assert layout.parse_step_dir("000000000020") == 20
    for key in FOREIGN_MARKERS:
        assert layout.parse_commit_key(key) is None, key
    for name in ("²", "0000000000²0", "1234567890123", "20", "-00000000020"):
        assert layout.parse_step_dir(name) is None, name


def test_files_in_commits_that_do_not_name_a_step_are_ignored(mgr: CheckpointManager, store: ObjectStore) -> None:
    for key in FOREIGN_MARKERS:
        store.put(key, b'{"step": 2}')
    store.put("steps/²/data/x", b"not a step")
    assert mgr.all_steps() == [10, 20]
    assert mgr.latest_step() == 20
    mgr.gc(keep=5)
    assert_intact(store)


def test_the_cli_on_a_file_named_commits_superscript_two(store_dir: Path, tmp_path: Path) -> None:
    for key in FOREIGN_MARKERS:
        (store_dir / key).write_text('{"step": 2}')
    url = str(store_dir)
    out = run_cli("ls", url, "--json")
    assert_no_traceback(out)
    assert out.returncode == 0 and [s["step"] for s in json.loads(out.stdout)["steps"]] == [10, 20]
    for args in (("inspect", url), ("verify", url), ("gc", url, "--keep", "5"),
                 ("export", url, "--step", "20", str(tmp_path / "out.npz"))):
        out = run_cli(*args)
        assert_no_traceback(out)
        assert out.returncode == 0, (args, out.stderr)
    assert_intact(url)


# ---- steps too large for the store's keys -----------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_the_cli_refuses_a_step_of_300_digits_naming_the_option(store_dir: Path, tmp_path: Path,
                                                                command: str) -> None:
    args = [command, str(store_dir), "--step", "1" + "0" * 299]
    if command == "export":
        args.append(str(tmp_path / "out.npz"))
    out = run_cli(*args)
    line = error_line(out)
    assert out.returncode == 2 and "--step" in line and "too large" in line and "999999999999" in line, line
    assert "0" * 50 not in line  # not the 300 digits back
    assert_intact(str(store_dir))


@pytest.mark.parametrize("step", [10 ** 300, 10 ** 12, 10 ** 5000], ids=["300-digits", "13-digits", "5001-digits"])
def test_a_step_too_large_for_the_keys_is_a_bad_step_before_anything_is_written(
        mgr: CheckpointManager, store: ObjectStore, step: int) -> None:
    before = snapshot(store)
    with pytest.raises(BadStepError, match="too large") as caught:
        mgr.save(step, state(1))
    assert "step" in str(caught.value) and "999999999999" in str(caught.value)
    with pytest.raises(BadStepError, match="too large"):
        mgr.save_async(step, state(1))
    for read in (mgr.restore, mgr.manifest, mgr.commit_marker, mgr.verify, mgr.delete):
        with pytest.raises(BadStepError):
            read(step)
    assert snapshot(store) == before
    assert_intact(store)


def test_the_largest_step_the_keys_hold_saves_and_restores(store: ObjectStore) -> None:
    with CheckpointManager(store, max_to_keep=None) as mgr:
        mgr.save(layout.STEP_LIMIT - 1, state(1))
        assert mgr.all_steps() == [layout.STEP_LIMIT - 1]
        assert_same_state(mgr.restore().tensors, state(1))


# ---- constructor and call arguments -----------------------------------------------------------


@pytest.mark.parametrize("compression", ["gzip", "ZSTD", None, 1])
def test_an_unknown_compression_is_refused_by_the_constructor(store: ObjectStore, compression: Any) -> None:
    with CheckpointManager(store, max_to_keep=None) as mgr:
        mgr.save(10, state(10))
    before = snapshot(store)
    with pytest.raises(BadCompressionError) as caught:
        CheckpointManager(store, compression=compression)
    message = str(caught.value)
    assert "compression" in message and repr(compression) in message
    assert all(repr(c) in message for c in ("none", "zstd", "blosc"))
    assert snapshot(store) == before
    assert_intact(store, (10,))


@pytest.mark.parametrize("how", ["path", "file_url", "local_store", "root_is_the_file"])
def test_a_store_path_below_a_regular_file_names_the_file(tmp_path: Path, how: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    below = afile / "runs" / "r1"
    with pytest.raises(StoreUnavailableError) as caught:
        if how == "path":
            CheckpointManager(str(below))
        elif how == "file_url":
            open_store(f"file://{below}")
        elif how == "local_store":
            LocalStore(below)
        else:
            LocalStore(afile)
    assert str(afile) in str(caught.value) and "not a directory" in str(caught.value)
    assert afile.read_text() == "not a directory\n"


@pytest.mark.parametrize("deadline", [math.inf, -math.inf, math.nan, np.float64("nan"), 10 ** 400, "soon", True,
                                      [1.0]], ids=["inf", "-inf", "nan", "np-nan", "401-digits", "str", "bool", "list"])
def test_a_deadline_that_is_not_finite_epoch_seconds_is_refused_before_anything_is_written(
        mgr: CheckpointManager, store: ObjectStore, deadline: Any) -> None:
    before = snapshot(store)
    with pytest.raises(BadDeadlineError) as caught:
        mgr.save(30, state(30), deadline=deadline)
    assert "deadline" in str(caught.value)
    assert snapshot(store) == before
    assert mgr.all_steps() == [10, 20]
    assert_intact(store)


def test_a_finite_deadline_still_saves(mgr: CheckpointManager) -> None:
    import time

    mgr.save(30, state(30), deadline=int(time.time()) + 120)
    mgr.save(40, state(40), deadline=np.float64(time.time() + 120))
    assert mgr.all_steps() == [10, 20, 30, 40]


@pytest.mark.parametrize("names", ["weights", b"weights", 5, ["weights", 7]])
def test_restore_names_must_be_a_list_of_names(mgr: CheckpointManager, store: ObjectStore, names: Any) -> None:
    with pytest.raises(BadNamesError) as caught:
        mgr.restore(names=names)
    assert "names" in str(caught.value)
    if isinstance(names, str):
        assert "one string" in str(caught.value) and "names=['weights']" in str(caught.value)
    got = mgr.restore(names=("weights",))
    assert list(got.tensors) == ["weights"]
    np.testing.assert_array_equal(got.tensors["weights"], state(20)["weights"])
    assert_intact(store)
# ---- commit markers whose fields have the wrong types ------------------------------------------


def damage_marker(store: ObjectStore, step: int, **fields: Any) -> str:
    key = layout.commit_key(step)
    body = json.loads(store.get(key))
    store.put(key, json.dumps({**body, **fields}).encode())
    return key


@pytest.mark.parametrize("bad_key", [7, ["steps/000000000020/manifest.x.json"]])
def test_a_marker_whose_manifest_key_is_not_a_string_is_unreadable_not_a_crash(
        mgr: CheckpointManager, store: ObjectStore, bad_key: Any) -> None:
    key = damage_marker(store, 20, manifest_key=bad_key)
    with pytest.raises(CorruptCheckpointError) as caught:
        mgr.manifest(20)
    assert key in str(caught.value) and "manifest_key" in str(caught.value)
    report = mgr.verify(20)
    assert not report.ok and "manifest_key" in report.problems[0]
    assert mgr.restore().step == 10  # the damaged latest step is skipped, as any unreadable marker is
    mgr.gc(keep=2)
    assert_intact(store, (10,))


@pytest.mark.parametrize("bad_key", ["7", '["steps/000000000020/manifest.x.json"]'])
def test_the_cli_on_a_marker_whose_manifest_key_is_not_a_string(store_dir: Path, tmp_path: Path, bad_key: str) -> None:
    damage_marker(LocalStore(store_dir), 20, manifest_key=json.loads(bad_key))
    url = str(store_dir)
    out = run_cli("ls", url)
    assert_no_traceback(out)
    assert out.returncode == 0 and "UNREADABLE" in out.stdout and "manifest_key" in out.stdout
    for args in (("inspect", url), ("inspect", url, "--step", "20"),
                 ("export", url, "--step", "20", str(tmp_path / "out.npz"))):
        out = run_cli(*args)
        line = error_line(out)
        assert out.returncode == 1 and "commits/000000000020.json" in line and "manifest_key" in line, line
    out = run_cli("verify", url)
    assert_no_traceback(out)
    assert out.returncode == 1 and "step 20: CORRUPT" in out.stdout and "manifest_key" in out.stdout
    out = run_cli("gc", url, "--keep", "2")
    assert_no_traceback(out)
    assert out.returncode == 0
    assert_intact(url, (10,))


