"""Shared bits for checkpoint-service tests: stores per backend, sample states, corruption."""
from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ckpt_service.stores import LocalStore, MemoryStore, ObjectStore
from ckpt_service.testing.delegating import DelegatingStore  # also re-exported for the tests

BACKENDS = ["memory", "local", "gcs"]
PAUSE_WAIT_S = 30.0  # a bound on a paused call's wait: hitting it is a hang


class PutSeenStore(DelegatingStore):
    """Sets ``seen`` once a put of a key that ``match`` accepts has succeeded (an event to wait on)."""

    def __init__(self, inner: ObjectStore, match: Callable[[str], bool]) -> None:
        super().__init__(inner)
        self.match, self.seen = match, threading.Event()

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        generation = super().put(key, data, if_generation_match=if_generation_match)
        if self.match(key):
            self.seen.set()
        return generation


def make_backend_store(kind: str, tmp_path: Path, request) -> ObjectStore:
    if kind == "memory":
        return MemoryStore(uuid.uuid4().hex)
    if kind == "local":
        return LocalStore(tmp_path / "store", fsync=False)
    from ckpt_service.stores.gcs import GCSStore

    emu = request.getfixturevalue("gcs_emulator_session")
    return GCSStore(emu.new_bucket("ckpt"), f"runs/{uuid.uuid4().hex[:8]}")


def sample_state(seed: int = 0, scale: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv1/kernel:0": rng.standard_normal((3, 3, 16, 32 * scale)).astype(np.float32),
        "conv1/bias:0": rng.standard_normal(32 * scale).astype(np.float32),
        "dense/kernel:0": rng.standard_normal((512, 100 * scale)).astype(np.float32),
        "bn/moving_mean:0": rng.standard_normal(64).astype(np.float64),
        "optimizer/iter:0": np.array(1234, dtype=np.int64),
        "mask": rng.integers(0, 2, 50).astype(bool),
        "half": rng.standard_normal((20, 7)).astype(np.float16),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "big_endian": np.arange(10, dtype=">i4"),
    }


def assert_same_state(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, arr in want.items():
        assert got[name].shape == arr.shape, name
        assert got[name].dtype.newbyteorder("<") == arr.dtype.newbyteorder("<"), name
        np.testing.assert_array_equal(got[name], arr, err_msg=name)


def flip_one_byte_of_a_chunk(store: ObjectStore, step: int) -> str:
    """Corrupt the first data chunk of ``step``; return its key."""
    prefix = f"steps/{step:012d}/data/"
    key = next(k for k in store.list(prefix) if "/c/" in k)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0xFF
    store.put(key, bytes(data))
    return key


def who_state(step: int, who: int = 0) -> dict[str, np.ndarray]:
    """A small state that says which step and which saver (``who``) made it."""
    return {"w": np.full(64, step * 1000 + who, np.float32), "b": np.arange(5, dtype=np.int64) + step}


def who_saved(ckpt: Any) -> int:
    return int(ckpt.tensors["w"][0]) % 1000


class PauseAt(DelegatingStore):
    """Blocks the first put whose key ``match`` accepts (once armed) until ``release`` is set: a process
    paused at that point of its save."""

    def __init__(self, inner: ObjectStore, match: Callable[[str], bool]) -> None:
        super().__init__(inner)
        self.match, self.armed = match, False
        self.reached, self.release = threading.Event(), threading.Event()

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if self.armed and self.match(key):
            self.armed = False
            self.reached.set()
            assert self.release.wait(PAUSE_WAIT_S), "the test never released the paused call"
        return self.inner.put(key, data, if_generation_match=if_generation_match)


class CoarseLocalStore(LocalStore):
    """A local store on a filesystem that keeps whole seconds only (ext2/3, HFS+): every mtime set is
    truncated, as such a filesystem would."""

    def _set_mtime(self, path: Path, ns: int) -> int:
        whole = ns - ns % 10**9
        os.utime(path, ns=(whole, whole))
        return os.stat(path).st_mtime_ns
