"""A local store's commit marker never outlives what it names: by the time the marker is renamed
into place, every piece and the manifest have been synced (file before its rename, folder after),
and so has the parent of every folder made for them."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from ckpt_service import layout
from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import LocalStore


class SyscallLog:
    """os.fsync, os.replace and os.mkdir, recorded in order and then performed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        real_fsync, real_replace, real_mkdir = os.fsync, os.replace, os.mkdir

        def fsync(fd: int) -> None:
            real_fsync(fd)
            self._note("fsync", os.readlink(f"/proc/self/fd/{fd}"))

        def replace(src: str, dst: str) -> None:
            real_replace(src, dst)
            self._note("replace", os.fspath(dst), os.fspath(src))

        def mkdir(path: str, *args: object, **kwargs: object) -> None:
            real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]
            self._note("mkdir", os.fspath(path))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "mkdir", mkdir)

    def _note(self, what: str, path: str, source: str = "") -> None:
        with self._lock:
            self.events.append((what, os.path.realpath(path), source and os.path.realpath(source)))

    def index(self, what: str, path: Path) -> int:
        return next(i for i, (w, p, _s) in enumerate(self.events) if (w, p) == (what, str(path)))

    def synced_between(self, path: Path | str, start: int, stop: int) -> bool:
        return any(e[:2] == ("fsync", str(path)) for e in self.events[start + 1:stop])


pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name synced files")


@pytest.mark.parametrize("world_size", [1, 2])
def test_pieces_and_manifest_are_durable_before_the_commit_marker(tmp_path: Path, monkeypatch, world_size) -> None:
    root = (tmp_path / "store").resolve()
    state = {"w": np.arange(5000, dtype=np.float32), "n": np.arange(100, dtype=np.int64)}
    managers = [CheckpointManager(LocalStore(root), max_to_keep=None, chunk_bytes=4096) for _ in range(world_size)]
    try:
        syscalls = SyscallLog(monkeypatch)
        ranks = [{"rank": r, "world_size": world_size, "attempt": "a1"} for r in range(world_size)]
        threads = [threading.Thread(target=m.save, args=(3, state), kwargs=kw) for m, kw in zip(managers, ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert managers[0].all_steps() == [3]
    finally:
        for m in managers:
            m.close()

    marker = syscalls.index("replace", root / layout.commit_key(3))
    step_dir = str(root / layout.step_prefix(3))
    published = [(i, Path(p), tmp) for i, (what, p, tmp) in enumerate(syscalls.events[:marker])
                 if what == "replace" and p.startswith(step_dir)]
    names = {p.name for _, p, _tmp in published}
    assert any(n.startswith("manifest.") for n in names) and "zarr.json" in names and "1" in names
    for i, path, tmp in published:
        assert syscalls.synced_between(tmp, -1, i), f"{path} was renamed into place before its data was synced"
        assert syscalls.synced_between(path.parent, i, marker), f"{path}: folder not synced before the commit"
    # every folder made on the way to the step's objects is synced into its parent
    made = [(i, Path(p)) for i, (what, p, _s) in enumerate(syscalls.events[:marker])
            if what == "mkdir" and p.startswith(str(root / layout.STEPS_PREFIX))]
    assert len(made) >= 5
    for i, folder in made:
        assert syscalls.synced_between(folder.parent, i, marker), f"the folder {folder} was not synced into its parent"


def test_no_syncs_without_fsync(tmp_path: Path, monkeypatch) -> None:
    syscalls = SyscallLog(monkeypatch)
    store = LocalStore(tmp_path / "store", fsync=False)
    store.put("a/b/c", b"x")
    store.create_exclusive("commits/1.json", b"y")
    assert [e for e in syscalls.events if e[0] == "fsync"] == []
    assert store.get("a/b/c") == b"x"
