"""In-process stand-in for Horovod collectives: one thread per rank, a barrier per call.

For unit tests of the framework-free protocol (TransientImpl); the real Horovod path is
covered by the end-to-end tests.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable

import numpy as np


class ThreadGroup:
    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=30)
        self._slots: list[Any] = [None] * size

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read
        return out

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """Run ``fn(rank)`` on one thread per rank; return the results, re-raise the first error."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        return results


class FakeCollectives:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self._rank = group, rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.group.size

    def allreduce_sum(self, values: np.ndarray) -> np.ndarray:
        return np.sum(self.group.exchange(self._rank, np.asarray(values)), axis=0)

    def allgather_json(self, obj: Any) -> list[Any]:
        return [json.loads(json.dumps(o)) for o in self.group.exchange(self._rank, obj)]

    def broadcast_json(self, obj: Any, root: int) -> Any:
        return json.loads(json.dumps(self.group.exchange(self._rank, obj)[root]))


class FakeWatcher:
    """A watcher whose notice (and early warning) the test sets."""

    def __init__(self) -> None:
        self.notice = None
        self.warning = None
        self.instance_id: str | None = None

    def start(self) -> "FakeWatcher":
        return self

    def stop(self) -> None:
        pass
