"""What ``hvd-transient cluster keep`` decides: :func:`plan` and :func:`settle`, pure functions over the
frozen dataclasses of :mod:`.worker_vms`, :mod:`.keeper_state` and :mod:`.keeper_actions`.

One pass of the keeper is::

    state = accrue(state, observation, policy)       # cost since the last look; episodes end (.keeper_cost)
    actions = plan(observation, state, policy)       # Start / Create / Delete / Wait
    outcomes = fleet.apply(vm_actions)               # I/O: keeper.py and the fleets
    state = settle(state, outcomes, now, policy)     # per-zone backoff, "no Spot since"

Decisions, in order:

1. an on-demand worker is deleted only once a RUNNING Spot worker leaves it surplus;
2. missing Spot workers: stopped ones (termination action STOP) are started again in their
   zone, the rest are created in the least loaded zone that is not backed off (round-robin
   from empty, as ``cluster up`` spreads them); a zone that answered with a stock-out or a
   quota error is skipped until its exponential backoff ends, so creation fails over to the
   other zones;
3. after ``on_demand_after_s`` without Spot capacity, what is still missing is filled with
   on-demand workers, which step 1 later swaps back for Spot ones;
4. every start/create is checked against the budget caps first; what would exceed one is not
   done and a :class:`~.keeper_actions.Wait` says so;
5. with a training job to supervise (``keep --job``), :mod:`.job_plan` decides: it is launched
   once ``min_workers`` are RUNNING (:func:`running_after`); a job left without any live worker
   is ended; a job that exits non-zero is launched again as soon as ``min_workers`` run again,
   up to ``max_relaunches`` times; exit 0 is the end of training.

Workers are counted by provisioning model and status, not by name, so a worker recreated in
another zone, or an on-demand one, is named like any other: the lowest free index.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from hvd_transient.cluster.keeper_actions import (
    ON_DEMAND_FALLBACK,
    RECREATE,
    REPLACE_ON_DEMAND,
    RESTART,
    SPOT_RUNNING,
    Action,
    Create,
    Delete,
    Outcome,
    Start,
    VMAction,
    Wait,
    action_dict,
    describe,
)
from hvd_transient.cluster.keeper_cost import accrue, hourly_rate, on_demand_premium, price_key, worker_rates
from hvd_transient.cluster.keeper_state import (
    Backoff,
    KeeperPolicy,
    KeeperState,
    Spend,
    backoff_delay,
    fallback_due,
)
from hvd_transient.cluster.keeper_store import state_from_json, state_to_json
from hvd_transient.cluster.rest_plan import worker_body
from hvd_transient.cluster.vm_failures import GONE, QUOTA, STOCKOUT, classify_failure
from hvd_transient.cluster.worker_vms import TRANSITIONAL, Observation, WorkerVM, provisioning, worker_from_resource

_TRAILING_INT = re.compile(r"(\d+)$")


def _natural(name: str) -> tuple[str, int]:
    match = _TRAILING_INT.search(name)
    return (name[: match.start()], int(match.group(1))) if match else (name, -1)


class _Names:
    """The lowest free worker names, in order."""

    def __init__(self, policy: KeeperPolicy, taken: Iterable[str]) -> None:
        self.policy, self.taken = policy, set(taken)

    def next(self) -> str | None:
        if self.policy.name_pool:
            name = next((n for n in self.policy.name_pool if n not in self.taken), None)
        else:
            index = 0
            while f"{self.policy.name_prefix}{index}" in self.taken:
                index += 1
            name = f"{self.policy.name_prefix}{index}"
        if name is not None:
            self.taken.add(name)
        return name


@dataclass
class _Budget:
    policy: KeeperPolicy
    rate: float  # USD/h of the live workers, after this pass's deletes
    spent: float

    def refuses(self, added_rate: float) -> tuple[str, float, str] | None:
        """(cap, limit, message) if adding ``added_rate`` would break a cap, else None."""
        new_rate = self.rate + added_rate
        cap = self.policy.max_cost_per_hour
        if cap is not None and new_rate > cap + 1e-9:
            return ("per_hour", cap, f"budget: another worker would raise the workers' rate to "
                                     f"${new_rate:.4f}/h, over --max-cost-per-hour ${cap:.2f}")
        total = self.policy.max_total_cost
        if total is not None and self.spent + new_rate * self.policy.budget_horizon_s / 3600.0 > total + 1e-9:
            return ("total", total, f"budget: ${self.spent:.4f} spent of --max-total-cost ${total:.2f}; "
                                    "creating no more workers")
        return None

    def take(self, added_rate: float) -> None:
        self.rate += added_rate


def plan(obs: Observation, state: KeeperState, policy: KeeperPolicy) -> tuple[Action, ...]:
    """The actions that move the fleet towards ``policy.workers`` live workers, Spot first."""
    now = obs.now
    live = [w for w in obs.workers if w.live]
    spot_live = [w for w in live if w.spot]
    od_live = [w for w in live if not w.spot]
    spot_settling = sum(1 for w in obs.workers if w.spot and w.status in TRANSITIONAL)
    actions: list[Action] = []

    # 1. on-demand workers that RUNNING Spot workers made surplus; not-yet-running and newest go first
    spot_running = sum(1 for w in spot_live if w.running)
    surplus = max(0, min(len(od_live), spot_running + len(od_live) - policy.workers))
    by_preference = sorted(sorted(od_live, key=lambda w: _natural(w.name), reverse=True), key=lambda w: w.running)
    released = by_preference[:surplus]
    actions += [Delete(w.name, w.zone, False, SPOT_RUNNING) for w in released]
    od_kept = [w for w in od_live if w not in released]

    load = Counter(w.zone for w in live if w not in released)
    budget = _Budget(policy, sum(policy.rate(w.spot) for w in live if w not in released), state.spend.total)
    names = _Names(policy, (w.name for w in obs.workers))
    refused: tuple[str, float, str] | None = None

    def least_loaded(spot: bool) -> str | None:
        open_zones = [z for z in policy.zones if state.available(z, spot, now)]
        return min(open_zones, key=lambda z: (load[z], policy.zones.index(z))) if open_zones else None

    def next_vm(spot: bool, stopped: list[WorkerVM], reason: str, avoided: tuple[str, ...]) -> VMAction | None:
        """Start a stopped VM where there is capacity, else create one in the least loaded open zone."""
        if stopped:
            vm = stopped.pop(0)
            return Start(vm.name, vm.zone, spot, vm.status, reason)
        zone = least_loaded(spot)
        name = names.next() if zone is not None else None
        return None if zone is None or name is None else Create(name, zone, spot, reason, avoided)

    def restartable(spot: bool) -> list[WorkerVM]:
        return sorted((w for w in obs.workers if w.spot == spot and w.restartable
                       and state.available(w.zone, spot, now)), key=lambda w: (load[w.zone], _natural(w.name)))

    # 2. Spot workers: restart stopped ones where there is capacity, then create
    spot_missing = policy.workers - len(spot_live) - spot_settling
    swaps = len(od_kept)  # a Spot worker started while an on-demand one stands in replaces it
    spot_stopped = restartable(True)
    spot_avoided = tuple(z for z in policy.zones if not state.available(z, True, now))
    spot_planned = 0
    while spot_planned < spot_missing:
        swap = spot_planned < swaps
        # a swap is charged at the rate after the on-demand worker it replaces is gone
        added = policy.spot_per_hour - (policy.on_demand_per_hour if swap else 0.0)
        if not spot_stopped and least_loaded(True) is None:
            break  # no zone to try: a backoff, not the budget, is what holds it back
        refused = budget.refuses(added)
        if refused is not None:
            break
        next_action = next_vm(True, spot_stopped, REPLACE_ON_DEMAND if swap else
                              RESTART if spot_stopped else RECREATE, spot_avoided)
        if next_action is None:
            break
        actions.append(next_action)
        budget.take(added)
        load[next_action.zone] += 1
        spot_planned += 1

    # 3. on-demand stand-ins for what Spot cannot give
    missing = policy.workers - len(spot_live) - spot_settling - spot_planned - len(od_kept)
    od_planned = 0
    if missing > 0 and refused is None and fallback_due(state, policy, now):
        od_stopped = restartable(False)
        od_avoided = tuple(z for z in policy.zones if not state.available(z, False, now))
        while od_planned < missing:
            if not od_stopped and least_loaded(False) is None:
                break
            refused = budget.refuses(policy.on_demand_per_hour)
            if refused is not None:
                break
            next_action = next_vm(False, od_stopped, ON_DEMAND_FALLBACK, od_avoided)
            if next_action is None:
                break
            actions.append(next_action)
            budget.take(policy.on_demand_per_hour)
            load[next_action.zone] += 1
            od_planned += 1

    # 4. why the rest waits
    short = missing - od_planned
    if refused is not None:
        cap, limit, message = refused
        blocked = max(short, spot_missing - spot_planned)
        actions.append(Wait("budget", message, cap=cap, limit=limit, blocked=blocked))
    elif short > 0:
        actions.append(_backoff_wait(state, policy, now, short))
    return tuple(actions)


def _backoff_wait(state: KeeperState, policy: KeeperPolicy, now: float, short: int) -> Wait:
    closed = sorted((b for b in state.backoffs if b.until > now and b.zone in policy.zones),
                    key=lambda b: (b.until, b.zone))
    detail = ", ".join(f"{b.zone} {provisioning(b.spot)} ({b.code}, retry in {b.until - now:.0f} s)" for b in closed)
    message = f"{short} worker(s) missing; no zone to try now" + (f": {detail}" if detail else "")
    if policy.on_demand_after_s is not None and state.no_spot_since is not None and not fallback_due(
            state, policy, now):
        message += f"; on-demand fallback in {state.no_spot_since + policy.on_demand_after_s - now:.0f} s"
    until = min((b.until for b in closed), default=None)
    return Wait("backoff", message, until=until)


def settle(state: KeeperState, outcomes: Sequence[Outcome], now: float, policy: KeeperPolicy) -> KeeperState:
    """Back off zones that failed (once per pass, exponentially), clear those that worked, start
    the "no Spot capacity" clock at the first stock-out or quota error, and charge what now runs."""
    backoffs = {(b.zone, b.spot): b for b in state.backoffs}
    failed: dict[tuple[str, bool], str] = {}
    worked: set[tuple[str, bool]] = set()
    no_spot_since = state.no_spot_since
    fallback_since, mark = state.fallback_since, state.fallback_spend_mark
    # a VM whose start/insert operation is done bills from now on: charge it before the next look
    # sees it RUNNING, so a budget cap never trails behind by an interval
    running = dict(state.running)
    for outcome in outcomes:
        action = outcome.action
        if isinstance(action, Delete):
            if outcome.ok:
                running.pop(action.name, None)
            continue
        key = (action.zone, action.spot)
        if outcome.ok:
            worked.add(key)
            running[action.name] = action.spot
            if not action.spot and fallback_since is None:
                fallback_since, mark = now, state.spend.on_demand
            continue
        failure = outcome.failure
        if failure == GONE:  # the VM vanished between the look and the act: the next look sees it
            continue
        failed.setdefault(key, outcome.code or str(failure))
        if action.spot and failure in (STOCKOUT, QUOTA) and no_spot_since is None:
            no_spot_since = now
    for key in worked - set(failed):
        backoffs.pop(key, None)
    for key, code in failed.items():
        previous = backoffs.get(key)
        failures = (previous.failures if previous else 0) + 1
        backoffs[key] = Backoff(key[0], key[1], failures, now + backoff_delay(failures, policy), code)
    # a backoff long over, never retried since (nothing was missing), no longer says anything about the zone
    backoffs = {k: b for k, b in backoffs.items() if b.until > now - policy.backoff_max_s}
    return replace(state, backoffs=tuple(sorted(backoffs.values(), key=lambda b: (b.zone, not b.spot))),
                   no_spot_since=no_spot_since, fallback_since=fallback_since, fallback_spend_mark=mark,
                   running=tuple(sorted(running.items())))


def running_after(obs: Observation, outcomes: Sequence[Outcome]) -> tuple[str, ...]:
    """The workers RUNNING once this pass's operations are done: those seen RUNNING, and those
    started or created (the operation is done once the VM runs), less those deleted."""
    running = {w.name for w in obs.workers if w.running}
    for outcome in outcomes:
        if outcome.ok:
            if isinstance(outcome.action, Delete):
                running.discard(outcome.action.name)
            else:
                running.add(outcome.action.name)
    return tuple(sorted(running, key=_natural))


# The keeper's model, its steps and its persistence were first all defined here: the names stay importable.
__all__ = [
    "Action", "Backoff", "Create", "Delete", "KeeperPolicy", "KeeperState", "Observation", "Outcome", "Spend",
    "Start", "VMAction", "Wait", "WorkerVM", "accrue", "action_dict", "backoff_delay", "classify_failure",
    "describe", "fallback_due", "hourly_rate", "on_demand_premium", "plan", "price_key", "running_after", "settle",
    "state_from_json", "state_to_json", "worker_body", "worker_from_resource", "worker_rates",
]
