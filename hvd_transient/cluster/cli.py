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
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from hvd_transient.cluster.spec import (
    CLUSTER_LABEL,
    DRIVER,
    ROLE_LABEL,
    ClusterSpec,
    ClusterSpecError,
    parse_label_items,
    plan_instances,
)
from hvd_transient.commandline import (
    ArgumentParser,
    command,
    http_url,
    non_negative_int,
    non_negative_seconds,
    positive_int,
    positive_seconds,
    store_url,
)
from hvd_transient.gcp.compute_api import API_URL_ENV, DEFAULT_API_URL

if TYPE_CHECKING:
    from hvd_transient.cluster.job_plan import JobPolicy
    from hvd_transient.cluster.keeper import Keeper
    from hvd_transient.gcp.compute_api import ComputeAPI

log = logging.getLogger(__name__)

PROG = "hvd-transient cluster"
# Where a source checkout keeps the startup script (pip install -e . installs from one).
DEFAULT_STARTUP_SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "startup_script.sh"
RESTARTABLE = frozenset({"TERMINATED", "STOPPED", "SUSPENDED"})
#: how long after its start a worker may take to publish itself ready (``--join-timeout``): a new VM
#: installs TensorFlow and builds Horovod first
DEFAULT_BOOT_TIMEOUT_S = 1200.0


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", required=True, help="cluster name: VM name prefix and hvdt-cluster label")
    parser.add_argument("--project", required=True, help="GCP project id")
    parser.add_argument("--zones", default="", help="comma-separated zones (workers are spread round-robin)")
    parser.add_argument("--api-url", type=http_url, help="Compute API base URL (default $HVDT_COMPUTE_API or Google's)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")


def _add_cluster_options(parser: argparse.ArgumentParser) -> None:
    """The options that describe the cluster's VMs (``up`` and ``keep``)."""
    parser.add_argument("--workers", type=non_negative_int, required=True, help="number of Spot GPU worker VMs")
    parser.add_argument("--machine-type", default="n1-standard-8")
    parser.add_argument("--gpu-type", default="nvidia-tesla-t4", help="accelerator type, or 'none'")
    parser.add_argument("--gpus-per-worker", type=non_negative_int, default=1)
    parser.add_argument("--image-family", default="debian-12")
    parser.add_argument("--image-project", default="debian-cloud")
    parser.add_argument("--boot-disk-gb", type=positive_int, default=100)
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                        help="extra labels (repeatable)")
    parser.add_argument("--termination-action", choices=("STOP", "DELETE"), default="STOP",
                        help="what GCE does to a preempted worker (default STOP: rerun 'up' to restart it)")
    parser.add_argument("--preemption-notice-duration", type=notice_seconds, metavar="SECONDS",
                        help="preemption notice the Spot workers get, e.g. 120 or 120s (GCE beta field "
                             "scheduling.preemptionNoticeDuration; default: Compute Engine's 30 s); "
                             "the workers' watchers read it from the VM's metadata")
    parser.add_argument("--driver-machine-type", default="n1-standard-4")
    parser.add_argument("--driver-zone", help="zone of the driver VM (default: the first zone)")
    parser.add_argument("--network", default="global/networks/default")
    parser.add_argument("--subnetwork")
    parser.add_argument("--no-external-ip", action="store_true", help="no external IPs (needs Cloud NAT for PyPI)")
    parser.add_argument("--service-account", default="default")
    parser.add_argument("--package", default="hvd-transient", help="pip requirement the VMs install")
    parser.add_argument("--store", type=store_url,
                        help="run store URL (gs://bucket/run) given to every VM as HVDT_STORE")
    parser.add_argument("--ssh-user", default="hvdt")
    parser.add_argument("--ssh-public-key", metavar="FILE",
                        help="public key horovodrun's ssh uses (e.g. ~/.ssh/id_ed25519.pub)")
    parser.add_argument("--startup-script", metavar="FILE", help=f"default: {DEFAULT_STARTUP_SCRIPT}")
    parser.add_argument("--standby", metavar="'SCRIPT ARGS'",
                        help="the training script and its arguments, as the job runs them (relative to --job-dir): "
                             "each worker starts a pre-warmed standby of it at boot, so a VM that joins a running "
                             "job stalls the others about a second instead of its whole start-up; run the job as "
                             "'horovodrun ... python -m hvd_transient.worker SCRIPT ARGS'. Needs --store")
    parser.add_argument("--job-dir", metavar="DIR",
                        help="the job's working directory on every VM, where the standby runs (default: the ssh "
                             "user's home)")


def _add_keep(commands: Any) -> None:
    keep = commands.add_parser(
        "keep", help="keep N Spot workers running: restart, recreate, fail over zones, fall back, cap the cost",
        description="Run on the driver VM: every --interval seconds, start stopped workers and recreate deleted "
                    "ones, spread over --zones; a zone that reports a stock-out or quota error is skipped with "
                    "exponential backoff. With --store, its actions go to the run's event log "
                    "(hvd-transient report) and its state to keeper/<name>.json there.")
    _add_common(keep)
    _add_cluster_options(keep)
    keep.add_argument("--interval", type=positive_seconds, default=30.0, metavar="SECONDS",
                      help="seconds between passes (default 30)")
    keep.add_argument("--on-demand-after", type=non_negative_seconds, metavar="SECONDS",
                      help="after this long without Spot capacity, fill the missing workers with on-demand ones "
                           "(deleted again once Spot workers run in their place); default: never")
    keep.add_argument("--max-cost-per-hour", type=usd, metavar="USD",
                      help="never start or create a worker that would raise the workers' hourly rate above this")
    keep.add_argument("--max-total-cost", type=usd, metavar="USD",
                      help="stop starting or creating workers once the workers' spend would exceed this")
    keep.add_argument("--prices", metavar="FILE", help="price file overriding the packaged table (or $HVDT_PRICES)")
    keep.add_argument("--backoff", type=positive_seconds, default=60.0, metavar="SECONDS",
                      help="first backoff of a zone after a stock-out or quota error; it doubles up to "
                           "--backoff-max (default 60)")
    keep.add_argument("--backoff-max", type=positive_seconds, default=1800.0, metavar="SECONDS",
                      help="longest backoff of a zone (default 1800)")
    keep.add_argument("--once", action="store_true", help="one pass, then exit (cron, tests)")
    keep.add_argument("--dry-run", action="store_true",
                      help="look at the workers and print the actions one pass would take; change nothing")
    keep.add_argument("--timeout", type=positive_seconds, default=900.0,
                      help="seconds to wait for each pass's operations (default 900)")
    job = keep.add_argument_group(
        "training job", "With --job the keeper also runs the training job on this VM: it launches it once "
                        "--min-workers workers are RUNNING; when a wave of preemptions leaves it no worker, or it "
                        "exits non-zero, it launches it again as soon as --min-workers run again (the job resumes "
                        "from its latest checkpoint); exit 0 ends training, and the keeper with it.")
    job.add_argument("--job", metavar="COMMAND",
                     help="the job's command line, run by /bin/sh -c, e.g. 'horovodrun -np 4 --min-np 2 "
                          "--host-discovery-script ... python train.py'")
    job.add_argument("--min-workers", type=positive_int, default=1, metavar="N",
                     help="launch (and relaunch) the job once N workers are RUNNING (default 1)")
    job.add_argument("--max-relaunches", type=non_negative_int, default=10, metavar="N",
                     help="launch a failed job again at most N times (default 10); then the keeper exits 1")
    job.add_argument("--keep-fleet", action="store_true",
                     help="go on keeping the workers after the job has ended")
    job.add_argument("--job-stop-timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                     help="seconds between SIGTERM and SIGKILL when the keeper ends the job (default 30)")
    job.add_argument("--join-timeout", type=non_negative_seconds, default=DEFAULT_BOOT_TIMEOUT_S, metavar="SECONDS",
                     help="with --store, the workers publish themselves ready once booted (or once their "
                          "--standby is warm): the job is launched on, and discovery lists, a VM that booted "
                          "less than this long ago only from then on (default 1200: a new VM installs "
                          "TensorFlow and builds Horovod first; 0: as soon as it is RUNNING)")


def usd(text: str) -> float:
    """argparse type: an amount of money > 0 (USD, as the price table)."""
    try:
        value = float(text.removeprefix("$"))
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected an amount in USD > 0 such as 2.5, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="{up,down,status,keep}")

    up = commands.add_parser("up", help="create (or refill) the cluster")
    _add_common(up)
    _add_cluster_options(up)
    up.add_argument("--dry-run", action="store_true", help="print the requests and gcloud commands; send nothing")
    up.add_argument("--timeout", type=positive_seconds, default=900.0, help="seconds to wait for the VMs (default 900)")

    down = commands.add_parser("down", help="delete the cluster's VMs")
    _add_common(down)
    down.add_argument("--keep-driver", action="store_true", help="delete only the workers")
    down.add_argument("--workers", type=non_negative_int, default=0,
                      help="with --dry-run: also print the deletes of this many planned workers")
    down.add_argument("--dry-run", action="store_true")
    down.add_argument("--timeout", type=positive_seconds, default=900.0,
                      help="seconds to wait for the deletes (default 900)")

    status = commands.add_parser("status", help="list the cluster's VMs")
    _add_common(status)
    _add_keep(commands)
    return parser


def _zones(text: str) -> tuple[str, ...]:
    return tuple(z.strip() for z in text.split(",") if z.strip())


def _read(path: str | Path, what: str) -> str:
    try:
        return Path(path).expanduser().read_text()
    except OSError as exc:
        raise ClusterSpecError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def notice_seconds(text: str) -> int:
    """argparse type: whole seconds of preemption notice, ``120`` or ``120s`` (Compute takes whole seconds)."""
    digits = text[:-1] if text.endswith("s") else text
    if not digits.isdigit() or int(digits) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of seconds > 0 such as 120 or 120s, not {text!r}")
    return int(digits)


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    script_path = args.startup_script or DEFAULT_STARTUP_SCRIPT
    if not args.startup_script and not DEFAULT_STARTUP_SCRIPT.is_file():
        raise ClusterSpecError(
            "no startup script: this installation has no launch/startup_script.sh; pass --startup-script FILE"
        )
    gpu_type = None if (args.gpu_type or "none").lower() == "none" else args.gpu_type
    return ClusterSpec(
        name=args.name, project=args.project, zones=_zones(args.zones), workers=args.workers,
        machine_type=args.machine_type, gpu_type=gpu_type, gpus_per_worker=args.gpus_per_worker,
        image_family=args.image_family, image_project=args.image_project, boot_disk_gb=args.boot_disk_gb,
        labels=parse_label_items(args.label), termination_action=args.termination_action,
        preemption_notice_s=args.preemption_notice_duration,
        driver_machine_type=args.driver_machine_type, driver_zone=args.driver_zone, network=args.network,
        subnetwork=args.subnetwork, external_ip=not args.no_external_ip, service_account=args.service_account,
        package=args.package, store=args.store, ssh_user=args.ssh_user,
        ssh_public_key=_read(args.ssh_public_key, "ssh public key").strip() if args.ssh_public_key else None,
        startup_script=_read(script_path, "startup script"), startup_script_path=str(script_path),
        standby=args.standby, job_dir=args.job_dir,
    )


def _api_url(args: argparse.Namespace) -> str:
    import os

    return (args.api_url or os.environ.get(API_URL_ENV) or DEFAULT_API_URL).rstrip("/")


def _connect(args: argparse.Namespace, *, write: bool) -> "ComputeAPI":
    from hvd_transient.gcp.compute_api import READONLY_SCOPE, READWRITE_SCOPE, ComputeAPI

    return ComputeAPI.connect(api_url=args.api_url, scopes=(READWRITE_SCOPE if write else READONLY_SCOPE,))


# ---- dry runs -------------------------------------------------------------------------------


def _print_dry_run(title: str, requests: list[Any], commands: list[list[str]], fmt: str) -> None:
    from hvd_transient.cluster.gcloud import render

    if fmt == "json":
        print(json.dumps({"requests": [r.to_dict() for r in requests], "gcloud": [render(c) for c in commands]},
                         indent=2))
        return
    print(f"# {title} (dry run: nothing was sent)\n")
    print("# Compute REST requests")
    for request in requests:
        print(request.render())
        print()
    print("# equivalent gcloud commands")
    for gcloud_command in commands:
        print(render(gcloud_command))


def _up_dry_run(args: argparse.Namespace, spec: ClusterSpec) -> int:
    from hvd_transient.cluster.gcloud import up_commands
    from hvd_transient.cluster.rest_plan import up_requests

    title = f"{PROG} up {spec.name}: 1 on-demand driver + {spec.workers} Spot workers"
    _print_dry_run(title, up_requests(_api_url(args), spec), up_commands(spec), args.format)
    return 0


def _down_dry_run(args: argparse.Namespace) -> int:
    from hvd_transient.cluster.gcloud import down_commands, status_command
    from hvd_transient.cluster.rest_plan import down_requests, list_request

    base = _api_url(args)
    requests = [list_request(base, args.project, args.name)]
    commands = [status_command(args.project, args.name)]
    zones = _zones(args.zones)
    if zones:  # the planned names; a real `down` deletes whatever the list returns
        spec = ClusterSpec(name=args.name, project=args.project, zones=zones, workers=args.workers)
        requests += down_requests(base, spec, keep_driver=args.keep_driver)
        commands += down_commands(spec, keep_driver=args.keep_driver)
    _print_dry_run(f"{PROG} down {args.name}: list the cluster's VMs, then DELETE each",
                   requests, commands, args.format)
    return 0


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
    instances = _cluster_instances(api, args.project, args.name, _zones(args.zones))
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
    from hvd_transient.cluster.job import CommandJob
    from hvd_transient.cluster.job_plan import JOB_FAILED
    from hvd_transient.cluster.keeper import ComputeFleet, Keeper, StateFile, policy_for
    from hvd_transient.cluster.keeper_plan import price_key, worker_rates
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
    store = None
    if args.store:
        from ckpt_service.stores import open_store

        store = open_store(args.store)
    state_file = StateFile(store, spec.name) if store is not None else None
    fleet = ComputeFleet(_connect(args, write=not args.dry_run), spec, operation_timeout=args.timeout)
    if args.dry_run:
        return _keep_dry_run(Keeper(fleet, policy, cluster=spec.name, state_file=state_file, job_policy=job_policy),
                             spec, args.format, args.job)

    events = None
    if store is not None:
        import socket

        from hvd_transient.telemetry.events import EventLog

        events = EventLog(store, socket.gethostname())
    job, lock = None, None
    if args.job:
        pidfile = _job_pidfile(spec)
        lock = _claim_job(pidfile, spec.name)
        # with a store the workers publish themselves ready (their boot, or their standby): gate on it
        job = CommandJob(args.job, join_timeout_s=job_policy.await_ready_s, pidfile=pidfile,
                         stop_timeout_s=args.job_stop_timeout)
    ready = None
    if store is not None:
        from hvd_transient.discovery.ready import read_ready

        ready = partial(read_ready, store)
    keeper = Keeper(fleet, policy, cluster=spec.name, instance_type=price_key(spec), events=events,
                    state_file=state_file, interval_s=args.interval, job=job, job_policy=job_policy,
                    job_stop_timeout_s=args.job_stop_timeout, ready=ready)
    try:
        if args.once:
            return 1 if keeper.reconcile().errors else 0
        _stop_on_sigterm(keeper)
        print(f"keeping {spec.workers} worker(s) of {spec.name} in {', '.join(spec.zones)} "
              f"(every {args.interval:g} s; Ctrl-C or SIGTERM stops)", flush=True)
        if job is not None:
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


def _job_pidfile(spec: ClusterSpec) -> Path:
    """Where this machine's keeper of ``spec`` notes its job's process (a keeper restarted after it was
    killed ends the job it left running before launching its own): ``$HVDT_KEEPER_DIR``, by default
    ``<tmp>/hvdt-keeper-<uid>``."""
    import os

    from hvd_transient.join.user_dirs import user_dir

    return user_dir(os.environ.get("HVDT_KEEPER_DIR"), "hvdt-keeper") / f"{spec.project}.{spec.name}.job"


def _claim_job(pidfile: Path, cluster: str) -> int | None:
    """This machine's lock on the cluster's job, held while the keeper runs: a second keeper of the cluster
    would end the first one's job as one left behind. None if it cannot be taken here (no lock, as before)."""
    from hvd_transient.join.user_dirs import ensure_dir, try_lock

    path = pidfile.with_suffix(".lock")
    try:
        ensure_dir(path.parent)
        fd = try_lock(path)
    except OSError as exc:
        log.warning("could not take %s (%s): nothing stops a second keeper of %s here", path, exc, cluster)
        return None
    if fd is None:
        raise ClusterSpecError(f"another 'cluster keep --job' of {cluster} runs on this machine (it holds {path}): "
                               "stop it first, or give this one another --name")
    return fd


def _job_policy(args: argparse.Namespace, spec: ClusterSpec) -> "JobPolicy":
    from hvd_transient.cluster.job_plan import JobPolicy

    if args.job is not None and not args.job.strip():
        raise ClusterSpecError("--job: the command is empty")
    if args.job and args.once:
        raise ClusterSpecError("--job needs the keeper to run on: it cannot be combined with --once")
    if args.min_workers > max(1, spec.workers):
        raise ClusterSpecError(f"--min-workers ({args.min_workers}) cannot exceed --workers ({spec.workers})")
    return JobPolicy(min_workers=args.min_workers, max_relaunches=args.max_relaunches, keep_fleet=args.keep_fleet,
                     await_ready_s=args.join_timeout if spec.store else None)


def _stop_on_sigterm(keeper: "Keeper") -> None:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():  # systemd stops a unit with SIGTERM
        signal.signal(signal.SIGTERM, lambda _signum, _frame: keeper.stop())


def _keep_dry_run(keeper: "Keeper", spec: ClusterSpec, fmt: str, job: str | None) -> int:
    from dataclasses import asdict

    from hvd_transient.cluster.job_plan import (
        describe_job,
        job_launch,
    )
    from hvd_transient.cluster.keeper_plan import (
        Outcome,
        Wait,
        action_dict,
        describe,
        running_after,
    )

    result = keeper.preview()
    # what the job would do after this pass, if its starts and creates all succeed
    ok = tuple(Outcome(a) for a in result.actions if not isinstance(a, Wait))
    running = running_after(result.observation, ok)
    launch = job_launch(keeper.job_state, running, result.observation.now, keeper.job_policy) if job else None
    if fmt == "json":
        doc: dict[str, Any] = {"workers": [asdict(w) for w in result.observation.workers],
                               "actions": [action_dict(a) for a in result.actions],
                               "spent": round(result.state.spend.total, 6)}
        if job:
            doc["job"] = {"command": job, "launch": launch is not None, "workers": list(running),
                          "min_workers": keeper.job_policy.min_workers}
        print(json.dumps(doc, indent=2))
        return 0
    live = sum(1 for w in result.observation.workers if w.live)
    print(f"# {PROG} keep {spec.name}: {live} of {spec.workers} workers live (dry run: nothing was changed)")
    for worker in result.observation.workers:
        print(f"#   {worker.name}  {worker.zone}  {worker.status}  {worker.provisioning}")
    for action in result.actions:
        print(describe(action))
    if not result.actions:
        print("nothing to do")
    if job:
        print(f"launch  job on {', '.join(running)}: {job}" if launch is not None
              else f"wait    {describe_job(keeper.job_state, running, keeper.job_policy)}")
    return 0


def describe(instance: dict[str, Any]) -> dict[str, Any]:
    """One row of ``status`` from a Compute instance resource (pure)."""
    from hvd_transient.gcp.compute_api import last_segment

    scheduling = instance.get("scheduling") or {}
    spot = scheduling.get("provisioningModel") == "SPOT" or bool(scheduling.get("preemptible"))
    nics = instance.get("networkInterfaces") or [{}]
    return {
        "name": instance.get("name"),
        "zone": last_segment(instance.get("zone", "")),
        "role": (instance.get("labels") or {}).get(ROLE_LABEL, "?"),
        "status": instance.get("status"),
        "provisioning": "spot" if spot else "on-demand",
        "machine_type": last_segment(instance.get("machineType", "")),
        "gpus": sum(int(a.get("acceleratorCount", 0)) for a in instance.get("guestAccelerators") or []),
        "internal_ip": nics[0].get("networkIP"),
    }


def _status(args: argparse.Namespace) -> int:
    api = _connect(args, write=False)
    rows = [describe(i) for i in _cluster_instances(api, args.project, args.name, _zones(args.zones))]
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
        return _up_dry_run(args, spec) if args.dry_run else _up(args, spec)
    if args.command == "down":
        return _down_dry_run(args) if args.dry_run else _down(args)
    if args.command == "keep":
        return _keep(args, spec_from_args(args))
    return _status(args)


if __name__ == "__main__":
    sys.exit(main())
