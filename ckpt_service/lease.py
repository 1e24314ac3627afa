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
unknown (:class:`WriteOutcomeUnknownError`) and the generation held is kept; if
the next compare-and-swap is refused, finding that write's record stored means
it landed, and the renewal is made on top of it.

Every write of the lease (acquire, steal, fence, release) is a conditional write that
moves the object to a new generation, and every store makes generations of one object
strictly increase; so the generation a commit marker records orders commits by their
fences (:func:`ckpt_service.manifest.superseded_steps`).

``fence(deadline=...)`` (the fence inside a save that has a deadline) makes every
request of the renewal, read-backs included, end by that deadline.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

from ckpt_service.deadline import Deadline
from ckpt_service.errors import CheckpointError, LeaseLostError, PreconditionFailedError
from ckpt_service.layout import LEASE_KEY
from ckpt_service.stores.base import ObjectStore, WriteOutcomeUnknownError

log = logging.getLogger(__name__)


class LeaseHeldError(CheckpointError, RuntimeError):
    """Another holder has a valid lease; acquiring needs it to expire, be released, or an election."""


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    expires_at: float
    released: bool
    write_id: str

    def usable_by(self, holder: str, now: float) -> bool:
        return self.released or self.holder == holder or self.expires_at <= now


class Lease:
    def __init__(self, store: ObjectStore, holder: str, *, ttl_s: float = 120.0, key: str = LEASE_KEY,
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.holder, self.ttl_s, self.key, self.clock = store, holder, ttl_s, key, clock
        self.generation: int | None = None
        #: the generation this holder's acquire (or steal) wrote: commit markers older than it
        #: were made before this tenure began
        self.acquired_generation: int | None = None
        # The bytes of this holder's last write whose outcome stayed unknown: if a later
        # compare-and-swap is refused, finding them stored means that write landed after all.
        self._unresolved: bytes | None = None

    @property
    def held(self) -> bool:
        return self.generation is not None

    def read(self) -> tuple[LeaseRecord | None, int]:
        """The current record and its generation (0 when absent)."""
        stored = self.store.get_versioned(self.key)  # the record and the generation it is at, in one read
        if stored is None:
            return None, 0
        body, generation = stored
        try:
            return LeaseRecord(**json.loads(body)), generation
        except (ValueError, TypeError):
            log.warning("lease object %s is unreadable; treating it as expired", self.key)
            return LeaseRecord("", 0.0, True, ""), generation

    def acquire(self, *, steal: bool = False, attempts: int = 5) -> int:
        """Take the lease. ``steal=True`` is for an elected successor (all ranks agreed).

        A successor may race the predecessor's ``release()``; a lost compare-and-swap is
        then simply re-read and tried again (``attempts`` times) rather than given up.
        """
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {attempts}")
        taken: int | None = None
        for attempt in range(attempts):
            record, generation = self.read()
            if record is not None and not steal and not record.usable_by(self.holder, self.clock()):
                raise LeaseHeldError(
                    f"the checkpoint-master lease is held by {record.holder!r} until "
                    f"{time.strftime('%H:%M:%S', time.localtime(record.expires_at))}; wait for it to "
                    "expire or elect a new master"
                )
            try:
                taken = self.generation = self.acquired_generation = self._write(self.store, generation,
                                                                                 released=False)
                break
            except PreconditionFailedError:
                if attempt == attempts - 1:
                    raise LeaseHeldError(
                        f"the lease {self.key} kept changing under {self.holder}; another process is "
                        "competing for it") from None
        if record is not None and record.holder not in ("", self.holder) and not record.released:
            log.warning("took over the checkpoint-master lease from %s", record.holder)
        assert taken is not None  # the loop either took it or raised
        return taken

    def fence(self, *, deadline: Deadline | None = None) -> int:
        """Renew the lease if still held; raise LeaseLostError otherwise. Call right before a commit.

        With a ``deadline``, a renewal that cannot be made or resolved before it raises
        StoreDeadlineError or WriteOutcomeUnknownError; the generation held is kept either way.
        """
        if self.generation is None:
            raise LeaseLostError(f"{self.holder} does not hold the checkpoint-master lease; acquire it first")
        store = self.store if deadline is None else self.store.within(deadline)
        try:
            self.generation = self._renew(store, released=False)
        except PreconditionFailedError:
            lost, self.generation = self.generation, None
            raise LeaseLostError(
                f"{self.holder} lost the checkpoint-master lease (generation {lost} is no longer current): "
                "another master was elected, so this process must not commit"
            ) from None
        return self.generation

    def release(self) -> None:
        if self.generation is None:
            return
        try:
            self._renew(self.store, released=True)
        except PreconditionFailedError:
            log.info("lease already taken over; nothing to release")
        self.generation = None

    def _renew(self, store: ObjectStore, *, released: bool) -> int:
        """Compare-and-swap on the generation held, or on this holder's own earlier write whose
        outcome was unknown if that is what is stored now."""
        assert self.generation is not None
        try:
            return self._write(store, self.generation, released=released)
        except PreconditionFailedError:
            landed = self._unresolved
            if landed is None:
                raise
            stored = store.get_versioned(self.key)
            self._unresolved = None  # known now, either way
            if stored is None or stored[0] != landed:
                raise
            log.info("the lease write whose outcome was unknown had been applied (generation %d)", stored[1])
            return self._write(store, stored[1], released=released)

    def _write(self, store: ObjectStore, expected_generation: int, *, released: bool) -> int:
        record = LeaseRecord(self.holder, self.clock() + self.ttl_s, released, uuid.uuid4().hex)
        data = json.dumps(asdict(record)).encode()
        # a write whose reply was lost is resolved by reading back (write_id makes data unique)
        try:
            generation = store.put_resolved(self.key, data, if_generation_match=expected_generation)
        except WriteOutcomeUnknownError:
            self._unresolved = data
            raise
        self._unresolved = None
        return generation
