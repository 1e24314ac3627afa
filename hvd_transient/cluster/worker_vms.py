"""The worker VMs as the keeper observes them: name, zone, Compute status and provisioning model,
read from Compute instance resources (pure)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from hvd_transient.gcp.instances import Incarnation, incarnation

#: a VM that bills (or is about to): it holds its slot
LIVE = frozenset({"PROVISIONING", "STAGING", "RUNNING", "REPAIRING"})
#: a stopped VM ``instances.start`` runs again (a Spot VM preempted with termination action STOP)
RESTARTABLE = frozenset({"TERMINATED", "STOPPED", "SUSPENDED"})
#: on its way down (a preemption in progress): neither refilled nor started until it settles
TRANSITIONAL = frozenset({"STOPPING", "SUSPENDING"})


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


def is_spot(instance: Mapping[str, Any]) -> bool:
    """Whether a Compute instance resource is a Spot (or legacy preemptible) VM."""
    scheduling = instance.get("scheduling") or {}
    return scheduling.get("provisioningModel") == "SPOT" or bool(scheduling.get("preemptible"))


def worker_from_resource(instance: Mapping[str, Any]) -> WorkerVM:
    """A Compute instance resource as the keeper sees it."""
    spot = is_spot(instance)
    zone = str(instance.get("zone", "")).rstrip("/").rsplit("/", 1)[-1]
    return WorkerVM(name=str(instance.get("name")), zone=zone, status=str(instance.get("status", "")), spot=spot,
                    incarnation=incarnation(instance))


__all__ = ["LIVE", "RESTARTABLE", "TRANSITIONAL", "Observation", "WorkerVM", "is_spot", "provisioning",
           "worker_from_resource"]
