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
Every request's total time is bounded (``metadata_http.py``), so a notice is seen
within about 2 s of its appearance even when the request in flight at that moment
is never answered, or answered a byte at a time.

``instance/preempted`` gives no time: a notice is dated by the poller's own
history (``deadline.py``): the window from the start of the last read that said
FALSE, or, with no such read, the start of the read that saw it (leave at once).

The VM's name, id and configured window are optional: they are read on a thread of
their own (so a broken or hung one never delays or stops a poll, nor the report of a
notice), a value that is no answer (empty, garbage) falls back to the default, and a
failed read is tried again later. While the window is unknown (its attribute failed,
neither read nor absent), no window from the last clear read can be trusted, and a
notice is dated by the read that saw it (leave at once): a guess of 30 s could be
longer than the VM's real notice.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import Callable, Mapping, Sequence

from hvd_transient.gcp.metadata import GCE_NOTICE_WINDOW_S, NOTICE_ATTRIBUTE

from .base import INITIAL_BACKOFF_S, MAX_BACKOFF_S, Notice, NoticeCallback, Poller, Watcher
from .deadline import FIRST_READ, Deadline, from_history
from .errors import MetadataGarbageError, MetadataServerError, WatcherConfigError, WatcherError
from .metadata_http import MetadataClient, MetadataReply, expect_status, printable_text

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://metadata.google.internal/computeMetadata/v1/"
HEADERS = {"Metadata-Flavor": "Google"}
MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")
#: an optional key that could not be read is asked again at most this often
IDENTITY_RETRY_S = 10.0
#: once the identity is known, its thread only wakes this rarely (it has nothing left to do)
IDENTITY_DONE_PAUSE_S = 3600.0


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
        # long_poll_timeout (whole seconds) + request_margin: a long-poll's total time, the most
        # a hung long-poll can blind the watcher; request_timeout: the total time of plain reads
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
        self.client = MetadataClient(connect_timeout=self.connect_timeout, total_timeout=self.request_timeout)
        self._id_known = False
        #: set once the identity's first try has ended (a notice waits for it, at most a request's time)
        self.identity_tried = threading.Event()

    def _pollers(self) -> Sequence[Poller]:
        pollers: list[Poller] = [_KeyPoller(self, "instance/preempted", _preempted_reason)]
        if self.watch_maintenance:
            pollers.append(_KeyPoller(self, "instance/maintenance-event", _maintenance_reason))
        if not self.identity_known:
            pollers.append(_IdentityPoller(self))
        return pollers

    @property
    def window_known(self) -> bool:
        """Whether the notice window is known: given, or read from the VM's attribute (or its absence)."""
        return self._window_known

    @property
    def identity_known(self) -> bool:
        return self._window_known and self._id_known and self.instance is not None

    def resolve_identity(self) -> None:
        """Best effort, on the identity's own thread: this VM's configured notice window, id and (unless
        given) name. Never raises; what could not be read is asked again by that thread's next poll."""
        if self.identity_known:
            return
        try:
            if not self._window_known:
                self.read_window()
            if not self._id_known:
                self._optional("instance id", self._learn_id, "instance/id")
            if self.instance is None:
                self._optional("instance name", self._learn_name, "instance/name")
        finally:
            self.identity_tried.set()

    def read_window(self) -> None:
        """One read of the VM's configured notice window, now (best effort, never raises)."""
        self._optional(NOTICE_ATTRIBUTE, self._learn_window, f"instance/attributes/{NOTICE_ATTRIBUTE}")

    def _optional(self, what: str, learn: Callable[[MetadataReply | None], None], key: str) -> None:
        """Read an optional ``key`` and hand its reply to ``learn`` (None when the key is absent);
        a server error or timeout leaves it for the next try."""
        try:
            reply = self._get(key)
            if reply.status_code == 404:
                learn(None)
                return
            expect_status(reply, 200)
        except (WatcherError, OSError) as exc:
            log.debug("could not read the %s (%s); asking again later", what, exc)
            return
        learn(reply)

    def _learn_window(self, reply: MetadataReply | None) -> None:
        self._window_known = True
        self.window = GCE_NOTICE_WINDOW_S if reply is None else configured_window(reply)

    def _learn_id(self, reply: MetadataReply | None) -> None:
        self._id_known = True
        self.instance_id = _text_or_none(reply, "instance id")

    def _learn_name(self, reply: MetadataReply | None) -> None:
        self.instance = _text_or_none(reply, "instance name") or socket.gethostname()

    def _get(self, key: str, params: dict[str, str] | None = None, total: float | None = None) -> MetadataReply:
        """GET ``key``, bounded by ``request_timeout`` in all unless given (a long-poll's)."""
        return self.client.get(self.base_url + key, headers=HEADERS, params=params, total=total)


def configured_window(reply: MetadataReply) -> float:
    """The notice window the VM was created with; anything but a positive number (empty
    included) is the default 30 s, never a longer guess."""
    try:
        text = printable_text(reply, NOTICE_ATTRIBUTE)
        seconds = float(text)
    except (MetadataGarbageError, ValueError):
        text, seconds = reply.text[:40], -1.0
    if not (math.isfinite(seconds) and seconds > 0):
        log.warning("metadata attribute %s is %r, not a positive number of seconds: assuming a %.0f s notice",
                    NOTICE_ATTRIBUTE, text, GCE_NOTICE_WINDOW_S)
        return GCE_NOTICE_WINDOW_S
    log.info("this VM gets a %.0f s preemption notice (%s)", seconds, NOTICE_ATTRIBUTE)
    return seconds


def _text_or_none(reply: MetadataReply | None, what: str) -> str | None:
    if reply is None:
        return None
    try:
        return printable_text(reply, what)
    except MetadataGarbageError as exc:
        log.warning("%s; going without it", exc)
        return None


class _KeyPoller(Poller):
    def __init__(self, watcher: GceWatcher, key: str, interpret: Callable[[str], str | None]) -> None:
        self.watcher, self.key, self.interpret = watcher, key, interpret
        self.name = key.rsplit("/", 1)[-1]
        self.etag: str | None = None
        #: epoch start of the last read that said "no notice" (what dates a notice)
        self.last_clear: float | None = None

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
        started = time.time()
        if self.etag is None:
            reply = w._get(self.key)
        else:
            reply = w._get(self.key, params={
                "wait_for_change": "true", "last_etag": self.etag,
                "timeout_sec": str(w.long_poll_timeout)}, total=w.read_timeout)
        detected_at = time.time()
        expect_status(reply, 200)
        if reply.headers.get("Metadata-Flavor") != "Google":
            raise MetadataGarbageError(f"{reply.url} answered without 'Metadata-Flavor: Google': "
                                       "not a GCE metadata server")
        value = printable_text(reply, f"value of {self.key}")
        reason = self.interpret(value)  # raises MetadataGarbageError on a value the API never has
        if reason is None:
            self.last_clear = started
            self.etag = reply.headers.get("ETag")
            return None
        # A notice right at the start may come before the identity's first try ended: it waits for
        # that try at most one request's time. If that try ended without the window, the window is
        # read once more here (one request's time); a try still hung is not waited for. The window
        # from the last clear read is used only where the window is known.
        if w.identity_tried.wait(w.request_timeout) and not w.window_known:
            w.read_window()
        deadline = (from_history(started, self.last_clear, w.window) if w.window_known
                    else Deadline(started, FIRST_READ))
        if not w.window_known:
            log.warning("this VM's notice window is unknown (%s could not be read): leaving at once",
                        NOTICE_ATTRIBUTE)
        return w.make_notice(reason, detected_at=detected_at, deadline=deadline,
                             instance=w.instance or socket.gethostname())

    def pause(self) -> float:
        # Without an ETag the server cannot long-poll for us: fall back to plain polling.
        return 0.0 if self.etag else 1.0


class _IdentityPoller(Poller):
    """Learns the VM's window, id and name on its own thread, until it knows them."""

    name = "identity"

    def __init__(self, watcher: GceWatcher) -> None:
        self.watcher = watcher

    def poll(self) -> Notice | None:
        self.watcher.resolve_identity()  # never raises
        if not self.watcher.window_known:  # retried with the watcher's back-off, as a failed poll is
            raise MetadataServerError(f"the VM's notice window ({NOTICE_ATTRIBUTE}) could not be read")
        return None

    def pause(self) -> float:
        return IDENTITY_DONE_PAUSE_S if self.watcher.identity_known else IDENTITY_RETRY_S


def _preempted_reason(value: str) -> str | None:
    if value not in ("TRUE", "FALSE"):
        raise MetadataGarbageError(f"instance/preempted is {value!r}, expected TRUE or FALSE")
    return "preempted" if value == "TRUE" else None


def _maintenance_reason(value: str) -> str | None:
    if value not in MAINTENANCE_VALUES:
        raise MetadataGarbageError(
            f"instance/maintenance-event is {value!r}, expected one of {', '.join(MAINTENANCE_VALUES)}")
    return f"maintenance-event {value}" if value == "TERMINATE_ON_HOST_MAINTENANCE" else None
