"""Joins that Horovod's driver announced to nobody, found from the standbys' ready records.

Horovod's elastic driver tells the job's rank 0 once, when the hosts discovery lists change, and never
again while they stay the same. That one message is lost where it comes while the ring re-forms: the
driver skips it while rank 0's notification client is not registered yet, and the worker drops the
messages it holds when it resets. A VM whose standby became ready just then is listed, but the new ring
formed without it, and nothing tells the ring again: it stays out until some other host changes (a
ring of 8 on 2 cores waited 10 minutes). The standby's ready record in the run's store says when it
became ready, so rank 0 looks, once per ring and ``LOOK_AFTER_S`` after it began, for a VM that became
ready around that ring's start and is not in it, and tells its own host check that the hosts changed:
every rank then resets at the next notice round, and the driver's new ring takes every VM listed.

Each record is announced at most once per process, so a VM that is listed but cannot join (the ring is
at ``--max-np``) costs one reset. A VM that became ready well before the ring began was listed when it
formed, and one that becomes ready later reaches rank 0 through the driver: neither is looked for.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Mapping

from hvd_transient.discovery.ready import ReadyRecord, read_ready

if TYPE_CHECKING:
    from ckpt_service.stores.base import ObjectStore

log = logging.getLogger(__name__)

#: a ring's rank 0 looks this long after the ring began (several of the driver's discovery rounds, 1 s
#: each, and its notification: a join announced normally has reset the ring by then)
LOOK_AFTER_S = 10.0
#: a record counts if its VM became ready from this long before the ring began (its reset, the driver's
#: discovery round and rendezvous) ...
READY_BEFORE_S = 30.0
#: ... to this long after (until rank 0's notification client is registered with the driver)
READY_AFTER_S = 3.0


@dataclass(frozen=True)
class MemberSeen:
    """A member of a ring: every name its VM goes by (Horovod's host, the machine's own name: a standby publishes
    its record under the latter, while discovery may list the VM by its internal IP) and the cloud's instance id
    of its VM, where known (machine names are unique per zone only: an id, where both sides have one, decides)."""

    names: frozenset[str]
    instance_id: str | None = None

    def keys(self) -> tuple[str, ...]:
        """What rank 0 remembers this member by: its id (where it said one) and its names; a name of a member
        that said no id also under ``noid:``, for a record that carries an id (see :func:`_keys`)."""
        names = tuple(f"name:{n}" for n in self.names)
        return (f"id:{self.instance_id}", *names) if self.instance_id else (*names, *(f"noid:{n}" for n in self.names))


@dataclass(frozen=True)
class RingSeen:
    """A ring as rank 0 saw it begin: its members and its start (epoch seconds)."""

    members: tuple[MemberSeen, ...]
    began_at: float


def _keys(record: ReadyRecord) -> tuple[str, ...]:
    """The members a record may be of, as :meth:`MemberSeen.keys` names them: with an id, the member of that id
    (machine names are unique per zone only) or one that said no id, under the record's name; without one, any
    member of that name."""
    return (f"id:{record.instance_id}", f"noid:{record.host}") if record.instance_id else (f"name:{record.host}",)


def lost_joins(records: Iterable[ReadyRecord], ring: RingSeen, *, last_in_ring: Mapping[str, float],
               announced: Collection[tuple[str, float]]) -> list[ReadyRecord]:
    """The ready records whose VM the driver may have announced while ``ring`` formed and is not in it (pure):
    ready from ``READY_BEFORE_S`` before the ring began to ``READY_AFTER_S`` after, not the VM of any member,
    nor of a member of a ring that began after it was ready (``last_in_ring``: a member's key, its instance id or
    else its names (:meth:`MemberSeen.keys`) -> the latest start of a ring it was in), not announced yet."""
    never = float("-inf")
    in_ring = {key for member in ring.members for key in member.keys()}
    return [r for r in records
            if in_ring.isdisjoint(_keys(r))
            and ring.began_at - READY_BEFORE_S <= r.ready_at <= ring.began_at + READY_AFTER_S
            and max(last_in_ring.get(k, never) for k in _keys(r)) < r.ready_at
            and (r.host, r.ready_at) not in announced]


class LostJoins:
    """Rank 0's look for lost joins (see the module's docstring): :meth:`ring_began` on each ring,
    :meth:`take` at the notice rounds."""

    def __init__(self, *, clock: Callable[[], float] = time.time, look_after_s: float = LOOK_AFTER_S) -> None:
        self._clock = clock
        self._look_after_s = look_after_s
        self._lock = threading.Lock()
        self._last_in_ring: dict[str, float] = {}
        self._announced: set[tuple[str, float]] = set()
        self._ring: RingSeen | None = None
        self._found: list[ReadyRecord] = []
        self._timer: threading.Timer | None = None

    def ring_began(self, members: Iterable[MemberSeen], *, rank: int, store: "ObjectStore") -> None:
        """A ring of ``members`` began (every rank calls this; rank 0 looks, in the background)."""
        ring = RingSeen(tuple(members), self._clock())
        with self._lock:
            for member in ring.members:
                for key in member.keys():
                    self._last_in_ring[key] = ring.began_at
            self._ring, self._found = ring, []
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if rank != 0:
                return
            self._timer = threading.Timer(self._look_after_s, self._look, args=(ring, store))
            self._timer.daemon = True
            self._timer.start()

    def look(self, ring: RingSeen, records: Iterable[ReadyRecord]) -> None:
        """Keep what ``records`` say was lost while ``ring`` formed (if it is still the current ring)."""
        with self._lock:
            if ring is not self._ring:
                return
            self._found = lost_joins(records, ring, last_in_ring=self._last_in_ring, announced=self._announced)

    def take(self) -> list[ReadyRecord]:
        """The lost joins found for the current ring, once each (marked announced)."""
        with self._lock:
            found, self._found = self._found, []
            self._announced.update((r.host, r.ready_at) for r in found)
        return found

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _look(self, ring: RingSeen, store: "ObjectStore") -> None:
        try:
            records = read_ready(store)
        except Exception as exc:  # whatever the store raised: the join waits for the next host change
            log.warning("could not read the standbys' ready records to look for lost joins: %s", exc)
            return
        self.look(ring, records)


__all__ = ["LOOK_AFTER_S", "LostJoins", "MemberSeen", "READY_AFTER_S", "READY_BEFORE_S", "RingSeen", "lost_joins"]
