"""The object-store abstraction every checkpoint backend implements.

The protocol above it (manifest, commit marker, lease) needs only four things
from a store, which Google Cloud Storage, a POSIX directory and a dict all give:

* whole-object put/get of bytes,
* a per-object *generation* that changes on every write,
* conditional writes: create-only (``if_generation_match=0``) and
  compare-and-swap (``if_generation_match=<gen>``), raising
  :class:`~ckpt_service.errors.PreconditionFailedError` when they lose,
* listing by prefix.

Keys are ``/``-separated relative paths. One shared test suite
(``ckpt_service.testing.store_conformance``) is run against every implementation.
"""
from __future__ import annotations

import abc
import builtins
import enum
import logging
import posixpath
import uuid
from dataclasses import dataclass
from typing import Iterator

from ckpt_service.deadline import Deadline
from ckpt_service.errors import BadStoreKeyError, PreconditionFailedError, StoreDeadlineError, StoreUnavailableError

log = logging.getLogger(__name__)

#: where :meth:`ObjectStore.store_time` writes its short-lived probe objects
CLOCK_PROBE_PREFIX = "clock-probe/"


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    generation: int
    mtime: float  # seconds since the epoch


class WriteOutcomeUnknownError(StoreUnavailableError):
    """A conditional write got no answer and reading it back failed too: it may have been applied."""


class WriteOutcome(enum.Enum):
    """What reading back tells about a conditional write whose answer was an error."""

    APPLIED = "applied"  # this writer's bytes are stored: the write won
    SUPERSEDED = "superseded"  # the object moved off the expected generation with other bytes: it lost
    NOT_APPLIED = "not applied"  # still at the expected generation: nothing changed


def classify_write(stored: tuple[bytes, int] | None, data: bytes, expected_generation: int) -> WriteOutcome:
    """Pure: the outcome of a conditional write of ``data`` on ``expected_generation`` (0: create-only),
    given what is stored now (bytes and generation, None if absent). ``data`` is unique to the
    writer (a token), so finding it means this write is the one stored."""
    if stored is not None and stored[0] == data:
        return WriteOutcome.APPLIED
    generation = stored[1] if stored is not None else 0
    return WriteOutcome.NOT_APPLIED if generation == expected_generation else WriteOutcome.SUPERSEDED


def check_key(key: str) -> str:
    """Reject keys that could escape the store's root or alias another key."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise BadStoreKeyError(f"invalid store key {key!r}: keys are non-empty relative '/'-paths")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts) or posixpath.normpath(key) != key:
        raise BadStoreKeyError(
            f"invalid store key {key!r}: empty, '.' or '..' path segments are not allowed"
        )
    return key


class ObjectStore(abc.ABC):
    """A flat namespace of byte objects with generations and conditional writes."""

    #: a human-readable location, e.g. ``gs://bucket/prefix`` or ``/data/ckpt``
    url: str

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Return the object's bytes; raise ObjectNotFoundError if absent."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """Return the object's info, or None if absent."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        """Write ``data`` atomically and return the new generation.

        ``if_generation_match=0`` writes only if the key is absent; any other
        integer writes only if the current generation equals it. On a lost
        precondition, raise PreconditionFailedError and leave the object as it was.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object; deleting an absent key is not an error."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key starting with ``prefix`` (a plain string prefix), in sorted order. A listing
        that fails part-way raises (StoreListingError or StoreUnavailableError): a key it could not
        see must never be taken for absent."""

    def delete_if_generation(self, key: str, generation: int) -> bool:
        """Delete ``key`` only while it is at ``generation``; returns whether it was deleted (False: it
        changed or is gone). This default looks then deletes, which a write in between can slip
        past; every backend here overrides it with an atomic one."""
        info = self.stat(key)
        if info is None or info.generation != generation:
            return False
        self.delete(key)
        return True

    def within(self, deadline: Deadline) -> ObjectStore:
        """This store with every call bounded by ``deadline``: a call that cannot finish before
        its end raises :class:`StoreDeadlineError` instead of waiting or retrying past it.

        The view shares this store's client or files. This default returns the store itself,
        which suits a backend whose calls never wait on a network or a lock (memory).
        """
        return self

    # ---- helpers shared by every backend -------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        """The object's bytes and the generation they belong to, or None if absent.

        The pair must be consistent (one read), which reading back an ambiguous write relies
        on. This default reads the generation before and after the bytes; a backend that can
        answer both in one request overrides it.
        """
        before = self.stat(key)
        if before is None:
            return None
        try:
            data = self.get(key)
        except KeyError:
            return None  # deleted between the two reads
        after = self.stat(key)
        if after is None or after.generation != before.generation:
            raise StoreUnavailableError(f"{self!r}: {key} changed while being read back; try again")
        return data, before.generation

    def put_resolved(self, key: str, data: bytes, *, if_generation_match: int) -> int:
        """A conditional put whose outcome is never ambiguous; ``data`` must be unique to this writer.

        A write whose *reply* was lost is either retried by the client, and then refused
        by the precondition its own first attempt moved on, or given up with
        :class:`StoreUnavailableError` although the server applied it. Either way,
        reading the object back tells "my write is stored" (its generation is returned)
        from "another write won" (:class:`PreconditionFailedError`) and from "nothing
        changed" (the original error). When the read-back fails too, the outcome stays
        unknown: :class:`WriteOutcomeUnknownError`. On a store bounded by a deadline
        (:meth:`within`), the write stops early enough to leave the read-back its own time.
        """
        try:
            return self.put(key, data, if_generation_match=if_generation_match)
        except (PreconditionFailedError, StoreUnavailableError) as exc:
            if isinstance(exc, StoreDeadlineError) and not exc.attempted:
                raise  # never sent: nothing to resolve
            try:
                stored = self.get_versioned(key)
            except StoreUnavailableError as read_exc:
                raise WriteOutcomeUnknownError(
                    f"{self!r}: the conditional write of {key} may or may not have been applied ({exc}); "
                    f"reading it back failed too ({read_exc})") from exc
            outcome = classify_write(stored, data, if_generation_match)
            if outcome is WriteOutcome.APPLIED:
                assert stored is not None  # classify_write says so
                log.info("%r: the conditional write of %s answered %s, yet reading back shows it applied",
                         self, key, type(exc).__name__)
                return stored[1]
            if outcome is WriteOutcome.SUPERSEDED:
                raise PreconditionFailedError(
                    f"{self!r}: {key} is at generation {stored[1] if stored else 0} with another "
                    f"writer's data, not {if_generation_match}") from exc
            raise  # NOT_APPLIED: the original error says why

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent. Return True if this call's write is the one stored.

        Lost replies are resolved by :meth:`put_resolved`, so ``data`` should contain
        something unique to the writer (a token).
        """
        try:
            self.put_resolved(key, data, if_generation_match=0)
            return True
        except PreconditionFailedError:
            return False

    def store_time(self) -> float:
        """The store's own current time (epoch seconds), on the clock its objects' mtimes come from.

        Ages of objects are measured against it, never against the caller's clock, which may be
        off by any amount on another VM. This default writes a probe object, reads its mtime
        back and deletes it (one round trip each on a network store).
        """
        key = f"{CLOCK_PROBE_PREFIX}{uuid.uuid4().hex}"
        self.put(key, b"")
        try:
            info = self.stat(key)
        finally:
            self.delete(key)
        if info is None:
            raise StoreUnavailableError(f"{self!r}: the clock probe {key} vanished before it could be read")
        return info.mtime

    def sweep_temporary(self, older_than_s: float, *, now: float | None = None) -> int:
        """Remove what writes killed midway left behind, untouched for ``older_than_s``; returns how many.

        ``now`` is on the store's clock (:meth:`store_time`, the default). Object stores write
        each object in one request and leave nothing behind: a no-op.
        """
        return 0

    def delete_prefix(self, prefix: str) -> int:
        keys = list(self.list(prefix))
        for key in keys:
            self.delete(key)
        return len(keys)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """Names of the immediate 'sub-directories' below ``prefix`` (which ends with '/')."""
        names = {k[len(prefix):].split("/", 1)[0] for k in self.list(prefix) if "/" in k[len(prefix):]}
        return sorted(names)

    def close(self) -> None:
        """Release clients or connections (optional)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
