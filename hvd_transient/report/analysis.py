"""What happened in a run, computed from its merged event log (pure: no I/O).

The event log (:mod:`hvd_transient.telemetry.events`, kinds in :mod:`hvd_transient.telemetry.schema`)
holds the events of every worker process. :func:`analyze` turns them into:

* one :class:`Worker` per process (``host`` + ``pid``): when it lived and how it
  ended - ``finished`` (``train_end``/``weights``), ``preempted`` (it published
  itself as leaving after a notice), ``killed`` (it vanished while the run went
  on, with no ``leave_published``) or ``lost`` (the log stops with it and no
  ``train_end``: the whole cluster was lost, or the run is still going);
* the rings: ``ring`` events carry no member list, so the rings are rebuilt by
  grouping the per-rank ``ring`` events of one (re)start (same step, size and
  master, each process once);
* one :class:`Preemption` per departure (with or without notice), with its marks
  (notice -> agreed -> commit -> left -> survivors' reset -> new ring -> first
  step) and what the survivors paid for it (rollback, time to their next step);
* one :class:`Join` per host entering a running ring, with the survivors' stall;
* learning-rate changes, commits, checkpoint stall, bytes written, wall time,
  completion, and a de-duplicated timeline (collective events are written by
  every rank: the timeline shows each once);
* a :class:`KeeperSummary` when ``hvd-transient cluster keep`` wrote to the log
  (``keeper_*`` events): refills, stock-outs by zone, on-demand fallbacks, spend,
  and each launch of the training job it supervises, with when training resumed.
  The keeper's events are not a worker's: they count in no worker, ring or wall time.

This module (with :mod:`.keeper_summary` for the keeper's events) is the one analyser of a
run's events: the report and the benchmarks (``bench/preemption_cost.py``) read the same
:class:`RunAnalysis`.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from hvd_transient.report.keeper_summary import JobAttempt, KeeperSummary, describe_keeper, summarize_keeper
from hvd_transient.report.records import TRAINING_KINDS, AnyRecord, ProcessKey
from hvd_transient.report.records import key as _key
from hvd_transient.report.records import of as _of
from hvd_transient.report.records import of_any as _of_any
from hvd_transient.report.records import step as _step
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import parse_records
from hvd_transient.telemetry.schema import EventBody, Record

log = logging.getLogger(__name__)


FINISHED, PREEMPTED, KILLED, LOST = "finished", "preempted", "killed", "lost"
#: save kinds whose ``save_end`` seconds the training loop waited for (periodic saves are async)
BLOCKING_SAVE_KINDS = frozenset({"emergency", "final"})
_STEP_KINDS: tuple[type[EventBody], ...] = (
    ev.FirstStep, ev.Progress, ev.Reset, ev.Ring, ev.NoticeAgreed, ev.Commit, ev.TrainEnd, ev.Weights,
    ev.StopRequested, ev.Start)


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
    hosts: tuple[str, ...]       # members in rank order, as far as their ring events reached the log
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

    @property
    def agreed_to_left_ms(self) -> float | None:
        """Agreed step -> published as leaving: every rank waited for the emergency checkpoint."""
        return _ms(self.departed_at, self.agreed_at) if self.notice else None

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
    new ring.
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
        return _ring_at(self.rings, t)

    def preemption_of(self, host: str, *, after: float = -math.inf) -> Preemption | None:
        """The first departure of ``host`` at or after ``after``."""
        return next((p for p in self.preemptions if p.host == host and p.departed_at >= after), None)


class NoEventsError(ValueError):
    """The event list is empty: there is nothing to report."""


# --------------------------------------------------------------------------- helpers


def _group_rings(ring_events: Sequence[Record[ev.Ring]]) -> list[tuple[dict[str, Any], list[Record[ev.Ring]]]]:
    """Group per-rank ``ring`` events into ring (re)starts.

    Ranks of one ring all write (step, size, master_host); a process appears at most once
    per ring and a ring has at most ``size`` members. A rank that does not know the
    master's host (``master_host`` None) joins the group its step and size match.
    """
    groups: list[tuple[dict[str, Any], list[Record[ev.Ring]]]] = []
    for e in ring_events:
        sig: dict[str, Any] = {"step": e.body.step, "size": e.body.size, "master_host": e.body.master_host}
        if groups:
            head, members = groups[-1]
            same_master = None in (head["master_host"], sig["master_host"]) or head["master_host"] == sig["master_host"]
            if (head["step"] == sig["step"] and head["size"] == sig["size"] and same_master
                    and _key(e) not in {_key(m) for m in members} and len(members) < max(1, sig["size"])):
                members.append(e)
                head["master_host"] = head["master_host"] or sig["master_host"]
                continue
        groups.append((sig, [e]))
    return groups


def _ring_at(rings: Sequence[Ring], t: float) -> Ring | None:
    current = None
    for ring in rings:
        if ring.started_at <= t:
            current = ring
        else:
            break
    return current


def _ms(later: float | None, earlier: float | None) -> float | None:
    if later is None or earlier is None:
        return None
    return (later - earlier) * 1e3


# --------------------------------------------------------------------------- analysis


def analyze(events: Iterable[AnyRecord | Mapping[str, Any]], *,
            kills: Mapping[str, float] | None = None) -> RunAnalysis:
    """Analyse a run's events: typed records (:func:`hvd_transient.telemetry.events.read_records`) or the
    logged dicts (:func:`hvd_transient.telemetry.events.read_events`), in any order.

    ``kills``: host -> when its worker was killed, where something outside the log knows
    (the benchmark that killed it): a worker of that host that vanished without notice
    departed then, not at its last event.
    """
    every = parse_records(events)
    if not every:
        raise NoEventsError("the event list is empty")
    # the keeper is no worker: its events count in no process, ring or wall time
    keeper_records = _of_any(every, ev.KEEPER_KINDS)
    records = [e for e in every if not isinstance(e.body, ev.KEEPER_KINDS)]
    timing = records or keeper_records

    by_proc: dict[ProcessKey, list[AnyRecord]] = defaultdict(list)
    for e in records:
        by_proc[_key(e)].append(e)

    rings, ring_members = _rings(records, by_proc)
    last_ring_start = rings[-1].started_at if rings else None

    workers = {k: _worker(k, evs, rings, ring_members) for k, evs in by_proc.items()}
    preemptions = _preemptions(records, workers, rings, by_proc, kills or {})
    joins = _joins(records, rings, ring_members)
    commits = tuple(Commit(e.t, e.body.step, e.body.kind, e.host, e.body.size) for e in _of(records, ev.Commit))
    lr_changes = _lr_changes(records)
    progress = _progress(records)

    stall: dict[str, float] = {}
    for key, evs in by_proc.items():
        seconds = sum(e.body.stall_ms for e in _of(evs, ev.AsyncSave)) / 1e3
        seconds += sum(e.body.seconds for e in _of(evs, ev.SaveEnd) if e.body.kind in BLOCKING_SAVE_KINDS)
        stall[workers[key].label] = seconds
    # Synchronous saves log each rank's share (save_end); a periodic commit logs its whole step.
    bytes_written = (sum(e.body.bytes for e in _of(records, ev.SaveEnd))
                     + sum(e.body.bytes or 0 for e in _of(records, ev.Commit) if e.body.kind == "periodic"))

    finals = _of_any(records, (ev.TrainEnd, ev.Weights))
    final_ring_finals = [e for e in finals if last_ring_start is None or e.t >= last_ring_start]
    weights = _of(records, ev.Weights)
    completed = bool(final_ring_finals) or bool(weights)
    starts = _of(records, ev.Start)
    started_at = starts[0].t if starts else timing[0].t
    ended_at = max(e.t for e in finals) if completed else timing[-1].t
    step_source = (final_ring_finals or finals) if completed else _of_any(records, _STEP_KINDS)
    final_step = max((s for s in map(_step, step_source) if s is not None), default=None)
    stops = [e for e in _of(records, ev.StopRequested) if last_ring_start is None or e.t >= last_ring_start]
    # A static job stops at the agreed step of a notice (its relaunch resumes from that checkpoint).
    static_stop = any(e.body.step == final_step for e in _of(records, ev.NoticeAgreed)
                      if last_ring_start is None or e.t >= last_ring_start)
    if not completed:
        ended_by = "incomplete"
    else:
        ended_by = "stop request" if stops else "notice (stopped for a relaunch)" if static_stop else "end of training"
    consistent = len({e.body.crc for e in weights}) == 1 if weights else None

    committed_steps = [c.step for c in commits]
    return RunAnalysis(
        workers=tuple(sorted(workers.values(), key=lambda w: (w.started_at, w.host, w.pid))),
        rings=tuple(rings),
        preemptions=preemptions,
        joins=joins,
        commits=commits,
        lr_changes=lr_changes,
        progress=progress,
        timeline=_timeline(every, rings, workers, joins),
        stall_s_by_worker=stall,
        checkpoint_stall_s=max(stall.values(), default=0.0),
        bytes_written=bytes_written,
        started_at=started_at,
        ended_at=ended_at,
        completed=completed,
        ended_by=ended_by,
        final_step=final_step,
        last_committed_step=max(committed_steps) if committed_steps else None,
        weights_consistent=consistent,
        saves_failed=len({(e.body.step, e.body.kind) for e in _of(records, ev.SaveFailed)}),
        event_count=len(every),
        keeper=summarize_keeper(keeper_records, records) if keeper_records else None,
    )


def _rings(events: Sequence[AnyRecord], by_proc: Mapping[ProcessKey, Sequence[AnyRecord]]
           ) -> tuple[list[Ring], list[tuple[ProcessKey, ...]]]:
    rings: list[Ring] = []
    members_of: list[tuple[ProcessKey, ...]] = []
    seen: set[ProcessKey] = set()
    groups = _group_rings(_of(events, ev.Ring))
    for i, (sig, group) in enumerate(groups):
        members = sorted(group, key=lambda e: (e.body.rank, e.t))
        keys = tuple(_key(e) for e in members)
        new = [k for k in keys if k not in seen]
        relaunch = len(new) == len(keys)
        next_start = min(e.t for e in groups[i + 1][1]) if i + 1 < len(groups) else math.inf
        started_at = min(e.t for e in members)
        ended_at = min(max(by_proc[k][-1].t for k in keys), next_start)
        rings.append(Ring(
            started_at=started_at,
            ended_at=ended_at,
            step=sig["step"],
            size=sig["size"],
            master_host=str(sig["master_host"]),
            hosts=tuple(k[0] for k in keys),
            joined=() if relaunch else tuple(k[0] for k in new),
            relaunch=relaunch,
            steps_per_s=_steps_per_s([by_proc[k] for k in keys], started_at, ended_at),
        ))
        members_of.append(keys)
        seen.update(keys)
    return rings, members_of


def _steps_per_s(members: Sequence[Sequence[AnyRecord]], start: float, end: float) -> float | None:
    best = max(([e for e in _of(evs, ev.Progress) if start <= e.t <= end] for evs in members), key=len, default=[])
    if len(best) < 2 or best[-1].t <= best[0].t:
        return None
    return (best[-1].body.step - best[0].body.step) / (best[-1].t - best[0].t)


def _worker(key: ProcessKey, evs: Sequence[AnyRecord], rings: Sequence[Ring],
            ring_members: Sequence[tuple[ProcessKey, ...]]) -> Worker:
    host, pid = key
    started_at, ended_at = evs[0].t, evs[-1].t
    steps = [s for s in map(_step, evs) if s is not None]
    if _of(evs, ev.LeavePublished):
        outcome = PREEMPTED
    elif _of_any(evs, (ev.TrainEnd, ev.Weights)):
        outcome = FINISHED
    elif any(r.started_at > ended_at and key not in m for r, m in zip(rings, ring_members)):
        outcome = KILLED  # the run went on without it, and it never said it was leaving
    else:
        outcome = LOST
    notices = _of(evs, ev.Notice)
    first_rings = _of(evs, ev.Ring)
    start = next(iter(_of(evs, ev.Start)), None)
    return Worker(
        host=host, pid=pid, started_at=started_at, ended_at=ended_at, outcome=outcome,
        first_step=steps[0] if steps else None, last_step=steps[-1] if steps else None,
        rank=first_rings[0].body.rank if first_rings else None,
        notice_at=float(notices[0].body.detected_at or notices[0].t) if notices else None,
        restored_step=start.body.restored_step if start is not None else None,
    )


def _departure(worker: Worker, own: Sequence[AnyRecord], kills: Mapping[str, float]) -> float:
    leave = next(iter(_of(own, ev.LeavePublished)), None)
    if leave is not None:
        # a VM that trained on through its window (leave="near_deadline") left at its leave_at
        leave_at = leave.body.leave_at
        return leave.t if leave_at is None else max(leave.t, leave_at)
    killed = kills.get(worker.host)
    if killed is not None and worker.outcome == KILLED and worker.started_at <= killed:
        return killed
    return worker.ended_at


def _preemptions(events: Sequence[AnyRecord], workers: Mapping[ProcessKey, Worker], rings: Sequence[Ring],
                 by_proc: Mapping[ProcessKey, Sequence[AnyRecord]],
                 kills: Mapping[str, float]) -> tuple[Preemption, ...]:
    agreements = _of(events, ev.NoticeAgreed)
    first_steps = _of(events, ev.FirstStep)
    all_resets = _of(events, ev.Reset)
    out: list[Preemption] = []
    for key, worker in workers.items():
        if worker.outcome not in (PREEMPTED, KILLED):
            continue
        own = by_proc[key]
        departed_at = _departure(worker, own, kills)
        notice = next((e for e in _of(own, ev.Notice) if e.t <= departed_at), None)
        agreed = [e for e in agreements if worker.host in e.body.leaving and worker.started_at <= e.t <= departed_at]
        agreement = agreed[-1] if agreed else None
        agreed_step = agreement.body.step if agreement is not None else None

        ring = _ring_at(rings, agreement.t if agreement is not None else departed_at)
        was_master = ring is not None and ring.master_host == worker.host

        commit = election = None
        agreed_at = None
        if agreement is not None:
            agreed_at = min(e.t for e in agreed if e.body.step == agreed_step)
            commit = next((e for e in _of(events, ev.Commit) if e.body.kind == "emergency"
                           and e.body.step == agreed_step and e.t >= agreement.t), None)
            election = next((e for e in _of(events, ev.Election) if e.body.step == agreed_step
                             and e.body.old_master_host == worker.host and e.t >= agreement.t), None)
            if election is not None:
                was_master = True
        notice_at = float(notice.body.detected_at or notice.t) if notice is not None else None
        deadline = agreement.body.deadline if agreement is not None else None

        # The survivors: every process but this one and those that left at the same agreement.
        departing = {key}
        if agreement is not None:
            together = set(agreement.body.leaving)
            departing |= {k for k, w in workers.items() if w.host in together
                          and w.outcome in (PREEMPTED, KILLED) and w.started_at <= agreement.t <= w.ended_at}

        def on_a_later_ring(t: float) -> bool:
            ring_then = _ring_at(rings, t)
            return ring_then is not None and ring_then.started_at > departed_at

        resumed = next((e for e in first_steps if e.t > departed_at and _key(e) not in departing
                        and on_a_later_ring(e.t)), None)
        window_end = resumed.t if resumed is not None else math.inf
        resets = [e for e in all_resets if departed_at < e.t <= window_end and _key(e) not in departing]
        resumed_ring = _ring_at(rings, resumed.t) if resumed is not None else None
        per_host: dict[str, int] = defaultdict(int)
        for e in resets:
            per_host[e.host] += 1

        out.append(Preemption(
            host=worker.host, pid=worker.pid, departed_at=departed_at,
            step=agreed_step if agreed_step is not None else worker.last_step,
            was_master=was_master, notice=notice is not None, notice_at=notice_at,
            agreed_step=agreed_step,
            checkpoint_committed=commit is not None,
            commit_at=commit.t if commit is not None else None,
            notice_to_commit_ms=_ms(commit.t if commit is not None else None, notice_at),
            deadline_met=(commit.t <= float(deadline)) if commit is not None and deadline is not None else None,
            new_master=election.body.new_master_host if election is not None else None,
            steps_rolled_back=max((e.body.rolled_back for e in resets), default=0),
            resume_ms=_ms(resumed.t if resumed is not None else None, departed_at),
            reset_to_first_step_ms=_ms(window_end, resets[0].t) if resets and resumed is not None else None,
            cold_restart=(resumed_ring is not None and resumed_ring.relaunch
                          and resumed_ring.started_at > departed_at),
            agreed_at=agreed_at,
            reset_at=resets[0].t if resets else None,
            ring_at=resumed_ring.started_at if resumed_ring is not None else None,
            resumed_at=resumed.t if resumed is not None else None,
            survivor_resets=max(per_host.values(), default=0),
            last_step_before_reset=resets[0].body.last_step if resets else None,
            step_after_reset=resets[0].body.step if resets else None,
        ))
    return tuple(sorted(out, key=lambda p: (p.departed_at, p.host)))


def _joins(events: Sequence[AnyRecord], rings: Sequence[Ring],
           ring_members: Sequence[tuple[ProcessKey, ...]]) -> tuple[Join, ...]:
    joins = []
    training = _of_any(events, TRAINING_KINDS)
    first_steps = _of(events, ev.FirstStep)
    resets = _of(events, ev.Reset)
    for i, (ring, members) in enumerate(zip(rings, ring_members)):
        if ring.relaunch or not ring.joined or i == 0:
            continue
        survivors = {k for k in members if k[0] not in ring.joined}
        since, until = rings[i - 1].started_at, rings[i + 1].started_at if i + 1 < len(rings) else math.inf
        # Horovod resets the survivors (rendezvous included) before the new ring's ring events
        theirs = [e for e in resets if _key(e) in survivors and since < e.t <= ring.started_at]
        changed_at = min((e.t for e in theirs), default=ring.started_at)
        # the survivors' last completed step, as their resets give it; else (older logs) their last
        # training event, which can be up to one progress interval earlier
        last_steps = [e.body.last_step_at for e in theirs
                      if e.body.last_step_at is not None and since <= e.body.last_step_at <= changed_at]
        stalled_from = max(last_steps, default=None) or max(
            (e.t for e in training if _key(e) in survivors and since <= e.t < changed_at), default=None)
        resumed_at = min((e.t for e in first_steps if _key(e) in survivors and ring.started_at <= e.t < until),
                         default=None)
        for host in ring.joined:
            pid = next(k[1] for k in members if k[0] == host)
            joins.append(Join(host=host, pid=pid, t=ring.started_at, step=ring.step, size=ring.size,
                              stalled_from=stalled_from, resumed_at=resumed_at,
                              steps_rolled_back=max((e.body.rolled_back for e in theirs), default=0)))
    return tuple(joins)


def _lr_changes(events: Sequence[AnyRecord]) -> tuple[LrChange, ...]:
    out: list[LrChange] = []
    for e in _of(events, ev.Lr):
        lr = float(e.body.lr)
        if not out or not math.isclose(out[-1].lr, lr, rel_tol=1e-9):
            out.append(LrChange(e.t, lr, e.body.size))
    return tuple(out)


def _progress(events: Sequence[AnyRecord]) -> tuple[ProgressPoint, ...]:
    """One point per step a step event reported (the first report of each step, in time order)."""
    points: list[ProgressPoint] = []
    last: tuple[int, int | None] | None = None
    for e in _of_any(events, (ev.FirstStep, ev.Progress, ev.Reset, ev.TrainEnd)):
        step = _step(e)
        if step is None:
            continue
        size = getattr(e.body, "size", None)
        if (step, size) != last:
            points.append(ProgressPoint(e.t, step, size))
            last = (step, size)
    return tuple(points)


# --------------------------------------------------------------------------- timeline


def _timeline(events: Sequence[AnyRecord], rings: Sequence[Ring], workers: Mapping[ProcessKey, Worker],
              joins: Sequence[Join]) -> tuple[TimelineEntry, ...]:
    entries: list[TimelineEntry] = []
    seen: set[tuple[Any, ...]] = set()

    def once(sig: tuple[Any, ...]) -> bool:
        if sig in seen:
            return False
        seen.add(sig)
        return True

    for ring in rings:
        what = "launch" if ring.relaunch else ("join " + ", ".join(ring.joined) if ring.joined else "ring")
        stall = next((j.stall_s for j in joins if j.t == ring.started_at and j.stall_s is not None), None)
        entries.append(TimelineEntry(ring.started_at, "ring", ring.master_host,
                                     f"{what}: ring of {ring.size} at step {ring.step}, master "
                                     f"{ring.master_host}, members {', '.join(ring.hosts)}"
                                     + (f"; survivors stalled {stall:.2f} s" if stall is not None else "")))
    for e in events:
        text = _describe(e, rings, once)
        if text is not None:
            entries.append(TimelineEntry(e.t, e.event, e.host, text))
    for w in workers.values():
        if w.outcome == KILLED:
            entries.append(TimelineEntry(w.ended_at, "vanished", w.host,
                                         f"last event of pid {w.pid}: vanished with no leave_published"))
        elif w.outcome == LOST:
            entries.append(TimelineEntry(w.ended_at, "lost", w.host,
                                         f"last event of pid {w.pid}: the log ends without train_end"))
    order = {"ring": 1}  # a ring line sorts after the per-process events at the same instant
    return tuple(sorted(entries, key=lambda x: (x.t, order.get(x.kind, 0))))


def _describe(e: AnyRecord, rings: Sequence[Ring], once: Callable[[tuple[Any, ...]], bool]) -> str | None:
    """The timeline line of one event, or None (not shown, or shown already for another rank)."""
    b = e.body
    if isinstance(b, ev.Start):
        return (f"worker started (pid {e.pid}, rank {b.rank} of {b.size}, step {b.step})"
                + (f", restored checkpoint step {b.restored_step}" if b.restored_step is not None else ""))
    if isinstance(b, ev.Restore):
        return f"restored checkpoint step {b.step} ({b.writers} writers, {_mb(b.bytes)})"
    if isinstance(b, ev.Lr) and once(("lr", b.lr, b.size, _ring_start(rings, e.t))):
        return f"learning rate {b.lr:g} for {b.size} workers ({b.mode})"
    if isinstance(b, ev.FirstStep) and once(("first_step", b.step, b.size)):
        return f"first step {b.step} on {b.size} workers"
    if isinstance(b, ev.Notice):
        window = b.deadline - b.detected_at if b.deadline is not None and b.detected_at is not None else None
        return f"preemption notice ({b.source}, {b.reason}" + (
            f", {window:.0f} s window)" if window is not None else ")")
    if isinstance(b, ev.NoticeAgreed) and once(("notice_agreed", b.step, b.leaving)):
        return f"notice agreed at step {b.step}: leaving {', '.join(b.leaving)}"
    if isinstance(b, ev.WaitInflight) and once(("wait_inflight", b.step)):
        return f"waiting for the in-flight periodic save before the emergency save (step {b.step})"
    if isinstance(b, ev.InflightCancelled) and once(("inflight_cancelled", b.step)):
        why = "for the emergency save" if b.reason == "emergency" else "its ring is gone"
        return f"cancelled the in-flight periodic save at step {b.step} ({why})"
    if isinstance(b, ev.Election) and once(("election", b.step)):
        return f"master moved {b.old_master_host} -> {b.new_master_host} at step {b.step}"
    if isinstance(b, ev.Commit):
        return f"{b.kind} checkpoint committed at step {b.step} ({b.size} writers)"
    if isinstance(b, ev.SaveFailed) and once(("save_failed", b.step, b.kind)):
        return f"{b.kind} save at step {b.step} FAILED: {b.error}"
    if isinstance(b, ev.LeavePublished):
        if b.leave_at is not None:
            return f"published as leaving at step {b.step}, training on until {b.leave_at - e.t:.1f} s later"
        return f"published as leaving at step {b.step}"
    if isinstance(b, ev.Reset) and once(("reset", b.step, _ring_start(rings, e.t))):
        return f"ring reset at step {b.step} (rolled back {b.rolled_back} steps)"
    if isinstance(b, ev.StopRequested) and once(("stop_requested", b.step)):
        return f"operator stop agreed at step {b.step}"
    if isinstance(b, ev.TrainEnd) and once(("train_end", b.step)):
        return f"training ended at step {b.step}"
    if isinstance(b, ev.Weights) and once(("weights", b.step)):
        return f"final weights at step {b.step} on {b.size} workers"
    if isinstance(b, ev.LeaseError):
        return f"lease error: {b.error}"
    if isinstance(b, ev.KEEPER_KINDS):
        return describe_keeper(b)
    return None


def _ring_start(rings: Sequence[Ring], t: float) -> float | None:
    ring = _ring_at(rings, t)
    return ring.started_at if ring is not None else None


def _mb(nbytes: float | None) -> str:
    return f"{float(nbytes or 0) / 1e6:.1f} MB"


__all__ = ["BLOCKING_SAVE_KINDS", "Commit", "FINISHED", "JobAttempt", "Join", "KILLED", "KeeperSummary", "LOST",
           "LrChange", "NoEventsError", "PREEMPTED", "Preemption", "ProgressPoint", "Ring", "RunAnalysis",
           "TimelineEntry", "Worker", "analyze"]
