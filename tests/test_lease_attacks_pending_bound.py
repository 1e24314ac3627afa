"""L2: _unresolved is cleared only by a confirmed write; during an outage every fence whose request
was (possibly) sent appends its full record bytes. Measure growth; fail if it is unbounded."""
from __future__ import annotations

import pytest
from test_lease_own_writes_attacks import Scripted, not_reached_reset, read_fails

from ckpt_service.errors import StoreUnavailableError
from ckpt_service.lease import MAX_PENDING_WRITES, Lease
from ckpt_service.stores.memory import MemoryStore

N = 2000
BOUND = MAX_PENDING_WRITES


@pytest.mark.parametrize("read_back", ["fails", "works"])
def test_unresolved_bounded_during_outage(read_back) -> None:
    inner = MemoryStore("l2")
    s = Scripted(inner)
    lease = Lease(s, "master-a")
    lease.acquire()
    sizes = []
    for i in range(N):
        s.puts.append(not_reached_reset)  # connection reset: never reached the server
        if read_back == "fails":
            s.reads.append(read_fails)
        with pytest.raises(StoreUnavailableError):
            lease.fence()
        sizes.append(len(lease._unresolved))
    total = sum(map(len, lease._unresolved))
    lease.fence()  # outage over: recovers and clears
    assert lease._unresolved == []
    assert sizes[-1] <= BOUND, (
        f"after {N} failed fences (read-back {read_back}): {sizes[-1]} remembered writes, {total} bytes "
        f"(+{sizes[-1] / N:.2f} entries/fence, ~{total // max(1, sizes[-1])} B each); "
        "none of these requests reached the server")
