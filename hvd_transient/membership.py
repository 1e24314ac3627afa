"""Who is leaving the cluster, published in the run's store.

A worker under preemption notice publishes ``hosts/leaving/<host>.json``; every
host-discovery backend drops those hosts from its output, which is what makes
Horovod shrink the ring gracefully (HostsUpdatedInterrupt, no rollback).
A host that comes back (a new VM reusing the name) is re-admitted by
``clear_leaving``.
"""
from __future__ import annotations

import json
import logging
import time

from ckpt_service.stores.base import ObjectStore, check_key

log = logging.getLogger(__name__)

LEAVING_PREFIX = "hosts/leaving/"


def _key(host: str) -> str:
    return check_key(f"{LEAVING_PREFIX}{host}.json")


def publish_leaving(store: ObjectStore, host: str, *, reason: str = "preemption-notice",
                    deadline: float | None = None) -> None:
    record = {"host": host, "reason": reason, "published_at": time.time(), "deadline": deadline}
    store.put(_key(host), json.dumps(record).encode())
    log.info("published %s as leaving (%s)", host, reason)


def clear_leaving(store: ObjectStore, host: str) -> None:
    store.delete(_key(host))


def leaving_hosts(store: ObjectStore) -> set[str]:
    """Hosts currently published as leaving."""
    return {
        key[len(LEAVING_PREFIX):-len(".json")]
        for key in store.list(LEAVING_PREFIX)
        if key.endswith(".json")
    }
