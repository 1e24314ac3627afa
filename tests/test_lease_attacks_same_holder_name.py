"""S3: a holder never writes on top of a record that is not its own bytes. The holder name is
f"{host}:{pid}" (hvd_transient/core/transient.py), so a restarted process on the same VM/container
can carry the same name. _renew checks bytes (write_id), but release()'s fallback after a refused
CAS checks only record.holder == self.holder and writes a release on top of whatever record of that
NAME is stored: a stale process's release() releases the live process's lease."""
from __future__ import annotations

import json

import pytest

from ckpt_service.lease import Lease, LeaseHeldError
from ckpt_service.stores.memory import MemoryStore


def test_stale_same_name_release_does_not_release_the_live_instance() -> None:
    inner = MemoryStore("s3")
    old = Lease(inner, "vm-1:1")  # the old process (e.g. pid 1 in a container)
    old.acquire()
    new = Lease(inner, "vm-1:1")  # the restarted process: same host, same pid
    new.acquire()  # usable_by: same holder name -> taken without steal
    assert new.fence() > 0
    before = json.loads(inner.get(new.key))
    old.release()  # the stale process shuts down: its CAS on its old generation is refused ...
    after = json.loads(inner.get(new.key))
    # ... and it must leave the live instance's record alone
    assert after["write_id"] == before["write_id"] and not after["released"], (
        f"stale same-name release wrote on top of the live instance's record: {before} -> {after}")
    new.fence()


def test_after_it_a_third_process_takes_the_lease_without_steal() -> None:
    """The consequence: the live master is fenced out and anyone acquires without an election."""
    inner = MemoryStore("s3b")
    old = Lease(inner, "vm-1:1")
    old.acquire()
    new = Lease(inner, "vm-1:1")
    new.acquire()
    old.release()
    other = Lease(inner, "vm-2:7")
    with pytest.raises(LeaseHeldError):  # must still be held by the live instance
        other.acquire()
    new.fence()
