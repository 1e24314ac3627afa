"""One notice round: each rank's view (its watcher's notice or early warning, whether it is busy
saving, the master's latest commit and stop request, its step times) summed by one tiny allreduce
into the :class:`~hvd_transient.core.election.NoticeRound` every rank acts on, and the step of the
next round; plus :class:`StepOutcome`, what a step boundary tells the framework layer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

from hvd_transient.core.config import NOTICE_EVENT_SHARE
from hvd_transient.core.control import StopPoller
from hvd_transient.core.election import NoticeRound, decode_notice, encode_notice
from hvd_transient.core.interfaces import Clocks, ProtocolParts
from hvd_transient.core.leave_plan import departure_stale, departures_due, steps_to_next_round
from hvd_transient.core.saves import Saves
from hvd_transient.gcp.metadata import GCE_NOTICE_WINDOW_S
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import EventLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutcome:
    emergency_step: int | None = None   # step of an emergency checkpoint taken at this boundary
    committed: bool = False             # whether it committed
    leaving: bool = False               # this rank is leaving the job
    departure_pending: bool = False     # some rank published itself as leaving
    stop: bool = False                  # the operator asked the job to stop (every rank agrees)
    leave_at: float | None = None       # this leaving rank stays in the ring until then (near_deadline)
    #: every rank runs the framework's host check (a collective) at this step: a departure is pending and
    #: due (at once, or past its leave_at), or this step's notice round found a host update pending
    check_hosts: bool = False


def notice_event_wait_s(events: EventLog, clocks: Clocks, until: float) -> float:
    """How long a durable event inside a notice may wait for its write: a small share of the
    time left before ``until``, so a slow store costs the notice little (best effort)."""
    left = until - clocks.wall()
    return min(events.durable_wait_s, max(0.0, NOTICE_EVENT_SHARE * left))


class EarlyWarnings:
    """This rank's early warning (AWS rebalance recommendation), pending until a checkpoint started
    after it commits; a save that fails leaves it pending, and a later round retries."""

    def __init__(self, parts: ProtocolParts) -> None:
        self.p = parts
        self._logged = False
        self._handled = False  # a committed checkpoint answered this rank's early warning
        self._save_step: int | None = None  # a save started after the warning, outcome not yet known

    def pending(self) -> bool:
        """This rank's watcher has an early warning that no checkpoint has answered or is answering."""
        return (not self._handled and self._save_step is None
                and self.p.watcher is not None and self.p.watcher.warning is not None)

    def log_once(self) -> None:
        """Log the warning the first time a round sees it pending."""
        if self._logged:
            return
        self._logged = True
        warning = self.p.watcher.warning if self.p.watcher is not None else None
        if warning is not None:
            self.p.events.emit(ev.EarlyWarning(source=warning.source, reason=warning.reason,
                                               detected_at=warning.detected_at))

    def save_started(self, step: int) -> None:
        """A save of ``step`` started: it answers this rank's warning if it commits."""
        if self.pending():
            self._save_step = step

    def settle(self, round_: NoticeRound) -> None:
        """Learn from the round whether the save answering this rank's warning committed.

        The master reports the latest step it knows committed; once no rank is busy any more, a
        save that did not get there failed, and the warning is pending again (a later round retries).
        """
        if self._save_step is None:
            return
        if round_.committed_step is not None and round_.committed_step >= self._save_step:
            self._handled, self._save_step = True, None
        elif not round_.busy:
            log.warning("the checkpoint of step %d answering an early warning did not commit; it is retried",
                        self._save_step)
            self._save_step = None


class NoticeRounds:
    """Runs the notice rounds of this rank; ``count`` says how many so far (benchmarks count them)."""

    def __init__(self, parts: ProtocolParts, warnings: EarlyWarnings, saves: Saves, stop_poller: StopPoller) -> None:
        self.p = parts
        self.warnings = warnings
        self._saves = saves
        self._stop_poller = stop_poller
        self.count = 0
        self._notice_logged = False
        self._due_in_ring: str | None = None  # the ring whose latest round found a departure due
        #: whether this rank's VM's leaving record (its latest version) is in the store (set by the owner)
        self.record_landed: Callable[[], bool] = lambda: False

    def agree(self, step: int) -> NoticeRound:
        """Every rank at the same step: share this rank's view, return the round every rank got."""
        p, run = self.p, self.p.run
        now = p.clocks.monotonic()
        elapsed, steps = now - run.last_round_at, step - run.last_round_step
        slowest, run.slowest_step_s = run.slowest_step_s, 0.0
        run.last_round_step, run.last_round_at = step, now
        notice = p.watcher.notice if p.watcher is not None else None
        rank, size = p.comm.rank(), p.comm.size()
        if notice is not None and p.host not in run.handled_leavers:
            if not run.leaving and not self._notice_logged:
                self._notice_logged = True
                # inside the notice already: its write waits only a share of the window (best effort)
                p.events.emit(ev.Notice(source=notice.source, reason=notice.reason,
                                        detected_at=notice.detected_at, deadline=notice.deadline,
                                        deadline_basis=notice.deadline_basis),
                              wait_s=None if notice.deadline is None else notice_event_wait_s(
                                  p.events, p.clocks, notice.deadline - p.config.leave_margin_s))
        deadline = notice.deadline if notice is not None else None
        warned = self.warnings.pending()
        if warned:
            self.warnings.log_once()
        # busy before the committed step: once a background save's outcome is in, busy reads
        # False only after the step it committed was recorded
        busy = self._saves.busy()
        committed = self._saves.committed_step if rank == run.master else None
        hosts_changed = p.host_updates is not None and p.host_updates.pending()
        summed = p.comm.allreduce_sum(
            encode_notice(rank, size, deadline, self._stop_requested(), busy, elapsed, warned,
                          slowest_step_s=slowest, committed_step=committed, departure_s=run.departure_s,
                          job_step_s=run.job_slowest_step_s or 0.0, gap_s=run.longest_gap_s, wall=p.clocks.wall(),
                          epoch_left_steps=run.epoch_left_steps, hosts_changed=hosts_changed,
                          record_landed=self.record_landed(), step_timed=run.step_timed),
            name="notice")
        round_ = decode_notice(summed, size, run.hosts if len(run.hosts) == size else None)
        if steps > 0:
            round_ = replace(round_, mean_step_s=round_.elapsed_s / steps)
        if not round_.step_timed and steps > 0:
            # no step timed yet on this job (a ring's first step pays its set-up and is not timed): the mean
            # time per step since the previous round, for the cadence only. It errs long where it holds the
            # set-up, short where the frontend began the ring within its first step, so a VM under notice
            # plans no leave on it and leaves at once (plan_for_round)
            round_ = replace(round_, step_s=round_.elapsed_s / steps)
        if round_.departure_s is not None:  # the ring's slowest, so a VM that joined since knows it too
            run.departure_s = round_.departure_s
        self.count += 1
        self.warnings.settle(round_)
        # Every rank got the same sum, so every rank picks the same next check step.
        run.ring_slowest_step_s = max(run.ring_slowest_step_s, round_.slowest_step_s)
        run.next_check_step = step + steps_to_next_round(p.config, round_, steps, run.ring_slowest_step_s)
        hosts = run.hosts if len(run.hosts) == size else [str(r) for r in range(size)]
        # due as planned now, or as agreed before: a VM told to leave at once stays due though steps timed since
        # would now let it train on (a leave is never moved later: its record and discovery say at once)
        due = departures_due(p.config, hosts, round_, self._window_s()) or run.departure_due_by(round_.at)
        self._due_in_ring = run.ring_id if due else None
        if run.departure_pending and departure_stale(round_):
            # Its VM is past its deadline and grace yet still in the ring (its leaving record no longer
            # keeps it out of discovery), or nobody is under notice any more: it will not leave this way,
            # and periodic saves must not stay off for it. Agreed: from the round alone.
            log.warning("a departure pending since the notice has not happened; periodic saves resume")
            run.departure_pending = False
        return round_

    def ring_began(self) -> None:
        """A ring began (its members merged what they know of the VMs under notice): it starts with a departure
        due where one of its VMs was due to leave by the time it began, as agreed (a newcomer learned it too), so
        the host check runs at every step before its first round."""
        run = self.p.run
        self._due_in_ring = run.ring_id if run.departure_due_by(run.ring_began_wall) else None

    @property
    def departures_due(self) -> bool:
        """Agreed at this ring's latest round, or as it began: some VM under notice leaves at once or is past
        its ``leave_at``, so Horovod's host check runs at every step until the next round."""
        return self._due_in_ring is not None and self._due_in_ring == self.p.run.ring_id

    def _window_s(self) -> float:
        return self.p.config.notice_window_s or GCE_NOTICE_WINDOW_S

    def _stop_requested(self) -> bool:
        """The master looks at the store in the background; the collective shares its latest answer."""
        return self.p.comm.rank() == self.p.run.master and self._stop_poller.requested


__all__ = ["EarlyWarnings", "NoticeRounds", "StepOutcome", "notice_event_wait_s"]
