"""The protocol's background threads: the store calls the training thread must not wait for
(this VM's leaving record, retried until its deadline; pruning expired records; the master's
look at the store before a final save).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class BackgroundCalls:
    """A small thread pool, made on first use; every call submitted to it is bounded by its own deadline."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.stopping = threading.Event()  # set by the owner's close(): background retries end

    def submit(self, fn: Callable[[], Any]) -> "Future[Any]":
        """Run ``fn`` on the background threads (made on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hvdt-membership")
            return self._pool.submit(fn)

    def shutdown(self) -> None:
        """Drop the calls not started yet; nothing waits, as every call there is bounded."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["BackgroundCalls"]
