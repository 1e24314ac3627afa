"""Who is leaving the cluster, published in the run's store, and for how long that holds.

A worker under preemption notice publishes ``hosts/leaving/<host>.json``; every
host-discovery backend drops those hosts from its output, which is what makes
Horovod shrink the ring gracefully (HostsUpdatedInterrupt, no rollback).

A record excludes its host only while it describes the *current incarnation* of
that host, so a VM that comes back under the same name is admitted again:

* every backend: once the notice's deadline plus a grace (``DEFAULT_GRACE_S``)
  has passed, the VM it was about is gone, and the record no longer excludes;
* gce backend: a VM whose instance id differs from the record's, or whose
  ``lastStartTimestamp`` is newer than the record, is a new incarnation and is
  listed again at once (a STOP-preempted Spot VM restarted by ``cluster up``).

A record may carry ``leave_at``: the host stays listed until then and is dropped from that
moment (a VM under notice that trains on through its window, ``TransientConfig.leave=
"near_deadline"``). A record without it (older writers too) excludes its host at once.

Expired records are deleted by the checkpoint master when a ring begins
(:func:`prune_leaving`, off the training thread, every call bounded).

A leaving worker writes its record with :func:`publish_leaving_until`: every call bounded
by a :class:`~ckpt_service.deadline.Deadline`, failures retried (tenacity) until the VM's
own notice deadline, so a slow or briefly unreachable store delays the record rather
than losing it, and nothing waits on the store past the window.

The record format (JSON, all times Unix seconds)::

    {"host": "w-1", "reason": "preemption-notice", "published_at": 1764000000.0,
     "deadline": 1764000030.0, "instance_id": "4521..." | null,
     "leave_at": 1764000020.0 | null}
"""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Collection, Iterable, Mapping

import tenacity
from tenacity.stop import stop_base

from ckpt_service.deadline import Deadline
from ckpt_service.errors import BadStoreKeyError, ObjectNotFoundError
from ckpt_service.stores.base import ObjectStore, check_key
from hvd_transient import store_keys as keys
from hvd_transient.gcp.instances import Incarnation
from hvd_transient.gcp.metadata import GCE_NOTICE_WINDOW_S
from hvd_transient.json_numbers import finite_number

log = logging.getLogger(__name__)

#: seconds after a record's deadline during which it still excludes its host (the VM stops
#: within seconds of the deadline; the grace covers clock skew and a slow stop)
DEFAULT_GRACE_S = 60.0
#: the notice window assumed for a record that carries no deadline
#: one call of :func:`publish_leaving_until` may take at most this long (its own requests and
#: the store client's retries included); a call that hangs ends, and a fresh one is tried
PUBLISH_CALL_S = 20.0
#: no publishing call starts with less time than this left before the deadline
MIN_PUBLISH_CALL_S = 0.2
#: a record whose VM's deadline has passed (too little is left for one call) is still written, retried
#: for this long (one whole call's bound, so a slow store can still take it; it is written in the
#: background): the deadline may have been dated early (a GCE notice seen by a watcher's first read),
#: the VM may still be in the ring, and without its record discovery would keep it there until it is stopped
LATE_RECORD_S = PUBLISH_CALL_S
#: leaving records read at a time (discovery reads them every second; a wave may write many)
READ_PARALLEL = 8


@dataclass(frozen=True)
class LeavingRecord:
    host: str
    published_at: float
    deadline: float | None = None
    reason: str = "preemption-notice"
    instance_id: str | None = None  # the cloud's id of the VM that published it, where known
    leave_at: float | None = None  # the host stays listed until then; None: it leaves at once

    def leaves_by(self, now: float) -> bool:
        """Whether discovery drops the host at ``now`` (before ``leave_at`` it is still listed)."""
        return self.leave_at is None or now >= self.leave_at

    @property
    def ends_at(self) -> float:
        """When the VM it describes is gone at the latest (before any grace)."""
        return self.deadline if self.deadline is not None else self.published_at + GCE_NOTICE_WINDOW_S

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, host: str, data: bytes) -> "LeavingRecord":
        """A stored record; unreadable or partial ones (older formats) still name their host."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep ([[[[...)
            doc = None
        if not isinstance(doc, dict):
            doc = {}

        instance_id = doc.get("instance_id")
        return cls(host=host, published_at=finite_number(doc.get("published_at")) or 0.0,
                   deadline=finite_number(doc.get("deadline")), reason=str(doc.get("reason", "preemption-notice")),
                   instance_id=str(instance_id) if instance_id not in (None, "") else None,
                   leave_at=finite_number(doc.get("leave_at")))


def still_leaving(record: LeavingRecord, now: float, *, grace_s: float = DEFAULT_GRACE_S,
                  incarnation: Incarnation | None = None) -> bool:
    """Whether ``record`` still describes the VM listed now (pure); it excludes its host from
    ``leave_at`` on (:meth:`LeavingRecord.leaves_by`), but is kept, and not pruned, before that."""
    if now > record.ends_at + grace_s:
        return False
    if incarnation is not None:
        if record.instance_id and incarnation.instance_id and incarnation.instance_id != record.instance_id:
            return False  # deleted and recreated under the same name
        if incarnation.started_at is not None and incarnation.started_at > record.published_at:
            return False  # stopped and started again since it published the record
    return True


def _key(host: str) -> str:
    return check_key(keys.leaving_key(host))  # a host name that would not make a valid key fails here


def publish_leaving(store: ObjectStore, host: str, *, reason: str = "preemption-notice",
                    deadline: float | None = None, instance_id: str | None = None,
                    now: float | None = None, leave_at: float | None = None) -> LeavingRecord:
    record = LeavingRecord(host=host, published_at=time.time() if now is None else now, deadline=deadline,
                           reason=reason, instance_id=instance_id, leave_at=leave_at)
    store.put(_key(host), record.to_json())
    log.info("published %s as leaving (%s)", host, reason)
    return record


def publish_leaving_until(store: ObjectStore, host: str, *, until: float, reason: str = "preemption-notice",
                          deadline: float | None = None, instance_id: str | None = None,
                          call_s: float = PUBLISH_CALL_S, stop: threading.Event | None = None,
                          clock: Callable[[], float] = time.time, leave_at: float | None = None) -> LeavingRecord:
    """:func:`publish_leaving`, retried until ``until`` (epoch seconds): the record's host must
    leave gracefully even if the store fails now and then, or answers slowly.

    Every call is bounded (``store.within``) to end by ``until`` and at most ``call_s`` after it
    starts; a failed call is retried with jittered backoff while time is left. The record is the
    same bytes in every attempt, so an attempt whose answer was lost but which landed is simply
    written again. Raises the last error when ``until`` passes (or ``stop`` is set) first, and
    :class:`~ckpt_service.errors.BadStoreKeyError` at once for a host name no key can hold. An ``until``
    already past (too close for one call) is pushed out ``LATE_RECORD_S``: the record is written anyway.
    """
    if not call_s > 0:
        raise ValueError(f"call_s must be positive, not {call_s}")
    key = _key(host)
    if until - clock() < MIN_PUBLISH_CALL_S:
        log.warning("%s is leaving %.1f s after its deadline; its record still gets %.0f s to land",
                    host, clock() - until, LATE_RECORD_S)
        until = clock() + LATE_RECORD_S
    record = LeavingRecord(host=host, published_at=clock(), deadline=deadline, reason=reason,
                           instance_id=instance_id, leave_at=leave_at)
    data = record.to_json()
    done = stop or threading.Event()

    def backoff(seconds: float) -> None:
        done.wait(seconds)  # a stop cuts it short

    def attempt() -> None:
        now = clock()
        store.within(Deadline(min(until, now + call_s), margin_s=0.0)).put(key, data)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(lambda exc: not isinstance(exc, BadStoreKeyError)),
        wait=tenacity.wait_exponential_jitter(initial=0.2, max=2.0, jitter=0.2),
        stop=tenacity.stop_any(tenacity.stop_when_event_set(done), _StopBefore(until, clock)),
        sleep=backoff,
        before_sleep=lambda state: log.warning("could not publish %s as leaving (%s); retrying", host,
                                               state.outcome.exception() if state.outcome else None),
        reraise=True,
    )
    retrying(attempt)
    log.info("published %s as leaving (%s)", host, reason)
    return record


class _StopBefore(stop_base):
    """Stop retrying once too little time would be left before ``until`` for another call, after
    the backoff about to be slept."""

    def __init__(self, until: float, clock: Callable[[], float]) -> None:
        self.until, self.clock = until, clock

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        backoff = getattr(retry_state, "upcoming_sleep", 0.0) or 0.0
        return self.until - self.clock() - backoff < MIN_PUBLISH_CALL_S


def clear_leaving(store: ObjectStore, host: str) -> None:
    store.delete(_key(host))


def read_leaving(store: ObjectStore, *, only: Collection[str] | None = None,
                 parallel: int = READ_PARALLEL) -> list[LeavingRecord]:
    """Every record in the store, or only those of the host names in ``only`` (discovery: the hosts it
    lists now; a record of a host it does not list changes nothing). One listing, then the records
    read ``parallel`` at a time (a record deleted meanwhile is skipped): a wave of departures costs
    discovery about one round trip per ``parallel`` records, not one each."""
    wanted = None if only is None else set(only)
    found = [(host, key) for key in store.list(keys.LEAVING_PREFIX)
             if (host := keys.host_of_leaving_key(key)) is not None and (wanted is None or host in wanted)]

    def read(item: tuple[str, str]) -> LeavingRecord | None:
        host, key = item
        try:
            return LeavingRecord.from_json(host, store.get(key))
        except ObjectNotFoundError:
            return None

    if len(found) <= 1 or parallel <= 1:
        read_all = [read(item) for item in found]
    else:
        with ThreadPoolExecutor(max_workers=min(parallel, len(found)), thread_name_prefix="hvdt-leaving") as pool:
            read_all = list(pool.map(read, found))
    return [record for record in read_all if record is not None]


def leaving_hosts(store: ObjectStore, *, now: float | None = None, grace_s: float = DEFAULT_GRACE_S) -> set[str]:
    """Hosts whose record excludes them now (no cloud view: ``leave_at``, deadline and grace only)."""
    now = time.time() if now is None else now
    return {r.host for r in read_leaving(store) if r.leaves_by(now) and still_leaving(r, now, grace_s=grace_s)}


def excluded(records: Iterable[LeavingRecord], names_to_incarnation: Mapping[str, Incarnation | None],
             now: float, *, grace_s: float = DEFAULT_GRACE_S) -> set[str]:
    """Names whose record excludes them now, each judged against the VM now listed under it (pure)."""
    return {r.host for r in records
            if r.leaves_by(now)
            and still_leaving(r, now, grace_s=grace_s, incarnation=names_to_incarnation.get(r.host))}


def prune_leaving(store: ObjectStore, *, now: float | None = None, grace_s: float = DEFAULT_GRACE_S) -> list[str]:
    """Delete records that no longer exclude their host; returns their hosts."""
    now = time.time() if now is None else now
    pruned = []
    for record in read_leaving(store):
        if not still_leaving(record, now, grace_s=grace_s):
            clear_leaving(store, record.host)
            pruned.append(record.host)
    if pruned:
        log.info("removed expired leaving records of %s", ", ".join(sorted(pruned)))
    return pruned
