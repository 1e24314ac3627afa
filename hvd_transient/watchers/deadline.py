"""When a VM under notice must be gone: the deadline of a notice and the bound it was taken from (pure).

The deadline decides when a VM under notice leaves, so it must never be later than the moment
the cloud stops the VM. A watcher sees a notice only when it reads it, which may be long after
the notice came (the metadata server failed for a while, or the watcher started late), so:

* where the cloud gives a time (AWS ``instance-action`` ``time``, Azure ``NotBefore``), that
  time is the deadline (``cloud_time``);
* where it does not (GCE ``instance/preempted``), or gives one that cannot be read, the notice
  came after the last read that said "no notice", so the deadline is that read's start plus the
  window (``last_clear_read``). A read's start, not its reply: the server may have looked at
  any moment between the two;
* with no such read (the first successful read already shows the notice: a watcher that
  started after it, a relaunch, a standby), the window may be over already: the deadline is
  that first read's start (``first_read_unknown_start``), i.e. leave at once;
* an Azure event that has started (``EventStatus: Started``, or no ``NotBefore``) is under
  way: the deadline is the read that saw it (``event_started``).
"""
from __future__ import annotations

import email.utils
import math
from dataclasses import dataclass
from datetime import datetime, timezone

#: the cloud said when the VM stops
CLOUD_TIME = "cloud_time"
#: the window counted from the start of the last read that saw no notice
LAST_CLEAR_READ = "last_clear_read"
#: nothing known before the read that saw the notice: leave at once
FIRST_READ = "first_read_unknown_start"
#: the cloud's event has started: leave at once
EVENT_STARTED = "event_started"
#: the window counted from when the notice was seen (a local notice file or signal)
DETECTED_AT = "detected_at"

#: epoch values above this are taken as milliseconds (1e11 s is the year 5138)
_EPOCH_MS_ABOVE = 1e11


@dataclass(frozen=True)
class Deadline:
    """A notice's deadline (epoch seconds) and the bound it was taken from (one of the names above)."""

    at: float
    basis: str


def from_history(read_started: float, last_clear: float | None, window: float) -> Deadline:
    """The deadline of a notice that carries no usable time, seen by a read that started at
    ``read_started``; ``last_clear``: the start of the last read that saw no notice, if any."""
    if last_clear is None or last_clear > read_started:
        return Deadline(read_started, FIRST_READ)
    return Deadline(last_clear + window, LAST_CLEAR_READ)


def from_cloud(cloud_time: float | None, read_started: float, last_clear: float | None,
               window: float) -> Deadline:
    """The cloud's time where it gave one that could be read, else what the history bounds."""
    if cloud_time is not None:
        return Deadline(cloud_time, CLOUD_TIME)
    return from_history(read_started, last_clear, window)


def parse_time(value: object) -> float | None:
    """Epoch seconds from what a metadata server may send as a time, None if it is none of them.

    ISO 8601 in its forms (``Z`` or ``z``, an offset with or without its colon, fractions, no
    zone meaning UTC, minutes only), epoch seconds (digits, a number, or milliseconds) and RFC
    1123 / RFC 2822 dates (``Mon, 19 Sep 2016 18:29:47 GMT``).
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return _epoch(float(value))
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip()
    try:
        return _epoch(float(text))
    except ValueError:
        pass
    for parse in (_iso8601, _rfc2822):
        parsed = parse(text)
        if parsed is not None:
            return parsed
    return None


def _epoch(seconds: float) -> float | None:
    if not math.isfinite(seconds) or seconds <= 0:
        return None
    return seconds / 1000.0 if seconds > _EPOCH_MS_ABOVE else seconds


def _iso8601(text: str) -> float | None:
    try:
        # fromisoformat takes Z and +0000 but not a lower-case z, nor a lower-case t
        parsed = datetime.fromisoformat(text.upper())
    except ValueError:
        return None
    if parsed.tzinfo is None:  # an instance time without a zone is UTC
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def _rfc2822(text: str) -> float | None:
    try:
        parsed = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if parsed.tzinfo is None:
        if not text.strip().endswith("-0000"):
            return None  # a zone name it does not know (JST, CET): taken for UTC it could be hours late
        parsed = parsed.replace(tzinfo=timezone.utc)  # "-0000": the clouds' dates are GMT
    return parsed.timestamp()
