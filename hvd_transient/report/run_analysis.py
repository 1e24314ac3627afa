"""The dataclasses of what :func:`hvd_transient.report.analysis.analyze` finds in a run (pure): its workers,
rings, preemptions, joins, commits and timeline, gathered in one :class:`RunAnalysis`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from hvd_transient.report.keeper_summary import KeeperSummary

FINISHED, PREEMPTED, KILLED, LOST = "finished", "preempted", "killed", "lost"


@dataclass(frozen=True)
class Worker:
    """One worker process: a VM's life as far as the log can tell."""

    host: str
    pid: int
    started_at: float           # its first event
    ended_at: float             # its last event
    outcome: str                # finished | preempted | killed | lost
    first_step: int | None
    last_step: int | None
    rank: int | None            # rank in its first ring
    notice_at: float | None     # when its watcher saw a notice
    restored_step: int | None   # a cold start that restored a checkpoint

    @property
    def label(self) -> str:
        return f"{self.host} ({self.pid})"

    @property
    def seconds(self) -> float:
        return max(0.0, self.ended_at - self.started_at)


@dataclass(frozen=True)
class Ring:
    """One (re)start of training on a set of workers."""

    started_at: float
    step: int
    size: int
    master_host: str
    hosts: tuple[str, ...]       # members in rank order: as the ring events name them, or (older logs, the
                                 # baseline) as far as their ring events reached the log
    joined: tuple[str, ...]      # members that were in no earlier ring (empty for a (re)launch)
    relaunch: bool               # no member was in an earlier ring: a fresh launch / cold restart
    ended_at: float              # the next ring's start, or when its last member's log ends
    #: training speed on this ring, from the progress events of the member that logged most of them
    steps_per_s: float | None = None


@dataclass(frozen=True)
class Preemption:
    """A worker that left: with notice (published as leaving) or without (vanished / killed).

    The survivors' figures use one rule: their *first* ``first_step`` on a ring that started
    after the departure ends the resume, and ``steps_rolled_back`` is the largest
    ``rolled_back`` of their resets between the departure and that step.
    """

    host: str
    pid: int
    departed_at: float          # leave_published (its leave_at, if later); without notice the kill time if
                                # known, else its last event
    step: int | None            # the agreed step, else its last known step
    was_master: bool            # master_host of the ring in force when the notice was agreed / it vanished
    notice: bool                # a notice event preceded the departure
    notice_at: float | None     # the watcher's detection time
    agreed_step: int | None     # step at which every rank acted on the notice
    checkpoint_committed: bool  # an emergency commit at the agreed step
    commit_at: float | None
    notice_to_commit_ms: float | None
    deadline_met: bool | None   # the commit landed before the agreed commit deadline
    new_master: str | None      # the master elected because this host was leaving
    steps_rolled_back: int      # max rolled_back of the survivors' resets that followed
    resume_ms: float | None     # departure -> survivors' next first_step (None: nobody resumed)
    reset_to_first_step_ms: float | None  # survivors' first reset -> their next first_step
    cold_restart: bool          # training resumed only through a fresh launch
    agreed_at: float | None = None    # the first rank's notice_agreed for this departure
    reset_at: float | None = None     # the survivors' first reset after the departure
    ring_at: float | None = None      # start of the ring the survivors resumed on
    resumed_at: float | None = None   # the survivors' next first_step
    survivor_resets: int = 0          # resets the survivors went through until then (most on one host)
    last_step_before_reset: int | None = None  # the first reset's last_step and step
    step_after_reset: int | None = None
    leave_lead_s: float | None = None  # trained on until this long before its VM's deadline (near_deadline)

    @property
    def agreed_to_left_ms(self) -> float | None:
        """Agreed step -> published as leaving: every rank waited for the emergency checkpoint."""
        return ms_between(self.departed_at, self.agreed_at) if self.notice else None

    @property
    def marks(self) -> dict[str, float]:
        """The moments known for this departure, in order of the protocol."""
        named = (("notice", self.notice_at), ("agreed", self.agreed_at), ("committed", self.commit_at),
                 ("left", self.departed_at), ("reset", self.reset_at), ("ring", self.ring_at),
                 ("first_step", self.resumed_at))
        return {name: t for name, t in named if t is not None}


@dataclass(frozen=True)
class Join:
    """A host entering a ring that already had members (a relaunch is not a join).

    ``stall_s``: from the survivors' last completed step before the ring changed (their
    resets' ``last_step_at``; in logs without it, their last ``first_step``/``progress``,
    which overstates by up to the progress interval) to their first ``first_step`` on the
    new ring. None when that ring never trained: a host that joins at the run's last step
    finds only the final save left.
    """

    host: str
    pid: int
    t: float
    step: int
    size: int
    stalled_from: float | None = None
    resumed_at: float | None = None
    steps_rolled_back: int = 0

    @property
    def stall_s(self) -> float | None:
        if self.stalled_from is None or self.resumed_at is None:
            return None
        return max(0.0, self.resumed_at - self.stalled_from)


@dataclass(frozen=True)
class Commit:
    t: float
    step: int
    kind: str
    host: str
    size: int | None


@dataclass(frozen=True)
class LrChange:
    t: float
    lr: float
    size: int | None


@dataclass(frozen=True)
class ProgressPoint:
    t: float
    step: int
    size: int | None


@dataclass(frozen=True)
class TimelineEntry:
    t: float
    kind: str
    host: str
    text: str


@dataclass(frozen=True)
class RunAnalysis:
    workers: tuple[Worker, ...]
    rings: tuple[Ring, ...]
    preemptions: tuple[Preemption, ...]
    joins: tuple[Join, ...]
    commits: tuple[Commit, ...]
    lr_changes: tuple[LrChange, ...]
    progress: tuple[ProgressPoint, ...]
    timeline: tuple[TimelineEntry, ...]
    stall_s_by_worker: Mapping[str, float]   # worker label -> seconds training waited for checkpoints
    checkpoint_stall_s: float                # the largest per-worker stall
    bytes_written: int                       # emergency/final save_end bytes + periodic commit bytes
    started_at: float
    ended_at: float
    completed: bool
    ended_by: str  # end of training | stop request | notice (stopped for a relaunch) | incomplete
    final_step: int | None
    last_committed_step: int | None
    weights_consistent: bool | None          # every finishing worker reported the same weights crc
    saves_failed: int
    event_count: int
    keeper: KeeperSummary | None = None
    #: ``join`` / ``removal`` -> VMs rank 0 announced to its host check because Horovod's driver lost its message
    host_updates_announced: Mapping[str, int] = field(default_factory=dict)
    #: kind -> events of it the analysis skipped: unreadable, or not of their kind's declared types
    skipped_events: Mapping[str, int] = field(default_factory=dict)

    @property
    def skipped_count(self) -> int:
        return sum(self.skipped_events.values())

    @property
    def wall_s(self) -> float:
        return max(0.0, self.ended_at - self.started_at)

    @property
    def worker_seconds(self) -> float:
        return sum(w.seconds for w in self.workers)

    @property
    def ring_sizes(self) -> tuple[tuple[float, int], ...]:
        return tuple((r.started_at, r.size) for r in self.rings)

    def ring_at(self, t: float) -> Ring | None:
        """The ring in force at ``t`` (the latest that started by then)."""
        return ring_at(self.rings, t)

    def preemption_of(self, host: str, *, after: float = -math.inf) -> Preemption | None:
        """The first departure of ``host`` at or after ``after``."""
        return next((p for p in self.preemptions if p.host == host and p.departed_at >= after), None)


class NoEventsError(ValueError):
    """The event list is empty: there is nothing to report."""


def ring_at(rings: Sequence[Ring], t: float) -> Ring | None:
    """The ring in force at ``t`` (the latest of ``rings``, in start order, that started by then)."""
    current = None
    for ring in rings:
        if ring.started_at <= t:
            current = ring
        else:
            break
    return current


def ms_between(later: float | None, earlier: float | None) -> float | None:
    """Milliseconds from ``earlier`` to ``later``; None when either is unknown."""
    if later is None or earlier is None:
        return None
    return (later - earlier) * 1e3


__all__ = ["Commit", "FINISHED", "Join", "KILLED", "LOST", "LrChange", "NoEventsError", "PREEMPTED", "Preemption",
           "ProgressPoint", "Ring", "RunAnalysis", "TimelineEntry", "Worker", "ms_between", "ring_at"]
