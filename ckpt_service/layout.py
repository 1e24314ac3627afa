"""Where things live under a run's store prefix (pure key naming).

Checkpoints (written by :mod:`ckpt_service`)::

    steps/000000000120/data/float32/00003.<nonce>/...   zarr v3 array, one piece
    steps/000000000120/records/<attempt>/rank-00001.json  a writer's shard record (store gather)
    steps/000000000120/manifest.<token>.json            the manifest
    commits/000000000120.json                           create-only commit marker
    lease/master.json                                   checkpoint-master lease

The training side (:mod:`hvd_transient`) keeps its own objects in the same store::

    hosts/leaving/<host>.json                           a host under preemption notice
    hosts/ready/<host>.json                             a new VM's standby worker is ready to join
    control/stop                                        an operator's stop request
    events/<host>.<pid>.<seq>.jsonl                     one segment of a process's event log

Commit markers live in their own small directory so that finding the committed
steps is one short listing, however many data objects the steps hold.

Shard records live under the save *attempt* that wrote them (an id every writer of one
save agrees on): a coordinator lists and reads only its own attempt's records, so the
records an abandoned attempt of the same step left behind can never be mixed into its commit.
"""
from __future__ import annotations

import re

from ckpt_service.errors import BadAttemptError

# ---- checkpoints --------------------------------------------------------------------------------

STEPS_PREFIX = "steps/"
COMMITS_PREFIX = "commits/"
LEASE_KEY = "lease/master.json"


def step_prefix(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint steps are non-negative integers, got {step}")
    return f"{STEPS_PREFIX}{step:012d}/"


def commit_key(step: int) -> str:
    step_prefix(step)  # validates
    return f"{COMMITS_PREFIX}{step:012d}.json"


def parse_commit_key(key: str) -> int | None:
    name = key[len(COMMITS_PREFIX):]
    stem = name[: -len(".json")] if name.endswith(".json") else ""
    return int(stem) if stem.isdigit() else None


def manifest_key(step: int, token: str) -> str:
    return step_prefix(step) + f"manifest.{token}.json"


#: what a save attempt id may be: one plain key segment (not '.' or '..'), short enough for any store
ATTEMPT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_attempt(attempt: str) -> str:
    """``attempt`` if it can name a save attempt in keys; BadAttemptError otherwise."""
    if not isinstance(attempt, str) or ATTEMPT_PATTERN.fullmatch(attempt) is None:
        raise BadAttemptError(
            f"save attempt id {attempt!r} is not usable in store keys: use 1 to 64 characters of "
            "letters, digits, '.', '_' and '-', starting with a letter or digit (e.g. 'ring3f2a-120-0')")
    return attempt


def records_prefix(step: int, attempt: str) -> str:
    """The directory of one save attempt's shard records."""
    return step_prefix(step) + f"records/{check_attempt(attempt)}/"


def record_key(step: int, attempt: str, rank: int) -> str:
    return records_prefix(step, attempt) + f"rank-{rank:05d}.json"


def piece_prefix(step: int, group: str, index: int, nonce: str) -> str:
    # The writer's nonce makes every attempt's keys unique: a late or zombie
    # writer can never overwrite bytes that a committed manifest points to.
    return step_prefix(step) + f"data/{group}/{index:05d}.{nonce}/"


def parse_step_dir(name: str) -> int | None:
    return int(name) if name.isdigit() else None


# ---- the training side's objects ----------------------------------------------------------------
# Retention and gc list and delete only under STEPS_PREFIX and COMMITS_PREFIX, so the
# prefixes below are never touched by them: their owners create and remove their own objects.

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
