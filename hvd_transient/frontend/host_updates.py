"""Horovod's host check, made to sync the state after every reset, and the host updates a rank holds.

Horovod's ``State.check_host_updates`` raises ``HostsUpdatedInterrupt(skip_sync=True)`` when the
updates this worker was told of are removals only, and its elastic loop then skips ``state.sync()``.
But the driver builds the next ring from its own view, which may already hold a new host: a
standby taking a leaving VM's slot when the ring is at ``--max-np`` is one reset, a removal and an
addition. The new worker always syncs; the survivors, having skipped it, go on to their next
collective, and the ring hangs (gloo's timeouts break it much later, or never). Syncing after every
reset costs the survivors one broadcast of the state at a departure; a ring that hangs costs the run.

:class:`HorovodHostUpdates` tells the protocol whether rank 0 holds an update that no host check took yet
(Horovod's driver tells rank 0 only), so the ranks run the check at the notice round that finds one: a
join is taken within about a round whether or not the script commits Horovod's state, and a VM under
notice that trains on is not looked for at every round of its window. It also announces the joins that
the driver's message lost (:mod:`hvd_transient.frontend.lost_joins`).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from hvd_transient.frontend.lost_joins import LostJoins, MemberSeen
from hvd_transient.telemetry import schema as ev

if TYPE_CHECKING:
    from ckpt_service.stores.base import ObjectStore
    from hvd_transient.telemetry.events import EventLog

log = logging.getLogger(__name__)

#: ``horovod.runner.elastic.worker.HostUpdateResult`` ``removed`` and ``added`` (an ``IntFlag``; not imported:
#: this layer is framework-free)
HOSTS_REMOVED = 1
HOSTS_ADDED = 2
#: an announced update's timestamp is the latest one checked plus this: later than it, so the check raises,
#: and earlier than the driver's next one (whole seconds), so that one is not taken for old
ANNOUNCE_AFTER_S = 1e-3


def check_host_updates_and_sync(check: Callable[[], None]) -> None:
    """``check()`` (Horovod's host check); an interrupt it raises never asks to skip the sync."""
    try:
        check()
    except Exception as exc:
        if getattr(exc, "skip_sync", False):
            exc.skip_sync = False  # type: ignore[attr-defined]  # HostsUpdatedInterrupt's one field
        raise


class HorovodHostUpdates:
    """The host updates of a Horovod elastic ``state`` (``horovod.common.elastic.State``: the driver's
    messages wait in its queue until ``check_host_updates`` takes them), for the protocol's rounds."""

    def __init__(self, state: Any, lost_joins: LostJoins | None = None) -> None:
        self.state = state
        self.lost_joins = lost_joins if lost_joins is not None else LostJoins()
        self.events: "EventLog | None" = None  # the run's event log, once the session has one

    def pending(self) -> bool:
        """Whether this rank holds a host update no host check took yet (a lost join found is announced first)."""
        found = self.lost_joins.take()
        if found:
            self.announce(r.host for r in found)
        messages = getattr(self.state, "_host_messages", None)
        return messages is not None and not messages.empty()

    def announce(self, hosts: Iterable[str]) -> None:
        """Tell this rank's host check that ``hosts`` were added (the driver's own message was lost)."""
        names = tuple(sorted(hosts))
        log.warning("%s became ready to join as the ring formed and is not in it (Horovod's driver told no rank): "
                    "the ring resets to take it", ", ".join(names))
        if self.events is not None:
            self.events.emit(ev.HostUpdateAnnounced(change=ev.ANNOUNCED_JOIN, hosts=names))
        self._put(HOSTS_ADDED)

    def announce_removal(self, hosts: Sequence[str]) -> None:
        """Tell this rank's host check that ``hosts`` were dropped (the driver's own message was lost)."""
        self._put(HOSTS_REMOVED)

    def ring_began(self, members: Iterable[MemberSeen], *, rank: int, store: "ObjectStore") -> None:
        """A ring of ``members`` began (rank 0 looks for lost joins in the background)."""
        self.lost_joins.ring_began(members, rank=rank, store=store)

    def _put(self, update: int) -> None:
        last = float(getattr(self.state, "_last_updated_timestamp", 0.0) or 0.0)
        self.state.on_hosts_updated(last + ANNOUNCE_AFTER_S, update)

    def close(self) -> None:
        self.lost_joins.close()


__all__ = ["ANNOUNCE_AFTER_S", "HOSTS_ADDED", "HOSTS_REMOVED", "HorovodHostUpdates", "check_host_updates_and_sync"]
