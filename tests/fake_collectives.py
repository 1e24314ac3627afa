"""In-process stand-in for Horovod collectives: one thread per rank, one tagged exchange per call.

For unit tests of the framework-free protocol (TransientImpl); the real Horovod path is
covered by the end-to-end tests.

Every exchange is tagged with its operation, its name and (for a broadcast) its root, and all
ranks must arrive with the same tag: a rank that calls a different collective than the others
fails every rank at once with :class:`CollectiveMismatch`, naming what each rank called, where
Horovod would stall or mix up payloads. A rank that never arrives (it raised, or skipped the
collective) fails the others with :class:`CollectiveTimeout` after ``timeout_s`` instead of
hanging the test run. ``calls[rank]`` keeps each rank's collectives in order.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class Call:
    """What one rank asked for: the operation, its name, and the root of a broadcast."""

    op: str
    name: str
    root: int | None = None

    def __str__(self) -> str:
        root = f", root={self.root}" if self.root is not None else ""
        return f"{self.op}({self.name!r}{root})"


class CollectiveMismatch(AssertionError):
    """The ranks called different collectives at the same point."""


class CollectiveTimeout(AssertionError):
    """Some rank did not reach a collective the others are waiting in."""


class ThreadGroup:
    def __init__(self, size: int, *, timeout_s: float = 10.0) -> None:
        self.size, self.timeout_s = size, timeout_s
        self.calls: list[list[Call]] = [[] for _ in range(size)]
        self._cond = threading.Condition()
        self._generation = 0
        self._arrived: dict[int, tuple[Call, Any]] = {}
        self._done: tuple[int, list[Any]] = (-1, [])
        self._failure: AssertionError | None = None

    def exchange(self, rank: int, call: Call, value: Any) -> list[Any]:
        """Every rank's value, once all have called the same collective."""
        with self._cond:
            if self._failure is not None:
                raise self._failure
            generation = self._generation
            self._arrived[rank] = (call, value)
            self.calls[rank].append(call)
            if len(self._arrived) == self.size:
                arrived, self._arrived = self._arrived, {}
                self._generation += 1
                if len({c for c, _ in arrived.values()}) > 1:
                    ops = ", ".join(f"rank {r} called {arrived[r][0]}" for r in sorted(arrived))
                    self._fail(CollectiveMismatch(f"the ranks disagree on the collective: {ops}"))
                self._done = (generation, [arrived[r][1] for r in range(self.size)])
                self._cond.notify_all()
                return list(self._done[1])
            finished = self._cond.wait_for(
                lambda: self._generation != generation or self._failure is not None, self.timeout_s)
            if self._generation != generation and self._done[0] == generation:
                return list(self._done[1])
            if self._failure is not None:
                raise self._failure
            assert not finished
            waiting = ", ".join(f"rank {r} in {c}" for r, (c, _) in sorted(self._arrived.items()))
            missing = sorted(set(range(self.size)) - set(self._arrived))
            self._fail(CollectiveTimeout(
                f"ranks {missing} did not reach the collective within {self.timeout_s:g} s ({waiting})"))
            raise AssertionError("unreachable")

    def _fail(self, failure: AssertionError) -> None:
        """Fail this exchange on every rank (caller holds the lock)."""
        if self._failure is None:
            self._failure = failure
        self._cond.notify_all()
        raise self._failure

    def abort(self, reason: str) -> None:
        """Wake every rank waiting in a collective: one of them failed outside it."""
        with self._cond:
            if self._failure is None:
                self._failure = CollectiveTimeout(f"the group was aborted: {reason}")
            self._cond.notify_all()

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """Run ``fn(rank)`` on one thread per rank; return the results, re-raise the first error."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                self.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s * 6)
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if errors:
            raise errors[0]
        assert not stuck, f"ranks {stuck} did not finish"
        return results


class FakeCollectives:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self._rank = group, rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.group.size

    def allreduce_sum(self, values: np.ndarray, *, name: str = "notice") -> np.ndarray:
        return np.sum(self.group.exchange(self._rank, Call("allreduce_sum", name), np.asarray(values)), axis=0)

    def allgather_json(self, obj: Any, *, name: str = "gather") -> list[Any]:
        return [json.loads(json.dumps(o)) for o in self.group.exchange(self._rank, Call("allgather_json", name), obj)]

    def broadcast_json(self, obj: Any, root: int, *, name: str = "bcast") -> Any:
        return json.loads(json.dumps(self.group.exchange(self._rank, Call("broadcast_json", name, root), obj)[root]))


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
