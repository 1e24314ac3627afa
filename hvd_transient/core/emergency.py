"""What every rank does when a notice round shows a rank newly under notice: publish the leaving
record (in the background), cancel a background save, elect a master not leaving and move the
lease to it, take the emergency checkpoint before the deadline, and let the noticed ranks leave.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

from ckpt_service.manager import ShareSnapshot
from hvd_transient.core.election import NoticeRound, elect_master
from hvd_transient.core.interfaces import ProtocolParts
from hvd_transient.core.leave_plan import record_writer
from hvd_transient.core.leaving import Departure, planned_leave_at
from hvd_transient.core.notice_round import EarlyWarnings, StepOutcome, notice_event_wait_s
from hvd_transient.core.ring import move_lease
from hvd_transient.core.saves import Saves, take_snapshot
from hvd_transient.gcp.metadata import GCE_NOTICE_WINDOW_S
from hvd_transient.telemetry import schema as ev

log = logging.getLogger(__name__)

#: a leave planned again is moved only if it comes this much earlier (the clock of each round moves a little)
REPLAN_TOLERANCE_S = 0.5


class Emergency:
    """The emergency path of one rank; :meth:`handle` runs on every rank at the same step boundary."""

    def __init__(self, parts: ProtocolParts, saves: Saves, warnings: EarlyWarnings, departure: Departure) -> None:
        self.p = parts
        self._saves = saves
        self._warnings = warnings
        self._departure = departure

    def handle(self, step: int, round_: NoticeRound, new: list[int],
               snapshot: Callable[[], Mapping[str, Any]], metadata: Callable[[], dict[str, Any]],
               share_snapshot: ShareSnapshot | None) -> StepOutcome:
        """``new``: the ranks whose notice no earlier round handled.

        Every store call on this path ends by ``deadline`` (the save's): the lease moves and the
        save are bounded by it, and durable events wait for their writes only a small share of
        it. The leaving record, written first, is retried in the background until its own VM's
        deadline.
        """
        p = self.p
        rank, size = p.comm.rank(), p.comm.size()
        now = p.clocks.wall()
        # Every rank still in the ring writes a share, earlier leavers too: the save must end
        # before the first of them is gone.
        deadline = (round_.deadline or now + self._window()) - p.config.leave_margin_s
        leaving_hosts = [p.run.hosts[r] for r in new]
        was_master = rank == p.run.master
        # One record per VM, written once, by its lowest rank, with its own notice's deadline
        # (not another VM's, nor one written again when a later notice comes in).
        own_deadline = round_.deadline_of(rank) if rank in new else None
        writes_record = self._writes_record(new)
        # Every rank plans every leaver's leave_at, to time its departure when the ring re-forms without it.
        planned = {p.run.hosts[r]: planned_leave_at(p.config, p.run.hosts, round_, self._vm_deadline(round_, r, now),
                                                    now) for r in new}
        p.run.leave_at_of.update({host: at for host, at in planned.items() if at is not None})
        # when each is due to leave (agreed): a VM still in the ring well after that lost the driver's message
        p.run.due_at_of.update({host: round_.at or now if at is None else at for host, at in planned.items()})
        leave_at = planned[p.host] if rank in new else None
        if writes_record:
            self._departure.publish_record(step, own_deadline, was_master, until=self._vm_deadline(round_, rank, now),
                                           leave_at=leave_at)
        p.events.emit(ev.NoticeAgreed(step=step, leaving=tuple(leaving_hosts), deadline=deadline, size=size),
                      wait_s=notice_event_wait_s(p.events, p.clocks, deadline))

        # A background save still in flight is cancelled, on every rank: the emergency step
        # supersedes it, and its uploads must not compete with this save's for a slow store
        # (those it already sent end on its own threads; this save uploads on others).
        if p.manager.cancel_inflight(f"an emergency save of step {step} needs the store"):
            p.events.emit(ev.InflightCancelled(step=step, reason="emergency"))

        new_master = self._elect(step, round_, rank, size, deadline)

        tensors, meta = take_snapshot(rank, step, snapshot, metadata)
        self._warnings.save_started(step)
        committed = self._saves.save_now(step, tensors, meta, coordinator=new_master, deadline=deadline,
                                         kind="emergency", share_snapshot=share_snapshot)
        p.run.handled_leavers.update(leaving_hosts)
        p.run.departure_pending = True
        if rank in new:
            self._departure.leave(step, until=self._vm_deadline(round_, rank, now), own_deadline=own_deadline,
                                  was_master=was_master, leave_at=leave_at, wrote_record=writes_record)
        return StepOutcome(emergency_step=step, committed=committed, leaving=p.run.leaving,
                           departure_pending=True, leave_at=leave_at if rank in new else None, check_hosts=True)

    def replan(self, step: int, round_: NoticeRound) -> None:
        """A later round of a ring whose VMs under notice train on to their ``leave_at``: each leave is
        planned again from this round (pure, so every rank plans the same), and one that must now come
        earlier (steps grew slower than when it was planned, or a slower departure was timed) moves so:
        the VM's record is written again with the earlier ``leave_at`` (or none: at once), so discovery
        drops it in time. A leave is never moved later: the first plan was already published."""
        p = self.p
        now = round_.at or p.clocks.wall()
        for r in round_.leaving:
            if r >= len(p.run.hosts) or p.run.hosts[r] not in p.run.handled_leavers:
                continue
            host = p.run.hosts[r]
            planned = p.run.leave_at_of.get(host)
            if planned is None or now >= planned:  # it leaves at once already, or its leave_at has come
                continue
            vm_deadline = self._vm_deadline(round_, r, now)
            again = planned_leave_at(p.config, p.run.hosts, round_, vm_deadline, now)
            if again is not None and again >= planned - REPLAN_TOLERANCE_S:
                continue
            log.warning("%s now leaves %s (steps or departures grew slower since its leave was planned)",
                        host, "at once" if again is None else f"{planned - again:.1f} s earlier")
            if again is None:
                del p.run.leave_at_of[host]
            else:
                p.run.leave_at_of[host] = again
            p.run.due_at_of[host] = now if again is None else again
            p.run.landed_at_of.pop(host, None)  # its record is written again: discovery reads the new one
            if host == p.host and self._writes_record(round_.leaving):
                self._departure.publish_record(step, round_.deadline_of(r), False, until=vm_deadline,
                                               leave_at=again)
                # the report dates the departure by the latest leave this host was given
                p.events.emit(ev.LeaveMoved(step=step, deadline=round_.deadline_of(r), leave_at=again),
                              wait_s=notice_event_wait_s(p.events, p.clocks, vm_deadline))

    def _window(self) -> float:
        return self.p.config.notice_window_s or GCE_NOTICE_WINDOW_S

    def _vm_deadline(self, round_: NoticeRound, r: int, now: float) -> float:
        """Rank ``r``'s VM's deadline; where its notice gave none, the configured window from ``now``."""
        return round_.deadline_of(r) or now + self._window()

    def _writes_record(self, leaving: Sequence[int]) -> bool:
        """Whether this rank writes its VM's leaving record: the VM's lowest rank among ``leaving`` does."""
        p, rank = self.p, self.p.comm.rank()
        return rank in leaving and rank == record_writer(p.run.hosts, leaving, p.host)

    def _elect(self, step: int, round_: NoticeRound, rank: int, size: int, deadline: float) -> int:
        """The master is the lowest rank not leaving; a new one takes the lease by ``deadline``."""
        p = self.p
        new_master = elect_master(size, round_.leaving)
        if new_master != p.run.master:
            move_lease(p.lease, p.events, take=rank == new_master, until=deadline)
            p.events.emit(ev.Election(step=step, old_master=p.run.master, new_master=new_master,
                                      old_master_host=p.run.hosts[p.run.master],
                                      new_master_host=p.run.hosts[new_master],
                                      lease_generation=p.lease.generation if rank == new_master else None))
            p.run.master = new_master
        return new_master
