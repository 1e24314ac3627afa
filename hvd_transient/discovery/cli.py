"""``hvd-transient discover``: print ``host:slots`` lines for ``horovodrun --host-discovery-script``.

Kept cheap to start (Horovod runs it every second): no TensorFlow, zarr or
cloud-storage import unless the store URL itself needs one; the Compute client
is imported only by the gce backend.

With ``--standby-since T`` (or ``$HVDT_STANDBY_SINCE``) and a store, a VM that started
after T is listed only once it is ready (its standby worker warm, or its boot done), or ``--join-timeout`` seconds
after it started (:mod:`hvd_transient.discovery.ready`); VMs that started together are listed
together (``--join-gather``); the ready records are read only while such a VM waits.

Exit status: 0 with the hosts (possibly none) on stdout; 2 for a
misconfiguration; 1 when the hosts could not be determined (API or store
unreachable), so Horovod keeps its current hosts instead of dropping them all.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from hvd_transient.discovery.errors import DiscoveryConfigError, DiscoveryError
from hvd_transient.discovery.hosts import Host, exclude_leaving, format_hosts, parse_slots, unique
from hvd_transient.discovery.ready import (
    DEFAULT_JOIN_GATHER_S,
    DEFAULT_JOIN_TIMEOUT_S,
    JOIN_GATHER_ENV,
    JOIN_TIMEOUT_ENV,
    LISTED_FILE_ENV,
    STANDBY_SINCE_ENV,
)

log = logging.getLogger(__name__)

BACKENDS = ("gce", "file", "local")
PROG = "hvd-transient discover"


def build_parser() -> argparse.ArgumentParser:
    from hvd_transient.commandline import ArgumentParser, http_url, non_negative_seconds, positive_seconds

    parser = ArgumentParser(
        prog=PROG,
        description="Print one host:slots line per available host, minus hosts published as leaving.",
    )
    parser.add_argument("--backend", required=True, choices=BACKENDS, help="where the hosts come from")
    parser.add_argument("--store", help="run store URL (local path, file://, gs://, memory://): drop leaving hosts")
    parser.add_argument(
        "--leaving-grace", type=non_negative_seconds, default=os.environ.get("HVDT_LEAVING_GRACE_S", "60"),
        metavar="SECONDS",
        help="a leaving record stops excluding its host this long after its notice deadline "
        "(default 60, or $HVDT_LEAVING_GRACE_S); on gce a restarted or recreated VM is admitted at once",
    )
    parser.add_argument(
        "--standby-since", type=non_negative_seconds, default=os.environ.get(STANDBY_SINCE_ENV) or None,
        metavar="UNIX_SECONDS",
        help="VMs started after this time (normally the job's launch) publish themselves ready (their standby "
        "worker once warm, or their startup script once booted): list each from then on (default "
        "$HVDT_STANDBY_SINCE; unset: no VM is held back). Needs --store",
    )
    parser.add_argument(
        "--join-timeout", type=non_negative_seconds,
        default=os.environ.get(JOIN_TIMEOUT_ENV, f"{DEFAULT_JOIN_TIMEOUT_S:g}"), metavar="SECONDS",
        help="list such a VM anyway this long after it started, ready or not "
        f"(default {DEFAULT_JOIN_TIMEOUT_S:g}, or ${JOIN_TIMEOUT_ENV})",
    )
    parser.add_argument(
        "--join-gather", type=non_negative_seconds,
        default=os.environ.get(JOIN_GATHER_ENV, f"{DEFAULT_JOIN_GATHER_S:g}"), metavar="SECONDS",
        help="VMs that started within this many seconds of each other join together: a ready one waits for "
        "the others' standbys, at most this long after the first was ready; each join stalls every worker "
        f"(default {DEFAULT_JOIN_GATHER_S:g}, or ${JOIN_GATHER_ENV}; 0: each joins as soon as it is ready)",
    )
    parser.add_argument(
        "--listed-file", type=Path, default=os.environ.get(LISTED_FILE_ENV) or None, metavar="PATH",
        help="where discovery keeps the VMs it let through the join gate, so that the gather never holds one back "
        f"again (default ${LISTED_FILE_ENV}, or a file under the temporary directory named after the store and "
        "--standby-since)",
    )
    parser.add_argument(
        "--slots", default="1",
        help="slots per host (default 1); 'auto' = one per attached GPU (gce only). "
        "For file/local it is the default for lines without ':slots'.",
    )
    gce = parser.add_argument_group("gce backend")
    gce.add_argument("--project", help="GCP project id")
    gce.add_argument("--zone", action="append", default=[], metavar="ZONE[,ZONE...]",
                     help="zone(s) to look in; with --label, no zone means all zones")
    gce.add_argument("--mig", help="zonal managed instance group whose RUNNING members are the hosts")
    gce.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                     help="RUNNING instances carrying this label (repeat for AND)")
    gce.add_argument("--use-ip", action="store_true", help="print internal IPs instead of instance names")
    gce.add_argument("--api-url", type=http_url, help="Compute API base URL (default $HVDT_COMPUTE_API or Google's)")
    gce.add_argument("--timeout", type=positive_seconds, default=10.0,
                     help="per-request timeout in seconds for the Compute and GCS APIs (default 10)")
    file_group = parser.add_argument_group("file backend")
    file_group.add_argument("--hosts-file", help="file of host[:slots] lines; '#' comments allowed")
    local = parser.add_argument_group("local backend")
    local.add_argument("--hosts", help="comma-separated host[:slots] list")
    local.add_argument("--state-file", help="simulator state file: host[:slots] lines or JSON")
    return parser


def _split_csv(values: Sequence[str]) -> list[str]:
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _slots(args: argparse.Namespace) -> int | None:
    if args.slots == "auto":
        if args.backend != "gce":
            raise DiscoveryConfigError("--slots auto (one slot per GPU) only applies to the gce backend")
        return None
    return parse_slots(args.slots, where="--slots: ")


def _gce_hosts(args: argparse.Namespace, slots: int | None) -> list[Host]:
    from hvd_transient.discovery.gce import discover_gce, parse_labels
    from hvd_transient.gcp.compute_api import (
        READONLY_SCOPE,
        ComputeAPI,
        ComputeAPIError,
        ComputeAuthError,
        ComputeConfigError,
    )

    labels = parse_labels(args.label)
    zones = _split_csv(args.zone)
    if not args.project:
        raise DiscoveryConfigError("the gce backend needs --project (or HVDT_PROJECT)")
    try:
        api = ComputeAPI.connect(
            api_url=args.api_url, scopes=(READONLY_SCOPE,), timeout=args.timeout, attempts=3, backoff_max=2.0
        )
        return discover_gce(
            api, project=args.project, zones=zones, mig=args.mig, labels=labels, slots=slots, use_ip=args.use_ip
        )
    except (ComputeAuthError, ComputeConfigError) as exc:  # no credentials, 401/403, a bad URL: fix the setup
        raise DiscoveryConfigError(str(exc)) from None
    except ComputeAPIError as exc:
        raise DiscoveryError(str(exc)) from None


def find_hosts(args: argparse.Namespace) -> list[Host]:
    slots = _slots(args)
    if args.standby_since is not None and not args.store:
        raise DiscoveryConfigError("--standby-since (HVDT_STANDBY_SINCE) needs --store (HVDT_STORE): "
                                   "standbys publish their readiness there")
    if args.backend == "gce":
        hosts = _gce_hosts(args, slots)
    elif args.backend == "file":
        from hvd_transient.discovery.sources import file_hosts

        hosts = file_hosts(args.hosts_file, slots or 1)
    else:
        from hvd_transient.discovery.sources import local_hosts

        hosts = local_hosts(args.hosts, args.state_file, slots or 1)
    listed = hosts = unique(hosts)
    if args.store:
        from hvd_transient.discovery.leaving import leaving_from_url

        records = leaving_from_url(args.store, timeout=args.timeout,
                                   only={name for host in hosts for name in host.names})
        hosts = exclude_leaving(hosts, records, time.time(), grace_s=float(args.leaving_grace))
        if args.standby_since is not None:
            hosts = _admit_ready(hosts, listed, args)
    return hosts


def _admit_ready(hosts: list[Host], listed: list[Host], args: argparse.Namespace) -> list[Host]:
    from hvd_transient.discovery import ready

    gate = ready.JoinGate(standby_since=float(args.standby_since), join_timeout_s=float(args.join_timeout),
                          gather_s=float(args.join_gather))
    if not any(gate.awaits(host, time.time()) for host in hosts):
        return hosts  # the usual case: nothing to read
    path = args.listed_file or ready.listed_path(args.store, float(args.standby_since))
    before = ready.read_listed(path)
    records = ready.ready_from_url(args.store, timeout=args.timeout)
    now = time.time()  # after the records were read: none of them is dated after it by this host's clock
    admitted = gate.admit(hosts, records, now, started_with=listed, listed=before)
    gated = {ready.ListedVM.of(host) for host in admitted if gate.awaits(host, now)}
    if not gated <= before:  # kept while their join timeout runs: after it, nothing holds them back anyway
        ready.write_listed(path, {vm for vm in before | gated
                                  if vm.started_at is None or now < vm.started_at + gate.join_timeout_s})
    return admitted


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        hosts = find_hosts(args)
    except DiscoveryConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except DiscoveryError as exc:
        print(f"{PROG}: cannot determine hosts: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(format_hosts(hosts))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
