"""S1/S2/S3/S4 around a successor, with the old holder carrying remembered (unresolved) writes."""
from __future__ import annotations

import json

import pytest
from test_lease_own_writes_attacks import (
    Scripted,
    applied_reply_lost,
    not_reached_reset,
    passes,
    read_fails,
    reads,
    timed_out_still_in_flight,
)

from ckpt_service.errors import LeaseLostError, StoreDeadlineError
from ckpt_service.lease import Lease
from ckpt_service.stores.base import WriteOutcomeUnknownError
from ckpt_service.stores.memory import MemoryStore


def fence_of(inner, key):
    return json.loads(inner.get(key))["fence"]


@pytest.fixture
def env():
    inner = MemoryStore("s1")
    s = Scripted(inner)
    a = Lease(s, "master-a")
    a.acquire()
    return inner, s, a


def load_pending_chain(s, a):
    """a: D1 landed (unknown), D2 on top of D1 in flight (NOT_APPLIED read-back): two remembered."""
    s.puts.append(applied_reply_lost)
    s.reads.append(read_fails)
    with pytest.raises(WriteOutcomeUnknownError):
        a.fence()
    s.puts.extend([passes, timed_out_still_in_flight])
    s.reads.extend([reads, reads])
    with pytest.raises(StoreDeadlineError):
        a.fence()
    assert len(a._unresolved) == 2


def test_s1_late_landing_after_steal(env) -> None:
    inner, s, a = env
    load_pending_chain(s, a)
    b = Lease(inner, "master-b")
    nb = b.acquire(steal=True)
    s.land_late()  # D2 (on D1's generation) refused: the object moved
    with pytest.raises(LeaseLostError):
        a.fence()
    assert b.fence() > nb
    assert json.loads(inner.get(a.key))["holder"] == "master-b"


def test_s1_s4_late_landing_just_before_steal(env) -> None:
    inner, s, a = env
    load_pending_chain(s, a)
    s.land_late()  # D2 lands: stored = a's D2
    landed = fence_of(inner, a.key)
    b = Lease(inner, "master-b")
    nb = b.acquire(steal=True)
    assert nb > landed  # S4: above the old holder's late-landed number
    with pytest.raises(LeaseLostError):
        a.fence()
    assert b.fence() > nb


def test_s1_late_landing_during_steal_cas(env) -> None:
    """D2 lands between the successor's read and its CAS: the steal retries on top of it."""
    inner, s, a = env
    load_pending_chain(s, a)
    b = Lease(inner, "master-b")
    orig = inner.put
    fired = []

    def put(key, data, *, if_generation_match=None):
        if "lease" in key and b"master-b" in data and not fired:
            fired.append(1)
            s.land_late()
        return orig(key, data, if_generation_match=if_generation_match)
    inner.put = put
    nb = b.acquire(steal=True)
    inner.put = orig
    assert fired and nb > 0
    with pytest.raises(LeaseLostError):
        a.fence()
    assert b.fence() > nb


@pytest.mark.parametrize("steal_fault", ["applied_unknown", "late_not_applied"])
def test_s1_successor_steal_unknown(env, steal_fault) -> None:
    inner, s, a = env
    load_pending_chain(s, a)
    b = Lease(s, "master-b")
    if steal_fault == "applied_unknown":
        s.puts.append(applied_reply_lost)
        s.reads.extend([reads, read_fails])  # acquire's read, then the read-back
        with pytest.raises(WriteOutcomeUnknownError):
            b.acquire(steal=True)
        # the steal landed: a must be out, whatever it remembers
        with pytest.raises(LeaseLostError):
            a.fence()
        assert not b.held
        b.acquire(steal=True)
        assert b.fence() > 0
    else:
        s.puts.append(timed_out_still_in_flight)
        s.reads.extend([reads, reads])
        with pytest.raises(StoreDeadlineError):
            b.acquire(steal=True)
        assert not b.held
        # the steal has not landed; a may still fence; then the steal lands late (refused) or not
        try:
            ga = a.fence()
        except LeaseLostError:
            ga = None
        s.land_late()
        stored = json.loads(inner.get(a.key))
        if ga is not None:
            assert stored["holder"] == "master-a"
        else:
            assert stored["holder"] == "master-b"


def test_s2_release_unknown_then_older_pending_fence_lands(env) -> None:
    inner, s, a = env
    # fence: timed out in flight, read back NOT_APPLIED
    s.puts.append(timed_out_still_in_flight)
    s.reads.append(reads)
    with pytest.raises(StoreDeadlineError):
        a.fence()
    # release: never reaches the server, read-back fails -> unknown
    s.puts.append(not_reached_reset)
    s.reads.append(read_fails)
    with pytest.raises(WriteOutcomeUnknownError):
        a.release()
    s.land_late()  # the old fence lands now: a's held record in the store
    with pytest.raises(LeaseLostError):
        a.fence()
    assert not a.held


def test_s2_release_landed_unknown_then_fence(env) -> None:
    inner, s, a = env
    s.puts.append(applied_reply_lost)
    s.reads.append(read_fails)
    with pytest.raises(WriteOutcomeUnknownError):
        a.release()
    with pytest.raises(LeaseLostError):
        a.fence()
    assert json.loads(inner.get(a.key))["released"]


def test_s3_same_name_other_instance_not_renewed_on(env) -> None:
    """Same holder name, another process: a's remembered writes never match its bytes."""
    inner, s, a = env
    load_pending_chain(s, a)
    twin = Lease(inner, "master-a")
    twin.acquire()  # same name: usable without steal
    s.land_late()
    with pytest.raises(LeaseLostError):
        a.fence()
    assert twin.fence() > 0
