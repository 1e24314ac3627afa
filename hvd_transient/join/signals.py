"""Signals as readable bytes on a socket, for the launcher's and the supervisor's ``select`` loops.

Both forward :data:`FORWARDED_SIGNALS` to the standby's worker. Standard library only.
"""
from __future__ import annotations

import contextlib
import signal
import socket
from types import FrameType
from typing import Sequence

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class SignalWakeup:
    """The given signals as bytes on a socket, for a loop that waits on sockets with ``select``.

    A Python signal handler runs only between bytecodes: a signal that arrives just before a
    blocking ``recv`` or ``select`` would wait until something else wakes the process up. The
    interpreter also writes each signal's number to the wakeup fd from its C handler, so the
    loop sees it at once; the Python handlers only keep the default action (death) away.
    """

    def __init__(self, signals: Sequence[int]) -> None:
        self.reader, self.writer = socket.socketpair()
        for sock in (self.reader, self.writer):
            sock.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        self._previous = {sig: signal.signal(sig, _noted) for sig in signals}

    def take(self) -> list[int]:
        """The signals that arrived since the last call, in order."""
        got = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := self.reader.recv(256):
                got += chunk
        return list(got)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(self._previous_fd)
        self.reader.close()
        self.writer.close()

    def __enter__(self) -> "SignalWakeup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _noted(signum: int, frame: FrameType | None) -> None:
    """A handler that only keeps a signal's default action away (:class:`SignalWakeup` reports it)."""
