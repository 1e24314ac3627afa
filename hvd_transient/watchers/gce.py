"""GCE preemption watcher: long-polls ``instance/preempted`` and ``instance/maintenance-event``.

Each key is long-polled ETag-aware on its own thread: a plain GET first (the
notice may already be there, and it yields the ETag), then
``?wait_for_change=true&last_etag=E&timeout_sec=S``, which the server answers
the moment the value changes (or at once if E is already stale).

A long-poll that hangs looks exactly like one that is waiting for a change, so
the only bound on how long a hung one blinds the watcher is its own timeout:
hence long-polls of ``long_poll_timeout=1`` s (read timeout 1.5 s with the
margin), not minutes; the server is on the VM, so one request a second per key
costs nothing, and a change still comes back the moment it happens. After a
failed request the poller reads the key plainly (``request_timeout``, 1 s)
until the server answers again, retrying about once a second (``base.py``).
Every request's timeouts are bounded, so a notice is seen within about 2 s of
its appearance even when the request in flight at that moment is never answered.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable, Mapping, Sequence

import requests

from hvd_transient.gcp.metadata import GCE_NOTICE_WINDOW_S, NOTICE_ATTRIBUTE

from .base import INITIAL_BACKOFF_S, MAX_BACKOFF_S, Notice, NoticeCallback, Poller, Watcher
from .errors import MetadataGarbageError, WatcherConfigError
from .metadata_http import expect_status, new_session, printable_text

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://metadata.google.internal/computeMetadata/v1/"
HEADERS = {"Metadata-Flavor": "Google"}
MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")


def gce_base_url(base_url: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The constructor's URL, else ``http://{GCE_METADATA_HOST}/computeMetadata/v1/``, else the real one."""
    environ: Mapping[str, str] = os.environ if env is None else env
    if base_url:
        url = base_url
    elif environ.get("GCE_METADATA_HOST"):
        url = f"http://{environ['GCE_METADATA_HOST'].rstrip('/')}/computeMetadata/v1/"
    else:
        url = DEFAULT_BASE_URL
    if not url.startswith(("http://", "https://")):
        raise WatcherConfigError(f"GCE metadata URL {url!r} needs an http:// scheme")
    return url if url.endswith("/") else url + "/"


class GceWatcher(Watcher):
    """Watches a GCE VM's metadata server for preemption (and terminating maintenance)."""

    source = "gce"

    def __init__(self, base_url: str | None = None, *, window: float | None = None,
                 long_poll_timeout: int = 1, request_margin: float = 0.5, request_timeout: float = 1.0,
                 connect_timeout: float = 0.5, watch_maintenance: bool = True,
                 instance: str | None = None, on_notice: NoticeCallback | None = None,
                 initial_backoff: float = INITIAL_BACKOFF_S, max_backoff: float = MAX_BACKOFF_S) -> None:
        # long_poll_timeout (whole seconds) + request_margin: a long-poll's read timeout, the most
        # a hung long-poll can blind the watcher; request_timeout: the read timeout of plain reads
        # window None: the VM's configured notice (read once, with the instance name), else 30 s
        super().__init__(window=GCE_NOTICE_WINDOW_S if window is None else window, instance=instance,
                         on_notice=on_notice, initial_backoff=initial_backoff, max_backoff=max_backoff)
        self._window_known = window is not None
        self.base_url = gce_base_url(base_url)
        # GCE takes whole seconds for timeout_sec.
        self.long_poll_timeout = max(1, int(round(long_poll_timeout)))
        self.read_timeout = self.long_poll_timeout + float(request_margin)
        self.request_timeout = float(request_timeout)
        self.connect_timeout = float(connect_timeout)
        self.watch_maintenance = watch_maintenance

    def _pollers(self) -> Sequence[Poller]:
        pollers: list[Poller] = [_KeyPoller(self, "instance/preempted", _preempted_reason)]
        if self.watch_maintenance:
            pollers.append(_KeyPoller(self, "instance/maintenance-event", _maintenance_reason))
        return pollers

    def resolve_instance(self, session: requests.Session) -> str:
        """This VM's name (asked once; the host name if the server has no ``instance/name``), its id
        and, unless given, its notice window."""
        if not self._window_known:
            self.window = self._configured_window(session)
            self._window_known = True
        if self.instance_id is None:
            reply = self._get(session, "instance/id")
            if reply.status_code == 200:
                self.instance_id = printable_text(reply, "instance id") or None
        if self.instance is None:
            reply = self._get(session, "instance/name")
            if reply.status_code == 404:
                self.instance = socket.gethostname()
            else:
                expect_status(reply, 200)
                self.instance = printable_text(reply, "instance name")
        return self.instance

    def _configured_window(self, session: requests.Session) -> float:
        reply = self._get(session, f"instance/attributes/{NOTICE_ATTRIBUTE}")
        if reply.status_code == 404:
            return GCE_NOTICE_WINDOW_S
        expect_status(reply, 200)  # a failing server says nothing about the window: ask again
        text = printable_text(reply, NOTICE_ATTRIBUTE)
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not seconds > 0:
            log.warning("metadata attribute %s is %r, not a positive number of seconds: assuming a %.0f s notice",
                        NOTICE_ATTRIBUTE, text, GCE_NOTICE_WINDOW_S)
            return GCE_NOTICE_WINDOW_S
        log.info("this VM gets a %.0f s preemption notice (%s)", seconds, NOTICE_ATTRIBUTE)
        return seconds

    def _get(self, session: requests.Session, key: str, params: dict[str, str] | None = None,
             read_timeout: float | None = None) -> requests.Response:
        """GET ``key``; the read timeout is ``request_timeout`` unless given (a long-poll's)."""
        return session.get(self.base_url + key, headers=HEADERS, params=params,
                           timeout=(self.connect_timeout, read_timeout or self.request_timeout))


class _KeyPoller(Poller):
    def __init__(self, watcher: GceWatcher, key: str, interpret: Callable[[str], str | None]) -> None:
        self.watcher, self.key, self.interpret = watcher, key, interpret
        self.name = key.rsplit("/", 1)[-1]
        self.session = new_session()
        self.etag: str | None = None

    def poll(self) -> Notice | None:
        try:
            return self._poll()
        except Exception:
            # Read plainly until the server answers again: a failing long-poll would cost its
            # whole read timeout each time, a plain read only ``request_timeout``.
            self.etag = None
            raise

    def _poll(self) -> Notice | None:
        w = self.watcher
        instance = w.resolve_instance(self.session)
        if self.etag is None:
            reply = w._get(self.session, self.key)
        else:
            reply = w._get(self.session, self.key, params={
                "wait_for_change": "true", "last_etag": self.etag,
                "timeout_sec": str(w.long_poll_timeout)}, read_timeout=w.read_timeout)
        detected_at = time.time()
        expect_status(reply, 200)
        if reply.headers.get("Metadata-Flavor") != "Google":
            raise MetadataGarbageError(f"{reply.url} answered without 'Metadata-Flavor: Google': "
                                       "not a GCE metadata server")
        value = printable_text(reply, f"value of {self.key}")
        reason = self.interpret(value)  # raises MetadataGarbageError on a value the API never has
        if reason is not None:
            return w.make_notice(reason, detected_at=detected_at, instance=instance)
        self.etag = reply.headers.get("ETag")
        return None

    def pause(self) -> float:
        # Without an ETag the server cannot long-poll for us: fall back to plain polling.
        return 0.0 if self.etag else 1.0


def _preempted_reason(value: str) -> str | None:
    if value not in ("TRUE", "FALSE"):
        raise MetadataGarbageError(f"instance/preempted is {value!r}, expected TRUE or FALSE")
    return "preempted" if value == "TRUE" else None


def _maintenance_reason(value: str) -> str | None:
    if value not in MAINTENANCE_VALUES:
        raise MetadataGarbageError(
            f"instance/maintenance-event is {value!r}, expected one of {', '.join(MAINTENANCE_VALUES)}")
    return f"maintenance-event {value}" if value == "TERMINATE_ON_HOST_MAINTENANCE" else None
