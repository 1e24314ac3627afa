"""Operator control of a running job through its store: ask it to stop cleanly.

``hvd-transient stop RUN_URL`` writes ``control/stop``; the checkpoint master
looks for it every ``STOP_POLL_S`` seconds on a background thread (a slow store
never holds up training) and folds the latest answer into the per-step notice
collective, so every rank stops at the same step, after a final checkpoint, and
the job exits with success.
"""
from __future__ import annotations

import json
import logging
import threading
import time

from ckpt_service.deadline import Deadline
from ckpt_service.stores.base import ObjectStore
from hvd_transient.store_keys import STOP_KEY

log = logging.getLogger(__name__)

STOP_POLL_S = 2.0
#: the longest one look at the store may take, retries included
STOP_POLL_TIMEOUT_S = 10.0


def request_stop(store: ObjectStore, reason: str = "operator request") -> None:
    store.put(STOP_KEY, json.dumps({"requested_at": time.time(), "reason": reason}).encode())


def stop_requested(store: ObjectStore) -> bool:
    return store.exists(STOP_KEY)


def clear_stop(store: ObjectStore) -> None:
    store.delete(STOP_KEY)


class StopPoller:
    """Looks for a stop request every ``interval_s`` on a background thread, started by the first
    read of :attr:`requested`, which returns the latest answer without touching the store."""

    def __init__(self, store: ObjectStore, *, interval_s: float = STOP_POLL_S,
                 timeout_s: float = STOP_POLL_TIMEOUT_S) -> None:
        self.store, self.interval_s, self.timeout_s = store, interval_s, timeout_s
        self.polled = threading.Event()  # set after each look at the store (tests wait on it)
        self._requested = False
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @property
    def requested(self) -> bool:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None and not self._closed.is_set():
                    self._thread = threading.Thread(target=self._loop, name="hvdt-stop-poll", daemon=True)
                    self._thread.start()
        return self._requested

    def _loop(self) -> None:
        failing = False
        while not self._closed.is_set():
            try:
                bounded = self.store.within(Deadline(time.time() + self.timeout_s, margin_s=0.0))
                self._requested = self._requested or stop_requested(bounded)
                failing = False
            except Exception as exc:  # an unreachable store must not stop training
                if not failing:
                    log.warning("could not check for a stop request: %s", exc)
                failing = True
            self.polled.set()
            if self._requested:
                return  # a request is never withdrawn: nothing more to learn
            self._closed.wait(self.interval_s)

    def close(self) -> None:
        self._closed.set()
