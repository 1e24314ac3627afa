"""The notice path as a stateful property, on a fake wall clock: a watcher that may start late and whose reads
fail in spells, steps of any length, a notice at any phase of a step and any window. The watcher dates the
notice by its own history (:func:`dated_deadline`), the ranks agree on it at a notice round, plan the leave
(``core/leave_plan.py``), and the departure plays out as in :func:`test_lead_plan.simulate`.

After every notice: the dated deadline is never later than the true one (or is the read that saw it),
and the VM either leaves, at a step boundary with its departure done, before its true deadline, or leaves
at once; and never does worse than ``leave="at_notice"`` on the same timeline.
"""
from __future__ import annotations

from dataclasses import replace

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_lead_plan import AT_NOTICE, NEAR, World, simulate

#: the watcher reads this often while the metadata server answers (and retries this often while it fails)
POLL_S = 1.0


def dated_deadline(read_at: float, last_clear: float | None, window_s: float) -> float:
    """The deadline of a notice first seen by a read at ``read_at`` (pure): the notice came after the last
    read that said "not preempted" (``last_clear``), so its window ends by that read plus ``window_s``; with
    no such read its start is unknown, and the deadline is the read itself (leave at once)."""
    return read_at if last_clear is None else last_clear + window_s


class NoticePath(RuleBasedStateMachine):
    @initialize(step_s=st.floats(0.05, 20.0), window_s=st.sampled_from([30.0, 60.0, 120.0]) | st.floats(2.0, 150.0),
                departure_s=st.none() | st.floats(0.0, 6.0), leaving=st.floats(0.0, 1.0),
                notified=st.floats(0.0, 1.0), save=st.floats(0.0, 1.0), write=st.floats(0.0, 1.0))
    def setup(self, step_s: float, window_s: float, departure_s: float | None, leaving: float, notified: float,
              save: float, write: float) -> None:
        self.now = 0.0  # a step boundary
        self.step_s, self.window_s = step_s, window_s
        allowance = NEAR.departure_allowance_s(departure_s)
        leave_s = leaving * allowance  # leaving takes no longer than the job's measure of it allows
        self.base = World(step_s=step_s, phase_s=0.0, seen_after_s=0.0, window_s=window_s, dated_early_s=0.0,
                          rounds_offset=0, save_s=0.0, write_s=0.0, notified_s=notified * leave_s,
                          reset_s=leave_s - notified * leave_s, departure_s=departure_s)
        self.save, self.write = save, write
        self.watcher_from: float | None = None
        self.next_read: float | None = None
        self.spells: list[tuple[float, float]] = []
        self.last_clear: float | None = None
        self.notice_at: float | None = None
        self.seen: tuple[float, float] | None = None  # when the watcher saw it, and the deadline it dated
        self.checked = False

    # ---- the world -------------------------------------------------------------------------------------

    @precondition(lambda self: self.watcher_from is None)
    @rule(after=st.floats(0.0, 30.0))
    def start_watcher(self, after: float) -> None:
        """The watcher starts (a worker started late, a relaunch, a standby), ``after`` seconds from now."""
        self.watcher_from = self.next_read = self.now + after

    @rule(after=st.floats(0.0, 20.0), length=st.floats(0.5, 30.0))
    def error_spell(self, after: float, length: float) -> None:
        """The metadata server fails every read for ``length`` seconds."""
        self.spells.append((self.now + after, self.now + after + length))

    @precondition(lambda self: self.notice_at is None)
    @rule(phase=st.floats(0.0, 0.999))
    def notice(self, phase: float) -> None:
        """The cloud gives the notice ``phase`` of the way into the current step."""
        self.notice_at = self.now + phase * self.step_s

    @rule(steps=st.integers(1, 10))
    def train(self, steps: int) -> None:
        """Steps run; the watcher reads meanwhile."""
        end = self.now + steps * self.step_s
        while self.next_read is not None and self.next_read <= end and self.seen is None:
            read = self.next_read
            self.next_read = read + POLL_S
            if any(start <= read < stop for start, stop in self.spells):
                continue  # failed: retried within the poll interval
            if self.notice_at is not None and self.notice_at <= read:
                self.seen = (read, dated_deadline(read, self.last_clear, self.window_s))
            else:
                self.last_clear = read
        self.now = end

    # ---- the checks ------------------------------------------------------------------------------------

    @invariant()
    def the_watcher_never_dates_a_notice_late(self) -> None:
        """Never after the true deadline, unless it is the read itself (the window may be over: leave now)."""
        if self.seen is not None:
            assert self.notice_at is not None
            read, dated = self.seen
            assert dated <= self.notice_at + self.window_s or dated == read

    @precondition(lambda self: self.seen is not None and not self.checked)
    @rule()
    def the_ranks_agree_and_the_vm_leaves(self) -> None:
        """Play the agreement and the departure from this timeline, with the lead planned on the dated
        deadline, and compare with leaving at the notice."""
        assert self.seen is not None and self.notice_at is not None
        self.checked = True
        # in the step's own frame: time 0 is the step boundary before the notice
        boundary = self.notice_at - (self.notice_at % self.step_s)
        read, dated = self.seen
        world = replace(self.base, phase_s=self.notice_at - boundary, seen_after_s=read - self.notice_at,
                        dated_early_s=self.notice_at + self.window_s - dated)
        near, at_notice = simulate(world, NEAR), simulate(world, AT_NOTICE)
        leave_at = near.plan.leave_at
        room = 0.0 if leave_at is None else max(0.0, leave_at - near.agreed_at)
        # the save and the record take their share of the time to leave_at (or, past it, whatever they took)
        world = replace(world, save_s=self.save * (room or 30.0), write_s=self.write * (room or 30.0))
        near, at_notice = simulate(world, NEAR), simulate(world, AT_NOTICE)
        event("leaves at once" if near.plan.at_once else "trains on, then leaves")
        event("dated from the first read" if self.last_clear is None else "dated from the last clear read")
        if near.plan.at_once:
            assert near.gone_at == at_notice.gone_at
        else:
            assert near.graceful, (near, world)
        assert near.graceful or not at_notice.graceful


NoticePath.TestCase.settings = settings(max_examples=500, stateful_step_count=25, deadline=None)
test_notice_path = NoticePath.TestCase
