"""What a Compute Engine instance resource says about the VM behind a name, read the same way by host
discovery and the cluster's keeper (pure: Compute JSON in).

An :class:`Incarnation` tells a VM from an earlier one under the same name (a Spot VM stopped by a
preemption and started again, or deleted and recreated): leaving and ready records apply only to
the incarnation they were written for.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Incarnation:
    """What the cloud says about the VM now listed under a host name."""

    instance_id: str | None = None
    started_at: float | None = None  # Unix seconds of its last start


def internal_ip(instance: Mapping[str, Any]) -> str | None:
    for nic in instance.get("networkInterfaces") or []:
        if nic.get("networkIP"):
            return str(nic["networkIP"])
    return None


def gpu_count(instance: Mapping[str, Any]) -> int:
    return sum(int(acc.get("acceleratorCount", 0)) for acc in instance.get("guestAccelerators") or [])


def incarnation(instance: Mapping[str, Any]) -> Incarnation | None:
    """The instance's id and last start (RFC 3339 ``lastStartTimestamp``) as Unix seconds."""
    started = instance.get("lastStartTimestamp")
    started_at = None
    if started:
        try:
            started_at = datetime.fromisoformat(str(started).replace("Z", "+00:00")).timestamp()
        except ValueError:
            log.warning("instance %s: unreadable lastStartTimestamp %r", instance.get("name"), started)
    instance_id = instance.get("id")
    if not instance_id and started_at is None:
        return None
    return Incarnation(instance_id=str(instance_id) if instance_id else None, started_at=started_at)
