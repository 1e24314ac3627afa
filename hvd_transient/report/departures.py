"""How each worker process ended, and one :class:`Preemption` per departure (pure): its marks from notice
to the survivors' first step, and what the survivors paid for it."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

from hvd_transient.report.records import AnyRecord, ProcessKey
from hvd_transient.report.records import key as _key
from hvd_transient.report.records import of as _of
from hvd_transient.report.records import of_any as _of_any
from hvd_transient.report.records import step as _step
from hvd_transient.report.run_analysis import FINISHED, KILLED, LOST, PREEMPTED, Preemption, Ring, Worker
from hvd_transient.report.run_analysis import ms_between as _ms
from hvd_transient.report.run_analysis import ring_at as _ring_at
from hvd_transient.telemetry import schema as ev


def worker_of(key: ProcessKey, evs: Sequence[AnyRecord], rings: Sequence[Ring],
              ring_members: Sequence[tuple[ProcessKey, ...]]) -> Worker:
    """One process from its own events; ``ring_members``: the member processes of each of ``rings``."""
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


@dataclass(frozen=True)
class _Leave:
    """When a worker under notice was to leave: its ``leave_published``, with a later ``leave_moved``'s
    ``leave_at`` (a later round moved it earlier; at once from that event's time where it has none)."""

    t: float
    leave_at: float | None
    deadline: float | None


def _leave_of(own: Sequence[AnyRecord]) -> _Leave | None:
    published = next(iter(_of(own, ev.LeavePublished)), None)
    if published is None:
        return None
    moved = _of(own, ev.LeaveMoved)
    if not moved:
        return _Leave(published.t, published.body.leave_at, published.body.deadline)
    last = moved[-1]
    return _Leave(min(published.t, last.t) if last.body.leave_at is None else published.t,
                  last.body.leave_at, published.body.deadline)


def _leave_lead_s(leave: _Leave | None) -> float | None:
    """How long before its VM's deadline a worker that trained on through its window was to leave."""
    if leave is None or leave.leave_at is None or leave.deadline is None:
        return None
    return float(leave.deadline) - float(leave.leave_at)


def _departure(worker: Worker, leave: _Leave | None, kills: Mapping[str, float]) -> float:
    """``leave``: when the worker was to leave, if it logged it."""
    if leave is not None:
        # a VM that trained on through its window (leave="near_deadline") left at its leave_at
        return leave.t if leave.leave_at is None else max(leave.t, leave.leave_at)
    killed = kills.get(worker.host)
    if killed is not None and worker.outcome == KILLED and worker.started_at <= killed:
        return killed
    return worker.ended_at


def preemptions_of(events: Sequence[AnyRecord], workers: Mapping[ProcessKey, Worker], rings: Sequence[Ring],
                   by_proc: Mapping[ProcessKey, Sequence[AnyRecord]],
                   kills: Mapping[str, float]) -> tuple[Preemption, ...]:
    """One departure per preempted or killed worker, in order of departure."""
    agreements = _of(events, ev.NoticeAgreed)
    first_steps = _of(events, ev.FirstStep)
    all_resets = _of(events, ev.Reset)
    out: list[Preemption] = []
    for key, worker in workers.items():
        if worker.outcome not in (PREEMPTED, KILLED):
            continue
        own = by_proc[key]
        leave = _leave_of(own)
        departed_at = _departure(worker, leave, kills)
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
            leave_lead_s=_leave_lead_s(leave),
        ))
    return tuple(sorted(out, key=lambda p: (p.departed_at, p.host)))


__all__ = ["preemptions_of", "worker_of"]
