"""The keeper's :class:`~hvd_transient.cluster.keeper.Fleet` over a :class:`LocalCluster`.

A host alias is a VM. One listed in the simulator's ``hosts.json`` state file is RUNNING;
one that ran and is no longer listed (its preemption window ended: the simulator drops it,
as Compute Engine stops a Spot VM with termination action STOP) is TERMINATED; an alias
that never ran is free for a new worker. Starting a stopped host and creating a worker
are both :meth:`LocalCluster.add_host`, which lists it again with a new start time, so
host discovery - and with it ``horovodrun`` - picks it up.

Everything is a Spot VM in the single zone ``local``, and there is always capacity:
``Keeper(LocalFleet(cluster), LocalFleet.policy(...))`` refills preempted hosts.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from hvd_transient.cluster.keeper_plan import Create, Delete, KeeperPolicy, Outcome, Start, VMAction, WorkerVM
from hvd_transient.testing.local_cluster import HOST_ALIASES, LocalCluster

log = logging.getLogger(__name__)

ZONE = "local"


class LocalFleet:
    def __init__(self, cluster: LocalCluster, *, spares: Sequence[str] = HOST_ALIASES) -> None:
        """``spares``: further host aliases new workers may take once the cluster's own are in use."""
        self.cluster = cluster
        self.names = tuple(dict.fromkeys([*cluster.spec.hosts, *spares]))

    def policy(self, workers: int, **settings: Any) -> KeeperPolicy:
        """A keeper policy for ``workers`` hosts, naming new ones from this fleet's aliases."""
        return KeeperPolicy(workers=workers, zones=(ZONE,), name_pool=self.names, **settings)

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
        return tuple(WorkerVM(host, ZONE, "RUNNING" if host in listed else "TERMINATED", True)
                     for host in sorted(ever))

    def apply(self, actions: Sequence[VMAction]) -> list[Outcome]:
        outcomes = []
        for action in actions:
            if isinstance(action, (Start, Create)):
                self.cluster.add_host(action.name)
                outcomes.append(Outcome(action))
            elif isinstance(action, Delete):  # only on-demand workers are deleted, and there are none here
                outcomes.append(Outcome(action, "the local simulator cannot delete a host", "unsupported"))
        return outcomes


__all__ = ["LocalFleet", "ZONE"]
