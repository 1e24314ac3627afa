"""Cancelling a save in flight.

A :class:`CancelToken` is handed to every part of a save that waits on the store (the share's
uploads, the store gather's polls, the commit). Each checks it between its requests, never in
the middle of one: a request already sent runs to its own end. Once the commit marker has
been sent the save can no longer be cancelled (its outcome is the store's).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from ckpt_service.errors import SaveCancelledError

log = logging.getLogger(__name__)


class CancelToken:
    """Set once, by any thread; read by the save's threads between store requests."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._reason = ""
        #: done (with SaveCancelledError) once cancelled: waits on futures can include it
        self.fired: Future[None] = Future()

    def cancel(self, reason: str) -> bool:
        """Cancel; returns False if it already was (the first reason stands)."""
        with self._lock:
            if self._event.is_set():
                return False
            self._reason = reason
            self._event.set()
        self.fired.set_exception(SaveCancelledError(reason))
        return True

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    @property
    def reason(self) -> str:
        with self._lock:
            return self._reason

    def check(self, step: int, where: str) -> None:
        """Raise SaveCancelledError if cancelled; ``where`` says what the save had not done yet."""
        if self._event.is_set():
            raise SaveCancelledError(f"step {step}: the save was cancelled {where} ({self.reason}); nothing was "
                                     "committed and the previous checkpoint stays the latest")

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` or until cancelled, whichever comes first (a poll interval)."""
        self._event.wait(seconds)


def check(token: CancelToken | None, step: int, where: str) -> None:
    """:meth:`CancelToken.check` for a save that may have no token."""
    if token is not None:
        token.check(step, where)
