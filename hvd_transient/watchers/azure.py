"""Azure Spot eviction watcher: poll Scheduled Events for a ``Preempt`` naming this VM.

An event names the VMs it affects in ``Resources``: this VM's resource name (IMDS
``compute/name``; a scale set's instance name, e.g. ``vmss_3``). The Horovod host name
the watcher may be given (``instance``) is often something else (an address, the OS
host name), so the watcher asks IMDS for the VM's own names (``compute/name`` and
``compute/osProfile/computerName``) and matches an event naming any of them, or
``instance``, ignoring case.

The deadline is the event's ``NotBefore`` (RFC 1123, at least 30 s ahead). An event
that has started (``EventStatus: Started``; its ``NotBefore`` is then blank) is under
way: leave at once. A ``NotBefore`` that cannot be read does not drop the notice: the
window (30 s) counts from the last read that found no event for this VM, or, with
none, the deadline is the read that saw it (``deadline.py``). A read made before IMDS
told the VM's own names is no clear read: it could not have matched an event naming them,
and a compute document that names no VM is asked again. Of several events for this VM, the one
whose deadline comes first counts.
Every request ends within ``request_timeout`` (1 s) in all, and failures are
retried about once a second (base.py), so neither errors nor a hung IMDS
delay a notice by more than about that once the service answers again.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterable, Sequence

from .base import INITIAL_BACKOFF_S, MAX_BACKOFF_S, Notice, NoticeCallback, Poller, Watcher
from .deadline import EVENT_STARTED, Deadline, from_cloud, parse_time
from .errors import MetadataGarbageError, WatcherConfigError, WatcherError
from .metadata_http import MetadataClient, expect_status, json_object

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://169.254.169.254"
ENDPOINT_ENV = "HVDT_AZURE_METADATA_ENDPOINT"
EVENTS_API_VERSION = "2020-07-01"
INSTANCE_API_VERSION = "2021-02-01"
HEADERS = {"Metadata": "true"}
#: the VM's names are asked again at most this often while IMDS cannot tell them
NAMES_RETRY_S = 10.0


def vm_names(compute: dict[str, Any]) -> set[str]:
    """The names an event may call this VM by, from the IMDS ``compute`` document (pure)."""
    os_profile = compute.get("osProfile")
    found = [compute.get("name"), os_profile.get("computerName") if isinstance(os_profile, dict) else None]
    return {name for name in found if isinstance(name, str) and name.strip()}


def event_for(events: Iterable[Any], names: set[str], event_types: Sequence[str]) -> dict[str, Any] | None:
    """Of the events of ``event_types`` whose ``Resources`` name this VM, the one due first (pure): one
    that has started, or whose ``NotBefore`` is blank or unreadable, before any with a readable time."""
    return min(events_for(events, names, event_types), key=_due, default=None)


def soonest_event(events: Iterable[Any], names: set[str], event_types: Sequence[str], read_started: float,
                  last_clear: float | None, window: float) -> tuple[dict[str, Any], Deadline] | None:
    """Of the events for this VM, the one whose deadline comes first, with that deadline (pure): an event
    whose ``NotBefore`` cannot be read is dated from history, which may be later than another's time."""
    dated = [(event, event_deadline(event, read_started, last_clear, window))
             for event in events_for(events, names, event_types)]
    return min(dated, key=lambda pair: pair[1].at, default=None)


def events_for(events: Iterable[Any], names: set[str], event_types: Sequence[str]) -> list[dict[str, Any]]:
    """The events of ``event_types`` whose ``Resources`` name this VM (pure)."""
    wanted = {name.strip().casefold() for name in names}
    matching: list[dict[str, Any]] = []
    for event in events:
        if not isinstance(event, dict):
            raise MetadataGarbageError(f"scheduled event is not an object: {event!r:.120}")
        resources = event.get("Resources")
        if event.get("EventType") not in event_types or not isinstance(resources, list):
            continue
        if any(isinstance(r, str) and r.strip().casefold() in wanted for r in resources):
            matching.append(event)
    return matching


def _due(event: dict[str, Any]) -> float:
    """When an event is due, for ordering: -inf where it is due now or its time cannot be read."""
    if str(event.get("EventStatus") or "").casefold() == "started":
        return float("-inf")
    at = parse_time(event.get("NotBefore"))
    return float("-inf") if at is None else at


def event_deadline(event: dict[str, Any], read_started: float, last_clear: float | None,
                   window: float) -> Deadline:
    """When the VM an ``event`` names must be gone (pure)."""
    not_before = event.get("NotBefore")
    if str(event.get("EventStatus") or "").casefold() == "started" or not str(not_before or "").strip():
        return Deadline(read_started, EVENT_STARTED)
    return from_cloud(parse_time(not_before), read_started, last_clear, window)


class AzureWatcher(Watcher):
    """Watches an Azure VM's Scheduled Events for its eviction."""

    source = "azure"

    def __init__(self, endpoint: str | None = None, *, interval: float = 2.0,
                 request_timeout: float = 1.0, window: float = 30.0,
                 event_types: Sequence[str] = ("Preempt",), instance: str | None = None,
                 on_notice: NoticeCallback | None = None, initial_backoff: float = INITIAL_BACKOFF_S,
                 max_backoff: float = MAX_BACKOFF_S) -> None:
        # ``instance``: a name of this VM events may list, besides those IMDS gives.
        # ``window``: Azure's notice, used only for an event whose NotBefore cannot be read.
        super().__init__(window=window, instance=instance, on_notice=on_notice,
                         initial_backoff=initial_backoff, max_backoff=max_backoff)
        self.endpoint = (endpoint or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT).rstrip("/")
        if not self.endpoint.startswith(("http://", "https://")):
            raise WatcherConfigError(f"Azure IMDS endpoint {self.endpoint!r} needs an http:// scheme")
        self.interval = float(interval)
        self.request_timeout = float(request_timeout)
        self.event_types = tuple(event_types)
        self.client = MetadataClient(total_timeout=self.request_timeout)
        #: the VM's own names from IMDS (None until they are known)
        self.vm_names: set[str] | None = None

    def _pollers(self) -> Sequence[Poller]:
        return [_ScheduledEventsPoller(self)]


class _ScheduledEventsPoller(Poller):
    name = "scheduled-events"

    def __init__(self, watcher: AzureWatcher) -> None:
        self.w = watcher
        self.names_tried_at: float | None = None  # monotonic
        #: epoch start of the last read that found no event for this VM
        self.last_clear: float | None = None

    def poll(self) -> Notice | None:
        w = self.w
        names = self._names()
        started = time.time()
        reply = w.client.get(f"{w.endpoint}/metadata/scheduledevents", headers=HEADERS,
                             params={"api-version": EVENTS_API_VERSION})
        detected_at = time.time()
        expect_status(reply, 200)
        events = json_object(reply).get("Events")
        if not isinstance(events, list):
            raise MetadataGarbageError(f"scheduled events document has no 'Events' list: {reply.text[:120]!r}")
        soonest = soonest_event(events, names, w.event_types, started, self.last_clear, w.window)
        if soonest is None:
            if w.vm_names is not None:
                # clear only where every name an event may use was looked for: before IMDS told the VM's
                # own names, an event naming it by one of them would have passed unseen
                self.last_clear = started
            return None
        event, deadline = soonest
        return w.make_notice(f"scheduled-event {event['EventType']} {event.get('EventId', '')}".strip(),
                             detected_at=detected_at, deadline=deadline,
                             instance=w.instance or min(names))

    def _names(self) -> set[str]:
        """Every name of this VM known so far: the given one and, once IMDS told them, its own.
        A failure to learn them is not fatal while a name is known (asked again later)."""
        w = self.w
        given = {w.instance} if w.instance else set()
        now = time.monotonic()
        if w.vm_names is None and (self.names_tried_at is None or now - self.names_tried_at >= NAMES_RETRY_S
                                   or not given):
            self.names_tried_at = now
            try:
                reply = w.client.get(f"{w.endpoint}/metadata/instance/compute", headers=HEADERS,
                                     params={"api-version": INSTANCE_API_VERSION})
                expect_status(reply, 200)
                compute = json_object(reply)
                names_told = vm_names(compute)
                if not names_told:  # a partial document: ask again, as after any other failure
                    raise MetadataGarbageError(f"IMDS compute metadata names no VM: {reply.text[:120]!r}")
                w.vm_names = names_told
                if w.instance is None and isinstance(compute.get("name"), str):
                    w.instance = compute["name"]  # what its notices are reported under
                log.info("Azure watcher: events naming %s are for this VM",
                         ", ".join(sorted(given | w.vm_names)))
            except (WatcherError, OSError) as exc:
                if not given:
                    raise
                log.warning("Azure watcher: IMDS did not tell this VM's names (%s); matching %s only "
                            "for now", exc, w.instance)
        names = given | (w.vm_names or set())
        if not names:
            raise MetadataGarbageError("IMDS compute metadata names no VM: no event can be matched")
        return names

    def pause(self) -> float:
        return self.w.interval
