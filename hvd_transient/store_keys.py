"""The plugin's own objects in a run's store, beside the checkpoints (pure key naming)::

    hosts/leaving/<host>.json                           a host under preemption notice
    hosts/ready/<host>.json                             a new VM's standby worker is ready to join
    control/stop                                        an operator's stop request
    events/<host>.<pid>.<seq>.jsonl                     one segment of a process's event log

The checkpoints' keys are :mod:`ckpt_service.layout`. Its retention and gc list and delete only
under its own prefixes, so these are never touched by them: their owners create and remove them.
"""
from __future__ import annotations

LEAVING_PREFIX = "hosts/leaving/"
READY_PREFIX = "hosts/ready/"
CONTROL_PREFIX = "control/"
STOP_KEY = CONTROL_PREFIX + "stop"
EVENTS_PREFIX = "events/"
EVENTS_SUFFIX = ".jsonl"


def leaving_key(host: str) -> str:
    """``w-1`` -> ``hosts/leaving/w-1.json``."""
    return f"{LEAVING_PREFIX}{host}.json"


def host_of_leaving_key(key: str) -> str | None:
    """``hosts/leaving/w-1.json`` -> ``w-1`` (None for anything else)."""
    if not key.startswith(LEAVING_PREFIX) or not key.endswith(".json"):
        return None
    return key[len(LEAVING_PREFIX):-len(".json")] or None


def ready_key(host: str) -> str:
    """``w-3`` -> ``hosts/ready/w-3.json``."""
    return f"{READY_PREFIX}{host}.json"


def host_of_ready_key(key: str) -> str | None:
    """``hosts/ready/w-3.json`` -> ``w-3`` (None for anything else)."""
    if not key.startswith(READY_PREFIX) or not key.endswith(".json"):
        return None
    return key[len(READY_PREFIX):-len(".json")] or None


def events_key(host: str, pid: int, seq: int) -> str:
    """Segment ``seq`` of the event log of process ``pid`` on ``host``."""
    return f"{EVENTS_PREFIX}{host}.{pid}.{seq:06d}{EVENTS_SUFFIX}"


def is_events_key(key: str) -> bool:
    """Whether ``key`` (from a listing of ``EVENTS_PREFIX``) is an event-log segment."""
    return key.startswith(EVENTS_PREFIX) and key.endswith(EVENTS_SUFFIX)
