"""What ``hvd-transient cluster keep`` did during a run, from its ``keeper_*`` events (pure): refills,
stock-outs by zone, on-demand fallbacks, spend, and each launch of the training job it supervises,
with when training resumed after it."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

from hvd_transient.report.records import TRAINING_KINDS, AnyRecord, of, of_any
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.schema import EventBody, Record


@dataclass(frozen=True)
class JobAttempt:
    """One launch of the training job by the keeper (``keep --job``)."""

    attempt: int                     # from 1
    launched_at: float
    workers: tuple[str, ...]         # RUNNING at the launch
    relaunch: bool
    waited_s: float | None           # a relaunch: from the previous attempt's end to this launch
    ended_at: float | None = None    # None: still running when the log ends
    exit_code: int | None = None
    reason: str | None = None        # why the keeper ended it: no_workers | keeper_stopped | launch_failed
    resumed_at: float | None = None  # the first step trained after the launch
    resumed_step: int | None = None
    restored_step: int | None = None  # the checkpoint its workers restored
    #: a relaunch: the last training event (a step, a ring, an agreed notice) before the previous attempt ended
    stopped_training_at: float | None = None

    @property
    def launch_to_step_s(self) -> float | None:
        """Launch -> first step: start-up, rendezvous and restore."""
        return None if self.resumed_at is None else max(0.0, self.resumed_at - self.launched_at)

    @property
    def outage_s(self) -> float | None:
        """A relaunch: training stopped (the wave) -> training again."""
        if self.resumed_at is None or self.stopped_training_at is None:
            return None
        return max(0.0, self.resumed_at - self.stopped_training_at)


@dataclass(frozen=True)
class KeeperSummary:
    """What ``hvd-transient cluster keep`` did during the run, from its ``keeper_*`` events."""

    started_at: float
    cluster: str
    wanted: int | None                    # workers it keeps
    zones: tuple[str, ...]
    refills: int                          # workers started again or created
    restarts: int                         # of which started again (the same VM)
    creates: int
    failovers: int                        # refills that skipped a backed-off zone
    on_demand_refills: int
    refills_by_zone: Mapping[str, int]
    stockouts_by_zone: Mapping[str, int]  # failed starts/creates for want of capacity or quota
    quota_errors: int                     # of those, quota errors
    releases: int                         # on-demand stand-ins deleted again
    errors: int
    budget_holds: int
    fallbacks: int                        # on-demand fallbacks begun
    fallback_s: float                     # ended fallbacks' duration
    fallback_cost: float                  # and what their on-demand workers cost
    spent: float | None                   # the workers' spend (USD) at the last keeper_cost
    spent_spot: float | None
    spent_on_demand: float | None
    on_demand_premium: float | None       # on-demand time's cost beyond the same time on Spot
    jobs: tuple[JobAttempt, ...]
    gave_up: bool                         # the job failed with no relaunch left

    @property
    def relaunches(self) -> int:
        return sum(1 for j in self.jobs if j.relaunch)


def summarize_keeper(events: Sequence[AnyRecord], run: Sequence[AnyRecord]) -> KeeperSummary:
    """``events``: the keeper's; ``run``: the workers' (when training resumed after each launch)."""
    start = next(iter(of(events, ev.KeeperStart)), None)
    refills = of(events, ev.KeeperRefill)
    stockouts = of(events, ev.KeeperStockout)
    fallbacks = of(events, ev.KeeperFallback)
    ended = [e.body for e in fallbacks if e.body.phase == "end"]
    costs = of(events, ev.KeeperCost)
    last_cost = costs[-1].body if costs else None
    by_zone: dict[str, int] = defaultdict(int)
    for e in refills:
        by_zone[e.body.zone] += 1
    out_by_zone: dict[str, int] = defaultdict(int)
    for failed in stockouts:
        out_by_zone[failed.body.zone] += 1
    job_events = of(events, ev.KeeperJob)
    return KeeperSummary(
        started_at=start.t if start is not None else events[0].t,
        cluster=start.body.cluster if start is not None else "",
        wanted=start.body.workers if start is not None else None,
        zones=start.body.zones if start is not None else (),
        refills=len(refills),
        restarts=sum(1 for e in refills if e.body.operation == "start"),
        creates=sum(1 for e in refills if e.body.operation == "create"),
        failovers=sum(1 for e in refills if e.body.avoided_zones),
        on_demand_refills=sum(1 for e in refills if e.body.provisioning != "spot"),
        refills_by_zone=dict(sorted(by_zone.items())),
        stockouts_by_zone=dict(sorted(out_by_zone.items())),
        quota_errors=sum(1 for e in stockouts if e.body.kind == "quota"),
        releases=len(of(events, ev.KeeperRelease)),
        errors=len(of(events, ev.KeeperError)),
        budget_holds=len(of(events, ev.KeeperBudget)),
        fallbacks=sum(1 for e in fallbacks if e.body.phase == "begin"),
        fallback_s=sum(b.seconds or 0.0 for b in ended),
        fallback_cost=sum(b.on_demand_cost or 0.0 for b in ended),
        spent=last_cost.spent if last_cost is not None else None,
        spent_spot=last_cost.spent_spot if last_cost is not None else None,
        spent_on_demand=last_cost.spent_on_demand if last_cost is not None else None,
        on_demand_premium=last_cost.on_demand_premium if last_cost is not None else None,
        jobs=_job_attempts(job_events, run),
        gave_up=any(e.body.phase == "give_up" for e in job_events),
    )


def _job_attempts(events: Sequence[Record[ev.KeeperJob]], run: Sequence[AnyRecord]) -> tuple[JobAttempt, ...]:
    launches = [e for e in events if e.body.phase in ("start", "relaunch")]
    exits = [e for e in events if e.body.phase == "exit"]
    first_steps = of(run, ev.FirstStep)
    starts = [e for e in of(run, ev.Start) if e.body.restored_step is not None]
    training = of_any(run, (*TRAINING_KINDS, ev.NoticeAgreed))
    out: list[JobAttempt] = []
    for i, launch in enumerate(launches):
        attempt = launch.body.attempt
        until = launches[i + 1].t if i + 1 < len(launches) else math.inf
        end = next((e for e in exits if e.body.attempt == attempt and e.t >= launch.t), None)
        resumed = next((e for e in first_steps if launch.t <= e.t < until), None)
        restored = next((e for e in starts if launch.t <= e.t < until), None)
        stopped = None
        previous_end = out[-1].ended_at if out else None
        if previous_end is not None:
            stopped = max((e.t for e in training if out[-1].launched_at <= e.t <= previous_end), default=None)
        out.append(JobAttempt(
            attempt=attempt, launched_at=launch.t, workers=launch.body.workers,
            relaunch=launch.body.phase == "relaunch", waited_s=launch.body.waited_s,
            ended_at=end.t if end is not None else None,
            exit_code=end.body.exit_code if end is not None else None,
            reason=end.body.reason if end is not None else None,
            resumed_at=resumed.t if resumed is not None else None,
            resumed_step=resumed.body.step if resumed is not None else None,
            restored_step=restored.body.restored_step if restored is not None else None,
            stopped_training_at=stopped,
        ))
    return tuple(out)


def describe_keeper(b: EventBody) -> str | None:
    if isinstance(b, ev.KeeperStart):
        return f"keeper: keeping {b.workers} worker(s) in {', '.join(b.zones)}"
    if isinstance(b, ev.KeeperRefill):
        how = "started again" if b.operation == "start" else "created"
        avoided = f" (failover: {', '.join(b.avoided_zones)} backed off)" if b.avoided_zones else ""
        return f"keeper: {b.name} {how}, {b.provisioning} in {b.zone}{avoided}"
    if isinstance(b, ev.KeeperStockout):
        return (f"keeper: {b.operation} {b.name} in {b.zone}: {b.code or b.kind}; zone backed off "
                f"{b.retry_in_s:.0f} s")
    if isinstance(b, ev.KeeperRelease):
        return f"keeper: on-demand {b.name} deleted, a Spot worker runs in its place"
    if isinstance(b, ev.KeeperFallback):
        if b.phase == "begin":
            return f"keeper: on-demand fallback: {b.on_demand_workers} worker(s) stand in for Spot"
        return f"keeper: back on Spot after {b.seconds or 0:.0f} s on demand (${b.on_demand_cost or 0:.4f})"
    if isinstance(b, ev.KeeperBudget):
        return f"keeper: budget cap held back {b.blocked} worker(s): {b.message}"
    if isinstance(b, ev.KeeperError):
        return f"keeper: {b.operation} failed: {b.error}"
    if isinstance(b, ev.KeeperJob):
        if b.phase in ("start", "relaunch"):
            waited = f", {b.waited_s:.1f} s after the previous attempt ended" if b.waited_s is not None else ""
            what = "relaunched" if b.phase == "relaunch" else "launched"
            return f"keeper: job {what} (attempt {b.attempt}) on {', '.join(b.workers)}{waited}"
        if b.phase == "exit":
            why = {"no_workers": "; ended by the keeper: no worker was left",
                   "keeper_stopped": "; ended by the keeper stopping"}.get(b.reason or "", "")
            return f"keeper: job attempt {b.attempt} exited with status {b.exit_code}{why}"
        if b.phase == "give_up":
            return f"keeper: job given up after attempt {b.attempt}"
    return None  # keeper_cost: in the summary


__all__ = ["JobAttempt", "KeeperSummary", "describe_keeper", "summarize_keeper"]
