"""L1: the only holder must recover once faults stop. _renew reads the stored record once and
writes on top of it once (no loop): if ANOTHER remembered write of this holder, conditioned on that
same found generation, lands between the read and the write-on-top, the write-on-top is refused and
the only holder takes it as a lost lease."""
from __future__ import annotations

import json

import pytest
from test_lease_own_writes_attacks import (
    Scripted,
    applied_reply_lost,
    passes,
    read_fails,
    reads,
    timed_out_still_in_flight,
)

from ckpt_service.errors import LeaseLostError, StoreDeadlineError
from ckpt_service.lease import Lease, LeaseHeldError
from ckpt_service.stores.base import WriteOutcomeUnknownError
from ckpt_service.stores.memory import MemoryStore


def test_own_late_write_lands_between_renew_read_and_write_on_top() -> None:
    inner = MemoryStore("l1")
    s = Scripted(inner)
    lease = Lease(s, "master-a")
    lease.acquire()  # g1
    # fence 1: D1 on g1 applied (g2), reply lost, read-back fails -> unresolved [D1]
    s.puts.append(applied_reply_lost)
    s.reads.append(read_fails)
    with pytest.raises(WriteOutcomeUnknownError):
        lease.fence()
    # fence 2: CAS on g1 refused; _renew reads D1 (own) and writes D2 on g2: the request times out
    # at the client (still in flight); put_resolved's read-back still shows D1 -> NOT_APPLIED
    s.puts.extend([passes, timed_out_still_in_flight])
    s.reads.extend([reads, reads])
    with pytest.raises(StoreDeadlineError) as info:
        lease.fence()
    assert not isinstance(info.value, WriteOutcomeUnknownError)
    assert len(lease._unresolved) == 2  # D1 and D2 remembered
    # fence 3: CAS on g1 refused; _renew reads D1 (g2) ... and D2 (conditioned on g2) lands now,
    # just before the write-on-top D3 (conditioned on g2)
    def read_then_late_lands(st, key):
        stored = st.inner.get_versioned(key)
        st.land_late()
        return stored
    s.reads.extend([reads, read_then_late_lands])  # put_resolved's read-back of the refused CAS, then _renew's read
    try:
        lease.fence()
        third = "ok"
    except LeaseLostError as exc:
        third = f"LeaseLostError: {exc}"
    # faults are over: nothing else was ever written by anyone but master-a
    stored = json.loads(inner.get(lease.key))
    assert stored["holder"] == "master-a" and not stored["released"]
    assert third == "ok", f"the only holder lost the lease to its own late write: {third}"
    assert lease.fence() > 0
    with pytest.raises(LeaseHeldError):
        Lease(inner, "master-b").acquire()
