"""Compute REST requests built from a :class:`ClusterSpec`. Pure: nothing here talks to the network.

The same builders feed ``--dry-run`` (printed) and the real client (sent), so
what a dry run shows is exactly what ``up`` would send; the keeper creates a worker
with the body ``up`` would (:func:`worker_body`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from hvd_transient.cluster.spec import CLUSTER_LABEL, WORKER, ClusterSpec, InstancePlan, plan_instances
from hvd_transient.gcp.compute_api import api_base_for
from hvd_transient.gcp.metadata import NOTICE_ATTRIBUTE


@dataclass(frozen=True)
class RestRequest:
    method: str
    url: str
    body: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "url": self.url, "body": self.body}

    def render(self) -> str:
        head = f"{self.method} {self.url}"
        return head if self.body is None else f"{head}\n{json.dumps(self.body, indent=2)}"


def image_url(spec: ClusterSpec) -> str:
    return f"projects/{spec.image_project}/global/images/family/{spec.image_family}"


def scheduling(plan: InstancePlan, spec: ClusterSpec) -> dict[str, Any]:
    if plan.spot:
        # GPUs cannot live-migrate, and a Spot VM must not restart by itself after preemption:
        # `cluster up` restarts (STOP) or recreates (DELETE) it deliberately.
        spot: dict[str, Any] = {
            "provisioningModel": "SPOT",
            "instanceTerminationAction": spec.termination_action,
            "onHostMaintenance": "TERMINATE",
            "automaticRestart": False,
        }
        if spec.preemption_notice_s is not None:
            spot["preemptionNoticeDuration"] = {"seconds": spec.preemption_notice_s}
        return spot
    return {"provisioningModel": "STANDARD", "onHostMaintenance": "MIGRATE", "automaticRestart": True}


def metadata_items(plan: InstancePlan, spec: ClusterSpec) -> list[dict[str, str]]:
    """Instance metadata: the startup script reads its settings from the ``hvdt-*`` keys."""
    items = {
        "hvdt-cluster": spec.name,
        "hvdt-role": plan.role,
        "hvdt-package": spec.package,
        "hvdt-ssh-user": spec.ssh_user,
    }
    if spec.store:
        items["hvdt-store"] = spec.store
    if plan.spot and spec.preemption_notice_s is not None:
        # the metadata server has no key for the notice duration: the watchers read it here
        items[NOTICE_ATTRIBUTE] = str(spec.preemption_notice_s)
    if plan.role == WORKER and spec.standby:
        items["hvdt-standby"] = spec.standby  # the startup script starts a standby of the job at boot
        if spec.job_dir:
            items["hvdt-job-dir"] = spec.job_dir
    if plan.gpu_count:
        items["install-nvidia-driver"] = "True"  # honoured by Deep Learning VM images
    if spec.ssh_public_key:
        items["ssh-keys"] = f"{spec.ssh_user}:{spec.ssh_public_key.strip()}"
    if spec.startup_script:
        items["startup-script"] = spec.startup_script
    return [{"key": key, "value": value} for key, value in items.items()]


def instance_body(plan: InstancePlan, spec: ClusterSpec) -> dict[str, Any]:
    nic: dict[str, Any] = {"network": spec.network}
    if spec.subnetwork:
        nic["subnetwork"] = spec.subnetwork
    if spec.external_ip:
        nic["accessConfigs"] = [{"type": "ONE_TO_ONE_NAT", "name": "External NAT"}]
    body: dict[str, Any] = {
        "name": plan.name,
        "machineType": f"zones/{plan.zone}/machineTypes/{plan.machine_type}",
        "labels": spec.all_labels(plan.role),
        "tags": {"items": [f"hvdt-{spec.name}"]},
        "scheduling": scheduling(plan, spec),
        "disks": [{
            "boot": True,
            "autoDelete": True,
            "initializeParams": {"sourceImage": image_url(spec), "diskSizeGb": str(spec.boot_disk_gb)},
        }],
        "networkInterfaces": [nic],
        "serviceAccounts": [{"email": spec.service_account, "scopes": list(spec.scopes)}],
        "metadata": {"items": metadata_items(plan, spec)},
    }
    if plan.gpu_count and spec.attaches_gpus:
        body["guestAccelerators"] = [{
            "acceleratorType": f"zones/{plan.zone}/acceleratorTypes/{plan.gpu_type}",
            "acceleratorCount": plan.gpu_count,
        }]
    return body


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


def _zone_url(base_url: str, project: str, zone: str) -> str:
    return f"{base_url.rstrip('/')}/projects/{project}/zones/{zone}"


def insert_request(base_url: str, spec: ClusterSpec, plan: InstancePlan) -> RestRequest:
    body = instance_body(plan, spec)
    return RestRequest("POST", f"{_zone_url(api_base_for(base_url, body), spec.project, plan.zone)}/instances", body)


def delete_request(base_url: str, project: str, zone: str, name: str) -> RestRequest:
    return RestRequest("DELETE", f"{_zone_url(base_url, project, zone)}/instances/{name}")


def cluster_filter(name: str) -> str:
    return f'(labels.{CLUSTER_LABEL} = "{name}")'


def list_request(base_url: str, project: str, cluster: str) -> RestRequest:
    # Shown in dry runs; the client sends the same as paginated GETs.
    from urllib.parse import quote

    return RestRequest(
        "GET",
        f"{base_url.rstrip('/')}/projects/{project}/aggregated/instances"
        f"?filter={quote(cluster_filter(cluster))}&returnPartialSuccess=true",
    )


def up_requests(base_url: str, spec: ClusterSpec) -> list[RestRequest]:
    return [insert_request(base_url, spec, plan) for plan in plan_instances(spec)]


def down_requests(base_url: str, spec: ClusterSpec, *, keep_driver: bool = False) -> list[RestRequest]:
    plans = [p for p in plan_instances(spec) if not (keep_driver and p.role == "driver")]
    return [delete_request(base_url, spec.project, p.zone, p.name) for p in plans]
