"""AWS spot interruption watcher: IMDSv2 token, then poll ``spot/instance-action``.

``spot/instance-action`` is 404 until an interruption is scheduled, then
``{"action": "terminate"|"stop"|"hibernate", "time": "2026-11-22T08:22:00Z"}``
about two minutes ahead; AWS suggests polling every 5 s.
``events/recommendations/rebalance`` (``{"noticeTime": "..."}``) appears earlier,
when the instance is at elevated risk of interruption: an early warning.
Every request ends within ``request_timeout`` (1 s) in all, and failures are
retried about once a second (base.py), so neither errors nor a hung IMDS
delay a notice by more than about that once the service answers again.

The deadline is the notice's ``time``, in any form a server could send
(``deadline.parse_time``), and never later than two minutes (``window``) after
the read that saw it. A ``time`` that cannot be read does not drop the notice:
its deadline is then the window from the last read that found no notice, or,
with none, the read that saw it (leave at once).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

from .base import INITIAL_BACKOFF_S, MAX_BACKOFF_S, Notice, NoticeCallback, Poller, Watcher
from .deadline import CLOUD_TIME, Deadline, from_cloud, parse_time
from .errors import MetadataGarbageError, WatcherConfigError, WatcherError
from .metadata_http import MetadataClient, MetadataReply, expect_status, json_object, printable_text

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://169.254.169.254"
ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"  # the variable botocore reads too
TOKEN_TTL_S = 21600


def action_deadline(time_field: object, read_started: float, detected_at: float,
                    last_clear: float | None, window: float) -> Deadline:
    """The deadline of an ``instance-action`` whose ``time`` is ``time_field`` (pure)."""
    deadline = from_cloud(parse_time(time_field), read_started, last_clear, window)
    if deadline.basis == CLOUD_TIME and deadline.at > detected_at + window:
        # a time past the two minutes AWS gives is no deadline to trust: dated as an unreadable one is
        log.warning("instance-action time %r is more than %.0f s away: dating the notice from this watcher's "
                    "reads instead", time_field, window)
        return from_cloud(None, read_started, last_clear, window)
    if deadline.basis != CLOUD_TIME:
        log.warning("instance-action time %r cannot be read: deadline from %s", time_field, deadline.basis)
    return deadline


@dataclass(frozen=True)
class _Read:
    """A JSON document read from IMDS, with the epoch start and end of its read."""

    document: dict[str, Any]
    started: float
    detected_at: float


class AwsWatcher(Watcher):
    """Watches an EC2 spot instance's IMDSv2 for an interruption notice."""

    source = "aws"

    def __init__(self, endpoint: str | None = None, *, interval: float = 5.0,
                 request_timeout: float = 1.0, window: float = 120.0,
                 instance: str | None = None, on_notice: NoticeCallback | None = None,
                 initial_backoff: float = INITIAL_BACKOFF_S, max_backoff: float = MAX_BACKOFF_S) -> None:
        # ``window`` is only used when a notice carries no usable ``time``.
        super().__init__(window=window, instance=instance, on_notice=on_notice,
                         initial_backoff=initial_backoff, max_backoff=max_backoff)
        self.endpoint = (endpoint or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT).rstrip("/")
        if not self.endpoint.startswith(("http://", "https://")):
            raise WatcherConfigError(f"IMDS endpoint {self.endpoint!r} needs an http:// scheme")
        self.interval = float(interval)
        self.request_timeout = float(request_timeout)
        self.client = MetadataClient(total_timeout=self.request_timeout)

    def _pollers(self) -> Sequence[Poller]:
        return [_InstanceActionPoller(self), _RebalancePoller(self)]


class _InstanceActionPoller(Poller):
    name = "instance-action"

    def __init__(self, watcher: AwsWatcher) -> None:
        self.w = watcher
        self.token: str | None = None
        self.token_expiry = 0.0
        #: epoch start of the last read that found no document (what dates one without a time)
        self.last_clear: float | None = None
        self.id_failed = False

    def poll(self) -> Notice | None:
        try:
            return self._poll()
        except Exception:
            self.token = None  # a bad token (or garbage taken for one) must not stick
            raise

    def _poll(self) -> Notice | None:
        found = self._document("spot/instance-action", "action")
        if found is None:
            self._learn_instance_id()  # after a clear read only: the id may neither delay nor hide a notice
            return None
        deadline = action_deadline(found.document.get("time"), found.started, found.detected_at,
                                   self.last_clear, self.w.window)
        return self.w.make_notice(f"spot-interruption {found.document['action']}",
                                  detected_at=found.detected_at, deadline=deadline)

    def _learn_instance_id(self) -> None:
        """The instance id names this VM's notices where no ``instance`` was given; best effort."""
        if self.w.instance is not None:
            return
        try:
            reply = self._get("instance-id")
            expect_status(reply, 200)
            self.w.instance = self.w.instance_id = printable_text(reply, "instance id")
        except (WatcherError, OSError) as exc:
            if not self.id_failed:
                log.warning("AWS watcher: IMDS did not tell the instance id (%s); asked again at every poll", exc)
            self.id_failed = True

    def _document(self, key: str, field: str) -> _Read | None:
        """The JSON object at ``key``, or None while the key is absent (404); an object without
        a string ``field`` is garbage."""
        started = time.time()
        reply = self._get(key)
        detected_at = time.time()
        if reply.status_code == 404:
            self.last_clear = started
            return None
        expect_status(reply, 200)
        document = json_object(reply)
        if not isinstance(document.get(field), str):
            raise MetadataGarbageError(f"{key} has no {field!r}: {document!r:.120}")
        return _Read(document, started, detected_at)

    def pause(self) -> float:
        return self.w.interval

    def _get(self, key: str) -> MetadataReply:
        return self.w.client.get(f"{self.w.endpoint}/latest/meta-data/{key}",
                                 headers={"X-aws-ec2-metadata-token": self._token()})

    def _token(self) -> str:
        if self.token is None or time.monotonic() >= self.token_expiry:
            reply = self.w.client.put(f"{self.w.endpoint}/latest/api/token",
                                      headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            expect_status(reply, 200)
            self.token = printable_text(reply, "IMDSv2 token")
            self.token_expiry = time.monotonic() + TOKEN_TTL_S - 60
        return self.token


class _RebalancePoller(_InstanceActionPoller):
    """The rebalance recommendation: an early warning, reported once."""

    name = "rebalance"

    def _poll(self) -> Notice | None:
        found = self._document("events/recommendations/rebalance", "noticeTime")
        if found is None:
            return None
        # a warning gives no deadline: its time is not needed, and an odd one does not lose it
        return self.w.make_notice("rebalance-recommendation", detected_at=found.detected_at, early=True)
