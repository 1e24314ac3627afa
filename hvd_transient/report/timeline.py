"""The run's timeline (pure): one line per ring and per event worth showing, each collective event once
although every rank wrote it, and one per worker that vanished or was lost."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from hvd_transient.report.keeper_summary import describe_keeper
from hvd_transient.report.records import AnyRecord, ProcessKey
from hvd_transient.report.run_analysis import KILLED, LOST, Join, Ring, TimelineEntry, Worker
from hvd_transient.report.run_analysis import ring_at as _ring_at
from hvd_transient.telemetry import schema as ev


def timeline_of(events: Sequence[AnyRecord], rings: Sequence[Ring], workers: Mapping[ProcessKey, Worker],
                joins: Sequence[Join]) -> tuple[TimelineEntry, ...]:
    """Every line of the timeline, in time order."""
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
    if isinstance(b, ev.HostUpdateAnnounced):
        return (f"Horovod's driver lost the {b.change} of {', '.join(b.hosts)}: rank 0 announced it to its "
                "host check")
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


__all__ = ["timeline_of"]
