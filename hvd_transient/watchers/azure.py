"""Azure Spot eviction watcher: poll Scheduled Events for a ``Preempt`` naming this VM.

The deadline is the event's ``NotBefore`` (RFC 1123, at least 30 s ahead).
Every request times out after ``request_timeout`` (1 s), and failures are
retried about once a second (base.py), so neither errors nor a hung IMDS
delay a notice by more than about that once the service answers again.
"""
from __future__ import annotations

import email.utils
import logging
import os
import time
from typing import Sequence

from .base import INITIAL_BACKOFF_S, MAX_BACKOFF_S, Notice, NoticeCallback, Poller, Watcher
from .errors import MetadataGarbageError, WatcherConfigError
from .metadata_http import expect_status, json_object, new_session, printable_text

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://169.254.169.254"
ENDPOINT_ENV = "HVDT_AZURE_METADATA_ENDPOINT"
EVENTS_API_VERSION = "2020-07-01"
INSTANCE_API_VERSION = "2021-02-01"
HEADERS = {"Metadata": "true"}


def parse_rfc1123(text: str) -> float | None:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` -> epoch seconds; None for an empty NotBefore."""
    if not text.strip():
        return None
    try:
        return email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError, IndexError):
        raise MetadataGarbageError(f"NotBefore {text!r} is not an RFC 1123 date") from None


class AzureWatcher(Watcher):
    """Watches an Azure VM's Scheduled Events for its eviction."""

    source = "azure"

    def __init__(self, endpoint: str | None = None, *, interval: float = 2.0,
                 request_timeout: float = 1.0, window: float = 30.0,
                 event_types: Sequence[str] = ("Preempt",), instance: str | None = None,
                 on_notice: NoticeCallback | None = None, initial_backoff: float = INITIAL_BACKOFF_S,
                 max_backoff: float = MAX_BACKOFF_S) -> None:
        # ``instance`` is the VM name the events must list; asked from IMDS if not given.
        # ``window`` is only used for an event with an empty NotBefore.
        super().__init__(window=window, instance=instance, on_notice=on_notice,
                         initial_backoff=initial_backoff, max_backoff=max_backoff)
        self.endpoint = (endpoint or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT).rstrip("/")
        if not self.endpoint.startswith(("http://", "https://")):
            raise WatcherConfigError(f"Azure IMDS endpoint {self.endpoint!r} needs an http:// scheme")
        self.interval = float(interval)
        self.request_timeout = float(request_timeout)
        self.event_types = tuple(event_types)

    def _pollers(self) -> Sequence[Poller]:
        return [_ScheduledEventsPoller(self)]


class _ScheduledEventsPoller(Poller):
    name = "scheduled-events"

    def __init__(self, watcher: AzureWatcher) -> None:
        self.w = watcher
        self.session = new_session()

    def poll(self) -> Notice | None:
        w = self.w
        if w.instance is None:
            reply = self.session.get(f"{w.endpoint}/metadata/instance/compute/name", headers=HEADERS,
                                     params={"api-version": INSTANCE_API_VERSION, "format": "text"},
                                     timeout=w.request_timeout)
            expect_status(reply, 200)
            w.instance = printable_text(reply, "VM name")
        reply = self.session.get(f"{w.endpoint}/metadata/scheduledevents", headers=HEADERS,
                                 params={"api-version": EVENTS_API_VERSION}, timeout=w.request_timeout)
        detected_at = time.time()
        expect_status(reply, 200)
        events = json_object(reply).get("Events")
        if not isinstance(events, list):
            raise MetadataGarbageError(f"scheduled events document has no 'Events' list: {reply.text[:120]!r}")
        for event in events:
            if not isinstance(event, dict):
                raise MetadataGarbageError(f"scheduled event is not an object: {event!r:.120}")
            if event.get("EventType") in w.event_types and w.instance in (event.get("Resources") or []):
                deadline = parse_rfc1123(str(event.get("NotBefore") or ""))
                return w.make_notice(f"scheduled-event {event['EventType']} {event.get('EventId', '')}".strip(),
                                     detected_at=detected_at, deadline=deadline)
        return None

    def pause(self) -> float:
        return self.w.interval
