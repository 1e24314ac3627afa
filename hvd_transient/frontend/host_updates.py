"""Horovod's host check, made to sync the state after every reset.

Horovod's ``State.check_host_updates`` raises ``HostsUpdatedInterrupt(skip_sync=True)`` when the
updates this worker was told of are removals only, and its elastic loop then skips ``state.sync()``.
But the driver builds the next ring from its own view, which may already hold a new host: a
standby taking a leaving VM's slot when the ring is at ``--max-np`` is one reset, a removal and an
addition. The new worker always syncs; the survivors, having skipped it, go on to their next
collective, and the ring hangs (gloo's timeouts break it much later, or never). Syncing after every
reset costs the survivors one broadcast of the state at a departure; a ring that hangs costs the run.
"""
from __future__ import annotations

from typing import Callable


def check_host_updates_and_sync(check: Callable[[], None]) -> None:
    """``check()`` (Horovod's host check); an interrupt it raises never asks to skip the sync."""
    try:
        check()
    except Exception as exc:
        if getattr(exc, "skip_sync", False):
            exc.skip_sync = False  # type: ignore[attr-defined]  # HostsUpdatedInterrupt's one field
        raise


__all__ = ["check_host_updates_and_sync"]
