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
from concurrent.futures import wait as wait_futures

from ckpt_service.errors import SaveCancelledError

log = logging.getLogger(__name__)


class CancelToken:
    """Set once, by any thread; read by the save's threads between store requests.

    An asynchronous save makes one on the training thread, during its stall, and most saves are
    never cancelled: making it costs one lock, and :attr:`fired` is made when first waited on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None  # set once, under the lock: cancelled
        self._fired: Future[None] | None = None

    def cancel(self, reason: str) -> bool:
        """Cancel; returns False if it already was (the first reason stands)."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason, fired = reason, self._fired
        if fired is not None:  # else it is made already failed, when first asked for
            fired.set_exception(SaveCancelledError(reason))
        return True

    @property
    def fired(self) -> Future[None]:
        """Done (with SaveCancelledError) once cancelled: waits on futures can include it."""
        with self._lock:
            if self._fired is None:
                self._fired = Future()
                if self._reason is not None:
                    self._fired.set_exception(SaveCancelledError(self._reason))
            return self._fired

    @property
    def cancelled(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str:
        with self._lock:
            return self._reason or ""

    def check(self, step: int, where: str) -> None:
        """Raise SaveCancelledError if cancelled; ``where`` says what the save had not done yet."""
        if self._reason is not None:
            raise SaveCancelledError(f"step {step}: the save was cancelled {where} ({self.reason}); nothing was "
                                     "committed and the previous checkpoint stays the latest")

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` or until cancelled, whichever comes first (a poll interval)."""
        wait_futures([self.fired], timeout=seconds)


def check(token: CancelToken | None, step: int, where: str) -> None:
    """:meth:`CancelToken.check` for a save that may have no token."""
    if token is not None:
        token.check(step, where)
