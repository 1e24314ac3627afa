"""The ``gcloud compute`` commands equivalent to the REST requests. Pure; for dry runs and docs."""
from __future__ import annotations

import shlex
from collections import defaultdict

from hvd_transient.cluster.rest_plan import cluster_filter, metadata_items, scheduling
from hvd_transient.cluster.spec import ClusterSpec, InstancePlan, plan_instances


def _metadata_flag(items: list[dict[str, str]]) -> str | None:
    pairs = [(item["key"], item["value"]) for item in items if item["key"] != "startup-script"]
    if not pairs:
        return None
    text = "".join(k + v for k, v in pairs)
    # gcloud splits --metadata on ','; values with commas need an alternative delimiter (gcloud topic escaping)
    delimiter = next(d for d in (",", "|", ";", "#", "@@") if d not in text)
    prefix = "" if delimiter == "," else f"^{delimiter}^"
    return "--metadata=" + prefix + delimiter.join(f"{k}={v}" for k, v in pairs)


def create_command(spec: ClusterSpec, plan: InstancePlan) -> list[str]:
    sched = scheduling(plan, spec)
    # the notice duration is a beta flag, as its REST field is a beta field
    beta = ["beta"] if "preemptionNoticeDuration" in sched else []
    argv = [
        "gcloud", *beta, "compute", "instances", "create", plan.name,
        f"--project={spec.project}",
        f"--zone={plan.zone}",
        f"--machine-type={plan.machine_type}",
        f"--provisioning-model={sched['provisioningModel']}",
    ]
    if plan.spot:
        argv += [f"--instance-termination-action={sched['instanceTerminationAction']}",
                 "--maintenance-policy=TERMINATE", "--no-restart-on-failure"]
        if beta:
            argv.append(f"--preemption-notice-duration={sched['preemptionNoticeDuration']['seconds']}s")
    else:
        argv += ["--maintenance-policy=MIGRATE", "--restart-on-failure"]
    if plan.gpu_count and spec.attaches_gpus:
        argv.append(f"--accelerator=type={plan.gpu_type},count={plan.gpu_count}")
    argv += [
        f"--image-family={spec.image_family}",
        f"--image-project={spec.image_project}",
        f"--boot-disk-size={spec.boot_disk_gb}GB",
        "--boot-disk-auto-delete",
        "--labels=" + ",".join(f"{k}={v}" for k, v in sorted(spec.all_labels(plan.role).items())),
        f"--tags=hvdt-{spec.name}",
        f"--network={spec.network.rsplit('/', 1)[-1]}",
    ]
    if spec.subnetwork:
        argv.append(f"--subnet={spec.subnetwork.rsplit('/', 1)[-1]}")
    if not spec.external_ip:
        argv.append("--no-address")
    if spec.service_account != "default":  # gcloud's default is the project's default account
        argv.append(f"--service-account={spec.service_account}")
    argv.append("--scopes=" + ",".join(spec.scopes))
    metadata = _metadata_flag(metadata_items(plan, spec))
    if metadata:
        argv.append(metadata)
    if spec.startup_script:
        argv.append(f"--metadata-from-file=startup-script={spec.startup_script_path or 'startup_script.sh'}")
    return argv


def up_commands(spec: ClusterSpec) -> list[list[str]]:
    return [create_command(spec, plan) for plan in plan_instances(spec)]


def down_commands(spec: ClusterSpec, *, keep_driver: bool = False) -> list[list[str]]:
    by_zone: dict[str, list[str]] = defaultdict(list)
    for plan in plan_instances(spec):
        if not (keep_driver and plan.role == "driver"):
            by_zone[plan.zone].append(plan.name)
    return [["gcloud", "compute", "instances", "delete", *names, f"--project={spec.project}", f"--zone={zone}",
             "--quiet"] for zone, names in sorted(by_zone.items())]


def status_command(project: str, cluster: str) -> list[str]:
    return ["gcloud", "compute", "instances", "list", f"--project={project}",
            f"--filter={cluster_filter(cluster).strip('()')}",
            "--format=table(name,zone.basename(),labels.hvdt-role,status,scheduling.provisioningModel)"]


def render(argv: list[str]) -> str:
    return shlex.join(argv)
