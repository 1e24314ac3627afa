"""The ring a rank trains on: its shared state (:class:`RunState`: members, master, step timing,
save attempt ids), how a new ring is learnt at its start, and the store lease that follows its master.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from ckpt_service.deadline import Deadline
from ckpt_service.lease import Lease
from hvd_transient.core.election import elect_master
from hvd_transient.core.leave_plan import (
    DeparturesSaid,
    RemovalAnnounced,
    merged_announces,
    merged_departures,
)
from hvd_transient.json_numbers import finite_number
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import EventLog

log = logging.getLogger(__name__)


def member_names(member: Sequence[Any]) -> tuple[str, ...]:
    """The names a member said its VM goes by (``[host, leaving, token, names, instance id]``), its host first;
    a member that said none (an older version), or no list of names, goes by its host alone (pure)."""
    said = member[3] if len(member) > 3 and isinstance(member[3], (list, tuple)) else ()
    return tuple(dict.fromkeys([str(member[0]), *(n for n in said if isinstance(n, str) and n)]))


def ring_id(members: list[tuple[str, str]]) -> str:
    """A short id of a ring from its members' ``(host, token)`` in rank order (pure)."""
    return hashlib.sha256(json.dumps(members).encode()).hexdigest()[:12]


@dataclass
class RunState:
    master: int = 0
    hosts: list[str] = field(default_factory=list)
    handled_leavers: set[str] = field(default_factory=set)
    departure_pending: bool = False
    leaving: bool = False
    last_step: int = -1
    last_step_at: float | None = None   # wall time the last step completed on this rank
    begun_at_step: int | None = None
    next_check_step: int = 0            # adaptive cadence: the next step with a notice round
    last_round_step: int = 0
    last_round_at: float = 0.0          # time.monotonic() of this rank's previous round
    step_done_at: float | None = None   # time.monotonic() when this rank last went back to training
    slowest_step_s: float = 0.0         # this rank's longest step since its previous round
    ring_slowest_step_s: float = 0.0    # the longest step any rank took on this ring (agreed)
    #: the slowest single step this rank timed on this job, whether or not a round came between (a ring that
    #: begins clears ``slowest_step_s`` before the next round could carry it); None: none timed yet (a ring's
    #: first step is not timed, and a timed step may take 0 s on a fake clock, so 0 would not say it)
    job_slowest_step_s: float | None = None
    #: the longest time between two steps of this job that :meth:`TransientImpl.before_step` kept out of
    #: the step time (an epoch's end: an evaluation, other callbacks): no host check runs inside it
    #: either, so a VM under notice may wait that long for a step at which it can leave
    longest_gap_s: float = 0.0
    #: steps left in the current epoch after the step being reported, where the frontend times epoch ends
    #: with before_step and knows where they fall (Keras: fit's steps per epoch and the batch index)
    epoch_left_steps: int | None = None
    ring_id: str = "ring"               # the same on every rank of this ring, new at each begin()
    saves_started: int = 0              # saves this ring started: part of each save's attempt id
    #: VMs under notice that train on: when each is to leave (epoch seconds), to time its departure
    leave_at_of: dict[str, float] = field(default_factory=dict)
    #: the slowest departure timed on this job (``leave_at`` -> the survivors' new ring), agreed at rounds
    departure_s: float | None = None
    #: VMs under notice still in this ring: when each was due to leave (epoch seconds, agreed: its ``leave_at``,
    #: or the round that agreed its notice where it leaves at once), to find a removal the framework never saw
    due_at_of: dict[str, float] = field(default_factory=dict)
    #: VMs under notice still in this ring: the round that first found their leaving record (its latest
    #: version) in the store (epoch seconds, agreed); discovery drops a VM only once it is there
    landed_at_of: dict[str, float] = field(default_factory=dict)
    #: VMs whose removal rank 0 announced to its own host check (see ``lost_removals``; every rank keeps the
    #: same count, and a new ring merges what its members say: ``merged_announces``), kept across rings while
    #: the VM stays in them, so that a VM discovery still lists is not announced at every ring, whichever
    #: process is rank 0 (dropped once the VM is gone from the ring)
    removals_announced: dict[str, RemovalAnnounced] = field(default_factory=dict)
    ring_began_wall: float = 0.0        # when this ring began: the latest wall clock its members said (agreed)
    #: every name each member's VM goes by, in rank order (Horovod's host first; see ``host_names``)
    member_names: list[tuple[str, ...]] = field(default_factory=list)
    #: each member's VM's instance id, in rank order (None: not known)
    member_ids: list[str | None] = field(default_factory=list)

    def start_ring(self, step: int, members: list[Any], *, now: float, wall: float = 0.0) -> int | None:
        """Take on the ring whose members said ``[host, leaving, token, names, instance id, wall clock,
        announced removals]`` in rank order (the same list on every rank), starting at ``step`` at monotonic
        time ``now`` (``wall``: this rank's wall clock, where no member said one); returns the previous ring's
        master (None on the first ring)."""
        self.hosts = [str(m[0]) for m in members]
        # what the members know of the VMs under notice and of the removals announced: every rank the same
        self._learn_departures(merged_departures([m[7] if len(m) > 7 else () for m in members], self.hosts))
        self.removals_announced = merged_announces([m[6] if len(m) > 6 else () for m in members], self.due_at_of)
        self.member_names = [member_names(m) for m in members]
        self.member_ids = [m[4] if len(m) > 4 and isinstance(m[4], str) and m[4] else None for m in members]
        # when the ring began on the clock the rounds share (theirs is the latest any rank reads, too)
        said = [w for m in members if len(m) > 5 and (w := finite_number(m[5])) is not None]
        self.ring_began_wall = max(said or [wall])
        leaving = [r for r, m in enumerate(members) if m[1]]
        self.ring_id = ring_id([(str(m[0]), str(m[2])) for m in members])
        self.saves_started = 0
        self.handled_leavers = ({h for h in self.handled_leavers if h not in self.hosts}
                                | {self.hosts[r] for r in leaving})
        previous_master = self.master if self.begun_at_step is not None else None
        self.master = elect_master(len(members), leaving)
        self.departure_pending = bool(leaving)
        self.begun_at_step = step
        self.last_step = step
        # a new ring checks at its first step, then adapts to the step rate it measures
        self.next_check_step = step + 1
        self.last_round_step, self.last_round_at = step, now
        self.step_done_at = None  # the time a reset took is neither a step nor a gap between two
        # every member starts the ring with no step timed, a newcomer as the others: the cadence each rank
        # computes from these must be the same on every rank (the rounds are collectives)
        self.slowest_step_s = self.ring_slowest_step_s = 0.0
        return previous_master

    @property
    def step_timed(self) -> bool:
        """This rank timed a step of this job."""
        return self.job_slowest_step_s is not None

    def departure_due_by(self, at: float) -> bool:
        """Whether a VM of this ring under notice is due to leave by ``at`` (epoch seconds), as the rounds agreed:
        one told to leave at once (no ``leave_at``) always, one that trains on once its ``leave_at`` has come. Every
        rank holds the same leave times, so with an agreed ``at`` every rank answers the same; an at-once leave is
        dated by no clock (a round's is the latest any member read, and a clock that ran ahead may leave the ring)."""
        return any(host not in self.leave_at_of or self.leave_at_of[host] <= at
                   for host in self.handled_leavers if host in self.hosts)

    def _learn_departures(self, said: DeparturesSaid) -> None:
        """Take what the members said of the VMs under notice in the ring: every rank then holds the same times,
        a newcomer too (a VM the members said nothing of keeps what this rank knew: one gone is timed)."""
        for host, due in said.due_at.items():
            self.due_at_of[host] = due
            if host in said.landed_at:
                self.landed_at_of[host] = said.landed_at[host]
            else:
                self.landed_at_of.pop(host, None)
            if host in said.leave_at:
                leave_at = said.leave_at[host]
                if leave_at is None:
                    self.leave_at_of.pop(host, None)
                else:
                    self.leave_at_of[host] = leave_at

    def time_departures(self, wall: float) -> dict[str, float]:
        """Call after :meth:`start_ring`, at epoch time ``wall``: the VMs that trained on to their
        ``leave_at`` and are gone from this ring, with the seconds from their ``leave_at`` to now (the
        slowest so far is kept in ``departure_s``). A VM gone before its ``leave_at`` left for another
        reason (its VM died, a failure reset the ring) and is not timed."""
        gone = {h: wall - at for h, at in self.leave_at_of.items() if h not in self.hosts}
        staying = set(self.hosts) & self.handled_leavers  # still training on to their leave_at
        self.leave_at_of = {h: at for h, at in self.leave_at_of.items() if h in staying}
        self.due_at_of = {h: at for h, at in self.due_at_of.items() if h in staying}
        self.landed_at_of = {h: at for h, at in self.landed_at_of.items() if h in staying}
        # what was announced of a VM gone from the ring counts no more (a notice after it rejoins has a new due
        # time); a VM still in it keeps its count, under notice or not (a notice read again has the same one)
        self.removals_announced = {h: a for h, a in self.removals_announced.items() if h in self.hosts}
        timed = {h: s for h, s in gone.items() if s >= 0.0}
        if timed:
            self.departure_s = max(self.departure_s or 0.0, *timed.values())
        return timed

    def next_attempt(self, step: int) -> str:
        """The attempt id of the next save this ring starts: every rank starts the same saves in the
        same order, so every rank computes the same id without communicating."""
        n, self.saves_started = self.saves_started, self.saves_started + 1
        return f"{self.ring_id}-{step}-{n}"


def move_lease(lease: Lease, events: EventLog, *, take: bool, until: float) -> None:
    """Take the lease if this rank is the master (``take``), else release it (all ranks agreed).

    Every store call ends by ``until`` (epoch seconds). ``lease.held`` is trusted: a release or
    steal here outdates any fence of a background save still in flight
    (:class:`~ckpt_service.lease.Lease`), whose late reply can no longer make a released lease
    look held. A failure here is logged, never raised: a master without the lease cannot commit
    (its saves are abandoned and reported), but training goes on.
    """
    try:
        bound = Deadline(until)
        if take:
            if not lease.held:
                lease.acquire(steal=True, deadline=bound)
        elif lease.held:
            lease.release(deadline=bound)
    except Exception as exc:  # whatever the store raised: every rank goes on to the same collectives
        log.error("checkpoint-master lease hand-over failed: %s", exc)
        events.emit(ev.LeaseError(error=str(exc)))


__all__ = ["RunState", "member_names", "move_lease", "ring_id"]
