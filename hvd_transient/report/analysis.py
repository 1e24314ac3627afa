"""What happened in a run, computed from its merged event log (pure: no I/O).

The event log (:mod:`hvd_transient.telemetry.events`, kinds in :mod:`hvd_transient.telemetry.schema`)
holds the events of every worker process. :func:`analyze` turns them into:

* one :class:`Worker` per process (``host`` + ``pid``): when it lived and how it
  ended - ``finished`` (``train_end``/``weights``), ``preempted`` (it published
  itself as leaving after a notice), ``killed`` (it vanished while the run went
  on, with no ``leave_published``) or ``lost`` (the log stops with it and no
  ``train_end``: the whole cluster was lost, or the run is still going);
* the rings: the per-rank ``ring`` events of one (re)start, grouped by the ring's
  id, with the member hosts they name; in older logs and the plain-Horovod
  baseline, without either, rebuilt by grouping the events of one (re)start
  (same step, size and master, each process once);
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

:func:`analyze` is the one analyser of a run's events: the report and the benchmarks
(``bench/preemption_cost.py``) read the same :class:`RunAnalysis`. Each part has a module:
the dataclasses in :mod:`.run_analysis`, the rings in :mod:`.rings`, the workers' ends and
preemptions in :mod:`.departures`, the joins in :mod:`.joins`, commits, stall and bytes in
:mod:`.saves`, the step curve and learning rates in :mod:`.progress`, the timeline in
:mod:`.timeline` and the keeper's events in :mod:`.keeper_summary`. The names those modules
define for :class:`RunAnalysis` stay importable from here.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Iterable, Mapping

from hvd_transient.report.departures import preemptions_of, worker_of
from hvd_transient.report.joins import joins_of
from hvd_transient.report.keeper_summary import JobAttempt, KeeperSummary, summarize_keeper
from hvd_transient.report.progress import lr_changes_of, progress_of
from hvd_transient.report.records import AnyRecord, ProcessKey
from hvd_transient.report.records import key as _key
from hvd_transient.report.records import of as _of
from hvd_transient.report.records import of_any as _of_any
from hvd_transient.report.records import step as _step
from hvd_transient.report.rings import rings_of
from hvd_transient.report.run_analysis import (
    FINISHED,
    KILLED,
    LOST,
    PREEMPTED,
    Commit,
    Join,
    LrChange,
    NoEventsError,
    Preemption,
    ProgressPoint,
    Ring,
    RunAnalysis,
    TimelineEntry,
    Worker,
)
from hvd_transient.report.saves import (
    BLOCKING_SAVE_KINDS,
    bytes_written_of,
    commits_of,
    saves_failed_of,
    stall_by_worker,
)
from hvd_transient.report.timeline import timeline_of
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.parsing import ParsedLog, parse_log
from hvd_transient.telemetry.schema import EventBody

log = logging.getLogger(__name__)

_STEP_KINDS: tuple[type[EventBody], ...] = (
    ev.FirstStep, ev.Progress, ev.Reset, ev.Ring, ev.NoticeAgreed, ev.Commit, ev.TrainEnd, ev.Weights,
    ev.StopRequested, ev.Start)


def analyze(events: ParsedLog | Iterable[AnyRecord | Mapping[str, Any]], *,
            kills: Mapping[str, float] | None = None) -> RunAnalysis:
    """Analyse a run's events: a parsed log (:func:`hvd_transient.telemetry.events.read_log`), typed records
    or the logged dicts (:func:`hvd_transient.telemetry.events.read_events`), in any order. An event that
    is not of its kind's declared types is skipped, and counted in ``skipped_events``.

    ``kills``: host -> when its worker was killed, where something outside the log knows
    (the benchmark that killed it): a worker of that host that vanished without notice
    departed then, not at its last event.
    """
    parsed = events if isinstance(events, ParsedLog) else parse_log(events)
    every = list(parsed.records)
    if not every:
        raise NoEventsError(f"none of the {parsed.skipped_count} events could be read" if parsed.skipped
                            else "the event list is empty")
    # the keeper is no worker: its events count in no process, ring or wall time
    keeper_records = _of_any(every, ev.KEEPER_KINDS)
    records = [e for e in every if not isinstance(e.body, ev.KEEPER_KINDS)]
    timing = records or keeper_records

    by_proc: dict[ProcessKey, list[AnyRecord]] = defaultdict(list)
    for e in records:
        by_proc[_key(e)].append(e)

    rings, ring_members = rings_of(records, by_proc)
    last_ring_start = rings[-1].started_at if rings else None

    workers = {k: worker_of(k, evs, rings, ring_members) for k, evs in by_proc.items()}
    preemptions = preemptions_of(records, workers, rings, by_proc, kills or {})
    joins = joins_of(records, rings, ring_members)
    commits = commits_of(records)
    lr_changes = lr_changes_of(records)
    progress = progress_of(records)
    stall = stall_by_worker(by_proc, workers)

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
        timeline=timeline_of(every, rings, workers, joins),
        stall_s_by_worker=stall,
        checkpoint_stall_s=max(stall.values(), default=0.0),
        bytes_written=bytes_written_of(records),
        started_at=started_at,
        ended_at=ended_at,
        completed=completed,
        ended_by=ended_by,
        final_step=final_step,
        last_committed_step=max(committed_steps) if committed_steps else None,
        weights_consistent=consistent,
        saves_failed=saves_failed_of(records),
        event_count=len(every),
        keeper=summarize_keeper(keeper_records, records) if keeper_records else None,
        host_updates_announced=host_updates_announced_of(records),
        skipped_events=parsed.skipped,
    )


def host_updates_announced_of(records: Iterable[AnyRecord]) -> dict[str, int]:
    """VMs rank 0 announced to its host check, by change (``join``, ``removal``): the driver had lost its message."""
    counts: dict[str, int] = defaultdict(int)
    for e in _of(records, ev.HostUpdateAnnounced):
        if e.body.hosts:  # rank 0 never announces nobody: an empty list says nothing
            counts[e.body.change] += len(e.body.hosts)
    return dict(sorted(counts.items()))


__all__ = ["BLOCKING_SAVE_KINDS", "Commit", "FINISHED", "JobAttempt", "Join", "KILLED", "KeeperSummary", "LOST",
           "LrChange", "NoEventsError", "PREEMPTED", "Preemption", "ProgressPoint", "Ring", "RunAnalysis",
           "TimelineEntry", "Worker", "analyze", "host_updates_announced_of"]
