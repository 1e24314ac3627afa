"""Local watcher: a notice file appearing, and/or SIGTERM to this process.

For the local transient-cluster simulator and for machines without a cloud
metadata server. The file may hold JSON ``{"deadline": <epoch>, "reason": "..."}``
(any time :func:`~hvd_transient.watchers.deadline.parse_time` reads, never later than the
window from when the file was seen); anything else (or nothing) means "now + window".

The SIGTERM handler only records the signal (a plain attribute write, no lock:
a handler that took a lock the interrupted main thread holds would deadlock);
the polling thread turns it into a notice within one ``interval``.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from typing import Any, Sequence

from hvd_transient.gcp.metadata import GCE_NOTICE_WINDOW_S

from .base import INITIAL_BACKOFF_S, MAX_BACKOFF_S, Notice, NoticeCallback, Poller, Watcher
from .deadline import parse_time

log = logging.getLogger(__name__)

NOTICE_FILE_ENV = "HVDT_NOTICE_FILE"


class LocalWatcher(Watcher):
    """Watches for a notice file (``path``, default ``$HVDT_NOTICE_FILE``) and, if asked, SIGTERM."""

    source = "local"

    def __init__(self, path: str | os.PathLike[str] | None = None, *, handle_sigterm: bool = False,
                 interval: float = 0.5, window: float = GCE_NOTICE_WINDOW_S, instance: str | None = None,
                 on_notice: NoticeCallback | None = None, initial_backoff: float = INITIAL_BACKOFF_S,
                 max_backoff: float = MAX_BACKOFF_S) -> None:
        super().__init__(window=window, instance=instance or socket.gethostname(), on_notice=on_notice,
                         initial_backoff=initial_backoff, max_backoff=max_backoff)
        path = path if path is not None else os.environ.get(NOTICE_FILE_ENV)
        self.path = os.fspath(path) if path else None
        self.handle_sigterm = handle_sigterm
        self.interval = float(interval)
        self._signal_seen: tuple[int, float] | None = None
        self._previous_handler: Any = None
        self._installed = False

    def _pollers(self) -> Sequence[Poller]:
        if self.path is None and not self._installed:
            log.warning("local watcher has neither a notice file nor a SIGTERM handler: it will see nothing")
        return [_LocalPoller(self)]

    def _on_start(self) -> None:
        if not self.handle_sigterm:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("local watcher: SIGTERM handler not installed (start() was not called "
                        "on the main thread); watching the notice file only")
            return
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def _on_stop(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._installed = False

    def _on_sigterm(self, signum: int, _frame: Any) -> None:
        if self._signal_seen is None:
            self._signal_seen = (signum, time.time())


class _LocalPoller(Poller):
    name = "local"

    def __init__(self, watcher: LocalWatcher) -> None:
        self.w = watcher

    def poll(self) -> Notice | None:
        seen = self.w._signal_seen
        if seen is not None:
            signum, at = seen
            return self.w.make_notice(f"signal {signal.Signals(signum).name}", detected_at=at)
        if self.w.path is not None and os.path.exists(self.w.path):
            return self._from_file(self.w.path)
        return None

    def _from_file(self, path: str) -> Notice:
        detected_at = time.time()
        deadline, reason = None, f"notice file {path}"
        try:
            with open(path, encoding="utf-8") as fh:
                content = json.loads(fh.read() or "null")
        except (OSError, ValueError):
            content = None  # appearing is the notice; the content is optional
        if isinstance(content, dict):
            given = parse_time(content.get("deadline")) if "deadline" in content else None
            if given is not None and given > detected_at + self.w.window:
                log.warning("notice file deadline %r is more than the %.0f s window away: the window counts",
                            content.get("deadline"), self.w.window)
            elif given is not None:
                deadline = given
            elif "deadline" in content:
                log.warning("notice file deadline %r is no time: the window counts", content.get("deadline"))
            if isinstance(content.get("reason"), str):
                reason = content["reason"]
        return self.w.make_notice(reason, detected_at=detected_at, deadline=deadline)

    def pause(self) -> float:
        return self.w.interval
