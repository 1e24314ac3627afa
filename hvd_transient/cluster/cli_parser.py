"""The ``hvd-transient cluster`` command line: its parsers and argument types, and the
:class:`~.spec.ClusterSpec` that the parsed arguments of ``up`` and ``keep`` describe."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from hvd_transient.cluster.spec import ClusterSpec, ClusterSpecError, parse_label_items
from hvd_transient.commandline import (
    ArgumentParser,
    http_url,
    non_negative_int,
    non_negative_seconds,
    positive_int,
    positive_seconds,
    store_url,
)

PROG = "hvd-transient cluster"
DESCRIPTION = "``hvd-transient cluster up|down|status|keep``: the paper's topology on GCE Spot VMs."
# Where a source checkout keeps the startup script (pip install -e . installs from one).
DEFAULT_STARTUP_SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "startup_script.sh"
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
    parser = ArgumentParser(prog=PROG, description=DESCRIPTION)
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


def split_zones(text: str) -> tuple[str, ...]:
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
        name=args.name, project=args.project, zones=split_zones(args.zones), workers=args.workers,
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


__all__ = ["DEFAULT_STARTUP_SCRIPT", "PROG", "build_parser", "notice_seconds", "spec_from_args", "split_zones", "usd"]
