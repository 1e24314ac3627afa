"""The keeper's configuration (:class:`KeeperPolicy`) and what it carries from pass to pass
(:class:`KeeperState`: per-zone backoff, since when Spot capacity is short, the spend so far)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hvd_transient.cluster.spec import ClusterSpec


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


def policy_for(spec: ClusterSpec, **settings: Any) -> KeeperPolicy:
    """The policy for a cluster spec: its worker count, zones and ``<name>-worker-<i>`` names
    (``settings``: the other :class:`KeeperPolicy` fields)."""
    return KeeperPolicy(workers=spec.workers, zones=spec.zones, name_prefix=f"{spec.name}-worker-", **settings)


__all__ = ["Backoff", "KeeperPolicy", "KeeperState", "Spend", "backoff_delay", "fallback_due", "policy_for"]
