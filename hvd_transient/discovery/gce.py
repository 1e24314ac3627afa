"""Compute Engine instances as Horovod hosts.

Two ways to name the worker set: the members of a zonal managed instance group
(``instanceGroupManagers.listManagedInstances``), or every instance carrying
given labels (``instances.list`` per zone, or ``aggregated/instances`` when no
zone is given). Only RUNNING instances count; a MIG member that the group is
deleting, stopping or recreating counts as already gone.

The ``*_hosts`` functions are pure (Compute JSON in, hosts out);
:func:`discover_gce` does the I/O through :class:`ComputeAPI`.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from hvd_transient.discovery.errors import DiscoveryConfigError
from hvd_transient.discovery.hosts import Host
from hvd_transient.gcp.instances import Incarnation, gpu_count, incarnation, internal_ip

if TYPE_CHECKING:  # the client imports requests/tenacity; only the gce backend needs it
    from hvd_transient.gcp.compute_api import ComputeAPI

log = logging.getLogger(__name__)

RUNNING = "RUNNING"
# MIG actions under which a RUNNING member still does useful work.
SERVING_ACTIONS = frozenset({"NONE", "VERIFYING", "REFRESHING"})


def _last(url: str) -> str:
    return str(url).rstrip("/").rsplit("/", 1)[-1]


def parse_labels(items: Iterable[str]) -> dict[str, str]:
    """``["role=worker", "run=r1"]`` (or comma lists) -> {"role": "worker", "run": "r1"}."""
    labels: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise DiscoveryConfigError(f"label {part!r} must be key=value")
            labels[key.strip()] = value.strip()
    return labels


def label_filter(labels: Mapping[str, str]) -> str:
    """A Compute list filter for RUNNING instances with all the labels (AND of parenthesised terms)."""
    terms = ['(status = "RUNNING")'] + [f'(labels.{key} = "{value}")' for key, value in sorted(labels.items())]
    return " ".join(terms)




def _host(instance: Mapping[str, Any], *, slots: int | None, use_ip: bool) -> Host | None:
    name = str(instance.get("name", ""))
    ip = internal_ip(instance)
    host_slots = slots if slots is not None else max(1, gpu_count(instance))
    if use_ip:
        if not ip:
            log.warning("instance %s has no internal IP yet; leaving it out", name)
            return None
        return Host(ip, host_slots, frozenset({name}), incarnation(instance))
    return Host(name, host_slots, frozenset({ip}) if ip else frozenset(), incarnation(instance))


def hosts_from_instances(
    instances: Iterable[Mapping[str, Any]], *, labels: Mapping[str, str], slots: int | None, use_ip: bool
) -> list[Host]:
    """RUNNING instances carrying every label, sorted by name.

    ``slots=None`` means one slot per attached GPU (at least one).
    The API was asked to filter already; checking again here keeps a lenient
    server (or a filter-syntax surprise) from admitting a stopped VM.
    """
    hosts = []
    for instance in instances:
        have = instance.get("labels") or {}
        if instance.get("status") != RUNNING or any(have.get(k) != v for k, v in labels.items()):
            continue
        host = _host(instance, slots=slots, use_ip=use_ip)
        if host is not None:
            hosts.append(host)
    return sorted(hosts, key=lambda h: h.name)


def hosts_from_managed(
    members: Iterable[Mapping[str, Any]],
    instances_by_name: Mapping[str, Mapping[str, Any]] | None,
    *,
    slots: int | None,
    use_ip: bool,
) -> list[Host]:
    """Serving RUNNING members of a MIG. ``instances_by_name`` is needed for IPs or GPU slots."""
    hosts = []
    for member in members:
        if member.get("instanceStatus") != RUNNING or member.get("currentAction", "NONE") not in SERVING_ACTIONS:
            continue
        name = _last(member.get("instance", ""))
        instance = (instances_by_name or {}).get(name)
        if instance is None:
            if use_ip or slots is None:
                log.warning("MIG member %s is not in the zone's instance list yet; leaving it out", name)
                continue
            # the member entry carries the instance id: enough to tell a recreated VM
            member_id = member.get("id")
            hosts.append(Host(name, slots, incarnation=Incarnation(str(member_id) if member_id else None)))
            continue
        host = _host(instance, slots=slots, use_ip=use_ip)
        if host is not None:
            hosts.append(host)
    return sorted(hosts, key=lambda h: h.name)


def discover_gce(
    api: "ComputeAPI",
    *,
    project: str,
    zones: Sequence[str],
    mig: str | None,
    labels: Mapping[str, str],
    slots: int | None,
    use_ip: bool,
) -> list[Host]:
    if not project:
        raise DiscoveryConfigError("the gce backend needs --project (or HVDT_PROJECT)")
    if mig:
        if len(zones) != 1:
            raise DiscoveryConfigError(f"--mig {mig} needs exactly one --zone (the group's zone), got {list(zones)}")
        if labels:
            raise DiscoveryConfigError("give either --mig or --label, not both")
        members = list(api.list_managed_instances(project, zones[0], mig))
        by_name = None
        if use_ip or slots is None:
            by_name = {i["name"]: i for i in api.list_instances(project, zones[0], filter='(status = "RUNNING")')}
        return hosts_from_managed(members, by_name, slots=slots, use_ip=use_ip)
    if not labels:
        raise DiscoveryConfigError("the gce backend needs --mig NAME or at least one --label key=value")
    query = label_filter(labels)
    if zones:
        instances = [i for zone in zones for i in api.list_instances(project, zone, filter=query)]
    else:
        instances = list(api.aggregated_instances(project, filter=query))
    return hosts_from_instances(instances, labels=labels, slots=slots, use_ip=use_ip)
