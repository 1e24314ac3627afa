"""What the protocol needs from outside it (the collectives across ranks, a notice source, the
clocks), and :class:`ProtocolParts`, what the parts of :mod:`hvd_transient.core.transient` share.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

from hvd_transient.core.config import TransientConfig

if TYPE_CHECKING:
    from ckpt_service.lease import Lease
    from ckpt_service.manager import CheckpointManager
    from hvd_transient.core.ring import RunState
    from hvd_transient.telemetry.events import EventLog
    from hvd_transient.watchers import Notice

log = logging.getLogger(__name__)


class NoticeSource(Protocol):
    """What the protocol needs of a watcher (:class:`hvd_transient.watchers.Watcher`, or a test's fake)."""

    @property
    def notice(self) -> "Notice | None": ...

    @property
    def warning(self) -> "Notice | None":
        """An early warning (AWS rebalance recommendation): checkpoint, keep training, stay."""
        ...

    #: the cloud's id of this VM, where known (leaving records carry it)
    instance_id: str | None

    def start(self) -> object: ...

    def stop(self) -> None: ...


class Collectives(Protocol):
    """The few collectives the protocol needs; every rank calls each one in the same order.

    ``name`` tells the calls apart (Horovod matches a collective across ranks by its name).
    """

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def allreduce_sum(self, values: np.ndarray[Any, Any], *, name: str = ...) -> np.ndarray[Any, Any]: ...

    def allgather_json(self, obj: Any, *, name: str = ...) -> list[Any]: ...

    def broadcast_json(self, obj: Any, root: int, *, name: str = ...) -> Any: ...


class HostUpdates(Protocol):
    """What a rank knows of the framework's host updates (Horovod elastic: its driver tells rank 0 when the
    hosts discovery lists change, and the framework's host check, a collective, acts on it)."""

    def pending(self) -> bool:
        """Whether this rank holds a host update that the framework's host check has not taken yet (read at
        the notice rounds only: every rank runs the check at a round where some rank holds one)."""

    def announce_removal(self, hosts: Sequence[str]) -> None:
        """Tell this rank's host check that ``hosts`` were dropped (called on rank 0, whose view the check
        broadcasts, where the framework's own message of it was lost)."""


@dataclass(frozen=True)
class Clocks:
    """The two clocks of the protocol, injected together: ``monotonic`` measures intervals (the
    step rate, the stop-poll cadence), ``wall`` is Unix time, in which notice deadlines are given."""

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


class ProtocolParts(Protocol):
    """What the protocol's collaborators (the notice round, the saves, the emergency, the leave)
    read of the :class:`~hvd_transient.core.transient.TransientImpl` that owns them.

    They read these on each use, never keep a copy: the owner may be given a new ``comm`` (a new
    ring in the tests' fakes) or ``config`` between steps. ``run`` is the ring's shared state.
    """

    @property
    def config(self) -> TransientConfig: ...

    @property
    def comm(self) -> Collectives: ...

    @property
    def clocks(self) -> Clocks: ...

    @property
    def host(self) -> str: ...

    @property
    def manager(self) -> "CheckpointManager": ...

    @property
    def events(self) -> "EventLog": ...

    @property
    def lease(self) -> "Lease": ...

    @property
    def watcher(self) -> NoticeSource | None: ...

    @property
    def run(self) -> "RunState": ...

    @property
    def host_updates(self) -> HostUpdates | None: ...


def configured_watcher(config: TransientConfig, host: str) -> NoticeSource | None:
    """The configured watcher; ``{host}`` in GCE_METADATA_HOST or AWS_EC2_METADATA_SERVICE_ENDPOINT
    selects a per-host metadata-emulator instance (one emulated VM per local host alias)."""
    from hvd_transient.watchers import make_watcher
    from hvd_transient.watchers.aws import ENDPOINT_ENV as AWS_ENDPOINT_ENV

    opts: dict[str, Any] = {"instance": host}
    if config.notice_window_s is not None:  # else each watcher's own: the VM's configuration or the cloud's
        opts["window"] = config.notice_window_s
    kind = os.environ.get("HVDT_WATCHER", config.watcher)
    metadata_host = os.environ.get("GCE_METADATA_HOST", "")
    aws_endpoint = os.environ.get(AWS_ENDPOINT_ENV, "")
    if "{host}" in metadata_host:
        opts["base_url"] = f"http://{metadata_host.format(host=host).rstrip('/')}/computeMetadata/v1/"
    if "{host}" in aws_endpoint:
        opts["endpoint"] = aws_endpoint.format(host=host)
    try:
        return make_watcher(kind, **opts)
    except Exception as exc:  # no watcher is bad, but must not stop training
        log.error("no preemption watcher (%s); training continues without notices", exc)
        return None


__all__ = ["Clocks", "Collectives", "HostUpdates", "NoticeSource", "ProtocolParts", "configured_watcher"]
