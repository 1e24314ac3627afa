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

The modules, in the order a notice flows through them: :mod:`~hvd_transient.core.interfaces`
(the watcher, the collectives and the clocks the protocol is given),
:mod:`~hvd_transient.core.notice_round` (one round of agreement across ranks),
:mod:`~hvd_transient.core.emergency` (the emergency save and the election),
:mod:`~hvd_transient.core.leaving` (the leave), with :mod:`~hvd_transient.core.saves` (every save),
:mod:`~hvd_transient.core.ring` (the ring's state and its master's lease) and
:mod:`~hvd_transient.core.config` (the settings and time bounds). This module holds the step loop.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
from concurrent.futures import Future
from typing import Any, Callable, Mapping

from ckpt_service.errors import CheckpointError
from ckpt_service.lease import Lease
from ckpt_service.manager import CheckpointManager, ShareSnapshot
from hvd_transient.core.background import BackgroundCalls
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
from hvd_transient.core.election import NoticeRound
from hvd_transient.core.emergency import Emergency
from hvd_transient.core.hostname import default_host, host_names
from hvd_transient.core.interfaces import Clocks, Collectives, HostUpdates, NoticeSource, configured_watcher
from hvd_transient.core.leave_plan import (
    LOST_REMOVAL_AFTER_S,
    after_announcing,
    announces_said,
    departures_said,
    lost_removals,
    record_writer,
)
from hvd_transient.core.leaving import Departure, prune_expired
from hvd_transient.core.notice_round import EarlyWarnings, NoticeRounds, StepOutcome
from hvd_transient.core.ring import RunState, move_lease, ring_id
from hvd_transient.core.saves import Saves
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import EventLog

log = logging.getLogger(__name__)


class TransientImpl:
    """One rank's protocol: :meth:`begin` on each new ring, :meth:`after_step` at every step boundary,
    :meth:`end` and :meth:`close` when training is over."""

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
        #: the framework's host updates (set by the frontend; None: a static job, or none to look at)
        self.host_updates: HostUpdates | None = None
        self.stop_poller = StopPoller(self.manager.store)
        self._closed = False
        # Store calls the training thread must not wait for: this VM's leaving record (retried
        # until its deadline), pruning expired records; made on first use.
        self._background = BackgroundCalls()
        self.pruning: Future[None] | None = None  # the latest pruning of expired leaving records
        # The collaborators read this object's parts (comm, config, run...) on each use.
        self._warnings = EarlyWarnings(self)
        self._saves = Saves(self, self._background, on_save_started=self._warnings.save_started)
        self._rounds = NoticeRounds(self, self._warnings, self._saves, self.stop_poller)
        self._departure = Departure(self, self._background)
        self._rounds.record_landed = lambda: self._departure.record_landed
        self._emergency = Emergency(self, self._saves, self._warnings, self._departure)
        if self.watcher is not None:
            self.watcher.start()

    @property
    def notice_rounds(self) -> int:
        """Notice collectives run so far (benchmarks count them)."""
        return self._rounds.count

    @property
    def publishing(self) -> "Future[None] | None":
        """The background write of this VM's leaving record."""
        return self._departure.publishing

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
        # Each also says every name its VM goes by: rank 0 tells a VM that joined from one that did not
        # (hvd_transient/frontend/lost_joins.py) where discovery lists VMs by another name than their own.
        instance_id = getattr(self.watcher, "instance_id", None)
        # And what it remembers of removals rank 0 announced, and of the VMs under notice (their due, landed and
        # leave times): a new rank 0, or a newcomer, learns the count and the times the rounds agreed before it came.
        members = self.comm.allgather_json([self.host, self.run.leaving, secrets.token_hex(8), host_names(self.host),
                                            instance_id if isinstance(instance_id, str) else None, self.clocks.wall(),
                                            announces_said(self.run.removals_announced),
                                            departures_said(self.run.due_at_of, self.run.landed_at_of,
                                                            self.run.leave_at_of)])
        previous_master = self.run.start_ring(step, members, now=self.clocks.monotonic(), wall=self.clocks.wall())
        for host, seconds in self.run.time_departures(self.clocks.wall()).items():
            log.info("%s left %.1f s after its leave_at; the next VM under notice leaves %.1f s before its deadline",
                     host, seconds, self.config.lead_s(self.run.departure_s))
        self._rounds.ring_began()
        move_lease(self.lease, self.events, take=rank == self.run.master,
                   until=self.clocks.wall() + LEASE_MOVE_TIMEOUT_S)
        if rank == self.run.master:
            self.pruning = prune_expired(self._background, self.manager.store, self.events, self.pruning)
        self.events.emit(ev.Ring(step=step, rank=rank, size=size, master=self.run.master,
                                 master_host=self.run.hosts[self.run.master], previous_master=previous_master,
                                 lease_generation=self.lease.generation if rank == self.run.master else None,
                                 ring=self.run.ring_id, hosts=tuple(self.run.hosts)))

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
        self._background.stopping.set()
        self.stop_poller.close()
        self._background.shutdown()  # every call there is bounded: nothing to wait for
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
        """Every rank: whether a final save of ``step`` is needed; the master's view of the store decides
        (see :meth:`~hvd_transient.core.saves.Saves.final_save_needed`)."""
        return self._saves.final_save_needed(step)

    def save_now(self, step: int, tensors: Mapping[str, Any], meta: dict[str, Any], *, coordinator: int,
                 deadline: float | None, kind: str, share_snapshot: ShareSnapshot | None = None) -> bool:
        """Synchronous sharded save on every rank; returns (on every rank) whether the step is committed.

        A step that an earlier save already committed counts as committed (reported as skipped).
        """
        return self._saves.save_now(step, tensors, meta, coordinator=coordinator, deadline=deadline, kind=kind,
                                    share_snapshot=share_snapshot)

    def before_leaving(self) -> threading.Thread:
        """This leaving rank is being reset out of the ring: copy its events out on a thread of their own
        (see :meth:`~hvd_transient.core.leaving.Departure.before_leaving`); nothing here waits."""
        return self._departure.before_leaving()

    # ------------------------------------------------------------ step boundary

    def before_step(self) -> None:
        """Optional, as training goes on after time that is no step (an evaluation, an epoch's end): the
        next step is timed from here, not from the previous :meth:`after_step`. Counted as a step, such a
        gap would pin the check cadence at every step for the rest of the ring (the slowest step seen bounds
        it). Not before every step: what the loop does between its steps (other callbacks, the input) is
        part of the step time that the cadence's bound in seconds rests on. One clock read.

        The gap is kept apart (``longest_gap_s``): a VM under notice cannot leave inside it, so the lead
        covers the longest gap timed, as it covers the slowest step (before any was timed, a frontend that
        says where its epochs end keeps a VM from training across one: ``run.epoch_left_steps``; see
        docs/reliability.md)."""
        now, run = self.clocks.monotonic(), self.run
        if run.step_done_at is not None:
            run.longest_gap_s = max(run.longest_gap_s, now - run.step_done_at)
        run.step_done_at = now

    def plain_step(self, step: int) -> bool:
        """Whether :meth:`after_step` at ``step`` takes the plain path: no round, save, host check or
        event (pure: from this ring's agreed state and the config). A frontend may count such steps
        instead of reading them exactly (:mod:`hvd_transient.frontend.step_counter`)."""
        run, cfg = self.run, self.config
        if run.departure_pending or run.begun_at_step is None or step <= run.begun_at_step + 1:
            return False
        if any(_reaches(every, run.last_step, step)
               for every in (cfg.progress_every_steps, cfg.save_every_steps, cfg.check_every_steps)):
            return False
        return cfg.check_every_steps is not None or step < run.next_check_step

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
            took = now - self.run.step_done_at
            self.run.slowest_step_s = max(self.run.slowest_step_s, took)
            self.run.job_slowest_step_s = max(self.run.job_slowest_step_s or 0.0, took)
        try:
            return self._after_step(step, snapshot, metadata, share_snapshot, samples, first_after_begin)
        finally:
            # a step is timed from here: the protocol's own work (rounds, saves) is not the step's
            self.run.step_done_at = self.clocks.monotonic()

    def _after_step(self, step: int, snapshot: Callable[[], Mapping[str, Any]],
                    metadata: Callable[[], dict[str, Any]], share_snapshot: ShareSnapshot | None,
                    samples: int | None, first_after_begin: bool) -> StepOutcome:
        previous = self.run.last_step
        self.run.last_step, self.run.last_step_at = step, self.clocks.wall()
        if first_after_begin:
            self.events.emit(ev.FirstStep(step=step, size=self.comm.size(), samples=samples))
        elif _reaches(self.config.progress_every_steps, previous, step):
            self.events.emit(ev.Progress(step=step, size=self.comm.size(), samples=samples))
        save_due = (step > 0 and _reaches(self.config.save_every_steps, previous, step)
                    and not self.run.departure_pending)
        if self.config.check_every_steps:
            check_due = _reaches(self.config.check_every_steps, previous, step)
        else:
            check_due = step >= self.run.next_check_step
        if check_due or save_due:
            round_ = self._rounds.agree(step)
            # This step's round is agreed, so a safe step for the host check: where a host update is pending
            # (a join, or discovery dropping a VM), or a departure is due. A VM that trains on to its leave_at
            # is not dropped before it: checking for it at every round of its window found nothing.
            check_hosts = round_.hosts_changed or (self.run.departure_pending and not self._departures_wait())
            new = [r for r in round_.leaving if self.run.hosts[r] not in self.run.handled_leavers]
            self._note_landed(round_)
            if new:
                return self._emergency.handle(step, round_, new, snapshot, metadata, share_snapshot)
            if self.run.leave_at_of:  # VMs under notice train on in this ring: their leave may have to come sooner
                self._emergency.replan(step, round_)
            self._announce_lost_removals(round_)
            if round_.stop:
                self.events.emit(ev.StopRequested(step=step))
                return StepOutcome(stop=True, leaving=self.run.leaving, departure_pending=self.run.departure_pending,
                                   check_hosts=check_hosts)
            if round_.early_warning and not round_.busy and not self.run.departure_pending:
                # Some VM is at elevated risk: every rank takes a checkpoint now (in the
                # background, as a periodic one) so a notice that follows finds a recent one.
                # Not while a rank is leaving: it would be a writer, and the ring re-forms soon.
                self._saves.start_background(step, snapshot, metadata, share_snapshot, kind="early")
                return StepOutcome(leaving=self.run.leaving, departure_pending=self.run.departure_pending,
                                   check_hosts=check_hosts)
            # Every rank takes the same decision: a save starts only if no rank is still busy,
            # so the writers of one step always meet in its gather.
            if save_due and not round_.busy:
                self._saves.start_background(step, snapshot, metadata, share_snapshot)
            elif save_due:
                self.events.emit(ev.SaveSkipped(step=step, reason="previous save still in flight"))
            return StepOutcome(leaving=self.run.leaving, departure_pending=self.run.departure_pending,
                               check_hosts=check_hosts)
        # a departure at once is looked for at every step; one that waits for its leave_at, at the rounds
        return StepOutcome(leaving=self.run.leaving, departure_pending=self.run.departure_pending,
                           check_hosts=self.run.departure_pending and not self._departures_wait())

    def _announce_lost_removals(self, round_: NoticeRound) -> None:
        """A VM under notice still in the ring ``LOST_REMOVAL_AFTER_S`` past both the time it was due to leave
        and the round that found its leaving record in the store, as this round agrees, means the driver's one
        message of its removal was lost (it came while the ring re-formed). Rank 0 (whose host updates
        Horovod's check broadcasts) announces the removal to its own host check (at most twice per VM and due
        time: :func:`lost_removals`), so the check that runs at every step while the departure is due resets
        the ring, and the driver forms the new one without the VM. Every rank keeps the count (from the round
        alone: the same everywhere), so a new rank 0 goes on from it."""
        run = self.run
        if self.host_updates is None or not run.departure_pending:
            return
        # never later than half what the lead keeps for leaving (a short leave_lead_s), so the reset fits
        after = min(LOST_REMOVAL_AFTER_S, self.config.departure_allowance_s(run.departure_s) / 2)
        lost = lost_removals(run.due_at_of, run.landed_at_of, run.hosts, run.removals_announced,
                             round_.at or self.clocks.wall(), ring=run.ring_id, ring_began_at=run.ring_began_wall,
                             after_s=after)
        if lost:
            run.removals_announced = after_announcing(run.removals_announced, lost, run.due_at_of, ring=run.ring_id)
            if self.comm.rank() != 0:
                return
            log.warning("%s should have left the ring by now (Horovod's driver told no rank it was dropped): "
                        "the ring resets without it", ", ".join(lost))
            self.events.emit(ev.HostUpdateAnnounced(change=ev.ANNOUNCED_REMOVAL, hosts=tuple(lost)))
            self.host_updates.announce_removal(lost)

    def _note_landed(self, round_: NoticeRound) -> None:
        """Every rank, at a round: the VMs under notice whose leaving record this round found in the store
        (agreed), from when discovery can drop them. Only the rank that writes the VM's record now (its lowest
        rank under notice) is heard: another process of the VM may still say its own, older version landed."""
        hosts = self.run.hosts
        for r in round_.records_landed:
            host = hosts[r] if r < len(hosts) else None
            if host is None or host not in self.run.due_at_of or host in self.run.landed_at_of:
                continue
            if r == record_writer(hosts, (*round_.leaving, r), host):
                self.run.landed_at_of[host] = round_.at or self.clocks.wall()

    def _departures_wait(self) -> bool:
        """Every pending departure waits for its ``leave_at``, so Horovod's host check (a collective) can
        wait for the next notice round. Agreed: from the mode and this ring's hosts handled as leaving (the
        set only grows until the ring re-forms) and the latest round (whose clock every rank shares), never
        from a rank's own clock, which could split the ranks."""
        return (self.config.trains_through(self.run.hosts, self.run.handled_leavers & set(self.run.hosts))
                and not self._rounds.departures_due)


def _reaches(every: int | None, previous: int | None, step: int) -> bool:
    """Whether the steps after ``previous`` up to ``step`` reach a multiple of ``every`` (pure): a
    frontend may hand several steps at once (Keras's ``steps_per_execution``), and a cadence must not
    be stepped over."""
    if not every:
        return False
    if previous is None or step <= previous:
        return step % every == 0
    return step // every > previous // every


# The names this module held before its parts moved out; users import them from here.
__all__ = ["CheckpointError", "Clocks", "Collectives", "DEFAULT_LEAVE_LEAD_S", "FINAL_SAVE_CHECK_TIMEOUT_S",
           "HOUSEKEEPING_TIMEOUT_S", "LEASE_MOVE_TIMEOUT_S", "LEAVE_EVENT_WAIT_S", "LEAVE_FLUSH_MAX_S", "LEAVE_MODES",
           "LeaveConfigError", "NOTICE_EVENT_SHARE", "NoticeSource", "StepOutcome", "TransientConfig", "TransientImpl",
           "default_host", "ring_id"]
