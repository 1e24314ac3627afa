"""A store that hangs must not slow training: between notices, no store call runs on the training thread."""
from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Iterator

import numpy as np
import pytest
from fake_collectives import FakeCollectives, FakeWatcher, ThreadGroup

from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import MemoryStore, ObjectStore
from ckpt_service.testing.delegating import DelegatingStore
from hvd_transient.core.config import TransientConfig
from hvd_transient.core.control import StopPoller, request_stop
from hvd_transient.core.transient import TransientImpl

pytestmark = pytest.mark.timed  # bounds wall-clock times


class HangingStore(DelegatingStore):
    """Every call blocks while the gate is closed (a store that stopped answering)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()  # a call is waiting at the closed gate

    def _wait(self) -> None:
        if not self.gate.is_set():
            self.blocked.set()
            self.gate.wait(60)

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        self._wait()
        return super().put(key, data, if_generation_match=if_generation_match)

    def get(self, key: str) -> bytes:
        self._wait()
        return super().get(key)

    def stat(self, key: str) -> Any:
        self._wait()
        return super().stat(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        self._wait()
        return super().list(prefix)


def test_training_steps_never_wait_on_a_hung_store() -> None:
    store = HangingStore(MemoryStore(uuid.uuid4().hex))
    group = ThreadGroup(2)
    config = TransientConfig(store=store.url, save_every_steps=None, check_every_steps=1, progress_every_steps=2)
    impls = [TransientImpl(config, FakeCollectives(group, r), host=f"h{r}", watcher=FakeWatcher(),
                           manager=CheckpointManager(store)) for r in range(2)]
    state = {"w": np.ones(10, np.float32)}
    group.run(lambda r: impls[r].begin(0))
    store.gate.clear()  # from here on every store call hangs
    try:
        slowest = 0.0
        for step in range(1, 31):  # a notice round at every step, a progress event every other one
            t0 = time.monotonic()
            outcomes = group.run(lambda r: impls[r].after_step(step, lambda: state, lambda: {}))
            slowest = max(slowest, time.monotonic() - t0)
            assert not any(o.stop or o.leaving for o in outcomes)
        assert store.blocked.is_set()  # the background writers did try the store
        assert slowest < 0.5, f"a step waited {slowest:.2f} s on the hung store"
    finally:
        store.gate.set()
        for impl in impls:
            impl.close()


def test_the_stop_poller_answers_at_once_while_the_store_hangs_then_sees_the_request() -> None:
    store = HangingStore(MemoryStore(uuid.uuid4().hex))
    poller = StopPoller(store, interval_s=0.05)
    request_stop(store)
    store.gate.clear()
    try:
        t0 = time.monotonic()
        assert poller.requested is False  # the first read starts the background look and returns
        assert store.blocked.wait(10)
        assert poller.requested is False and time.monotonic() - t0 < 0.5
        store.gate.set()
        assert poller.polled.wait(10)
        assert poller.requested is True
    finally:
        store.gate.set()
        poller.close()
