"""The keeper's :class:`~hvd_transient.cluster.fleet.Fleet` and :class:`~hvd_transient.cluster.job.Job`
over a :class:`LocalCluster`.

A host alias is a VM. One listed in the simulator's ``hosts.json`` state file is RUNNING;
one that ran and is no longer listed (its preemption window ended: the simulator drops it,
as Compute Engine stops a Spot VM with termination action STOP) is TERMINATED; an alias
that never ran is free for a new worker. Starting a stopped host and creating a worker
are both :meth:`LocalCluster.add_host`, which lists it again with a new start time, so
host discovery - and with it ``horovodrun`` - picks it up.

Everything is a Spot VM. Zones are labels: each host is in one (the cluster's own hosts in
the first zone unless placed otherwise; a created one where the keeper created it), and
:meth:`LocalFleet.exhaust` makes a zone answer every start and create with a stock-out
(``ZONE_RESOURCE_POOL_EXHAUSTED``) until :meth:`LocalFleet.restore`, at once or once a given number of
VMs more have started there, so the keeper's zone failover runs as on Compute Engine. By default there
is one zone, ``local``, always with capacity: ``Keeper(LocalFleet(cluster), LocalFleet.policy(...))``
refills preempted hosts.

:class:`LocalClusterJob` is the training job: ``horovodrun`` of the same cluster, launched
again on the hosts listed now, as the driver VM would launch it.
"""
from __future__ import annotations

import json
import logging
import subprocess
import threading
from typing import Any, Mapping, Sequence

from hvd_transient.cluster.job import exit_status
from hvd_transient.cluster.keeper_actions import Create, Delete, Outcome, VMAction
from hvd_transient.cluster.keeper_state import KeeperPolicy
from hvd_transient.cluster.vm_failures import STOCKOUT_CODES
from hvd_transient.cluster.worker_vms import WorkerVM
from hvd_transient.testing.local_cluster import HOST_ALIASES, LocalCluster

log = logging.getLogger(__name__)

ZONE = "local"
STOCKOUT = sorted(STOCKOUT_CODES)[0]


class LocalFleet:
    def __init__(self, cluster: LocalCluster, *, spares: Sequence[str] = HOST_ALIASES,
                 zones: Sequence[str] = (ZONE,), placement: Mapping[str, str] | None = None) -> None:
        """``spares``: further host aliases new workers may take once the cluster's own are in use;
        ``zones``: the zones the keeper may use; ``placement``: host -> zone of hosts that are not
        in the first zone."""
        if not zones:
            raise ValueError("at least one zone is needed")
        self.cluster = cluster
        self.names = tuple(dict.fromkeys([*cluster.spec.hosts, *spares]))
        self.zones = tuple(zones)
        self._zone_of = dict(placement or {})
        self._capacity: dict[str, int] = {}  # zone -> starts and creates it still takes (absent: unlimited)
        self._lock = threading.Lock()  # the keeper's thread applies, a test exhausts or restores

    def policy(self, workers: int, **settings: Any) -> KeeperPolicy:
        """A keeper policy for ``workers`` hosts, naming new ones from this fleet's aliases."""
        return KeeperPolicy(workers=workers, zones=self.zones, name_pool=self.names, **settings)

    def zone_of(self, host: str) -> str:
        return self._zone_of.get(host, self.zones[0])

    def exhaust(self, zone: str, *, after: int = 0) -> None:
        """No capacity in ``zone`` once ``after`` more VMs have started or been created there: starts and
        creates fail with a stock-out from then on."""
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        with self._lock:
            self._capacity[zone] = after

    def restore(self, zone: str) -> None:
        with self._lock:
            self._capacity.pop(zone, None)

    def listed(self) -> list[str]:
        """The hosts the state file lists now (what discovery sees)."""
        try:
            doc = json.loads(self.cluster.state_file.read_text())
        except FileNotFoundError:
            return []
        return [str(entry["host"]) for entry in doc.get("hosts", [])]

    def observe(self) -> tuple[WorkerVM, ...]:
        listed = set(self.listed())
        ever = set(self.cluster.vm_started) | listed
        return tuple(WorkerVM(host, self.zone_of(host), "RUNNING" if host in listed else "TERMINATED", True)
                     for host in sorted(ever))

    def apply(self, actions: Sequence[VMAction]) -> list[Outcome]:
        outcomes = []
        for action in actions:
            if isinstance(action, Delete):  # only on-demand workers are deleted, and there are none here
                outcomes.append(Outcome(action, "the local simulator cannot delete a host", "unsupported"))
                continue
            with self._lock:
                left = self._capacity.get(action.zone)
                exhausted = left == 0
                if left:
                    self._capacity[action.zone] = left - 1
            if exhausted:
                outcomes.append(Outcome(action, f"no Spot capacity in {action.zone}", STOCKOUT))
                continue
            if isinstance(action, Create):
                self._zone_of[action.name] = action.zone
            self.cluster.add_host(action.name)
            outcomes.append(Outcome(action))
        return outcomes


class LocalClusterJob:
    """``horovodrun`` of ``cluster``, (re)launched on the hosts its state file lists now.

    Each launch passes the VMs' start times (``vm_started``), so a leaving record a VM
    published is honoured until it expires unless that VM has been started again since
    (the keeper's refill gives it a new start time), as on Compute Engine."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.launched_at: list[float] = []  # one per launch
        self.exit_codes: list[int] = []  # one per attempt that ended

    def start(self, workers: Sequence[str]) -> None:
        if self.cluster.process is not None and self.cluster.process.poll() is None:
            raise RuntimeError("horovodrun is still running")
        log.info("launching horovodrun on %s", ", ".join(workers))
        self.cluster.start(vm_started=self.cluster.vm_started)
        self.launched_at.append(self.cluster.started_at)

    def poll(self) -> int | None:
        process = self.cluster.process
        code = None if process is None else process.poll()
        return None if code is None else self._ended(code)

    def wait(self, timeout: float) -> int | None:
        process = self.cluster.process
        if process is None:
            return None
        try:
            return self._ended(process.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float) -> int:
        """The whole cluster's processes go at once (the workers are gone with their VMs)."""
        process = self.cluster.process
        if process is None:
            raise RuntimeError("horovodrun was never started")
        self.cluster.stop()
        return self._ended(process.wait(timeout=timeout))

    def _ended(self, code: int) -> int:
        status = exit_status(code)
        if len(self.exit_codes) < len(self.launched_at):
            self.exit_codes.append(status)
        return status


__all__ = ["LocalClusterJob", "LocalFleet", "STOCKOUT", "ZONE"]
