"""The notice protocol's stateful property test (``test_protocol_interleavings``) with
``leave="near_deadline"``: a VM under notice trains on, and Horovod re-forms the ring with it (discovery
still lists it) until its ``leave_at``, so a reset keeps it. On top of that test's checks, after every
step:

* a VM under notice is never the checkpoint master while a VM that is not stays in the ring;
* each leaving record's ``leave_at`` is its VM's deadline less ``leave_lead_s`` and one wait for a step
  boundary (a round at every step here: one step, of these fakes' instant ones), or None (leave at once)
  exactly when every VM of the ring was under notice at the emergency that handled it.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import test_protocol_interleavings as base
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from test_protocol_agreement import published

from hvd_transient.core.membership import read_leaving

pytestmark = pytest.mark.timed  # bounds wall-clock times

LEAD_S = 10.0
#: the fakes' steps take no time of their own: a lead's wait for a step boundary stays below this, unless the
#: machine makes a step slower (the lead then waits that step, and a later round may plan the leave again)
STEP_BOUND_S = 0.5


class NearDeadlineProtocol(base.NoticeProtocol):
    def __init__(self) -> None:
        super().__init__()
        self.config = dataclasses.replace(self.config, leave="near_deadline", leave_lead_s=LEAD_S)
        self.expected_leave_at: dict[str, float | None] = {}
        self.longest_wait_s = STEP_BOUND_S  # the longest wait for a step boundary a lead has planned with

    def _step_boundary(self) -> None:
        new = [h for h in self.ring if h in self.deadlines and h not in self.handled]
        whole_ring = all(h in self.deadlines for h in self.ring)  # every VM of the ring sends its notice
        # every VM of the ring was handled before this boundary: its round plans each leave again, and
        # one still training on to its leave_at now leaves at once (its record written again)
        handled_whole = bool(self.ring) and all(h in self.handled for h in self.ring)
        super()._step_boundary()
        waits = [self.config.boundary_wait_s(impl.run.ring_slowest_step_s) for impl in self._impls()]
        self.longest_wait_s = max([self.longest_wait_s, *waits])
        for host in new:
            self.expected_leave_at[host] = None if whole_ring else self.deadlines[host] - LEAD_S
            event("whole ring under notice: leave at once" if whole_ring else "train on until leave_at")
        if handled_whole:
            for host in self.ring:
                if self.expected_leave_at.get(host) is not None:
                    self.expected_leave_at[host] = None
                    event("a leave planned again: at once")

    def record_writes_allowed(self, host: str) -> int:
        # once, and once more where a later round moved its leave earlier (the whole ring under notice,
        # or steps grown slower than when it was planned)
        return 2

    def _leave_at(self, host: str) -> float | None:
        published([self.ranks[host].impl], base.GROUP_TIMEOUT_S)
        return {r.host: r.leave_at for r in read_leaving(self.memory)}[host]

    @base.running
    @rule(join=st.booleans())
    def reset(self, join: bool) -> None:
        """Horovod re-forms the ring without the VMs that left at once; one still before its
        ``leave_at`` is still listed, and stays."""
        if self.finished:
            return
        now = time.time()
        staying = []
        for host in self.ring:
            if not self.ranks[host].impl.run.leaving:
                staying.append(host)
                continue
            leave_at = self._leave_at(host)
            if leave_at is not None and now < leave_at:
                staying.append(host)
        if (not any(h not in self.handled for h in staying) or len(staying) + join > base.MAX_RANKS
                or (staying == self.ring and not join)):
            return  # nothing for Horovod to re-form, or only leavers left
        self._form_ring(staying + ([self._new_rank()] if join else []))
        event("reset with a leaver still training" if set(staying) & self.handled else "reset")

    @invariant()
    def a_vm_under_notice_is_master_only_if_every_vm_is(self) -> None:
        if not self.ring or all(h in self.handled for h in self.ring):
            return
        master = self.ring[self._impls()[0].run.master]
        assert master not in self.handled, f"{master} is under notice and master of {self.ring}"

    @invariant()
    def leave_at_is_the_deadline_less_the_lead_unless_the_whole_ring_leaves(self) -> None:
        for host, expected in self.expected_leave_at.items():
            leave_at = self._leave_at(host)
            if expected is None or leave_at is None:
                assert leave_at == expected, f"{host}'s record says leave_at {leave_at}, expected {expected}"
            else:  # less one wait for a step boundary, as long as the slowest step the ring timed
                assert expected - self.longest_wait_s - 0.1 < leave_at <= expected, (
                    f"{host}'s record says leave_at {leave_at}, expected at most {self.longest_wait_s:.2f} s "
                    f"before {expected}")


NearDeadlineProtocol.TestCase.settings = base.NoticeProtocol.TestCase.settings
test_near_deadline_interleavings = NearDeadlineProtocol.TestCase
