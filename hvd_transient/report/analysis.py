"""What happened in a run, computed from its merged event log (pure: no I/O).

The event log (:mod:`hvd_transient.events`) holds one JSON object per event from
every worker process. :func:`analyze` turns the time-sorted list into:

* one :class:`Worker` per process (``host`` + ``pid``): when it lived and how it
  ended - ``finished`` (``train_end``/``weights``), ``preempted`` (it published
  itself as leaving after a notice), ``killed`` (it vanished while the run went
  on, with no ``leave_published``) or ``lost`` (the log stops with it and no
  ``train_end``: the whole cluster was lost, or the run is still going);
* the rings: ``ring`` events carry no member list, so the rings are rebuilt by
  grouping the per-rank ``ring`` events of one (re)start (same step, size and
  master, each process once);
* one :class:`Preemption` per departure (with or without notice), with what the
  survivors paid for it (rollback, time to their next first step) and whether the
  emergency checkpoint committed;
* joins, learning-rate changes, commits, checkpoint stall, bytes written, wall
  time, completion, and a de-duplicated timeline (collective events are written
  by every rank: the timeline shows each once).
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

log = logging.getLogger(__name__)

Event = Mapping[str, Any]
ProcessKey = tuple[str, int]

FINISHED, PREEMPTED, KILLED, LOST = "finished", "preempted", "killed", "lost"
#: save kinds whose ``save_end`` seconds the training loop waited for (periodic saves are async)
BLOCKING_SAVE_KINDS = frozenset({"emergency", "final"})
_STEP_EVENTS = ("first_step", "progress", "reset", "ring", "notice_agreed", "commit", "train_end",
                "weights", "stop_requested", "start")


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


@dataclass(frozen=True)
class Preemption:
    """A worker that left: with notice (published as leaving) or without (vanished)."""

    host: str
    pid: int
    departed_at: float          # leave_published, or (no notice) its last event
    step: int | None            # the agreed step, else its last known step
    was_master: bool            # master_host of the ring in force when the notice was agreed / it vanished
    notice: bool                # a notice event preceded the departure
    notice_at: float | None
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


@dataclass(frozen=True)
class Join:
    host: str
    pid: int
    t: float
    step: int
    size: int


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

    @property
    def wall_s(self) -> float:
        return max(0.0, self.ended_at - self.started_at)

    @property
    def worker_seconds(self) -> float:
        return sum(w.seconds for w in self.workers)

    @property
    def ring_sizes(self) -> tuple[tuple[float, int], ...]:
        return tuple((r.started_at, r.size) for r in self.rings)


class NoEventsError(ValueError):
    """The event list is empty: there is nothing to report."""


# --------------------------------------------------------------------------- helpers


def _key(e: Event) -> ProcessKey:
    return (str(e.get("host", "?")), int(e.get("pid", 0) or 0))


def _t(e: Event) -> float:
    return float(e.get("t", 0.0))


def _step(e: Event) -> int | None:
    step = e.get("step")
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def _of(events: Iterable[Event], *kinds: str) -> list[Event]:
    return [e for e in events if e.get("event") in kinds]


def _group_rings(ring_events: Sequence[Event]) -> list[tuple[dict[str, Any], list[Event]]]:
    """Group per-rank ``ring`` events into ring (re)starts.

    Ranks of one ring all write (step, size, master_host); a process appears at
    most once per ring and a ring has at most ``size`` members.
    """
    groups: list[tuple[dict[str, Any], list[Event]]] = []
    for e in ring_events:
        sig = {"step": _step(e), "size": int(e.get("size", 0) or 0), "master_host": e.get("master_host")}
        if groups:
            head, members = groups[-1]
            if (head == sig and _key(e) not in {_key(m) for m in members}
                    and len(members) < max(1, sig["size"])):
                members.append(e)
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


def analyze(events: Sequence[Event]) -> RunAnalysis:
    """Analyse a run's merged event list (as :func:`hvd_transient.events.read_events` returns it)."""
    events = sorted((e for e in events if isinstance(e, Mapping) and "event" in e), key=_t)
    if not events:
        raise NoEventsError("the event list is empty")

    by_proc: dict[ProcessKey, list[Event]] = defaultdict(list)
    for e in events:
        by_proc[_key(e)].append(e)

    rings, ring_members = _rings(events, {k: _t(evs[-1]) for k, evs in by_proc.items()})
    last_ring_start = rings[-1].started_at if rings else None

    workers = {k: _worker(k, evs, rings, ring_members) for k, evs in by_proc.items()}
    preemptions = _preemptions(events, workers, rings, by_proc)
    joins = _joins(rings, ring_members)
    commits = tuple(Commit(_t(e), _step(e) or 0, str(e.get("kind", "?")), str(e.get("host")), e.get("size"))
                    for e in _of(events, "commit"))
    lr_changes = _lr_changes(events)
    progress = _progress(events)

    stall: dict[str, float] = {}
    for key, evs in by_proc.items():
        seconds = sum(float(e.get("stall_ms", 0.0) or 0.0) for e in _of(evs, "async_save")) / 1e3
        seconds += sum(float(e.get("seconds", 0.0) or 0.0) for e in _of(evs, "save_end")
                       if e.get("kind") in BLOCKING_SAVE_KINDS)
        stall[workers[key].label] = seconds
    # Synchronous saves log each rank's share (save_end); a periodic commit logs its whole step.
    bytes_written = (sum(int(e.get("bytes", 0) or 0) for e in _of(events, "save_end"))
                     + sum(int(e.get("bytes", 0) or 0) for e in _of(events, "commit")
                           if e.get("kind") == "periodic"))

    finals = _of(events, "train_end", "weights")
    final_ring_finals = [e for e in finals if last_ring_start is None or _t(e) >= last_ring_start]
    completed = bool(final_ring_finals) or bool(_of(events, "weights"))
    starts = _of(events, "start")
    started_at = _t(starts[0]) if starts else _t(events[0])
    ended_at = max(_t(e) for e in finals) if completed else _t(events[-1])
    if completed:
        final_step = max((s for s in map(_step, final_ring_finals or finals) if s is not None), default=None)
    else:
        final_step = max((s for s in map(_step, _of(events, *_STEP_EVENTS)) if s is not None), default=None)
    stops = [e for e in _of(events, "stop_requested") if last_ring_start is None or _t(e) >= last_ring_start]
    # A static job stops at the agreed step of a notice (its relaunch resumes from that checkpoint).
    static_stop = any(_step(e) == final_step for e in _of(events, "notice_agreed")
                      if last_ring_start is None or _t(e) >= last_ring_start)
    if not completed:
        ended_by = "incomplete"
    else:
        ended_by = "stop request" if stops else "notice (stopped for a relaunch)" if static_stop else "end of training"
    weights = _of(events, "weights")
    consistent = len({e.get("crc") for e in weights}) == 1 if weights else None

    committed_steps = [c.step for c in commits]
    analysis_workers = tuple(sorted(workers.values(), key=lambda w: (w.started_at, w.host, w.pid)))
    return RunAnalysis(
        workers=analysis_workers,
        rings=tuple(rings),
        preemptions=preemptions,
        joins=joins,
        commits=commits,
        lr_changes=lr_changes,
        progress=progress,
        timeline=_timeline(events, rings, workers, preemptions),
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
        saves_failed=len({(e.get("step"), e.get("kind")) for e in _of(events, "save_failed")}),
        event_count=len(events),
    )


def _rings(events: Sequence[Event], last_seen: Mapping[ProcessKey, float]
           ) -> tuple[list[Ring], list[tuple[ProcessKey, ...]]]:
    rings: list[Ring] = []
    members_of: list[tuple[ProcessKey, ...]] = []
    seen: set[ProcessKey] = set()
    groups = _group_rings(_of(events, "ring"))
    for i, (sig, members) in enumerate(groups):
        members = sorted(members, key=lambda e: (int(e.get("rank", 0) or 0), _t(e)))
        keys = tuple(_key(e) for e in members)
        new = [k for k in keys if k not in seen]
        relaunch = len(new) == len(keys)
        members_gone = max(last_seen[k] for k in keys)
        next_start = min(_t(e) for e in groups[i + 1][1]) if i + 1 < len(groups) else math.inf
        rings.append(Ring(
            started_at=min(_t(e) for e in members),
            ended_at=min(members_gone, next_start),
            step=sig["step"] if sig["step"] is not None else 0,
            size=sig["size"],
            master_host=str(sig["master_host"]),
            hosts=tuple(k[0] for k in keys),
            joined=() if relaunch else tuple(k[0] for k in new),
            relaunch=relaunch,
        ))
        members_of.append(keys)
        seen.update(keys)
    return rings, members_of


def _worker(key: ProcessKey, evs: Sequence[Event], rings: Sequence[Ring],
            ring_members: Sequence[tuple[ProcessKey, ...]]) -> Worker:
    host, pid = key
    started_at, ended_at = _t(evs[0]), _t(evs[-1])
    steps = [s for s in map(_step, evs) if s is not None]
    if _of(evs, "leave_published"):
        outcome = PREEMPTED
    elif _of(evs, "train_end", "weights"):
        outcome = FINISHED
    elif any(r.started_at > ended_at and key not in m for r, m in zip(rings, ring_members)):
        outcome = KILLED  # the run went on without it, and it never said it was leaving
    else:
        outcome = LOST
    notices = _of(evs, "notice")
    first_rings = _of(evs, "ring")
    start = next(iter(_of(evs, "start")), None)
    restored = start.get("restored_step") if start is not None else None
    return Worker(
        host=host, pid=pid, started_at=started_at, ended_at=ended_at, outcome=outcome,
        first_step=steps[0] if steps else None, last_step=steps[-1] if steps else None,
        rank=int(first_rings[0].get("rank", 0)) if first_rings else None,
        notice_at=float(notices[0].get("detected_at") or _t(notices[0])) if notices else None,
        restored_step=int(restored) if isinstance(restored, (int, float)) else None,
    )


def _preemptions(events: Sequence[Event], workers: Mapping[ProcessKey, Worker], rings: Sequence[Ring],
                 by_proc: Mapping[ProcessKey, Sequence[Event]]) -> tuple[Preemption, ...]:
    agreements = _of(events, "notice_agreed")
    out: list[Preemption] = []
    for key, worker in workers.items():
        if worker.outcome not in (PREEMPTED, KILLED):
            continue
        own = by_proc[key]
        leave = next(iter(_of(own, "leave_published")), None)
        departed_at = _t(leave) if leave is not None else worker.ended_at
        notice = next((e for e in _of(own, "notice") if _t(e) <= departed_at), None)
        agreed = [e for e in agreements if worker.host in (e.get("leaving") or []) and _t(e) <= departed_at
                  and _t(e) >= worker.started_at]
        agreement = agreed[-1] if agreed else None
        agreed_step = _step(agreement) if agreement is not None else None

        ring = _ring_at(rings, _t(agreement) if agreement is not None else departed_at)
        was_master = ring is not None and ring.master_host == worker.host

        commit = None
        election = None
        if agreed_step is not None:
            commit = next((e for e in _of(events, "commit") if e.get("kind") == "emergency"
                           and _step(e) == agreed_step and _t(e) >= _t(agreement)), None)
            election = next((e for e in _of(events, "election") if _step(e) == agreed_step
                             and e.get("old_master_host") == worker.host and _t(e) >= _t(agreement)), None)
            if election is not None:
                was_master = True
        notice_at = float(notice.get("detected_at") or _t(notice)) if notice is not None else None
        deadline = agreement.get("deadline") if agreement is not None else None

        # The survivors: every process but this one and those that left at the same agreement.
        departing = {key}
        if agreement is not None:
            t_agreed = _t(agreement)
            leaving_together = {str(h) for h in (agreement.get("leaving") or [])}
            departing |= {k for k, w in workers.items() if w.host in leaving_together
                          and w.outcome in (PREEMPTED, KILLED) and w.started_at <= t_agreed <= w.ended_at}

        def survivor(e: Event) -> bool:
            return _key(e) not in departing

        def on_a_later_ring(e: Event) -> bool:
            ring_of_e = _ring_at(rings, _t(e))
            return ring_of_e is not None and ring_of_e.started_at > departed_at

        resumed = next((e for e in _of(events, "first_step")
                        if _t(e) > departed_at and survivor(e) and on_a_later_ring(e)), None)
        window_end = _t(resumed) if resumed is not None else math.inf
        resets = [e for e in _of(events, "reset") if departed_at < _t(e) <= window_end and survivor(e)]
        cold = False
        if resumed is not None:
            resumed_ring = _ring_at(rings, _t(resumed))
            cold = resumed_ring is not None and resumed_ring.relaunch and resumed_ring.started_at > departed_at

        out.append(Preemption(
            host=worker.host, pid=worker.pid, departed_at=departed_at,
            step=agreed_step if agreed_step is not None else worker.last_step,
            was_master=was_master, notice=notice is not None, notice_at=notice_at,
            agreed_step=agreed_step,
            checkpoint_committed=commit is not None,
            commit_at=_t(commit) if commit is not None else None,
            notice_to_commit_ms=_ms(_t(commit) if commit is not None else None, notice_at),
            deadline_met=(_t(commit) <= float(deadline)) if commit is not None and deadline is not None else None,
            new_master=str(election.get("new_master_host")) if election is not None else None,
            steps_rolled_back=max((int(e.get("rolled_back", 0) or 0) for e in resets), default=0),
            resume_ms=_ms(window_end if resumed is not None else None, departed_at),
            reset_to_first_step_ms=_ms(window_end, _t(resets[0])) if resets and resumed is not None else None,
            cold_restart=cold,
        ))
    return tuple(sorted(out, key=lambda p: (p.departed_at, p.host)))


def _joins(rings: Sequence[Ring], ring_members: Sequence[tuple[ProcessKey, ...]]) -> tuple[Join, ...]:
    joins = []
    for ring, members in zip(rings, ring_members):
        if ring.relaunch:
            continue
        for host in ring.joined:
            pid = next(k[1] for k in members if k[0] == host)
            joins.append(Join(host=host, pid=pid, t=ring.started_at, step=ring.step, size=ring.size))
    return tuple(joins)


def _lr_changes(events: Sequence[Event]) -> tuple[LrChange, ...]:
    out: list[LrChange] = []
    for e in _of(events, "lr"):
        lr = float(e.get("lr", 0.0))
        if not out or not math.isclose(out[-1].lr, lr, rel_tol=1e-9):
            out.append(LrChange(_t(e), lr, e.get("size")))
    return tuple(out)


def _progress(events: Sequence[Event]) -> tuple[ProgressPoint, ...]:
    """One point per step a step event reported (the first report of each step, in time order)."""
    points: list[ProgressPoint] = []
    last: tuple[int, int | None] | None = None
    for e in _of(events, "first_step", "progress", "reset", "train_end"):
        step = _step(e)
        if step is None:
            continue
        sig = (step, e.get("size"))
        if sig != last:
            points.append(ProgressPoint(_t(e), step, e.get("size")))
            last = sig
    return tuple(points)


# --------------------------------------------------------------------------- timeline


def _timeline(events: Sequence[Event], rings: Sequence[Ring], workers: Mapping[ProcessKey, Worker],
              preemptions: Sequence[Preemption]) -> tuple[TimelineEntry, ...]:
    entries: list[TimelineEntry] = []
    seen: set[tuple[Any, ...]] = set()

    def once(sig: tuple[Any, ...]) -> bool:
        if sig in seen:
            return False
        seen.add(sig)
        return True

    for ring in rings:
        what = "launch" if ring.relaunch else ("join " + ", ".join(ring.joined) if ring.joined else "ring")
        entries.append(TimelineEntry(ring.started_at, "ring", ring.master_host,
                                     f"{what}: ring of {ring.size} at step {ring.step}, master "
                                     f"{ring.master_host}, members {', '.join(ring.hosts)}"))
    for e in events:
        kind, host, t = e.get("event"), str(e.get("host")), _t(e)
        step = _step(e)
        text = None
        if kind == "start":
            restored = e.get("restored_step")
            text = (f"worker started (pid {e.get('pid')}, rank {e.get('rank')} of {e.get('size')}, step {step})"
                    + (f", restored checkpoint step {restored}" if restored is not None else ""))
        elif kind == "restore":
            text = f"restored checkpoint step {step} ({e.get('writers')} writers, {_mb(e.get('bytes'))})"
        elif kind == "lr" and once(("lr", e.get("lr"), e.get("size"), _ring_start(rings, t))):
            text = f"learning rate {e.get('lr'):g} for {e.get('size')} workers ({e.get('mode')})"
        elif kind == "first_step" and once(("first_step", step, e.get("size"))):
            text = f"first step {step} on {e.get('size')} workers"
        elif kind == "notice":
            window = _window(e)
            text = f"preemption notice ({e.get('source')}, {e.get('reason')}" + (
                f", {window:.0f} s window)" if window is not None else ")")
        elif kind == "notice_agreed" and once(("notice_agreed", step, tuple(e.get("leaving") or ()))):
            text = f"notice agreed at step {step}: leaving {', '.join(map(str, e.get('leaving') or []))}"
        elif kind == "wait_inflight" and once(("wait_inflight", step)):
            text = f"waiting for the in-flight periodic save before the emergency save (step {step})"
        elif kind == "election" and once(("election", step)):
            text = f"master moved {e.get('old_master_host')} -> {e.get('new_master_host')} at step {step}"
        elif kind == "commit":
            text = f"{e.get('kind')} checkpoint committed at step {step} ({e.get('size')} writers)"
        elif kind == "save_failed" and once(("save_failed", step, e.get("kind"))):
            text = f"{e.get('kind')} save at step {step} FAILED: {e.get('error')}"
        elif kind == "leave_published":
            text = f"published as leaving at step {step}"
        elif kind == "reset" and once(("reset", step, _ring_start(rings, t))):
            text = f"ring reset at step {step} (rolled back {e.get('rolled_back', 0)} steps)"
        elif kind == "stop_requested" and once(("stop_requested", step)):
            text = f"operator stop agreed at step {step}"
        elif kind == "train_end" and once(("train_end", step)):
            text = f"training ended at step {step}"
        elif kind == "weights" and once(("weights", step)):
            text = f"final weights at step {step} on {e.get('size')} workers"
        elif kind == "lease_error":
            text = f"lease error: {e.get('error')}"
        if text is not None:
            entries.append(TimelineEntry(t, str(kind), host, text))
    for w in workers.values():
        if w.outcome == KILLED:
            entries.append(TimelineEntry(w.ended_at, "vanished", w.host,
                                         f"last event of pid {w.pid}: vanished with no leave_published"))
        elif w.outcome == LOST:
            entries.append(TimelineEntry(w.ended_at, "lost", w.host,
                                         f"last event of pid {w.pid}: the log ends without train_end"))
    order = {"ring": 1}  # a ring line sorts after the per-process events at the same instant
    return tuple(sorted(entries, key=lambda x: (x.t, order.get(x.kind, 0))))


def _ring_start(rings: Sequence[Ring], t: float) -> float | None:
    ring = _ring_at(rings, t)
    return ring.started_at if ring is not None else None


def _window(notice: Event) -> float | None:
    deadline, detected = notice.get("deadline"), notice.get("detected_at")
    if isinstance(deadline, (int, float)) and isinstance(detected, (int, float)):
        return float(deadline) - float(detected)
    return None


def _mb(nbytes: Any) -> str:
    return f"{float(nbytes or 0) / 1e6:.1f} MB"


__all__ = ["BLOCKING_SAVE_KINDS", "Commit", "FINISHED", "Join", "KILLED", "LOST", "LrChange", "NoEventsError",
           "PREEMPTED", "Preemption", "ProgressPoint", "Ring", "RunAnalysis", "TimelineEntry", "Worker",
           "analyze"]
