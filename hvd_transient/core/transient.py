"""The framework-free heart of preemption-safe training (Keras, custom loops, static jobs).

:class:`TransientImpl` is driven at step boundaries by a thin framework layer
(``hvd_transient.keras``) and talks to the other ranks only through a
:class:`Collectives` object, so its logic runs the same under Horovod and under
the in-process fakes of the unit tests.

Per step boundary, on every rank, in the same order:

1. about once per ``check_interval_s`` (the step count adapts to the step times all
   ranks measured, see :func:`~hvd_transient.core.election.steps_until_next_check` for the
   time bound it promises; or every ``check_every_steps`` steps if set), one tiny
   allreduce tells all ranks which ranks are under preemption notice and their deadlines;
2. if some rank newly got a notice: cancel a background save in flight (a new
   ring cancels one its predecessor left, too); elect the master (lowest rank not leaving) and move the store lease to
   it; write the **emergency sharded checkpoint** with every rank writing its
   share (records gathered by collective, commit by the master before the
   deadline, or abandoned cleanly); broadcast the outcome. Each newly leaving VM
   publishes its leaving record once, with its own notice's deadline, so host
   discovery drops it and Horovod shrinks the ring with no rollback: first, before
   the save (Horovod acts on it only at its next host check), on a background
   thread that retries it until that deadline, so the leave depends neither on the
   save nor on one store call. With ``leave="near_deadline"`` the record carries a
   ``leave_at`` (the VM's deadline less ``leave_lead_s``): discovery keeps the host
   until then, and the VM trains on through its window (the survivors hold the whole
   state, so nothing is rolled back when it goes); a notice to every host of the ring
   leaves at once, as the checkpoint is then all that counts;
3. otherwise, every ``save_every_steps`` steps, start a periodic asynchronous
   sharded checkpoint (the caller only pays for the host-memory snapshot).

No rank raises between two collectives: a failure on one rank (its snapshot, its share,
the master's look at the store) becomes an outcome that every rank learns from the next
collective (a failed save in the outcome broadcast, an error in a broadcast answer), so
the other ranks never wait on it until the transport's timeout.

The store is never waited on without bound from the training thread. Between notices the
protocol makes no store call there (events, the stop poll and the pruning of expired leaving
records run in the background; a lease move at a ring's start is bounded by
``LEASE_MOVE_TIMEOUT_S``). Inside a notice, one deadline covers every store call on its path:
the lease moves at the election, the save, and the durable events, which get only a small
share of it each (best effort).
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from ckpt_service.deadline import Deadline
from ckpt_service.errors import BadSnapshotError, CheckpointError
from ckpt_service.lease import Lease
from ckpt_service.manager import CheckpointManager, CommitConflictError, ShareSnapshot
from ckpt_service.manifest import checked_metadata
from hvd_transient.core.config import (
    DEFAULT_LEAVE_LEAD_S,
    FINAL_SAVE_CHECK_TIMEOUT_S,
    HOUSEKEEPING_TIMEOUT_S,
    LEASE_MOVE_TIMEOUT_S,
    LEAVE_EVENT_WAIT_S,
    LEAVE_FLUSH_MAX_S,
    LEAVE_MODES,
    NOTICE_EVENT_SHARE,
    LeaveConfigError,
    TransientConfig,
)
from hvd_transient.core.control import StopPoller
from hvd_transient.core.election import (
    NoticeRound,
    decode_notice,
    elect_master,
    encode_notice,
    steps_until_next_check,
)
from hvd_transient.core.hostname import default_host
from hvd_transient.core.interfaces import Clocks, Collectives, NoticeSource, configured_watcher
from hvd_transient.core.membership import prune_leaving, publish_leaving_until
from hvd_transient.core.ring import RunState, move_lease, ring_id
from hvd_transient.gcp.metadata import GCE_NOTICE_WINDOW_S
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import EventLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutcome:
    emergency_step: int | None = None   # step of an emergency checkpoint taken at this boundary
    committed: bool = False             # whether it committed
    leaving: bool = False               # this rank is leaving the job
    departure_pending: bool = False     # some rank published itself as leaving
    stop: bool = False                  # the operator asked the job to stop (every rank agrees)
    leave_at: float | None = None       # this leaving rank stays in the ring until then (near_deadline)


class TransientImpl:
    def __init__(self, config: TransientConfig, collectives: Collectives, *, host: str | None = None,
                 watcher: NoticeSource | None = None, manager: CheckpointManager | None = None,
                 events: EventLog | None = None, clocks: Clocks = Clocks()) -> None:
        self.config = config
        self.clocks = clocks
        self.comm = collectives
        self.host = host or default_host()
        self._owns_manager = manager is None  # close() closes only a manager made here
        self.manager = manager or CheckpointManager(
            config.store, max_to_keep=config.max_to_keep, keep_every_n_steps=config.keep_every_n_steps,
            gather_timeout_s=config.async_gather_timeout_s)
        self.events = events or EventLog(self.manager.store, self.host)
        self.lease = Lease(self.manager.store, f"{self.host}:{os.getpid()}")
        self.watcher: NoticeSource | None = watcher if watcher is not None else configured_watcher(config, self.host)
        self.run = RunState()
        self.stop_poller = StopPoller(self.manager.store)
        self.notice_rounds = 0  # notice collectives run so far (benchmarks count them)
        self._notice_logged = False
        self._warning_logged = False
        self._warning_handled = False  # a committed checkpoint answered this rank's early warning
        self._warning_save_step: int | None = None  # a save started after the warning, outcome not yet known
        self._closed = False
        # The latest step this rank knows committed (the coordinator learns a background save's
        # commit on its thread); the master shares it in the notice round.
        self._commit_lock = threading.Lock()
        self._committed_step: int | None = None
        self._async_outcome_pending = False  # a background save's on_done has not run yet
        # Store calls the training thread must not wait for: this VM's leaving record (retried
        # until its deadline), pruning expired records; made on first use.
        self._background: ThreadPoolExecutor | None = None
        self._background_lock = threading.Lock()
        self._stopping = threading.Event()  # close(): background retries end
        self.pruning: Future[None] | None = None  # the latest pruning of expired leaving records
        self._leaving_record: _LeavingRecord | None = None
        self.publishing: Future[None] | None = None  # the background write of this VM's leaving record
        self._leaving_until: float | None = None  # when this rank's VM is gone (epoch seconds)
        if self.watcher is not None:
            self.watcher.start()

    # ----------------------------------------------------------------- lifecycle

    def begin(self, step: int) -> None:
        """Every rank, each time training (re)starts on a new ring: learn the ring, elect, take the lease."""
        rank, size = self.comm.rank(), self.comm.size()
        # A background save of the previous ring may wait for a member that is gone (its gather,
        # up to async_gather_timeout_s), and every save and emergency would wait behind it.
        if self.manager.cancel_inflight(f"a new ring began at step {step}"):
            self.events.emit(ev.InflightCancelled(step=step, reason="new_ring"))
        # Each member says itself whether it is leaving: a VM that left and came back under the same
        # name runs a new process that is not, whatever the survivors remember, and every rank must
        # take the same view (it decides the master and which steps run a collective).
        # A fresh token per member and begin() makes the ring's id new even when the same hosts
        # replay the same steps after a reset or a relaunch: its saves get attempt ids of their own.
        members = self.comm.allgather_json([self.host, self.run.leaving, secrets.token_hex(8)])
        previous_master = self.run.start_ring(step, members, now=self.clocks.monotonic())
        move_lease(self.lease, self.events, take=rank == self.run.master,
                   until=self.clocks.wall() + LEASE_MOVE_TIMEOUT_S)
        if rank == self.run.master:
            self._prune_leaving()
        self.events.emit(ev.Ring(step=step, rank=rank, size=size, master=self.run.master,
                                 master_host=self.run.hosts[self.run.master], previous_master=previous_master,
                                 lease_generation=self.lease.generation if rank == self.run.master else None,
                                 ring=self.run.ring_id, hosts=tuple(self.run.hosts)))

    def _prune_leaving(self) -> None:
        """Delete leaving records whose VM is gone by now (discovery already ignores them), in the
        background with every call bounded: a ring's start must not wait on a slow store."""
        if self.pruning is not None and not self.pruning.done():
            return  # the previous ring's pruning is still at it
        store = self.manager.store

        def prune() -> None:
            try:
                pruned = prune_leaving(store.within(Deadline(time.time() + HOUSEKEEPING_TIMEOUT_S, margin_s=0.0)))
            except Exception as exc:  # housekeeping: an unreachable store must not stop training
                log.warning("could not prune expired leaving records: %s", exc)
                return
            if pruned:
                self.events.emit(ev.LeavingPruned(hosts=tuple(sorted(pruned))))

        self.pruning = self._submit(prune)

    def _submit(self, fn: Callable[[], Any]) -> "Future[Any]":
        """Run ``fn`` on this object's background threads (made on first use)."""
        with self._background_lock:
            if self._background is None:
                self._background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hvdt-membership")
            return self._background.submit(fn)

    def note_reset(self, step_after: int) -> int:
        """Record a reset (called on every rank); returns how many steps were rolled back."""
        rolled_back = max(0, self.run.last_step - step_after) if self.run.last_step >= 0 else 0
        self.events.emit(ev.Reset(step=step_after, rolled_back=rolled_back, last_step=self.run.last_step,
                                  last_step_at=self.run.last_step_at))
        self.run.last_step = step_after
        return rolled_back

    def end(self, step: int) -> None:
        """Training finished on this rank: let the background save finish, flush the log."""
        try:
            self.manager.wait(timeout=self.config.async_gather_timeout_s)
        except Exception as exc:  # a failed background save must not fail a finished run
            log.warning("the last background checkpoint did not complete: %s", exc)
        self.events.emit(ev.TrainEnd(step=step))

    def close(self) -> None:
        """Stop the watcher and the stop poller, flush the event log, and close the manager if this
        object made it."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self.stop_poller.close()
        with self._background_lock:
            if self._background is not None:  # every call there is bounded: nothing to wait for
                self._background.shutdown(wait=False, cancel_futures=True)
        try:
            if self.watcher is not None:
                self.watcher.stop()
            self.events.close()
        finally:
            if self._owns_manager:
                try:
                    self.manager.close()  # waits for the background save, and re-raises its error
                except Exception as exc:  # end() has reported it; closing must not fail
                    log.warning("the last background checkpoint did not complete: %s", exc)

    def final_save_needed(self, step: int) -> bool:
        """Every rank: whether a final save of ``step`` is needed; the master's view of the store decides.

        Only the master reads the store, and every rank gets its answer from one broadcast, so
        every rank takes the same branch. If the master cannot read the store, the error is
        broadcast instead and every rank answers True: a save of a step that is already
        committed is reported as skipped, and one the store refuses fails cleanly on every rank.
        """
        master = self.run.master
        answer: dict[str, Any] | None = None
        if self.comm.rank() == master:
            # bounded: the other ranks wait in the broadcast for this look at the store
            try:
                latest = self._submit(self.manager.latest_step).result(timeout=FINAL_SAVE_CHECK_TIMEOUT_S)
                answer = {"needed": latest != step, "error": None}
            except FutureTimeoutError:
                answer = {"needed": True,
                          "error": f"the store did not answer within {FINAL_SAVE_CHECK_TIMEOUT_S:g} s"}
            except Exception as exc:  # shared below, not raised: the other ranks are in the broadcast
                answer = {"needed": True, "error": f"{type(exc).__name__}: {exc}"}
        answer = self.comm.broadcast_json(answer, master, name="final-save")
        assert answer is not None
        if answer["error"] is not None:
            log.warning("the master could not read the latest committed step (%s); saving step %d anyway",
                        answer["error"], step)
        return bool(answer["needed"])

    # ------------------------------------------------------------ step boundary

    def after_step(self, step: int, snapshot: Callable[[], Mapping[str, Any]],
                   metadata: Callable[[], dict[str, Any]],
                   share_snapshot: ShareSnapshot | None = None, *, samples: int | None = None) -> StepOutcome:
        """Every rank, after each optimizer step, with the global step number.

        ``snapshot()`` gives the state's tensors by name, ``metadata()`` the checkpoint
        metadata; both are called only when a save happens. With ``share_snapshot`` (see
        :data:`~ckpt_service.manager.ShareSnapshot`), saves take this rank's share from it and
        ``snapshot()`` only needs to give shapes and dtypes (e.g. TensorSpecs). ``samples``: the
        global sample offset after this step, if the input pipeline tracks one (logged with progress).
        """
        now = self.clocks.monotonic()
        first_after_begin = self.run.begun_at_step is not None and step == self.run.begun_at_step + 1
        if first_after_begin:
            # the first step of a ring also pays for its set-up: it says nothing about the step time
            self.run.slowest_step_s = self.run.ring_slowest_step_s = 0.0
        elif self.run.step_done_at is not None:
            self.run.slowest_step_s = max(self.run.slowest_step_s, now - self.run.step_done_at)
        try:
            return self._after_step(step, snapshot, metadata, share_snapshot, samples, first_after_begin)
        finally:
            # a step is timed from here: the protocol's own work (rounds, saves) is not the step's
            self.run.step_done_at = self.clocks.monotonic()

    def _after_step(self, step: int, snapshot: Callable[[], Mapping[str, Any]],
                    metadata: Callable[[], dict[str, Any]], share_snapshot: ShareSnapshot | None,
                    samples: int | None, first_after_begin: bool) -> StepOutcome:
        self.run.last_step, self.run.last_step_at = step, self.clocks.wall()
        if first_after_begin:
            self.events.emit(ev.FirstStep(step=step, size=self.comm.size(), samples=samples))
        elif self.config.progress_every_steps and step % self.config.progress_every_steps == 0:
            self.events.emit(ev.Progress(step=step, size=self.comm.size(), samples=samples))
        every = self.config.save_every_steps
        save_due = every is not None and every > 0 and step > 0 and step % every == 0 and not self.run.departure_pending
        if self.config.check_every_steps:
            check_due = step % self.config.check_every_steps == 0
        else:
            check_due = step >= self.run.next_check_step
        if check_due or save_due:
            round_ = self._notice_round(step)
            new = [r for r in round_.leaving if self.run.hosts[r] not in self.run.handled_leavers]
            if new:
                return self._emergency(step, round_, new, snapshot, metadata, share_snapshot)
            if round_.stop:
                self.events.emit(ev.StopRequested(step=step))
                return StepOutcome(stop=True, leaving=self.run.leaving, departure_pending=self.run.departure_pending)
            if round_.early_warning and not round_.busy and not self.run.departure_pending:
                # Some VM is at elevated risk: every rank takes a checkpoint now (in the
                # background, as a periodic one) so a notice that follows finds a recent one.
                # Not while a rank is leaving: it would be a writer, and the ring re-forms soon.
                self._periodic_save(step, snapshot, metadata, share_snapshot, kind="early")
                return StepOutcome(leaving=self.run.leaving, departure_pending=self.run.departure_pending)
            # Every rank takes the same decision: a save starts only if no rank is still busy,
            # so the writers of one step always meet in its gather.
            if save_due and not round_.busy:
                self._periodic_save(step, snapshot, metadata, share_snapshot)
            elif save_due:
                self.events.emit(ev.SaveSkipped(step=step, reason="previous save still in flight"))
        return StepOutcome(leaving=self.run.leaving, departure_pending=self.run.departure_pending)

    def _notice_round(self, step: int) -> NoticeRound:
        now = self.clocks.monotonic()
        elapsed, steps = now - self.run.last_round_at, step - self.run.last_round_step
        slowest, self.run.slowest_step_s = self.run.slowest_step_s, 0.0
        self.run.last_round_step, self.run.last_round_at = step, now
        notice = self.watcher.notice if self.watcher is not None else None
        rank, size = self.comm.rank(), self.comm.size()
        if notice is not None and self.host not in self.run.handled_leavers:
            if not self.run.leaving and not self._notice_logged:
                self._notice_logged = True
                # inside the notice already: its write waits only a share of the window (best effort)
                self.events.emit(ev.Notice(source=notice.source, reason=notice.reason,
                                           detected_at=notice.detected_at, deadline=notice.deadline),
                                 wait_s=None if notice.deadline is None else self._notice_event_wait_s(
                                     notice.deadline - self.config.leave_margin_s))
        deadline = notice.deadline if notice is not None else None
        warned = self._warning_pending()
        if warned and not self._warning_logged:
            self._warning_logged = True
            warning = self.watcher.warning if self.watcher is not None else None
            if warning is not None:
                self.events.emit(ev.EarlyWarning(source=warning.source, reason=warning.reason,
                                                 detected_at=warning.detected_at))
        # busy before the committed step: once a background save's outcome is in, busy reads
        # False only after the step it committed was recorded
        busy = self.manager.save_in_flight or self._async_outcome_pending
        committed = self._committed_step if rank == self.run.master else None
        summed = self.comm.allreduce_sum(
            encode_notice(rank, size, deadline, self._stop_requested(), busy, elapsed, warned,
                          slowest_step_s=slowest, committed_step=committed), name="notice")
        round_ = decode_notice(summed, size, self.run.hosts if len(self.run.hosts) == size else None)
        self.notice_rounds += 1
        self._settle_warning(round_)
        # Every rank got the same sum, so every rank picks the same next check step.
        self.run.ring_slowest_step_s = max(self.run.ring_slowest_step_s, round_.slowest_step_s)
        self.run.next_check_step = step + steps_until_next_check(
            round_.elapsed_s, steps, self.config.check_interval_s, self.config.max_check_every_steps,
            slowest_step_s=round_.slowest_step_s, ring_slowest_step_s=self.run.ring_slowest_step_s,
            allowance=self.config.check_slowdown_allowance)
        return round_

    def _warning_pending(self) -> bool:
        """This rank's watcher has an early warning that no checkpoint has answered or is answering."""
        return (not self._warning_handled and self._warning_save_step is None
                and self.watcher is not None and self.watcher.warning is not None)

    def _warning_save_started(self, step: int) -> None:
        """A save of ``step`` started: it answers this rank's warning if it commits."""
        if self._warning_pending():
            self._warning_save_step = step

    def _settle_warning(self, round_: NoticeRound) -> None:
        """Learn from the round whether the save answering this rank's warning committed.

        The master reports the latest step it knows committed; once no rank is busy any more, a
        save that did not get there failed, and the warning is pending again (a later round retries).
        """
        if self._warning_save_step is None:
            return
        if round_.committed_step is not None and round_.committed_step >= self._warning_save_step:
            self._warning_handled, self._warning_save_step = True, None
        elif not round_.busy:
            log.warning("the checkpoint of step %d answering an early warning did not commit; it is retried",
                        self._warning_save_step)
            self._warning_save_step = None

    def _note_committed(self, step: int) -> None:
        with self._commit_lock:
            if self._committed_step is None or step > self._committed_step:
                self._committed_step = step

    def _stop_requested(self) -> bool:
        """The master looks at the store in the background; the collective shares its latest answer."""
        return self.comm.rank() == self.run.master and self.stop_poller.requested

    def _take_snapshot(self, step: int, snapshot: Callable[[], Mapping[str, Any]],
                       metadata: Callable[[], dict[str, Any]]) -> tuple[Mapping[str, Any], dict[str, Any]]:
        """This rank's tensors and metadata for a save; never raises.

        A failure gives tensors that raise BadSnapshotError when the save reads them, so the save
        still reaches its gather with a failed share record and fails on every rank together.
        """
        try:
            tensors, meta = snapshot(), metadata()
            checked_metadata(meta)  # bad metadata fails here, before the save's gather, not after it
            return tensors, meta
        except Exception as exc:
            log.error("could not take the snapshot of step %d: %s", step, exc)
            return _FailedSnapshot(BadSnapshotError(
                f"rank {self.comm.rank()} could not take its snapshot of step {step} "
                f"({type(exc).__name__}: {exc}); the save fails on every rank and the previous checkpoint "
                "stays the latest")), {}

    def _emergency(self, step: int, round_: NoticeRound, new: list[int],
                   snapshot: Callable[[], Mapping[str, Any]], metadata: Callable[[], dict[str, Any]],
                   share_snapshot: ShareSnapshot | None) -> StepOutcome:
        """``new``: the ranks whose notice no earlier round handled.

        Every store call on this path ends by ``deadline`` (the save's): the lease moves and the
        save are bounded by it, and durable events wait for their writes only a small share of
        it. The leaving record, written first, is retried in the background until its own VM's
        deadline.
        """
        rank, size = self.comm.rank(), self.comm.size()
        window = self.config.notice_window_s or GCE_NOTICE_WINDOW_S
        now = self.clocks.wall()
        # Every rank still in the ring writes a share, earlier leavers too: the save must end
        # before the first of them is gone.
        deadline = (round_.deadline or now + window) - self.config.leave_margin_s
        leaving_hosts = [self.run.hosts[r] for r in new]
        was_master = rank == self.run.master
        # One record per VM, written once, by its lowest rank, with its own notice's deadline
        # (not another VM's, nor one written again when a later notice comes in).
        own_deadline = round_.deadline_of(rank) if rank in new else None
        writes_record = rank in new and rank == min(r for r in new if self.run.hosts[r] == self.host)
        leave_at = self._leave_at(round_, own_deadline if own_deadline is not None else now + window, now)
        if writes_record:
            self._start_leaving_record(step, own_deadline, was_master,
                                       until=own_deadline if own_deadline is not None else now + window,
                                       leave_at=leave_at)
        self.events.emit(ev.NoticeAgreed(step=step, leaving=tuple(leaving_hosts), deadline=deadline, size=size),
                         wait_s=self._notice_event_wait_s(deadline))

        # A background save still in flight is cancelled, on every rank: the emergency step
        # supersedes it, and its uploads must not compete with this save's for a slow store
        # (those it already sent end on its own threads; this save uploads on others).
        if self.manager.cancel_inflight(f"an emergency save of step {step} needs the store"):
            self.events.emit(ev.InflightCancelled(step=step, reason="emergency"))

        new_master = elect_master(size, round_.leaving)
        if new_master != self.run.master:
            move_lease(self.lease, self.events, take=rank == new_master, until=deadline)
            self.events.emit(ev.Election(step=step, old_master=self.run.master, new_master=new_master,
                                         old_master_host=self.run.hosts[self.run.master],
                                         new_master_host=self.run.hosts[new_master],
                                         lease_generation=self.lease.generation if rank == new_master else None))
            self.run.master = new_master

        tensors, meta = self._take_snapshot(step, snapshot, metadata)
        self._warning_save_started(step)
        committed = self.save_now(step, tensors, meta, coordinator=new_master, deadline=deadline,
                                  kind="emergency", share_snapshot=share_snapshot)
        self.run.handled_leavers.update(leaving_hosts)
        self.run.departure_pending = True
        if rank in new:
            self.run.leaving = True
            self._leaving_until = own_deadline if own_deadline is not None else now + window
            wait_s = min(LEAVE_EVENT_WAIT_S, self._notice_event_wait_s(self._leaving_until))
            if self._leaving_record is not None and writes_record:
                self._leaving_record.left(wait_s)
            else:  # another rank of this VM writes its record
                self.events.emit(ev.LeavePublished(step=step, deadline=own_deadline, was_master=was_master,
                                                   leave_at=leave_at), wait_s=wait_s)
        return StepOutcome(emergency_step=step, committed=committed, leaving=self.run.leaving,
                           departure_pending=True, leave_at=leave_at if rank in new else None)

    def _leave_at(self, round_: NoticeRound, vm_deadline: float, now: float) -> float | None:
        """When discovery should drop a VM whose window ends at ``vm_deadline``; None: at once.

        ``near_deadline`` only pays while some host of the ring is not under notice: a wave that
        takes every host leaves nobody to carry the state, and the checkpoint is what counts.
        """
        if self.config.leave != "near_deadline":
            return None
        if {self.run.hosts[r] for r in round_.leaving} >= set(self.run.hosts):
            return None
        leave_at = vm_deadline - self.config.leave_lead_s
        return leave_at if leave_at > now else None

    def before_leaving(self) -> threading.Thread:
        """This leaving rank is being reset out of the ring: the process ends inside Horovod soon
        after, with no Python after it, and its events must get out first. The event log's
        writer may be stuck on a slow write, so they are also copied in one write of their own
        (:meth:`EventLog.write_final`, bounded by ``LEAVE_FLUSH_MAX_S`` and the VM's deadline).
        Nothing here waits: Horovod resets the survivors only once this rank has reset too."""
        until = self._leaving_until if self._leaving_until is not None else self.clocks.wall()
        timeout = max(0.0, min(LEAVE_FLUSH_MAX_S, until - self.clocks.wall() - 0.5))
        writer = threading.Thread(target=self.events.write_final, args=(timeout,), name="hvdt-last-events",
                                  daemon=True)  # the process may end before it does
        writer.start()
        return writer

    def _notice_event_wait_s(self, until: float) -> float:
        """How long a durable event inside a notice may wait for its write: a small share of the
        time left before ``until``, so a slow store costs the notice little (best effort)."""
        left = until - self.clocks.wall()
        return min(self.events.durable_wait_s, max(0.0, NOTICE_EVENT_SHARE * left))

    def _start_leaving_record(self, step: int, own_deadline: float | None, was_master: bool, *,
                              until: float, leave_at: float | None = None) -> None:
        """Write this VM's leaving record in the background, retried until ``until`` (its own deadline).

        A record that cannot be written in time is logged: discovery then keeps the host until
        its VM is gone, and Horovod sees its worker fail.
        """
        store, host = self.manager.store, self.host
        instance_id = self.watcher.instance_id if self.watcher is not None else None
        record = self._leaving_record = _LeavingRecord(
            lambda wait_s: self.events.emit(ev.LeavePublished(step=step, deadline=own_deadline,
                                                              was_master=was_master, leave_at=leave_at),
                                            wait_s=wait_s))

        def publish() -> None:
            try:
                publish_leaving_until(store, host, until=until, deadline=own_deadline, instance_id=instance_id,
                                      stop=self._stopping, leave_at=leave_at)
            except Exception as exc:  # every rank already agreed on the departure; nothing may raise
                log.error("could not publish %s as leaving before its deadline: %s; discovery keeps the host "
                          "until its VM is gone", host, exc)
                return
            record.landed()

        self.publishing = self._submit(publish)

    def save_now(self, step: int, tensors: Mapping[str, Any], meta: dict[str, Any], *, coordinator: int,
                  deadline: float | None, kind: str, share_snapshot: ShareSnapshot | None = None) -> bool:
        """Synchronous sharded save on every rank; returns (on every rank) whether the step is committed.

        A step that an earlier save already committed counts as committed (reported as skipped).
        """
        rank, size = self.comm.rank(), self.comm.size()
        attempt = self.run.next_attempt(step)
        self.events.emit(ev.SaveStart(step=step, kind=kind, size=size))
        t0 = self.clocks.monotonic()
        error, already = None, False
        try:
            self.manager.save(step, tensors, meta, rank=rank, world_size=size,
                              gather=self.comm.allgather_json, coordinator=coordinator,
                              lease=self.lease if rank == coordinator else None, deadline=deadline,
                              snapshot=share_snapshot, attempt=attempt)
        except CommitConflictError:
            already = True  # the step is already durable (a periodic save of the same step got there first)
        except Exception as exc:  # reported below; training goes on either way
            error = f"{type(exc).__name__}: {exc}"
        stats = self.manager.last_stats
        outcome = self.comm.broadcast_json({"ok": error is None, "error": error, "already": already},
                                           coordinator, name="save-outcome")
        self.events.emit(ev.SaveEnd(step=step, kind=kind, seconds=self.clocks.monotonic() - t0,
                                    bytes=stats.bytes_written if stats and stats.step == step else 0))
        if outcome["ok"]:
            self._note_committed(step)
            if outcome["already"]:  # this save wrote no commit: say so, not that it committed
                self.events.emit(ev.SaveSkipped(step=step, reason="already committed"))
            elif rank == coordinator:
                self.events.emit(ev.Commit(step=step, kind=kind, size=size, lease_generation=self.lease.generation))
        else:
            self.events.emit(ev.SaveFailed(step=step, kind=kind, error=outcome["error"]))
        return bool(outcome["ok"])

    def _periodic_save(self, step: int, snapshot: Callable[[], Mapping[str, Any]],
                       metadata: Callable[[], dict[str, Any]], share_snapshot: ShareSnapshot | None,
                       kind: str = "periodic") -> None:
        """Start a background save of ``step`` on every rank (all agreed that no rank is busy).

        Never raises: a rank whose snapshot or share fails reports it to the save's gather, so the
        coordinator abandons the step, and the failure is logged here; the ranks learn at the next
        round (through the committed step the master reports) that it did not commit.
        """
        rank, size = self.comm.rank(), self.comm.size()
        master = self.run.master
        attempt = self.run.next_attempt(step)
        t0 = time.perf_counter()
        def done(manifest: Any, error: BaseException | None) -> None:
            try:
                if isinstance(error, CommitConflictError):
                    # After a rollback the ring replays steps; this one is already durable.
                    self._note_committed(step)
                    self.events.emit(ev.SaveSkipped(step=step, reason="already committed"))
                elif error is not None:
                    self.events.emit(ev.SaveFailed(step=step, kind=kind, error=f"{type(error).__name__}: {error}"))
                elif manifest is not None:  # the coordinator
                    self._note_committed(step)
                    self.events.emit(ev.Commit(step=step, kind=kind, size=size, bytes=manifest.nbytes,
                                               lease_generation=manifest.lease_generation))
            finally:
                self._async_outcome_pending = False

        tensors, meta = self._take_snapshot(step, snapshot, metadata)
        self._warning_save_started(step)
        self._async_outcome_pending = True
        try:
            started = self.manager.save_async(
                step, tensors, meta, rank=rank, world_size=size, coordinator=master,
                lease=self.lease if rank == master else None, if_busy="wait",  # not busy: agreed above
                on_done=done, snapshot=share_snapshot, attempt=attempt)
        except Exception as exc:  # this rank's share failed; the save's gather has its error record
            self._async_outcome_pending = False
            self.events.emit(ev.SaveFailed(step=step, kind=kind, error=f"{type(exc).__name__}: {exc}"))
            return
        if not started:
            self._async_outcome_pending = False
        if started:
            self.events.emit(ev.AsyncSave(step=step, stall_ms=(time.perf_counter() - t0) * 1e3, size=size,
                                          kind=None if kind == "periodic" else kind))




__all__ = ["CheckpointError", "Clocks", "Collectives", "DEFAULT_LEAVE_LEAD_S", "FINAL_SAVE_CHECK_TIMEOUT_S",
           "HOUSEKEEPING_TIMEOUT_S", "LEASE_MOVE_TIMEOUT_S", "LEAVE_EVENT_WAIT_S", "LEAVE_FLUSH_MAX_S", "LEAVE_MODES",
           "LeaveConfigError", "NOTICE_EVENT_SHARE", "NoticeSource", "StepOutcome", "TransientConfig", "TransientImpl",
           "default_host", "ring_id"]


class _LeavingRecord:
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

    def left(self, wait_s: float) -> None:
        """The emergency is over; a record still being written gets up to ``wait_s`` to land first."""
        self._landed.wait(wait_s)
        with self._lock:
            self._left = True
            now = self._landed.is_set()
        if now:
            self._log_it(wait_s)


class _FailedSnapshot(Mapping[str, Any]):
    """The tensors of a rank whose snapshot failed: reading them raises the failure.

    Handed to the save like any tensors, so the save reaches its gather with this rank's
    failed share record and the coordinator abandons the step for every rank.
    """

    def __init__(self, error: BadSnapshotError) -> None:
        self.error = error

    def __getitem__(self, name: str) -> Any:
        raise self.error

    def __iter__(self) -> Iterator[str]:
        raise self.error

    def __len__(self) -> int:
        raise self.error
