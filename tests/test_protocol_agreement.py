"""The notice protocol agrees on every outcome, with in-process ranks.

The fake group fails any test whose ranks call different collectives (or one rank none) at
the same point, so each test here also checks that every rank ran the same collectives.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from fake_collectives import CollectiveMismatch, CollectiveTimeout, FakeCollectives, ThreadGroup

# ------------------------------------------------------------------ the fake group itself

def test_the_fake_group_names_both_ranks_calls_when_they_disagree() -> None:
    group = ThreadGroup(2, timeout_s=5)
    comms = [FakeCollectives(group, r) for r in range(2)]

    def call(r: int) -> Any:
        if r == 0:
            return comms[0].allreduce_sum(np.ones(2))
        return comms[1].broadcast_json("x", 1, name="save-outcome")

    with pytest.raises(CollectiveMismatch, match=r"rank 0 called allreduce_sum\('notice'\), "
                                                 r"rank 1 called broadcast_json\('save-outcome', root=1\)"):
        group.run(call)


def test_the_fake_group_fails_fast_when_a_rank_never_arrives() -> None:
    group = ThreadGroup(2, timeout_s=0.5)
    comms = [FakeCollectives(group, r) for r in range(2)]
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"ranks \[1\] did not reach the collective .*rank 0 in "):
        group.run(lambda r: comms[r].allgather_json(r) if r == 0 else None)
    assert time.monotonic() - t0 < 5
