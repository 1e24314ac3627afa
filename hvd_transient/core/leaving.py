"""How a VM under notice leaves the ring: when (at once, or near its deadline), its leaving record
written in the background so host discovery drops it, the ``leave_published`` event, the last copy
of its events as Horovod resets it away, and the master's pruning of expired records.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from ckpt_service.deadline import Deadline
from ckpt_service.stores.base import ObjectStore
from hvd_transient.core.background import BackgroundCalls
from hvd_transient.core.config import HOUSEKEEPING_TIMEOUT_S, LEAVE_EVENT_WAIT_S, LEAVE_FLUSH_MAX_S, TransientConfig
from hvd_transient.core.election import NoticeRound
from hvd_transient.core.interfaces import ProtocolParts
from hvd_transient.core.leave_plan import plan_for_round
from hvd_transient.core.membership import prune_leaving, publish_leaving_until
from hvd_transient.core.notice_round import notice_event_wait_s
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import EventLog

log = logging.getLogger(__name__)


def planned_leave_at(config: TransientConfig, hosts: list[str], round_: NoticeRound, vm_deadline: float,
                     now: float) -> float | None:
    """When discovery should drop a VM whose window ends at ``vm_deadline``; None: at once (pure; see
    :func:`~hvd_transient.core.leave_plan.plan_leave`: the lead covers the slowest step the round says
    this job timed, the slowest departure and a margin, or the VM leaves at once)."""
    plan = plan_for_round(config, hosts, round_, vm_deadline, now)
    log.debug("a VM whose deadline is %.1f leaves %s", vm_deadline, plan.why)
    return plan.leave_at


class LeavingRecord:
    """The moment this VM's leaving record counts as published, for the event log.

    ``leave_published`` (which the report reads as the moment the host left, or, with a
    ``leave_at``, the moment it was to leave) is logged once
    the record is in the store *and* this rank is done with its emergency: by the training
    thread (:meth:`left`) if the record landed first, else by the background thread that
    wrote it (:meth:`landed`).
    """

    def __init__(self, log_it: Callable[[float | None], object]) -> None:
        self._log_it = log_it
        self._lock = threading.Lock()
        self._landed = threading.Event()
        self._left = False

    def landed(self) -> None:
        with self._lock:
            self._landed.set()
            now = self._left
        if now:
            self._log_it(None)

    @property
    def is_landed(self) -> bool:
        return self._landed.is_set()

    def left(self, wait_s: float) -> None:
        """The emergency is over; a record still being written gets up to ``wait_s`` to land first."""
        self._landed.wait(wait_s)
        with self._lock:
            self._left = True
            now = self._landed.is_set()
        if now:
            self._log_it(wait_s)


@dataclass(frozen=True)
class _RecordWrite:
    """One version of this VM's leaving record to write (a re-plan makes a newer one)."""

    until: float
    own_deadline: float | None
    leave_at: float | None
    record: LeavingRecord


class _Superseded(threading.Event):
    """A write's stop: set when a newer version of the record replaces it, and set as well while the
    protocol's background calls are stopping (the owner closed)."""

    def __init__(self, stopping: threading.Event) -> None:
        super().__init__()
        self._stopping = stopping

    def is_set(self) -> bool:
        return super().is_set() or self._stopping.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = STOP_POLL_S if end is None else min(STOP_POLL_S, end - time.monotonic())
            if left <= 0:
                return False
            super().wait(left)
        return True


#: how often a write's backoff looks at the owner's close
STOP_POLL_S = 0.1


class Departure:
    """This VM's way out of the ring, once every rank agreed on its notice."""

    def __init__(self, parts: ProtocolParts, background: BackgroundCalls) -> None:
        self.p = parts
        self._background = background
        self._record: LeavingRecord | None = None
        #: the background writer of this VM's leaving record (its latest version: see publish_record)
        self.publishing: Future[None] | None = None
        self.until: float | None = None  # when this rank's VM is gone (epoch seconds)
        self._lock = threading.Lock()
        self._queued: _RecordWrite | None = None
        self._writing = False
        self._current_stop: _Superseded | None = None

    def publish_record(self, step: int, own_deadline: float | None, was_master: bool, *,
                       until: float, leave_at: float | None = None) -> None:
        """Write this VM's leaving record in the background, retried until ``until`` (its own deadline).

        One writer writes the versions in order, the latest last: a re-plan's earlier ``leave_at`` stops
        the write of the older version (its retries end) and is written after it, so an older put that
        lands late, or is retried after its reply was lost, never leaves discovery reading the later
        ``leave_at``. A record that cannot be written in time is logged: discovery then keeps the host
        until its VM is gone, and Horovod sees its worker fail.
        """
        p = self.p
        record = self._record = LeavingRecord(
            lambda wait_s: p.events.emit(ev.LeavePublished(step=step, deadline=own_deadline,
                                                           was_master=was_master, leave_at=leave_at),
                                         wait_s=wait_s))
        with self._lock:
            self._queued = _RecordWrite(until=until, own_deadline=own_deadline, leave_at=leave_at, record=record)
            if self._current_stop is not None:
                self._current_stop.set()  # the version being written gives way to this one
            if not self._writing:
                self._writing = True
                self.publishing = self._background.submit(self._write_latest)
                self.publishing.add_done_callback(self._dropped)

    @property
    def record_landed(self) -> bool:
        """Whether the latest version of this VM's leaving record is in the store (written by this rank)."""
        return self._record is not None and self._record.is_landed

    def _dropped(self, writer: Future[None]) -> None:
        """The owner closed before the writer ran (its queued call was dropped): none is writing."""
        if writer.cancelled():
            with self._lock:
                self._writing = False

    def _write_latest(self) -> None:
        p = self.p
        store, host = p.manager.store, p.host
        instance_id = p.watcher.instance_id if p.watcher is not None else None
        unlanded: list[LeavingRecord] = []  # versions replaced before they landed: the newer one lands for them
        while True:
            with self._lock:
                write, self._queued = self._queued, None
                if write is None:
                    self._writing, self._current_stop = False, None
                    return
                stop = self._current_stop = _Superseded(self._background.stopping)
            try:
                publish_leaving_until(store, host, until=write.until, deadline=write.own_deadline,
                                      instance_id=instance_id, stop=stop, leave_at=write.leave_at)
            except Exception as exc:  # every rank already agreed on the departure; nothing may raise
                with self._lock:
                    replaced = self._queued is not None
                if replaced:
                    unlanded.append(write.record)
                else:
                    log.error("could not publish %s as leaving before its deadline: %s; discovery keeps the host "
                              "until its VM is gone", host, exc)
                continue
            for landed in (*unlanded, write.record):
                landed.landed()
            unlanded.clear()

    def leave(self, step: int, *, until: float, own_deadline: float | None, was_master: bool,
              leave_at: float | None, wrote_record: bool) -> None:
        """This rank's emergency is over and it leaves (its VM is gone at ``until``): log ``leave_published``,
        once its record landed if this rank writes it (:class:`LeavingRecord`), at once if another rank does."""
        p = self.p
        p.run.leaving = True
        self.until = until
        wait_s = min(LEAVE_EVENT_WAIT_S, notice_event_wait_s(p.events, p.clocks, self.until))
        if self._record is not None and wrote_record:
            self._record.left(wait_s)
        else:  # another rank of this VM writes its record
            p.events.emit(ev.LeavePublished(step=step, deadline=own_deadline, was_master=was_master,
                                            leave_at=leave_at), wait_s=wait_s)

    def before_leaving(self) -> threading.Thread:
        """This leaving rank is being reset out of the ring: the process ends inside Horovod soon
        after, with no Python after it, and its events must get out first. The event log's
        writer may be stuck on a slow write, so they are also copied in one write of their own
        (:meth:`EventLog.write_final`, bounded by ``LEAVE_FLUSH_MAX_S`` and the VM's deadline).
        Nothing here waits: Horovod resets the survivors only once this rank has reset too."""
        p = self.p
        until = self.until if self.until is not None else p.clocks.wall()
        timeout = max(0.0, min(LEAVE_FLUSH_MAX_S, until - p.clocks.wall() - 0.5))
        writer = threading.Thread(target=p.events.write_final, args=(timeout,), name="hvdt-last-events",
                                  daemon=True)  # the process may end before it does
        writer.start()
        return writer


def prune_expired(background: BackgroundCalls, store: ObjectStore, events: EventLog,
                  running: "Future[None] | None") -> "Future[None] | None":
    """Delete leaving records whose VM is gone by now (discovery already ignores them), in the
    background with every call bounded: a ring's start must not wait on a slow store.

    Returns the pruning under way: ``running`` itself if the previous ring's is still at it.
    """
    if running is not None and not running.done():
        return running  # the previous ring's pruning is still at it

    def prune() -> None:
        try:
            pruned = prune_leaving(store.within(Deadline(time.time() + HOUSEKEEPING_TIMEOUT_S, margin_s=0.0)))
        except Exception as exc:  # housekeeping: an unreachable store must not stop training
            log.warning("could not prune expired leaving records: %s", exc)
            return
        if pruned:
            events.emit(ev.LeavingPruned(hosts=tuple(sorted(pruned))))

    return background.submit(prune)


__all__ = ["Departure", "LeavingRecord", "planned_leave_at", "prune_expired"]
