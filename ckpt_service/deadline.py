"""Time budgets of a save that has a deadline (pure: every function is given ``now``).

An emergency save runs inside a preemption notice and gets ``deadline=`` in epoch seconds.
A :class:`Deadline` is handed down explicitly to everything that touches the store on the
save's behalf; each store call derives its own :class:`CallWindow` from it at the moment it
starts, and each request of that call (a first attempt or a retry) a timeout that ends
inside the window. A slow or faulty store therefore makes the save give up before the
deadline rather than after it.

The phases of a save split the time left: the share writes and the gather stop early
enough to leave the commit its reserve (:meth:`Deadline.before_commit`), and a
conditional write stops early enough for one read-back that resolves a lost answer
(:func:`call_window` with ``conditional_write=True``).
"""
from __future__ import annotations

from dataclasses import dataclass

#: the store calls of a save end this long before its deadline, so it can still return in time
DEFAULT_MARGIN_S = 0.25
#: no request starts with less time than this left: it could only time out
MIN_ATTEMPT_S = 0.1
#: a request may stall at most this share of its call's window, so one retry still fits
ATTEMPT_SHARE = 0.5
#: a conditional write leaves this long (at most READBACK_SHARE of the time left) to read it back
READBACK_RESERVE_S = 1.0
READBACK_SHARE = 1 / 3
#: the share writes and the gather leave the commit this long (at most COMMIT_SHARE of the time
#: left): the manifest, the lease fence and the marker, each a small object, with read-backs
COMMIT_RESERVE_S = 3.0
COMMIT_SHARE = 0.25


@dataclass(frozen=True)
class Deadline:
    """A save must be over at ``at`` (epoch seconds); its store calls end ``margin_s`` earlier."""

    at: float
    margin_s: float = DEFAULT_MARGIN_S

    def __post_init__(self) -> None:
        if self.margin_s < 0:
            raise ValueError(f"margin_s must not be negative, not {self.margin_s}")

    @property
    def end(self) -> float:
        """When the last store call must be over."""
        return self.at - self.margin_s

    def left(self, now: float) -> float:
        """Seconds until :attr:`end` (negative once it passed)."""
        return self.end - now

    def expired(self, now: float) -> bool:
        return self.left(now) <= 0.0

    def keeping(self, now: float, reserve_s: float, share: float) -> Deadline:
        """This deadline brought forward by what a later phase needs: ``reserve_s``, but at most
        ``share`` of the time left at ``now`` (a short window is split, not given away)."""
        keep = min(reserve_s, share * max(0.0, self.left(now)))
        return Deadline(self.at - keep, self.margin_s)

    def before_commit(self, now: float) -> Deadline:
        """The deadline of the share writes and the gather: the commit keeps its reserve."""
        return self.keeping(now, COMMIT_RESERVE_S, COMMIT_SHARE)


@dataclass(frozen=True)
class CallWindow:
    """When one store call, every attempt and backoff included, may run: from ``start`` to ``end``."""

    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def left(self, now: float) -> float:
        return self.end - now

    def attempt_timeout(self, now: float, default_s: float) -> float | None:
        """The timeout of a request started at ``now``, or None when too little time is left.

        The client's usual ``default_s``, cut to ATTEMPT_SHARE of the window (a stalled
        request leaves room for a retry on a fresh connection) and to what is left of it.
        """
        left = self.left(now)
        if left < MIN_ATTEMPT_S:
            return None
        return min(default_s, left, max(MIN_ATTEMPT_S, ATTEMPT_SHARE * self.seconds))


def call_window(deadline: Deadline, now: float, *, conditional_write: bool = False) -> CallWindow | None:
    """The window of a store call starting at ``now``; None when not even one request fits.

    A conditional write ends early enough for reading it back: if its answer is lost, only
    the read-back tells whether it was applied.
    """
    left = deadline.left(now)
    if conditional_write:
        left -= min(READBACK_RESERVE_S, READBACK_SHARE * max(0.0, left))
    if left < MIN_ATTEMPT_S:
        return None
    return CallWindow(now, now + left)
