"""AWS spot interruption watcher: IMDSv2 token, then poll ``spot/instance-action``.

``spot/instance-action`` is 404 until an interruption is scheduled, then
``{"action": "terminate"|"stop"|"hibernate", "time": "2026-11-22T08:22:00Z"}``
about two minutes ahead; AWS suggests polling every 5 s.
``events/recommendations/rebalance`` (``{"noticeTime": "..."}``) appears earlier,
when the instance is at elevated risk of interruption: an early warning.
Every request times out after ``request_timeout`` (1 s), and failures are
retried about once a second (base.py), so neither errors nor a hung IMDS
delay a notice by more than about that once the service answers again.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import datetime, timezone
from typing import Any, Sequence

import requests

from .base import INITIAL_BACKOFF_S, MAX_BACKOFF_S, Notice, NoticeCallback, Poller, Watcher
from .errors import MetadataGarbageError, WatcherConfigError
from .metadata_http import expect_status, json_object, new_session, printable_text

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://169.254.169.254"
ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"  # the variable botocore reads too
TOKEN_TTL_S = 21600


def parse_iso8601_z(text: str) -> float:
    """``2026-11-22T08:22:00Z`` -> epoch seconds."""
    try:
        parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise MetadataGarbageError(f"IMDS time {text!r} is not ISO 8601") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


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

    def _pollers(self) -> Sequence[Poller]:
        return [_InstanceActionPoller(self), _RebalancePoller(self)]


class _InstanceActionPoller(Poller):
    name = "instance-action"

    def __init__(self, watcher: AwsWatcher) -> None:
        self.w = watcher
        self.session = new_session()
        self.token: str | None = None
        self.token_expiry = 0.0

    def poll(self) -> Notice | None:
        try:
            return self._poll()
        except Exception:
            self.token = None  # a bad token (or garbage taken for one) must not stick
            raise

    def _poll(self) -> Notice | None:
        if self.w.instance is None:
            reply = self._get("instance-id")
            expect_status(reply, 200)
            self.w.instance = self.w.instance_id = printable_text(reply, "instance id")
        found = self._document("spot/instance-action", "action")
        if found is None:
            return None
        action, detected_at = found
        deadline = parse_iso8601_z(action["time"]) if isinstance(action.get("time"), str) else None
        return self.w.make_notice(f"spot-interruption {action['action']}", detected_at=detected_at,
                                  deadline=deadline)

    def _document(self, key: str, field: str) -> tuple[dict[str, Any], float] | None:
        """The JSON object at ``key`` and when it was read, or None while the key is absent (404);
        an object without a string ``field`` is garbage."""
        reply = self._get(key)
        detected_at = time.time()
        if reply.status_code == 404:
            return None
        expect_status(reply, 200)
        document = json_object(reply)
        if not isinstance(document.get(field), str):
            raise MetadataGarbageError(f"{key} has no {field!r}: {document!r:.120}")
        return document, detected_at

    def pause(self) -> float:
        return self.w.interval

    def _get(self, key: str) -> requests.Response:
        return self.session.get(f"{self.w.endpoint}/latest/meta-data/{key}",
                                headers={"X-aws-ec2-metadata-token": self._token()},
                                timeout=self.w.request_timeout)

    def _token(self) -> str:
        if self.token is None or time.monotonic() >= self.token_expiry:
            reply = self.session.put(f"{self.w.endpoint}/latest/api/token",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
                                     timeout=self.w.request_timeout)
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
        recommendation, detected_at = found
        parse_iso8601_z(recommendation["noticeTime"])  # garbage is an error, as for instance-action
        return self.w.make_notice("rebalance-recommendation", detected_at=detected_at, early=True)
