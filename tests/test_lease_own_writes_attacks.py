"""The only lease holder must not lose the lease to its *own* earlier write (ckpt_service/lease.py).

A scripted store under the real Lease and the real ObjectStore.put_resolved: every conditional put and
every read-back of the lease follows a script. Each sequence failed before with LeaseLostError on a fence
of the only holder once the faults were gone: a CAS that reaches the server after its read-back said "not
applied"; a second unknown fence that replaced the memory of a first that had landed; a write found landed
whose write on top then failed (forgotten). Fixed: every write of the holder that was sent and not confirmed
is remembered until a later write of it is confirmed. Also: a fence never takes back the holder's own
landed release; and a real successor still fences the old holder out.
"""
from __future__ import annotations

import json
from collections import deque
from typing import Callable

import pytest

from ckpt_service.errors import LeaseLostError, PreconditionFailedError, StoreDeadlineError, StoreUnavailableError
from ckpt_service.lease import Lease, LeaseHeldError
from ckpt_service.stores.base import WriteOutcomeUnknownError
from ckpt_service.stores.memory import MemoryStore
from ckpt_service.testing.delegating import DelegatingStore


class Scripted(DelegatingStore):
    """Conditional puts and read-backs of the lease key follow ``puts`` / ``reads`` (then pass through).

    A put step is a callable ``(inner, key, data, expected) -> int`` (it may apply and/or raise); a read
    step is a callable ``(inner, key) -> stored`` (it may raise). ``late`` holds requests that a
    client gave up on but that reach the server later (``land_late()`` applies them)."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.puts: deque[Callable] = deque()
        self.reads: deque[Callable] = deque()
        self.late: list[Callable[[], object]] = []

    def put(self, key, data, *, if_generation_match=None):
        if if_generation_match is not None and self.puts and "lease" in key:
            return self.puts.popleft()(self, key, data, if_generation_match)
        return self.inner.put(key, data, if_generation_match=if_generation_match)

    def get_versioned(self, key):
        if self.reads and "lease" in key:
            return self.reads.popleft()(self, key)
        return self.inner.get_versioned(key)

    def land_late(self) -> None:
        for land in self.late:
            try:
                land()
            except PreconditionFailedError:
                pass  # a late request refused by its precondition changes nothing
        self.late.clear()


# ---- put steps --------------------------------------------------------------------------------

def applied_reply_lost(s, key, data, expected):
    s.inner.put(key, data, if_generation_match=expected)  # the server applied it
    raise StoreDeadlineError("put lease: not done within the window (reply held)", attempted=True)


def not_reached_reset(s, key, data, expected):
    raise StoreUnavailableError("put lease: connection reset before the server (not applied)")


def timed_out_still_in_flight(s, key, data, expected):
    """The client's request timed out and it gave up; the request itself reaches the server later."""
    s.late.append(lambda: s.inner.put(key, data, if_generation_match=expected))
    raise StoreDeadlineError("put lease: not done within the window (read timeout)", attempted=True)


def window_spent_not_sent(s, key, data, expected):
    raise StoreDeadlineError("put lease: no time left before the deadline; not sent", attempted=False)


def passes(s, key, data, expected):
    return s.inner.put(key, data, if_generation_match=expected)


# ---- read steps -------------------------------------------------------------------------------

def read_fails(s, key):
    raise StoreDeadlineError("read back lease: not done within the window", attempted=True)


def reads(s, key):
    return s.inner.get_versioned(key)


def fence_no(store: MemoryStore, lease: Lease) -> int:
    return json.loads(store.get(lease.key))["fence"]


@pytest.fixture
def setup():
    inner = MemoryStore("leaseflake")
    scripted = Scripted(inner)
    lease = Lease(scripted, "master-a")
    lease.acquire()
    return inner, scripted, lease


def assert_still_holder(inner: MemoryStore, scripted: Scripted, lease: Lease) -> None:
    """No faults any more: the only holder's fence renews (it must never be 'lost' to itself)."""
    assert not scripted.puts and not scripted.reads
    g = lease.fence()  # on a2387d3: LeaseLostError ("another master was elected")
    assert g == fence_no(inner, lease) and inner.stat(lease.key).generation == lease.object_generation
    with pytest.raises(LeaseHeldError):
        Lease(inner, "master-b").acquire()


def test_a_timed_out_fence_read_back_as_not_applied_lands_later(setup) -> None:
    """(A) A fence's CAS request times out at the client (the window is spent: StoreDeadlineError,
    attempted); put_resolved reads the lease back *before* the request reaches the server: NOT_APPLIED,
    so the original StoreDeadlineError is raised and the Lease records nothing. Then the request lands."""
    inner, scripted, lease = setup
    scripted.puts.extend([timed_out_still_in_flight])
    scripted.reads.extend([reads])  # the read-back: still at the held generation
    with pytest.raises(StoreDeadlineError) as info:
        lease.fence()
    assert not isinstance(info.value, WriteOutcomeUnknownError)  # reported as not applied
    scripted.land_late()  # ... and then it was
    assert_still_holder(inner, scripted, lease)


def test_a_second_unknown_fence_overwrites_the_first_that_landed(setup) -> None:
    """(B) Fence 1's CAS is applied, its reply and read-back lost: _unresolved = D1. Fence 2's CAS (on the
    same held generation) never reaches the server and its read-back fails too: WriteOutcomeUnknownError,
    _unresolved = D2, overwriting D1 although D2 can no longer land (D1 moved the object)."""
    inner, scripted, lease = setup
    scripted.puts.extend([applied_reply_lost, not_reached_reset])
    scripted.reads.extend([read_fails, read_fails])
    for _ in range(2):
        with pytest.raises(WriteOutcomeUnknownError):
            lease.fence()
    assert_still_holder(inner, scripted, lease)


def test_a_found_out_unknown_fence_is_forgotten_when_the_write_on_top_fails(setup) -> None:
    """(C) Fence 1's CAS is applied, reply and read-back lost: _unresolved = D1. Fence 2: CAS on the held
    generation is refused, _renew reads back and finds D1 (clears _unresolved), then the write on top of
    D1 fails without being applied (the window is spent). The Lease still holds the old generation and
    no longer remembers D1: fence 3 is refused and taken for a lost lease."""
    inner, scripted, lease = setup
    scripted.puts.extend([applied_reply_lost, passes, window_spent_not_sent])
    scripted.reads.extend([read_fails])
    with pytest.raises(WriteOutcomeUnknownError):
        lease.fence()
    with pytest.raises(StoreDeadlineError):
        lease.fence()
    assert_still_holder(inner, scripted, lease)


def test_a_found_out_unknown_fence_whose_write_on_top_is_unknown_and_not_applied(setup) -> None:
    """(C') As (C), but the write on top of D1 ends unknown (not applied, read-back failed):
    _unresolved = D2, D1 forgotten."""
    inner, scripted, lease = setup
    scripted.puts.extend([applied_reply_lost, passes, not_reached_reset])
    scripted.reads.extend([read_fails, reads, reads, read_fails])
    with pytest.raises(WriteOutcomeUnknownError):
        lease.fence()
    with pytest.raises(WriteOutcomeUnknownError):
        lease.fence()
    assert_still_holder(inner, scripted, lease)


# ---- fencing is not weakened -------------------------------------------------------------------

def test_a_late_landing_own_write_does_not_hide_a_successor(setup) -> None:
    """As (A), but a successor steals before the late request arrives (which the precondition then
    refuses): the old holder must be fenced out."""
    inner, scripted, lease = setup
    scripted.puts.extend([timed_out_still_in_flight])
    scripted.reads.extend([reads])
    with pytest.raises(StoreDeadlineError):
        lease.fence()
    successor = Lease(inner, "master-b")
    successor.acquire(steal=True)
    scripted.land_late()  # refused: the object moved on
    with pytest.raises(LeaseLostError):
        lease.fence()
    assert successor.fence() > 0


def test_a_landed_own_write_then_a_successor_is_lost(setup) -> None:
    """As (B)/(C): the holder's own unknown writes landed, then a successor stole: still fenced out."""
    inner, scripted, lease = setup
    scripted.puts.extend([applied_reply_lost, passes, window_spent_not_sent])
    scripted.reads.extend([read_fails])
    with pytest.raises(WriteOutcomeUnknownError):
        lease.fence()
    with pytest.raises(StoreDeadlineError):
        lease.fence()
    successor = Lease(inner, "master-b")
    successor.acquire(steal=True)
    with pytest.raises(LeaseLostError):
        lease.fence()
    assert successor.fence() > 0


def test_a_fence_never_takes_back_its_own_landed_release(setup) -> None:
    """A release on another thread, while a fence is in flight, lands with its reply lost and its
    read-back failed; the fence's CAS is then refused and finds the holder's own *release* record stored:
    the fence must not write a held record on top of it (it is lost, and the store stays released)."""
    inner, scripted, lease = setup

    def release_meanwhile_then_cas(s, key, data, expected):
        s.puts.appendleft(applied_reply_lost)  # the release's write
        s.reads.appendleft(read_fails)  # ... and its read-back
        with pytest.raises(WriteOutcomeUnknownError):
            lease.release()
        return s.inner.put(key, data, if_generation_match=expected)  # the fence's CAS: refused

    scripted.puts.extend([release_meanwhile_then_cas])
    with pytest.raises(LeaseLostError):
        lease.fence()
    assert json.loads(inner.get(lease.key))["released"] is True
    assert Lease(inner, "master-b").acquire() > 0  # released: taken without a steal
