"""The checkpoint-master lease: a small object whose generation is the fencing token.

Only the lease holder may commit. Every write of the lease object is a
conditional write on the generation the writer last saw, so:

* two processes cannot both acquire it (create-only / compare-and-swap),
* a master that lost it (expired, released, or taken over by a successor the
  ranks elected) fails its next ``fence()`` with :class:`LeaseLostError`, and
  ``fence()`` is called immediately before writing a commit marker.

Each write carries a unique ``write_id`` so that a write whose reply was lost
(the client retries and then sees a precondition failure on its *own* write,
or gives up although the server applied it) is recognised by reading it back
(:meth:`ObjectStore.put_resolved`) as won rather than lost, and one that was
not applied as not applied. If even the read-back fails, the write's outcome is
unknown (:class:`WriteOutcomeUnknownError`) and the generation held is kept.
"Not applied" is not final either: a request the client gave up on (timed out)
may still reach the server after the read-back. So every write of this holder
that was sent and not confirmed, whatever error it ended in, is remembered until
a later write of this holder is confirmed (the object has then moved past every
generation those writes were conditioned on, so none of them can land any more);
if a compare-and-swap is refused, finding one of those records stored means it
landed, and the renewal is made on top of it. Only this holder's own bytes (a
unique ``write_id``) count: a record of any other writer still means the lease is lost.

The store's own generation is used for atomicity only (compare-and-swap). What orders
commits is the lease's *fence number*, a counter kept in the lease object itself: every
write of the lease (acquire, steal, fence, release) writes the stored number plus one, and
each commit marker records the number its fence wrote
(:func:`ckpt_service.manifest.superseded_steps`). It does not depend on the store's clock
or generation scheme, so it keeps its order on a filesystem with coarse timestamps and in a
copy of the run moved to another kind of store. A lease object that is absent (a fresh run,
or a copy of the prefix without it) starts a new *lineage*: commits are ordered only among
markers of one lineage (another run's markers copied into the store order nothing of this
one's). Every acquire starts above the highest number a marker of its lineage carries.

``fence(deadline=...)`` (the fence inside a save that has a deadline) makes every
request of the renewal, read-backs included, end by that deadline.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

from ckpt_service.deadline import Deadline
from ckpt_service.errors import CheckpointError, LeaseLostError, PreconditionFailedError, StoreDeadlineError
from ckpt_service.layout import LEASE_KEY
from ckpt_service.stores.base import ObjectStore

log = logging.getLogger(__name__)

#: the most lease writes of one holder remembered as possibly landing later (each about 165 bytes)
MAX_PENDING_WRITES = 64


class LeaseHeldError(CheckpointError, RuntimeError):
    """Another holder has a valid lease; acquiring needs it to expire, be released, or an election."""


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    expires_at: float
    released: bool
    write_id: str
    fence: int = 0  # the fence number: +1 on every write of the lease
    lineage: str = ""  # the run whose numbers these are: made with the lease object, kept by every write

    def usable_by(self, holder: str, now: float) -> bool:
        return self.released or self.holder == holder or self.expires_at <= now


class Lease:
    """Thread-safe: a fence on a save's background thread and a release or steal on the training
    thread may overlap. The lock guards the state, never a store request (a slow fence must not
    hold up a release). Every release and acquire starts a new *tenure* (an epoch counter); a
    fence or release whose request was sent in an earlier tenure does not write its generation
    back when its reply comes, so after a release or a steal by this process, ``held`` and
    ``generation`` say what that release or steal left, whatever an older request answers later.
    Two fences of this process (a background save's and an emergency save's) run one after the
    other: both compare-and-swap on the generation held, and the second must see the first's.
    """

    def __init__(self, store: ObjectStore, holder: str, *, ttl_s: float = 120.0, key: str = LEASE_KEY,
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.holder, self.ttl_s, self.key, self.clock = store, holder, ttl_s, key, clock
        self._lock = threading.Lock()
        self._fencing = threading.Lock()  # held through a fence's requests (never by release or acquire)
        self._generation: int | None = None  # the store generation held (compare-and-swap only)
        self._fence_no: int | None = None  # the fence number held (what orders commits)
        self._lineage = ""  # the lineage of the numbers held
        self._tenure = 0  # bumped by every acquire and release: older requests' replies are stale
        #: the fence number this holder's acquire (or steal) wrote: commit markers with a lower one
        #: were made before this tenure began
        self.acquired_generation: int | None = None
        # The bytes of every write of this holder sent since its last confirmed one that may yet
        # land (an unknown outcome, or "not applied" while a request the client gave up on may still
        # reach the server): if a later compare-and-swap is refused, finding one of them stored means
        # that write landed after all. Cleared only by a confirmed write of this holder.
        self._unresolved: list[bytes] = []
        # this instance's own records besides those: the last confirmed one, and those in flight (a
        # release recognises them; the holder name alone may be another process's of the same name)
        self._written: bytes | None = None
        self._in_flight: set[bytes] = set()

    @property
    def generation(self) -> int | None:
        """The fence number this process last wrote and still holds (None: not held); a commit
        marker records the one its fence wrote."""
        with self._lock:
            return self._fence_no if self._generation is not None else None

    @property
    def lineage(self) -> str:
        """The run whose fence numbers this lease counts: commits order only among markers of one lineage."""
        with self._lock:
            return self._lineage

    @property
    def object_generation(self) -> int | None:
        """The store's generation of the lease object this process last wrote and still holds
        (compare-and-swap only: it orders nothing)."""
        with self._lock:
            return self._generation

    @property
    def held(self) -> bool:
        with self._lock:
            return self._generation is not None

    def adopt(self, other: Lease) -> None:
        """Take what ``other`` (the same holder's lease in another process) holds, without writing."""
        with other._lock:
            held = other._generation, other._fence_no, other.acquired_generation, other._lineage
        with self._lock:
            self._generation, self._fence_no, self.acquired_generation, self._lineage = held

    def drop(self) -> None:
        """Forget the lease without writing (as a process that lost it would): its next fence raises."""
        with self._lock:
            self._generation = None

    def read(self, store: ObjectStore | None = None) -> tuple[LeaseRecord | None, int]:
        """The current record and its generation (0 when absent), through ``store`` if given."""
        stored = (store or self.store).get_versioned(self.key)  # the record and the generation it is at, in one read
        if stored is None:
            return None, 0
        body, generation = stored
        try:
            record = LeaseRecord(**json.loads(body))
            if not isinstance(record.fence, int) or isinstance(record.fence, bool) or record.fence < 0:
                raise ValueError(f"fence {record.fence!r}")
            if not isinstance(record.lineage, str):
                raise ValueError(f"lineage {record.lineage!r}")
            return record, generation
        except (ValueError, TypeError):
            log.warning("lease object %s is unreadable; treating it as expired", self.key)
            return LeaseRecord("", 0.0, True, ""), generation

    def acquire(self, *, steal: bool = False, attempts: int = 5, deadline: Deadline | None = None) -> int:
        """Take the lease. ``steal=True`` is for an elected successor (all ranks agreed).

        A successor may race the predecessor's ``release()``; a lost compare-and-swap is
        then simply re-read and tried again (``attempts`` times) rather than given up. A fence
        of this process still in flight is outdated by it (see the class docstring). With a
        ``deadline``, every store request ends by it (StoreDeadlineError otherwise).
        """
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {attempts}")
        store = self.store if deadline is None else self.store.within(deadline)
        tenure = self._new_tenure()
        taken: tuple[int, int] | None = None
        for attempt in range(attempts):
            record, generation = self.read(store)
            if record is not None and not steal and not record.usable_by(self.holder, self.clock()):
                raise LeaseHeldError(
                    f"the checkpoint-master lease is held by {record.holder!r} until "
                    f"{time.strftime('%H:%M:%S', time.localtime(record.expires_at))}; wait for it to "
                    "expire or elect a new master"
                )
            # The lineage and its count go on from the record; a record without one starts a new lineage.
            # Either way the count starts above every marker of that lineage in the store, whatever the
            # record says (a lease object reset by hand or copied from another run cannot make new commits
            # look older than the ones made).
            lineage = record.lineage if record is not None and record.lineage else uuid.uuid4().hex[:16]
            counted = max(record.fence if record is not None else 0, highest_fence(store, lineage))
            try:
                taken = self._write(store, generation, released=False, fence=counted + 1, lineage=lineage)
                break
            except PreconditionFailedError:
                if attempt == attempts - 1:
                    raise LeaseHeldError(
                        f"the lease {self.key} kept changing under {self.holder}; another process is "
                        "competing for it") from None
        if record is not None and record.holder not in ("", self.holder) and not record.released:
            log.warning("took over the checkpoint-master lease from %s", record.holder)
        assert taken is not None  # the loop either took it or raised
        with self._lock:
            if self._tenure == tenure:  # else a release or another acquire came after this one
                self._generation, self._fence_no = taken
                self.acquired_generation, self._lineage = taken[1], lineage
        return taken[1]

    def fence(self, *, deadline: Deadline | None = None) -> int:
        """Renew the lease if still held; raise LeaseLostError otherwise. Call right before a commit.

        With a ``deadline``, a renewal that cannot be made or resolved before it raises
        StoreDeadlineError or WriteOutcomeUnknownError; the generation held is kept either way.
        A fence whose reply comes after this process released or took the lease again
        (another thread) raises LeaseLostError and changes nothing: its tenure is over. A fence
        waits for another fence of this process to end first (with a ``deadline``, at most until
        it: StoreDeadlineError).
        """
        wait = -1.0 if deadline is None else max(0.0, deadline.left(time.time()))
        if not self._fencing.acquire(timeout=wait):
            raise StoreDeadlineError(f"{self.holder}: another fence of the lease was still in flight at the "
                                     "deadline; nothing was written", attempted=False)
        try:
            return self._fence(deadline)
        finally:
            self._fencing.release()

    def _fence(self, deadline: Deadline | None) -> int:
        with self._lock:
            held, number, tenure = self._generation, self._fence_no, self._tenure
        if held is None or number is None:
            raise LeaseLostError(f"{self.holder} does not hold the checkpoint-master lease; acquire it first")
        store = self.store if deadline is None else self.store.within(deadline)
        try:
            renewed = self._renew(store, held, number, released=False)
        except PreconditionFailedError:
            with self._lock:
                if self._tenure == tenure and self._generation == held:
                    self._generation = None
            raise LeaseLostError(
                f"{self.holder} lost the checkpoint-master lease (generation {held} is no longer current): "
                "another master was elected, so this process must not commit"
            ) from None
        with self._lock:
            if self._tenure == tenure:
                self._generation, self._fence_no = renewed
                return renewed[1]
        raise LeaseLostError(
            f"{self.holder} released or took the checkpoint-master lease again while this fence (of generation "
            f"{held}) was in flight: the fence is outdated, so this commit must not go on")

    def release(self, *, deadline: Deadline | None = None) -> None:
        """Mark the lease released, so a successor takes it at once; a fence of this process still in
        flight is outdated by it (its commit fails with LeaseLostError). With a ``deadline``, every
        store request ends by it."""
        with self._lock:
            held, number = self._generation, self._fence_no
            self._generation = None
        self._new_tenure()
        if held is None or number is None:
            return
        store = self.store if deadline is None else self.store.within(deadline)
        try:
            self._renew(store, held, number, released=True)
        except PreconditionFailedError:
            # A fence of this process in flight may have moved the record on: release that one, if what is
            # stored is this instance's own record (another process may go by the same holder name).
            stored = store.get_versioned(self.key)
            with self._lock:
                own = {*self._unresolved, *self._in_flight, *([self._written] if self._written else [])}
            landed = json.loads(stored[0]) if stored is not None and stored[0] in own else None
            if stored is None or landed is None or landed["released"]:
                log.info("lease already taken over; nothing to release")
                return
            try:
                self._write(store, stored[1], released=True, fence=landed["fence"] + 1, lineage=landed["lineage"])
            except PreconditionFailedError:
                log.info("lease changed while being released; nothing to release")

    def _new_tenure(self) -> int:
        with self._lock:
            self._tenure += 1
            return self._tenure

    def _renew(self, store: ObjectStore, held: int, number: int, *, released: bool) -> tuple[int, int]:
        """Compare-and-swap on the generation ``held`` (fence number ``number``), or on this holder's
        own earlier write whose outcome was unknown if that is what is stored now; returns the
        (generation, fence number) written."""
        lineage = self.lineage
        try:
            return self._write(store, held, released=released, fence=number + 1, lineage=lineage)
        except PreconditionFailedError as exc:
            refused = exc
        # Each turn finds one more of this holder's own writes landed (another of them, aimed at the same
        # generation, may land between the read and the write on top), so it ends within their number.
        with self._lock:
            turns = len(self._unresolved)
        for _ in range(turns):
            with self._lock:
                pending = list(self._unresolved)
            # if this fails, the next renewal looks again; what is pending stays until a write is confirmed
            # (a write on top of the one found here may fail too, and that one must still be recognised)
            stored = store.get_versioned(self.key)
            if stored is None or stored[0] not in pending:
                break
            landed = json.loads(stored[0])
            if landed["released"] and not released:
                break  # this holder's own release landed: a fence no longer holds the lease
            log.info("a lease write of this holder whose outcome was not known had been applied (generation %d)",
                     stored[1])
            try:
                return self._write(store, stored[1], released=released, fence=landed["fence"] + 1, lineage=lineage)
            except PreconditionFailedError as exc:
                refused = exc
        raise refused

    def _remember(self, data: bytes) -> None:
        """Keep ``data`` among the writes that may yet land, the latest ``MAX_PENDING_WRITES`` of them: a fence
        per save during a long outage would add one each, and a request sent that long ago no longer arrives."""
        with self._lock:
            self._unresolved.append(data)
            del self._unresolved[:-MAX_PENDING_WRITES]

    def _write(self, store: ObjectStore, expected_generation: int, *, released: bool,
               fence: int, lineage: str) -> tuple[int, int]:
        record = LeaseRecord(self.holder, self.clock() + self.ttl_s, released, uuid.uuid4().hex, fence, lineage)
        data = json.dumps(asdict(record)).encode()
        # a write whose reply was lost is resolved by reading back (write_id makes data unique)
        with self._lock:
            self._in_flight.add(data)
        try:
            generation = store.put_resolved(self.key, data, if_generation_match=expected_generation)
        except PreconditionFailedError:
            raise  # refused: the object moved off the expected generation, so this write can never land
        except StoreDeadlineError as exc:
            if exc.attempted:  # sent: even read back as not applied, a request of it may land later
                self._remember(data)
            raise
        except Exception:  # unknown, or not applied (yet): a request of it may land later
            self._remember(data)
            raise
        else:
            with self._lock:
                # confirmed: the object is past every generation the pending writes were conditioned on
                self._unresolved.clear()
                self._written = data
        finally:
            with self._lock:
                self._in_flight.discard(data)
        return generation, fence


def highest_fence(store: ObjectStore, lineage: str) -> int:
    """The highest fence number a commit marker of ``lineage`` in ``store`` carries (0: none)."""
    from ckpt_service.reader import list_commits  # the reader's listing; imported here to keep lease.py its base

    fences = [m.fence for m in list_commits(store).markers.values()
              if m is not None and m.fence is not None and m.lineage == lineage]
    return max(fences, default=0)
