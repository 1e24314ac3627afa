"""What ``hvd-transient cluster keep`` decides, as pure functions over frozen dataclasses.

One pass of the keeper is::

    state = accrue(state, observation, policy)       # cost since the last look; episodes end
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
   done and a :class:`Wait` says so;
5. with a training job to supervise (``keep --job``), :mod:`.job_plan` decides: it is launched
   once ``min_workers`` are RUNNING (:func:`running_after`); a job left without any live worker
   is ended; a job that exits non-zero is launched again as soon as ``min_workers`` run again,
   up to ``max_relaunches`` times; exit 0 is the end of training.

Workers are counted by provisioning model and status, not by name, so a worker recreated in
another zone, or an on-demand one, is named like any other: the lowest free index.
"""
from __future__ import annotations

import logging
import math
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence, Union

from hvd_transient.cluster.rest_plan import instance_body
from hvd_transient.cluster.spec import WORKER, ClusterSpec, InstancePlan
from hvd_transient.core.membership import Incarnation
from hvd_transient.discovery.gce import incarnation
from hvd_transient.gcp.pricing import PriceTable, instance_type_key

log = logging.getLogger(__name__)

#: a VM that bills (or is about to): it holds its slot
LIVE = frozenset({"PROVISIONING", "STAGING", "RUNNING", "REPAIRING"})
#: a stopped VM ``instances.start`` runs again (a Spot VM preempted with termination action STOP)
RESTARTABLE = frozenset({"TERMINATED", "STOPPED", "SUSPENDED"})
#: on its way down (a preemption in progress): neither refilled nor started until it settles
TRANSITIONAL = frozenset({"STOPPING", "SUSPENDING"})

# Failure classes of a start/insert: the first two mean "no capacity here now"
STOCKOUT, QUOTA, GONE, ERROR = "stockout", "quota", "gone", "error"
STOCKOUT_CODES = frozenset({"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"})
QUOTA_CODES = frozenset({"QUOTA_EXCEEDED"})
NOT_FOUND_CODES = frozenset({"NOTFOUND", "RESOURCE_NOT_FOUND"})

# Action reasons (written into the event log)
RESTART = "restart"                # a stopped Spot VM started again
RECREATE = "recreate"              # a missing Spot worker created
REPLACE_ON_DEMAND = "replace_on_demand"  # a Spot worker created/started while on-demand ones stand in
ON_DEMAND_FALLBACK = "on_demand_fallback"
SPOT_RUNNING = "spot_running"      # why an on-demand worker is deleted

_TRAILING_INT = re.compile(r"(\d+)$")


def _normal(code: str) -> str:
    return code.replace("_", "").casefold()


_STOCKOUT_NORMAL = frozenset(map(_normal, STOCKOUT_CODES))
_QUOTA_NORMAL = frozenset(map(_normal, QUOTA_CODES))
_NOT_FOUND_NORMAL = frozenset(map(_normal, NOT_FOUND_CODES))


def classify_failure(code: str) -> str:
    """An operation error code (``ZONE_RESOURCE_POOL_EXHAUSTED``) or HTTP error reason
    (``quotaExceeded``) -> STOCKOUT, QUOTA, GONE (the VM vanished meanwhile) or ERROR."""
    norm = _normal(code)
    if norm in _STOCKOUT_NORMAL:
        return STOCKOUT
    if norm in _QUOTA_NORMAL:
        return QUOTA
    if norm in _NOT_FOUND_NORMAL:
        return GONE
    return ERROR


# ---- what is observed ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerVM:
    name: str
    zone: str
    status: str  # the Compute instance status: PROVISIONING, RUNNING, TERMINATED, ...
    spot: bool
    incarnation: Incarnation | None = None  # its id and last start, where the API says

    @property
    def live(self) -> bool:
        return self.status in LIVE

    @property
    def running(self) -> bool:
        return self.status == "RUNNING"

    @property
    def restartable(self) -> bool:
        return self.status in RESTARTABLE

    @property
    def provisioning(self) -> str:
        return provisioning(self.spot)


@dataclass(frozen=True)
class Observation:
    now: float  # epoch seconds
    workers: tuple[WorkerVM, ...]


def provisioning(spot: bool) -> str:
    return "spot" if spot else "on-demand"


def worker_from_resource(instance: Mapping[str, Any]) -> WorkerVM:
    """A Compute instance resource as the keeper sees it."""
    scheduling = instance.get("scheduling") or {}
    spot = scheduling.get("provisioningModel") == "SPOT" or bool(scheduling.get("preemptible"))
    zone = str(instance.get("zone", "")).rstrip("/").rsplit("/", 1)[-1]
    return WorkerVM(name=str(instance.get("name")), zone=zone, status=str(instance.get("status", "")), spot=spot,
                    incarnation=incarnation(instance))


# ---- configuration and state --------------------------------------------------------------------


@dataclass(frozen=True)
class KeeperPolicy:
    workers: int
    zones: tuple[str, ...]
    #: new workers are named ``name_prefix + index`` (the lowest index not in use) ...
    name_prefix: str = "worker-"
    #: ... or, when given, take the first unused of these names (the local simulator's host aliases)
    name_pool: tuple[str, ...] = ()
    spot_per_hour: float = 0.0  # USD per worker-hour
    on_demand_per_hour: float = 0.0
    #: fill missing workers on demand after this long without Spot capacity; None: never
    on_demand_after_s: float | None = None
    max_cost_per_hour: float | None = None  # the workers' summed hourly rate
    max_total_cost: float | None = None  # the workers' spend since the keeper first ran
    #: the total cap refuses a VM whose cost over this horizon (one billing minimum) would cross it
    budget_horizon_s: float = 60.0
    backoff_initial_s: float = 60.0
    backoff_max_s: float = 1800.0
    #: a longer time between two looks (the keeper was not running) is charged as this long:
    #: what ran meanwhile was not watched, and a store reused days later must not trip the total cap
    max_accrual_gap_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, not {self.workers}")
        if not self.zones:
            raise ValueError("at least one zone is needed")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_initial_s must be > 0 and at most backoff_max_s")

    def rate(self, spot: bool) -> float:
        return self.spot_per_hour if spot else self.on_demand_per_hour


@dataclass(frozen=True)
class Backoff:
    """No request for ``spot``/on-demand capacity goes to ``zone`` before ``until``."""

    zone: str
    spot: bool
    failures: int  # consecutive passes that failed there
    until: float
    code: str  # the last failure's error code


@dataclass(frozen=True)
class Spend:
    """What the workers cost so far (USD), accrued by observed RUNNING time."""

    spot: float = 0.0
    on_demand: float = 0.0
    on_demand_seconds: float = 0.0  # VM-seconds of on-demand workers

    @property
    def total(self) -> float:
        return self.spot + self.on_demand


@dataclass(frozen=True)
class KeeperState:
    backoffs: tuple[Backoff, ...] = ()
    #: since when Spot capacity has been wanted and refused (stock-out/quota); None: not short
    no_spot_since: float | None = None
    spend: Spend = field(default_factory=Spend)
    observed_at: float | None = None
    #: (name, spot) of every worker RUNNING at ``observed_at``: they accrue until the next look
    running: tuple[tuple[str, bool], ...] = ()
    #: since when on-demand workers stand in; and ``spend.on_demand`` then
    fallback_since: float | None = None
    fallback_spend_mark: float = 0.0
    #: which budget cap last held workers back (each hold is reported once)
    budget_note: str = ""

    def backoff(self, zone: str, spot: bool) -> Backoff | None:
        return next((b for b in self.backoffs if b.zone == zone and b.spot == spot), None)

    def available(self, zone: str, spot: bool, now: float) -> bool:
        b = self.backoff(zone, spot)
        return b is None or b.until <= now


def fallback_due(state: KeeperState, policy: KeeperPolicy, now: float) -> bool:
    return (policy.on_demand_after_s is not None and state.no_spot_since is not None
            and now - state.no_spot_since >= policy.on_demand_after_s)


def backoff_delay(failures: int, policy: KeeperPolicy) -> float:
    """Exponential per zone: initial, 2x, 4x ... capped at the maximum."""
    return min(policy.backoff_initial_s * 2.0 ** max(0, failures - 1), policy.backoff_max_s)


# ---- actions --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    name: str
    zone: str
    spot: bool
    was: str  # the status it had
    reason: str = RESTART
    operation = "start"


@dataclass(frozen=True)
class Create:
    name: str
    zone: str
    spot: bool
    reason: str
    #: zones skipped for this provisioning model because they are backed off
    avoided: tuple[str, ...] = ()
    operation = "create"


@dataclass(frozen=True)
class Delete:
    name: str
    zone: str
    spot: bool
    reason: str
    operation = "delete"


@dataclass(frozen=True)
class Wait:
    """Nothing (more) can be done this pass; ``message`` says why."""

    reason: str  # "backoff" | "budget"
    message: str
    until: float | None = None  # backoff: when the first zone opens again
    cap: str = ""  # budget: "per_hour" | "total"
    limit: float | None = None
    blocked: int = 0  # budget: workers not started or created


VMAction = Union[Start, Create, Delete]
Action = Union[Start, Create, Delete, Wait]


@dataclass(frozen=True)
class Outcome:
    """What applying one action did: ``error`` None on success, else the API's code and message."""

    action: VMAction
    error: str | None = None
    code: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def failure(self) -> str | None:
        return None if self.ok else classify_failure(self.code)


def describe(action: Action) -> str:
    """One line for people (dry runs, logs)."""
    if isinstance(action, Wait):
        return f"wait    {action.message}"
    kind = "Spot" if action.spot else "on-demand"
    if isinstance(action, Start):
        return f"start   {action.name} ({kind}, {action.zone}, was {action.was}; {action.reason})"
    if isinstance(action, Create):
        avoided = f"; backed off: {', '.join(action.avoided)}" if action.avoided else ""
        return f"create  {action.name} ({kind}, {action.zone}, {action.reason}{avoided})"
    return f"delete  {action.name} ({kind}, {action.zone}): a Spot worker runs in its place"


def action_dict(action: Action) -> dict[str, Any]:
    from dataclasses import asdict

    out = asdict(action)
    out["action"] = type(action).__name__.lower()
    return out


# ---- the pure steps -------------------------------------------------------------------------------


def accrue(state: KeeperState, obs: Observation, policy: KeeperPolicy) -> KeeperState:
    """Charge the workers RUNNING at the last look for the time since, and note what this look shows."""
    spend = state.spend
    if state.observed_at is not None and obs.now > state.observed_at:
        dt = min(obs.now - state.observed_at, policy.max_accrual_gap_s)
        if dt < obs.now - state.observed_at:
            log.warning("nothing was watched for %.0f s: charging the workers last seen RUNNING for %.0f s",
                        obs.now - state.observed_at, dt)
        spot_s = sum(dt for _name, spot in state.running if spot)
        od_s = sum(dt for _name, spot in state.running if not spot)
        spend = Spend(spot=spend.spot + policy.spot_per_hour * spot_s / 3600.0,
                      on_demand=spend.on_demand + policy.on_demand_per_hour * od_s / 3600.0,
                      on_demand_seconds=spend.on_demand_seconds + od_s)
    spot_live = sum(1 for w in obs.workers if w.spot and w.live)
    od_live = sum(1 for w in obs.workers if not w.spot and w.live)
    fallback_since, mark = state.fallback_since, state.fallback_spend_mark
    if od_live == 0:
        fallback_since = None
    elif fallback_since is None:  # on-demand workers found (e.g. made before this state existed)
        fallback_since, mark = obs.now, spend.on_demand
    return replace(
        state, spend=spend, observed_at=obs.now,
        running=tuple(sorted((w.name, w.spot) for w in obs.workers if w.running)),
        no_spot_since=None if spot_live >= policy.workers else state.no_spot_since,
        fallback_since=fallback_since, fallback_spend_mark=mark,
    )


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


def hourly_rate(obs: Observation, policy: KeeperPolicy) -> float:
    """What the live workers cost per hour (USD)."""
    return float(sum(policy.rate(w.spot) for w in obs.workers if w.live))


def on_demand_premium(spend: Spend, policy: KeeperPolicy) -> float:
    """What the on-demand stand-ins cost beyond the same time on Spot (USD)."""
    return spend.on_demand_seconds * max(0.0, policy.on_demand_per_hour - policy.spot_per_hour) / 3600.0


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



# ---- persistence (JSON; pure) ------------------------------------------------------------------------


def state_to_json(state: KeeperState) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(state)


def state_from_json(doc: object) -> KeeperState:
    """The saved state, or a fresh one (with a warning) for anything unreadable."""
    try:
        if not isinstance(doc, dict):
            raise TypeError("not a JSON object")

        def opt(value: object) -> float | None:
            return None if value is None else _finite(value)

        spend = doc.get("spend") or {}
        return KeeperState(
            backoffs=tuple(Backoff(str(b["zone"]), bool(b["spot"]), int(b["failures"]), _finite(b["until"]),
                                   str(b.get("code", ""))) for b in doc.get("backoffs") or ()),
            no_spot_since=opt(doc.get("no_spot_since")),
            spend=Spend(_finite(spend.get("spot", 0.0)), _finite(spend.get("on_demand", 0.0)),
                        _finite(spend.get("on_demand_seconds", 0.0))),
            observed_at=opt(doc.get("observed_at")),
            running=tuple((str(n), bool(s)) for n, s in doc.get("running") or ()),
            fallback_since=opt(doc.get("fallback_since")),
            fallback_spend_mark=_finite(doc.get("fallback_spend_mark", 0.0)),
            budget_note=str(doc.get("budget_note", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring the keeper's saved state (%s): starting afresh", exc)
        return KeeperState()


def _finite(value: object) -> float:
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


# ---- Compute specifics (pure) -------------------------------------------------------------------------


def price_key(spec: ClusterSpec) -> str:
    """The price-table name of a worker: ``n1-standard-8+nvidia-tesla-t4``, or ``g2-standard-8``
    where the GPU comes with the machine type."""
    if spec.attaches_gpus:
        return instance_type_key(spec.machine_type, spec.gpu_type, spec.gpus_per_worker)
    return spec.machine_type


def worker_rates(spec: ClusterSpec, table: PriceTable) -> tuple[float, float]:
    """(Spot, on-demand) USD per worker-hour; PriceTableError if the table lacks the type."""
    price = table.price(price_key(spec))
    return price.spot_per_hour, price.on_demand_per_hour


def worker_body(spec: ClusterSpec, name: str, zone: str, spot: bool) -> dict[str, Any]:
    """The insert body of one worker, as ``cluster up`` builds it (labels, metadata, startup script)."""
    gpus = spec.gpus_per_worker if spec.gpu_type else 0
    plan_ = InstancePlan(name=name, zone=zone, role=WORKER, machine_type=spec.machine_type, spot=spot,
                         gpu_type=spec.gpu_type if gpus else None, gpu_count=gpus)
    body = instance_body(plan_, spec)
    if not spot and gpus:
        # a VM with GPUs cannot live-migrate: Compute refuses MIGRATE for it
        body["scheduling"] = {**body["scheduling"], "onHostMaintenance": "TERMINATE"}
    return body


__all__ = [
    "Action", "Backoff", "Create", "Delete", "KeeperPolicy", "KeeperState", "Observation", "Outcome", "Spend",
    "Start", "VMAction", "Wait", "WorkerVM", "accrue", "action_dict", "backoff_delay", "classify_failure",
    "describe", "fallback_due", "hourly_rate", "on_demand_premium", "plan", "price_key", "running_after", "settle",
    "state_from_json", "state_to_json", "worker_body", "worker_from_resource", "worker_rates",
]
