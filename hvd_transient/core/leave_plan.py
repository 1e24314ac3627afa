"""When a VM under notice leaves the ring (pure): at once, or near its deadline with a lead that covers
one wait for a step boundary, its departure and a margin.

A VM leaves only at a step boundary (Horovod's host check there sees discovery drop it), so a VM that
trains on must be dropped early enough that the step it is in, the wait for the next host check and
the ring's reset all end before its deadline. Where that does not fit before the deadline, the VM
leaves at once, exactly as ``leave="at_notice"`` does: training through the window is only ever taken
where it ends before the deadline, so it never does worse than leaving at the notice.

Every input is agreed by the notice round (the deadlines, the slowest step and departure the ranks
timed, one shared clock), so every rank plans the same thing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from hvd_transient.core.config import TransientConfig
from hvd_transient.core.election import NoticeRound, steps_until_next_check
from hvd_transient.core.membership import DEFAULT_GRACE_S
from hvd_transient.json_numbers import finite_number

#: a departure that cannot happen keeps periodic saves off at most this long after the latest deadline
#: of the VMs under notice in the ring: as long as their leaving records keep them out of discovery
STALE_DEPARTURE_S = DEFAULT_GRACE_S


@dataclass(frozen=True)
class LeavePlan:
    """How one VM under notice leaves: ``leave_at`` (epoch seconds, when discovery drops it), or None
    to leave at once; ``lead_s``, the lead it was planned with; ``why``, in words."""

    leave_at: float | None
    lead_s: float
    why: str

    @property
    def at_once(self) -> bool:
        return self.leave_at is None


def plan_leave(config: TransientConfig, hosts: Collection[str], leaving: Collection[str], deadline: float,
               now: float, *, step_s: float, departure_s: float | None, gap_s: float = 0.0,
               epoch_end_s: float | None = None) -> LeavePlan:
    """How a VM of the ring ``hosts`` whose window ends at ``deadline`` leaves, with the VMs ``leaving``
    under notice, at ``now`` (every time epoch seconds): near its deadline where the mode and the ring
    allow it (:meth:`TransientConfig.trains_through`) and the lead (:meth:`TransientConfig.lead_s`, from
    the slowest step ``step_s``, the longest gap between two steps ``gap_s`` and the slowest departure
    ``departure_s`` timed) fits before it, else at once. ``epoch_end_s``: where no epoch's end was timed yet
    (so how long its evaluation takes is unknown), how soon the current epoch may end: a VM whose
    ``leave_at`` would come after it leaves at once, as ``at_notice`` would."""
    lead = config.lead_s(departure_s, step_s, gap_s)
    if not config.trains_through(hosts, leaving):
        return LeavePlan(None, lead, "at the notice" if config.leave == "at_notice" else "every host is leaving")
    if not (math.isfinite(deadline) and math.isfinite(lead) and math.isfinite(now)):
        # a deadline or a timing that is no time plans nothing: leaving at once is never worse than at_notice
        return LeavePlan(None, lead, f"no plan from a deadline of {deadline} and a lead of {lead}")
    leave_at = deadline - lead
    if leave_at <= now:
        return LeavePlan(None, lead, f"a lead of {lead:.1f} s does not fit in the {deadline - now:.1f} s left")
    # it goes at the first host check after leave_at, up to one boundary wait later
    if epoch_end_s is not None and not now + epoch_end_s > leave_at + config.boundary_wait_s(step_s):
        return LeavePlan(None, lead, f"the epoch may end in {epoch_end_s:.1f} s, before it is gone, and no "
                                     "epoch's end (its evaluation) was timed yet")
    return LeavePlan(leave_at, lead, f"{lead:.1f} s before its deadline")


def plan_for_round(config: TransientConfig, hosts: Sequence[str], round_: NoticeRound, vm_deadline: float,
                   now: float) -> LeavePlan:
    """:func:`plan_leave` from a notice round: its agreed clock (``now`` if the round carries none), the
    slowest step and departure it carries, and its leaving ranks' hosts. Where no rank timed a step of the job
    yet, the lead has no step time to cover, and the VM leaves at once (never later than ``at_notice``)."""
    if not round_.step_timed:
        lead = config.lead_s(round_.departure_s, round_.step_s, round_.gap_s)
        return LeavePlan(None, lead, "no step of the job was timed yet")
    return plan_leave(config, hosts, {hosts[r] for r in round_.leaving}, vm_deadline, round_.at or now,
                      step_s=round_.step_s, departure_s=round_.departure_s, gap_s=round_.gap_s,
                      epoch_end_s=epoch_end_s(round_))


#: how much faster than the mean since the previous round the steps to an epoch's end may come
EPOCH_END_SPEEDUP = 2.0


def epoch_end_s(round_: NoticeRound) -> float | None:
    """How soon the current epoch may end, where that matters to a leave (pure): its steps left, at the
    mean step time since the previous round made ``EPOCH_END_SPEEDUP`` times faster; None where no rank
    knows where its epoch ends, or an epoch's end was timed already (its gap is in the lead; an epoch
    end whose evaluation runs only every few epochs, after shorter ones were timed, is not covered)."""
    if round_.epoch_left_steps is None or round_.gap_s > 0.0:
        return None
    return round_.epoch_left_steps * max(0.0, round_.mean_step_s) / EPOCH_END_SPEEDUP


def steps_to_next_round(config: TransientConfig, round_: NoticeRound, steps: int,
                        ring_slowest_step_s: float) -> int:
    """How many steps to train before the round after ``round_`` (pure, agreed), ``steps`` having run
    since the one before it.

    Normally the adaptive cadence (:func:`steps_until_next_check`, the slowdown allowance included).
    While a VM of the round is under notice, its lead (:meth:`TransientConfig.boundary_wait_s`) counts
    on a host check within ``max(step, check interval)`` at steps no slower than the slowest this job
    timed: so the next round is set by that step, with no slowdown allowance. A few more rounds, for
    the length of a window only.

    Where no step was timed yet (the round at a ring's first step: that step pays the ring's set-up and is
    not timed), the next round is at the next step: the time since the ring began says nothing of the step
    time, and a frontend that begins the ring within its first step makes it look like a few ms, which
    would put the next round seconds of steps away."""
    if round_.slowest_step_s <= 0.0 and ring_slowest_step_s <= 0.0:
        return 1
    ring_slowest = ring_slowest_step_s
    allowance = config.check_slowdown_allowance
    if round_.leaving:
        ring_slowest, allowance = max(ring_slowest, round_.step_s), 1.0
    return steps_until_next_check(round_.elapsed_s, steps, config.check_interval_s, config.max_check_every_steps,
                                  slowest_step_s=round_.slowest_step_s, ring_slowest_step_s=ring_slowest,
                                  allowance=allowance)


def departures_due(config: TransientConfig, hosts: Sequence[str], round_: NoticeRound, window_s: float) -> bool:
    """Whether some VM under notice in this round should be looked for at every step from now on: one
    that leaves at once, or whose ``leave_at`` has passed (agreed: from the round alone)."""
    return any(plan_for_round(config, hosts, round_, round_.deadline_of(r) or round_.at + window_s,
                              round_.at).at_once
               for r in round_.leaving if r < len(hosts))


def departure_stale(round_: NoticeRound, *, grace_s: float = STALE_DEPARTURE_S) -> bool:
    """Whether a departure marked pending can no longer happen (pure, agreed): no rank of the ring is
    under notice any more, or every such VM's deadline passed more than ``grace_s`` ago (its leaving
    record no longer keeps it out of discovery, and it is still in the ring)."""
    deadlines = [d for r in round_.leaving if (d := round_.deadline_of(r)) is not None]
    return not deadlines or round_.at > max(deadlines) + grace_s


#: a VM under notice still in the ring this long after it was due to leave and its leaving record was in the
#: store: the driver's message of its removal was lost (discovery drops it at once, Horovod's driver polls
#: discovery every second and tells rank 0, and the host check runs at every step once the departure is due:
#: that takes about 1-1.5 s)
LOST_REMOVAL_AFTER_S = 2.0
#: how many times rank 0 announces one VM's removal (for one due time) at most: a second time only on a later
#: ring that ran ``LOST_REMOVAL_AFTER_S`` (the first announce may have come as discovery was still dropping it)
MAX_REMOVAL_ANNOUNCES = 2


@dataclass(frozen=True)
class RemovalAnnounced:
    """What rank 0 announced of one VM's removal: for which due time, how often, last on which ring."""

    due: float
    count: int
    ring: str


def lost_removals(due_at_of: Mapping[str, float], landed_at_of: Mapping[str, float], hosts: Collection[str],
                  announced: Mapping[str, RemovalAnnounced], now: float, *, ring: str, ring_began_at: float,
                  after_s: float = LOST_REMOVAL_AFTER_S, most: int = MAX_REMOVAL_ANNOUNCES) -> list[str]:
    """The VMs under notice still in the ring ``ring`` (of ``hosts``, begun at ``ring_began_at``) at ``now``
    more than ``after_s`` after both their due time (``due_at_of``) and the round that first found their
    leaving record in the store (``landed_at_of``; every time epoch seconds), whose removal may be announced
    (pure): not yet for this due time, or fewer than ``most`` times, never twice on one ring, and again only
    on a ring that ran ``after_s``."""
    out = []
    for host, due in due_at_of.items():
        landed = landed_at_of.get(host)
        if host not in hosts or landed is None or not (math.isfinite(due) and math.isfinite(landed)):
            continue
        if now <= max(due, landed) + after_s:
            continue
        prev = announced.get(host)
        if prev is not None and prev.due == due and (prev.count >= most or prev.ring == ring
                                                     or now <= ring_began_at + after_s):
            continue
        out.append(host)
    return sorted(out)


def record_writer(hosts: Sequence[str], leaving: Collection[int], host: str) -> int | None:
    """The rank that writes ``host``'s leaving record: the VM's lowest rank among ``leaving`` (pure; None where
    none of them is on it)."""
    return min((r for r in leaving if r < len(hosts) and hosts[r] == host), default=None)


def announces_said(announced: Mapping[str, RemovalAnnounced]) -> list[list[object]]:
    """What a rank says of ``announced`` in a ring's first allgather (JSON): ``[host, due, count, ring]`` each."""
    return [[host, a.due, a.count, a.ring] for host, a in sorted(announced.items())]


_UNSAID = object()  # said by a member too old to say a leave_at


@dataclass(frozen=True)
class DeparturesSaid:
    """What the members of a new ring know of its VMs under notice, merged (:func:`merged_departures`)."""
    due_at: dict[str, float]
    #: the landed time where every member that says the chosen due time says one
    landed_at: dict[str, float]
    #: the ``leave_at`` said with the chosen due time (None: the VM leaves at once); a VM absent was said with
    #: none (an older member), and a rank keeps its own
    leave_at: dict[str, float | None]


def departures_said(due_at_of: Mapping[str, float], landed_at_of: Mapping[str, float],
                    leave_at_of: Mapping[str, float]) -> list[list[object]]:
    """What a rank says in a ring's first allgather (JSON) of the VMs under notice it knows: ``[host, due time,
    landed time or None, leave_at or None]`` each (``RunState.due_at_of``, ``landed_at_of``, ``leave_at_of``)."""
    return [[host, due, landed_at_of.get(host), leave_at_of.get(host)] for host, due in sorted(due_at_of.items())]


def merged_departures(said: Sequence[object], hosts: Collection[str]) -> DeparturesSaid:
    """The due, landed and leave times of the VMs under notice of a new ring of ``hosts``, from what its members
    said (:func:`departures_said` each, in rank order; pure, the same on every rank). A newcomer, which saw none
    of the rounds that agreed them, learns them here: else it would never look for the VM's lost removal, nor
    plan its leave again with the others when steps grow slower. Per VM, the earliest due time said (a leave is
    only ever moved earlier, so a member that missed a move says a later one); its landed time only where every
    member saying that due time says one (the latest), since a record written again lands again; its leave_at,
    the first such member's. What is malformed is ignored."""
    entries: dict[str, list[tuple[float, float | None, object]]] = {}
    for member in said:
        for entry in member if isinstance(member, (list, tuple)) else ():
            if not (isinstance(entry, (list, tuple)) and len(entry) in (3, 4) and isinstance(entry[0], str)
                    and entry[0] in hosts):
                continue
            due = finite_number(entry[1])
            if due is not None:
                leave = finite_number(entry[3]) if len(entry) == 4 else _UNSAID  # None: it leaves at once
                entries.setdefault(entry[0], []).append((due, finite_number(entry[2]), leave))
    due_at: dict[str, float] = {}
    landed_at: dict[str, float] = {}
    leave_at: dict[str, float | None] = {}
    for host, said_of in entries.items():
        due_at[host] = due = min(d for d, _, _ in said_of)
        at_due = [(landed, leave) for d, landed, leave in said_of if d == due]
        landed = [t for t, _ in at_due if t is not None]
        if len(landed) == len(at_due):
            landed_at[host] = max(landed)
        leave = next((v for _, v in at_due if v is not _UNSAID), _UNSAID)
        if leave is not _UNSAID:
            leave_at[host] = leave if isinstance(leave, float) else None
    return DeparturesSaid(due_at, landed_at, leave_at)


def merged_announces(said: Sequence[object], due_at_of: Mapping[str, float]) -> dict[str, RemovalAnnounced]:
    """What the members of a new ring said they remember of announced removals (:func:`announces_said` each, in
    rank order), merged (pure; the same on every rank): per VM under notice in the ring (``due_at_of``, as
    :func:`merged_departures` gave it), the highest count said for its current due time. Every rank keeps the
    count, not only rank 0, so a new rank 0 (the old one left) knows it, and a newcomer learns it here. A count
    for another due time counts for nothing (the cap is per due time), so no member can lift the cap by saying
    a later one. What is malformed is ignored."""
    out: dict[str, RemovalAnnounced] = {}
    for member in said:
        for entry in member if isinstance(member, (list, tuple)) else ():
            if not (isinstance(entry, (list, tuple)) and len(entry) == 4):
                continue
            host, due, count, ring = entry
            if not (isinstance(host, str) and host in due_at_of and finite_number(due) == due_at_of[host]
                    and isinstance(count, int) and not isinstance(count, bool) and count >= 1
                    and isinstance(ring, str)):
                continue
            prev = out.get(host)
            if prev is None or count > prev.count:
                out[host] = RemovalAnnounced(due_at_of[host], count, ring)
    return out


def after_announcing(announced: Mapping[str, RemovalAnnounced], lost: Collection[str],
                     due_at_of: Mapping[str, float], *, ring: str) -> dict[str, RemovalAnnounced]:
    """``announced`` once the removals of ``lost`` (from :func:`lost_removals`) were announced on ``ring``
    (pure): a VM's count goes on for the same due time, and starts again at 1 for a new one."""
    out = dict(announced)
    for host in lost:
        prev, due = announced.get(host), due_at_of[host]
        out[host] = RemovalAnnounced(due, prev.count + 1 if prev is not None and prev.due == due else 1, ring)
    return out


__all__ = ["EPOCH_END_SPEEDUP", "LOST_REMOVAL_AFTER_S", "LeavePlan", "MAX_REMOVAL_ANNOUNCES", "RemovalAnnounced",
           "STALE_DEPARTURE_S", "after_announcing", "announces_said", "departure_stale", "departures_due",
           "DeparturesSaid", "departures_said", "epoch_end_s", "lost_removals", "merged_announces",
           "merged_departures", "plan_for_round", "plan_leave", "record_writer", "steps_to_next_round"]
