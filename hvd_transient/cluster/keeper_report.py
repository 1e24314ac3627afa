"""What the keeper says about a pass: the line for people and the ``keeper_*`` event for the run's
event log, built from the outcomes, waits and spend. Pure: :class:`~.keeper.Keeper` prints and emits them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hvd_transient.cluster.keeper_actions import Action, Delete, Outcome, Start, Wait
from hvd_transient.cluster.keeper_cost import hourly_rate, on_demand_premium
from hvd_transient.cluster.keeper_state import KeeperPolicy, KeeperState, Spend
from hvd_transient.cluster.vm_failures import ERROR, GONE
from hvd_transient.cluster.worker_vms import Observation, provisioning
from hvd_transient.telemetry.schema import (
    EventBody,
    KeeperBudget,
    KeeperCost,
    KeeperError,
    KeeperFallback,
    KeeperRefill,
    KeeperRelease,
    KeeperStart,
    KeeperStockout,
)


def start_event(policy: KeeperPolicy, *, cluster: str, instance_type: str, interval_s: float) -> KeeperStart:
    """The keeper's first event: what it keeps, where, at what price and within which caps."""
    p = policy
    return KeeperStart(cluster=cluster, workers=p.workers, zones=p.zones,
                       instance_type=instance_type, spot_per_hour=p.spot_per_hour,
                       on_demand_per_hour=p.on_demand_per_hour, on_demand_after_s=p.on_demand_after_s,
                       max_cost_per_hour=p.max_cost_per_hour, max_total_cost=p.max_total_cost,
                       interval_s=interval_s)


def outcome_report(outcome: Outcome, state: KeeperState, now: float) -> tuple[str, EventBody | None]:
    """The line and the event (None: the line only) of one applied action; ``state`` is after the pass
    (its backoffs say when a failed zone is tried again)."""
    action = outcome.action
    kind = "Spot" if action.spot else "on-demand"
    if outcome.ok:
        if isinstance(action, Delete):
            return (f"deleted {action.name} ({kind}, {action.zone}): a Spot worker runs in its place",
                    KeeperRelease(name=action.name, zone=action.zone, reason=action.reason))
        if isinstance(action, Start):
            return (f"started {action.name} ({kind}, {action.zone}, was {action.was})",
                    KeeperRefill(name=action.name, zone=action.zone, provisioning=provisioning(action.spot),
                                 operation="start", reason=action.reason, was=action.was))
        avoided = f"; {', '.join(action.avoided)} backed off" if action.avoided else ""
        return (f"created {action.name} ({kind}, {action.zone}{avoided})",
                KeeperRefill(name=action.name, zone=action.zone, provisioning=provisioning(action.spot),
                             operation="create", reason=action.reason, avoided_zones=action.avoided))
    failure = outcome.failure
    backoff = state.backoff(action.zone, action.spot)
    retry_in = None if backoff is None else max(0.0, backoff.until - now)
    if failure == GONE:
        return f"gone    {action.name} ({kind}, {action.zone}): it vanished before the {action.operation}", None
    if failure == ERROR:
        return (f"FAILED  {action.operation} {action.name} ({kind}, {action.zone}): {outcome.error}",
                KeeperError(operation=action.operation, error=str(outcome.error), name=action.name,
                            zone=action.zone, retry_in_s=retry_in))
    return (f"{failure:<8} {action.name} ({kind}, {action.zone}): {outcome.code}; {action.zone} backed off "
            f"for {retry_in or 0:.0f} s",
            KeeperStockout(name=action.name, zone=action.zone, provisioning=provisioning(action.spot),
                           operation=action.operation, code=outcome.code, kind=str(failure),
                           failures=backoff.failures if backoff else 1, retry_in_s=retry_in or 0.0))


def fallback_begin_report(before: KeeperState, state: KeeperState, obs: Observation,
                          outcomes: Sequence[Outcome]) -> tuple[str, KeeperFallback] | None:
    """When this pass started the on-demand fallback: how many on-demand workers stand in."""
    if before.fallback_since is not None or state.fallback_since is None:
        return None
    created = sum(1 for o in outcomes if o.ok and not o.action.spot and not isinstance(o.action, Delete))
    od_workers = created + sum(1 for w in obs.workers if not w.spot and w.live)
    no_spot = None if before.no_spot_since is None else state.fallback_since - before.no_spot_since
    return (f"on-demand fallback: {od_workers} on-demand worker(s) stand in for missing Spot capacity",
            KeeperFallback(phase="begin", on_demand_workers=od_workers, no_spot_s=no_spot))


def fallback_end_report(before: KeeperState, state: KeeperState, obs: Observation,
                        ) -> tuple[str, KeeperFallback] | None:
    """When this pass ended the on-demand fallback: how long it lasted and what it cost."""
    if before.fallback_since is None or state.fallback_since is not None:
        return None
    seconds = obs.now - before.fallback_since
    cost = state.spend.on_demand - before.fallback_spend_mark
    return (f"back on Spot: the on-demand fallback lasted {seconds:.0f} s and cost ${cost:.4f}",
            KeeperFallback(phase="end", on_demand_workers=0, seconds=seconds, on_demand_cost=cost))


@dataclass(frozen=True)
class WaitReport:
    """Why workers still wait after a pass, said once per change."""

    note: str  # which budget cap holds workers back ("" none): the state's ``budget_note`` from now on
    headline: str  # the waits without their countdowns: compared with the next pass's
    line: str | None = None  # printed when what waits changed
    event: KeeperBudget | None = None  # emitted when a budget cap newly holds


def wait_report(actions: Sequence[Action], state: KeeperState, obs: Observation, policy: KeeperPolicy,
                last_headline: str) -> WaitReport:
    """What the pass's :class:`Wait` actions come to, given the previous pass's headline."""
    waits = [a for a in actions if isinstance(a, Wait)]
    budget = next((w for w in waits if w.reason == "budget"), None)
    # the message quotes the spend, which grows every pass: a hold is "new" when what holds changes
    note = f"{budget.cap} {budget.limit} {budget.blocked}" if budget is not None else ""
    event = None
    if budget is not None and note != state.budget_note:
        event = KeeperBudget(cap=budget.cap, limit=budget.limit or 0.0,
                             rate_per_hour=hourly_rate(obs, policy), spent=state.spend.total,
                             blocked=budget.blocked, message=budget.message)
    text = "; ".join(w.message for w in waits)
    headline = text.split(":", 1)[0]  # without the countdowns, which change every pass
    line = None
    if text and (headline != last_headline or note != state.budget_note):
        line = f"waiting: {text}"
    return WaitReport(note=note, headline=headline, line=line, event=event)


def cost_event(spend: Spend, obs: Observation, policy: KeeperPolicy) -> KeeperCost:
    """The spend so far, the hourly rate now and the workers running, as one ``keeper_cost`` event."""
    return KeeperCost(
        spent=round(spend.total, 6), spent_spot=round(spend.spot, 6), spent_on_demand=round(spend.on_demand, 6),
        on_demand_premium=round(on_demand_premium(spend, policy), 6),
        rate_per_hour=round(hourly_rate(obs, policy), 6),
        spot_running=sum(1 for w in obs.workers if w.spot and w.running),
        on_demand_running=sum(1 for w in obs.workers if not w.spot and w.running),
        wanted=policy.workers)


__all__ = [
    "WaitReport", "cost_event", "fallback_begin_report", "fallback_end_report", "outcome_report", "start_event",
    "wait_report",
]
