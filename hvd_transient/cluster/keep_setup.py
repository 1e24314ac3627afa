"""What ``hvd-transient cluster keep`` sets up from its arguments before the keeper runs: the keeper's
and the job's policies (checked against each other, priced from the price table), and the keeper with
its event log, its job, the job's lock and the standbys' ready records."""
from __future__ import annotations

import argparse
import logging
from functools import partial
from typing import TYPE_CHECKING

from hvd_transient.cluster.fleet import Fleet
from hvd_transient.cluster.job_plan import JobPolicy
from hvd_transient.cluster.keeper import Keeper
from hvd_transient.cluster.keeper_cost import price_key, worker_rates
from hvd_transient.cluster.keeper_state import KeeperPolicy, policy_for
from hvd_transient.cluster.keeper_store import StateFile
from hvd_transient.cluster.spec import ClusterSpec, ClusterSpecError

if TYPE_CHECKING:
    from ckpt_service.stores.base import ObjectStore

log = logging.getLogger(__name__)


def keep_policies(args: argparse.Namespace, spec: ClusterSpec) -> tuple[KeeperPolicy, JobPolicy]:
    """The keeper's policy and the job's; ClusterSpecError for options that contradict each other."""
    from hvd_transient.gcp.pricing import PriceTableError, load_price_table

    if args.backoff_max < args.backoff:
        raise ClusterSpecError(f"--backoff-max ({args.backoff_max:g}) must be at least --backoff ({args.backoff:g})")
    job_policy = _job_policy(args, spec)
    if args.once and not args.dry_run and not args.store:
        # one pass per process: the spend and the "no Spot since" clock live in the store between passes
        needs = [o for o, v in (("--max-total-cost", args.max_total_cost), ("--on-demand-after", args.on_demand_after))
                 if v is not None]
        if needs:
            raise ClusterSpecError(f"{' and '.join(needs)} with --once need --store, where the keeper keeps its "
                                   "state between runs")
    table = load_price_table(args.prices)  # a bad price file is an error whatever the caps
    try:
        spot_rate, on_demand_rate = worker_rates(spec, table)
    except PriceTableError:
        if args.max_cost_per_hour is not None or args.max_total_cost is not None:
            raise  # a cap cannot be kept without a price
        log.warning("no price for %s: the keeper counts its cost as 0 (add it with --prices)", price_key(spec))
        spot_rate = on_demand_rate = 0.0
    policy = policy_for(
        spec, spot_per_hour=spot_rate, on_demand_per_hour=on_demand_rate, on_demand_after_s=args.on_demand_after,
        max_cost_per_hour=args.max_cost_per_hour, max_total_cost=args.max_total_cost,
        budget_horizon_s=max(60.0, args.interval), backoff_initial_s=args.backoff, backoff_max_s=args.backoff_max,
        max_accrual_gap_s=max(3600.0, 4 * args.interval))
    return policy, job_policy


def _job_policy(args: argparse.Namespace, spec: ClusterSpec) -> JobPolicy:
    if args.job is not None and not args.job.strip():
        raise ClusterSpecError("--job: the command is empty")
    if args.job and args.once:
        raise ClusterSpecError("--job needs the keeper to run on: it cannot be combined with --once")
    if args.min_workers > max(1, spec.workers):
        raise ClusterSpecError(f"--min-workers ({args.min_workers}) cannot exceed --workers ({spec.workers})")
    return JobPolicy(min_workers=args.min_workers, max_relaunches=args.max_relaunches, keep_fleet=args.keep_fleet,
                     await_ready_s=args.join_timeout if spec.store else None)


def keeper_for(args: argparse.Namespace, spec: ClusterSpec, fleet: Fleet, policy: KeeperPolicy,
               job_policy: JobPolicy, store: "ObjectStore | None",
               state_file: StateFile | None) -> tuple[Keeper, int | None]:
    """The keeper that acts (not a dry run), and this machine's lock on its job (an fd the caller closes
    once the keeper is closed; None without ``--job``)."""
    from hvd_transient.cluster.job import CommandJob
    from hvd_transient.cluster.job_lock import claim_job, job_pidfile

    events = None
    if store is not None:
        import socket

        from hvd_transient.telemetry.events import EventLog

        events = EventLog(store, socket.gethostname())
    job, lock = None, None
    if args.job:
        pidfile = job_pidfile(spec)
        lock = claim_job(pidfile, spec.name)
        # with a store the workers publish themselves ready (their boot, or their standby): gate on it
        job = CommandJob(args.job, join_timeout_s=job_policy.await_ready_s, pidfile=pidfile,
                         stop_timeout_s=args.job_stop_timeout)
    ready = leaving = None
    if store is not None:
        from hvd_transient.core.membership import read_leaving
        from hvd_transient.discovery.ready import read_ready

        ready, leaving = partial(read_ready, store), partial(read_leaving, store)
    keeper = Keeper(fleet, policy, cluster=spec.name, instance_type=price_key(spec), events=events,
                    state_file=state_file, interval_s=args.interval, job=job, job_policy=job_policy,
                    job_stop_timeout_s=args.job_stop_timeout, ready=ready, leaving=leaving)
    return keeper, lock


def stop_on_sigterm(keeper: Keeper) -> None:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():  # systemd stops a unit with SIGTERM
        signal.signal(signal.SIGTERM, lambda _signum, _frame: keeper.stop())


__all__ = ["keep_policies", "keeper_for", "stop_on_sigterm"]
