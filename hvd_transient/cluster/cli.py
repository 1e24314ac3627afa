"""``hvd-transient cluster up|down|status|keep``: the paper's topology on GCE Spot VMs.

``up`` creates one on-demand CPU driver VM and N Spot GPU workers. It is
idempotent: existing VMs are left alone, stopped ones (a Spot worker preempted
with termination action STOP) are started again, missing ones (DELETE) are
created again - so rerunning ``up`` after preemptions refills the cluster.
``down`` deletes every VM labelled with the cluster's name; ``status`` lists
them. ``--dry-run`` prints the exact REST requests and the equivalent
``gcloud`` commands without credentials or network. ``keep`` runs on the driver VM and
does what rerunning ``up`` would, continuously: it keeps the workers RUNNING, fails over
between zones on stock-outs, optionally falls back to on-demand workers and stops creating
at a budget cap; with ``--job`` it also runs the training job and launches it again after a
wave of preemptions (:mod:`hvd_transient.cluster.keeper`).

Here are the subcommands and their ``main``; the parsers are :mod:`.cli_parser`, the dry runs
:mod:`.dry_run`, and what ``keep`` sets up before the keeper runs :mod:`.keep_setup`.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Sequence

from hvd_transient.cluster.cli_parser import PROG, build_parser, spec_from_args, split_zones
from hvd_transient.cluster.dry_run import down_dry_run, keep_dry_run, up_dry_run
from hvd_transient.cluster.spec import (
    CLUSTER_LABEL,
    DRIVER,
    ROLE_LABEL,
    ClusterSpec,
    plan_instances,
)
from hvd_transient.cluster.worker_vms import RESTARTABLE, is_spot, provisioning
from hvd_transient.commandline import command

if TYPE_CHECKING:
    from hvd_transient.gcp.compute_api import ComputeAPI



def _connect(args: argparse.Namespace, *, write: bool) -> "ComputeAPI":
    from hvd_transient.gcp.compute_api import READONLY_SCOPE, READWRITE_SCOPE, ComputeAPI

    return ComputeAPI.connect(api_url=args.api_url, scopes=(READWRITE_SCOPE if write else READONLY_SCOPE,))



# ---- real runs ------------------------------------------------------------------------------


def _cluster_instances(api: "ComputeAPI", project: str, name: str, zones: tuple[str, ...]) -> list[dict[str, Any]]:
    from hvd_transient.cluster.rest_plan import cluster_filter

    query = cluster_filter(name)
    found = ([i for z in zones for i in api.list_instances(project, z, filter=query)] if zones
             else list(api.aggregated_instances(project, filter=query)))
    # the server filtered already; check again so a lenient filter can never widen a delete
    return sorted((i for i in found if (i.get("labels") or {}).get(CLUSTER_LABEL) == name),
                  key=lambda i: (i.get("labels", {}).get(ROLE_LABEL) != DRIVER, i["name"]))


def _up(args: argparse.Namespace, spec: ClusterSpec) -> int:
    from hvd_transient.cluster.rest_plan import instance_body
    from hvd_transient.gcp.compute_api import ComputeConflictError

    api = _connect(args, write=True)
    pending: list[tuple[str, dict[str, Any]]] = []
    for plan in plan_instances(spec):
        kind = "Spot" if plan.spot else "on-demand"
        current = api.get_instance(spec.project, plan.zone, plan.name)
        if current is None:
            try:
                op = api.insert_instance(spec.project, plan.zone, instance_body(plan, spec))
                pending.append((f"created {plan.name} ({plan.role}, {kind}, {plan.zone})", op))
            except ComputeConflictError:  # created by a retried request or a concurrent `up`
                print(f"exists  {plan.name}")
        elif current.get("status") in RESTARTABLE:
            op = api.start_instance(spec.project, plan.zone, plan.name)
            pending.append((f"started {plan.name} ({plan.role}, {kind}, was {current['status']})", op))
        else:
            print(f"exists  {plan.name} ({current.get('status')})")
    failed = _wait_all(api, pending, args.timeout)
    if failed:
        print(f"{PROG} up: {failed} of {len(pending)} VM operations failed (rerun 'up' to retry, "
              "e.g. once Spot capacity is back, or add --zones)", file=sys.stderr)
        return 1
    labels = " ".join(f"--label {item}" for item in spec.worker_labels)
    print(f"\nhost discovery for horovodrun (on {spec.name}-driver):\n"
          f"  hvd-transient discover --backend gce --project {spec.project} --zone {','.join(spec.zones)} "
          f"{labels}" + (" --use-ip" if len(spec.zones) > 1 else ""))
    return 0


def _down(args: argparse.Namespace) -> int:
    from hvd_transient.gcp.compute_api import last_segment

    api = _connect(args, write=True)
    instances = _cluster_instances(api, args.project, args.name, split_zones(args.zones))
    pending = []
    for instance in instances:
        if args.keep_driver and instance.get("labels", {}).get(ROLE_LABEL) == DRIVER:
            continue
        zone = last_segment(instance["zone"])
        pending.append((instance["name"], api.delete_instance(args.project, zone, instance["name"])))
    failed = _wait_all(api, [(f"deleted {name}", op) for name, op in pending], args.timeout)
    if not pending:
        print(f"no VMs labelled {CLUSTER_LABEL}={args.name} to delete")
    return 1 if failed else 0


def _wait_all(api: "ComputeAPI", pending: list[tuple[str, dict[str, Any]]], timeout: float) -> int:
    """Wait for every operation, reporting each; one failure (e.g. no Spot capacity) does not hide the rest."""
    from hvd_transient.gcp.compute_api import ComputeAPIError

    failed = 0
    for message, op in pending:
        try:
            api.wait_operation(op, timeout=timeout)
        except ComputeAPIError as exc:
            failed += 1
            print(f"FAILED  {message.split(' ', 1)[1]}: {exc}", file=sys.stderr)
            continue
        print(message)
    return failed


def _keep(args: argparse.Namespace, spec: ClusterSpec) -> int:
    """Run the keeper: one pass (``--once``), a preview (``--dry-run``) or until SIGTERM/Ctrl-C."""
    from hvd_transient.cluster.fleet import ComputeFleet
    from hvd_transient.cluster.job_plan import JOB_FAILED
    from hvd_transient.cluster.keep_setup import keep_policies, keeper_for, stop_on_sigterm
    from hvd_transient.cluster.keeper import Keeper
    from hvd_transient.cluster.keeper_store import StateFile

    policy, job_policy = keep_policies(args, spec)
    store = None
    if args.store:
        from ckpt_service.stores import open_store

        store = open_store(args.store)
    state_file = StateFile(store, spec.name) if store is not None else None
    fleet = ComputeFleet(_connect(args, write=not args.dry_run), spec, operation_timeout=args.timeout)
    if args.dry_run:
        return keep_dry_run(Keeper(fleet, policy, cluster=spec.name, state_file=state_file, job_policy=job_policy),
                            spec, args.format, args.job)

    keeper, lock = keeper_for(args, spec, fleet, policy, job_policy, store, state_file)
    try:
        if args.once:
            return 1 if keeper.reconcile().errors else 0
        stop_on_sigterm(keeper)
        print(f"keeping {spec.workers} worker(s) of {spec.name} in {', '.join(spec.zones)} "
              f"(every {args.interval:g} s; Ctrl-C or SIGTERM stops)", flush=True)
        if keeper.job is not None:
            and_ready = " and ready" if job_policy.await_ready_s else ""
            print(f"job: {args.job!r}, launched once {job_policy.min_workers} worker(s) are RUNNING{and_ready}, "
                  f"relaunched at most {job_policy.max_relaunches} time(s)", flush=True)
        keeper.run()
        return 1 if keeper.job_state.phase == JOB_FAILED else 0
    finally:
        keeper.close()
        if lock is not None:
            import os

            os.close(lock)


def describe(instance: dict[str, Any]) -> dict[str, Any]:
    """One row of ``status`` from a Compute instance resource (pure)."""
    from hvd_transient.gcp.compute_api import last_segment

    nics = instance.get("networkInterfaces") or [{}]
    return {
        "name": instance.get("name"),
        "zone": last_segment(instance.get("zone", "")),
        "role": (instance.get("labels") or {}).get(ROLE_LABEL, "?"),
        "status": instance.get("status"),
        "provisioning": provisioning(is_spot(instance)),
        "machine_type": last_segment(instance.get("machineType", "")),
        "gpus": sum(int(a.get("acceleratorCount", 0)) for a in instance.get("guestAccelerators") or []),
        "internal_ip": nics[0].get("networkIP"),
    }


def _status(args: argparse.Namespace) -> int:
    api = _connect(args, write=False)
    rows = [describe(i) for i in _cluster_instances(api, args.project, args.name, split_zones(args.zones))]
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no VMs labelled {CLUSTER_LABEL}={args.name} in project {args.project}")
        return 0
    columns = ("name", "zone", "role", "status", "provisioning", "machine_type", "gpus", "internal_ip")
    table = [[c.upper() for c in columns]] + [[str(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    return 0


@command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    """ClusterSpecError and ComputeAuthError exit 2, other ComputeAPIErrors 1 (commandline.run)."""
    args = build_parser().parse_args(argv)
    if args.command == "up":
        spec = spec_from_args(args)
        return up_dry_run(args, spec) if args.dry_run else _up(args, spec)
    if args.command == "down":
        return down_dry_run(args) if args.dry_run else _down(args)
    if args.command == "keep":
        return _keep(args, spec_from_args(args))
    return _status(args)


if __name__ == "__main__":
    sys.exit(main())
