"""What the workers cost: their hourly rates from the price table, and the spend accrued by observed
RUNNING time between two looks (:func:`accrue`, the first step of a keeper pass). Pure."""
from __future__ import annotations

import logging
from dataclasses import replace

from hvd_transient.cluster.keeper_state import KeeperPolicy, KeeperState, Spend
from hvd_transient.cluster.spec import ClusterSpec
from hvd_transient.cluster.worker_vms import Observation
from hvd_transient.gcp.pricing import PriceTable, instance_type_key

log = logging.getLogger(__name__)


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


def hourly_rate(obs: Observation, policy: KeeperPolicy) -> float:
    """What the live workers cost per hour (USD)."""
    return float(sum(policy.rate(w.spot) for w in obs.workers if w.live))


def on_demand_premium(spend: Spend, policy: KeeperPolicy) -> float:
    """What the on-demand stand-ins cost beyond the same time on Spot (USD)."""
    return spend.on_demand_seconds * max(0.0, policy.on_demand_per_hour - policy.spot_per_hour) / 3600.0


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


__all__ = ["accrue", "hourly_rate", "on_demand_premium", "price_key", "worker_rates"]
