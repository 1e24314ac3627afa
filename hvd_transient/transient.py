"""The framework-free heart of preemption-safe training (Keras, custom loops, static jobs).

:class:`TransientImpl` is driven at step boundaries by a thin framework layer
(``hvd_transient.keras``) and talks to the other ranks only through a
:class:`Collectives` object, so its logic runs the same under Horovod and under
the in-process fakes of the unit tests.

Per step boundary, on every rank, in the same order:

1. about once per ``check_interval_s`` (the step count adapts to the step rate all
   ranks measured; or every ``check_every_steps`` steps if set), one tiny allreduce
   tells all ranks which ranks are under preemption notice and the earliest deadline;
2. if some rank newly got a notice: wait (bounded) for an in-flight background
   save; elect the master (lowest rank not leaving) and move the store lease to
   it; write the **emergency sharded checkpoint** with every rank writing its
   share (records gathered by collective, commit by the master before the
   deadline, or abandoned cleanly); broadcast the outcome; the leaving ranks
   publish themselves as leaving, so host discovery drops them and Horovod
   shrinks the ring with no rollback;
3. otherwise, every ``save_every_steps`` steps, start a periodic asynchronous
   sharded checkpoint (the caller only pays for the host-memory snapshot).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import numpy as np

from ckpt_service.errors import CheckpointError
from ckpt_service.lease import Lease
from ckpt_service.manager import CheckpointManager, CommitConflictError, ShareSnapshot
from hvd_transient import event_schema as ev
from hvd_transient.control import StopPoller
from hvd_transient.election import NoticeRound, decode_notice, elect_master, encode_notice, steps_until_next_check
from hvd_transient.events import EventLog
from hvd_transient.membership import prune_leaving, publish_leaving

if TYPE_CHECKING:
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
    """The few collectives the protocol needs; every rank calls each one in the same order."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def allreduce_sum(self, values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]: ...

    def allgather_json(self, obj: Any) -> list[Any]: ...

    def broadcast_json(self, obj: Any, root: int) -> Any: ...


#: the shortest notice a cloud gives (GCE Spot default), for a notice without a deadline
DEFAULT_NOTICE_WINDOW_S = 30.0


@dataclass(frozen=True)
class TransientConfig:
    store: str
    save_every_steps: int | None = 500
    #: notice collective every N steps; None: adaptive, about once per ``check_interval_s``
    check_every_steps: int | None = None
    check_interval_s: float = 1.0
    max_check_every_steps: int = 1000
    #: how long a notice gives when the notice itself carries no deadline; None: what the VM is
    #: configured with (GCE: ``cluster up --preemption-notice-duration``, else 30 s)
    notice_window_s: float | None = None
    #: seconds of the window kept for leaving the ring after the emergency commit
    leave_margin_s: float = 5.0
    watcher: str = "auto"
    max_to_keep: int | None = 3
    keep_every_n_steps: int | None = None
    async_gather_timeout_s: float = 300.0
    lr_scaling: str = "linear"
    base_lr: float | None = None
    progress_every_steps: int = 10

    def __post_init__(self) -> None:
        if self.check_every_steps is not None and self.check_every_steps < 1:
            raise ValueError(f"check_every_steps must be None (adaptive) or at least 1, not {self.check_every_steps}")
        if not self.check_interval_s > 0:
            raise ValueError(f"check_interval_s must be positive, not {self.check_interval_s}")
        if self.max_check_every_steps < 1:
            raise ValueError(f"max_check_every_steps must be at least 1, not {self.max_check_every_steps}")


@dataclass(frozen=True)
class StepOutcome:
    emergency_step: int | None = None   # step of an emergency checkpoint taken at this boundary
    committed: bool = False             # whether it committed
    leaving: bool = False               # this rank is leaving the job
    departure_pending: bool = False     # some rank published itself as leaving
    stop: bool = False                  # the operator asked the job to stop (every rank agrees)


@dataclass
class _RunState:
    master: int = 0
    hosts: list[str] = field(default_factory=list)
    handled_leavers: set[str] = field(default_factory=set)
    departure_pending: bool = False
    leaving: bool = False
    last_step: int = -1
    last_step_at: float | None = None   # wall time the last step completed on this rank
    begun_at_step: int | None = None
    next_check_step: int = 0            # adaptive cadence: the next step with a notice round
    last_round_step: int = 0
    last_round_at: float = 0.0          # time.monotonic() of this rank's previous round


def default_host() -> str:
    """The host name Horovod assigned this worker (one alias per slot locally), else the real one."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


@dataclass(frozen=True)
class Clocks:
    """The two clocks of the protocol, injected together: ``monotonic`` measures intervals (the
    step rate, the stop-poll cadence), ``wall`` is Unix time, in which notice deadlines are given."""

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


class TransientImpl:
    def __init__(self, config: TransientConfig, collectives: Collectives, *, host: str | None = None,
                 watcher: NoticeSource | None = None, manager: CheckpointManager | None = None,
                 events: EventLog | None = None, clocks: Clocks = Clocks()) -> None:
        self.config = config
        self.clocks = clocks
        self.comm = collectives
        self.host = host or default_host()
        self.manager = manager or CheckpointManager(
            config.store, max_to_keep=config.max_to_keep, keep_every_n_steps=config.keep_every_n_steps,
            gather_timeout_s=config.async_gather_timeout_s)
        self.events = events or EventLog(self.manager.store, self.host)
        self.lease = Lease(self.manager.store, f"{self.host}:{os.getpid()}")
        self.watcher: NoticeSource | None = watcher if watcher is not None else _make_watcher(config, self.host)
        self.run = _RunState()
        self.stop_poller = StopPoller(self.manager.store)
        self.notice_rounds = 0  # notice collectives run so far (benchmarks count them)
        self._notice_logged = False
        self._warning_logged = False
        self._warning_handled = False  # a checkpoint answered this rank's early warning
        if self.watcher is not None:
            self.watcher.start()

    # ----------------------------------------------------------------- lifecycle

    def begin(self, step: int) -> None:
        """Every rank, each time training (re)starts on a new ring: learn the ring, elect, take the lease."""
        rank, size = self.comm.rank(), self.comm.size()
        # Each member says itself whether it is leaving: a VM that left and came back under the same
        # name runs a new process that is not, whatever the survivors remember, and every rank must
        # take the same view (it decides the master and which steps run a collective).
        members = self.comm.allgather_json([self.host, self.run.leaving])
        self.run.hosts = [str(h) for h, _ in members]
        leaving = [r for r, (_, is_leaving) in enumerate(members) if is_leaving]
        self.run.handled_leavers = ({h for h in self.run.handled_leavers if h not in self.run.hosts}
                                    | {self.run.hosts[r] for r in leaving})
        previous_master = self.run.master if self.run.begun_at_step is not None else None
        self.run.master = elect_master(size, leaving)
        self.run.departure_pending = bool(leaving)
        self.run.begun_at_step = step
        self.run.last_step = step
        # a new ring checks at its first step, then adapts to the step rate it measures
        self.run.next_check_step = step + 1
        self.run.last_round_step, self.run.last_round_at = step, self.clocks.monotonic()
        self._move_lease(self.run.master)
        if rank == self.run.master:
            self._prune_leaving()
        self.events.emit(ev.Ring(step=step, rank=rank, size=size, master=self.run.master,
                                 master_host=self.run.hosts[self.run.master], previous_master=previous_master,
                                 lease_generation=self.lease.generation if rank == self.run.master else None))

    def _prune_leaving(self) -> None:
        """Delete leaving records whose VM is gone by now (discovery already ignores them)."""
        try:
            pruned = prune_leaving(self.manager.store)
        except Exception as exc:  # housekeeping: an unreachable store must not stop training
            log.warning("could not prune expired leaving records: %s", exc)
            return
        if pruned:
            self.events.emit(ev.LeavingPruned(hosts=tuple(sorted(pruned))))

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
        self.stop_poller.close()
        if self.watcher is not None:
            self.watcher.stop()
        self.events.close()

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
        self.run.last_step, self.run.last_step_at = step, self.clocks.wall()
        first_after_begin = self.run.begun_at_step is not None and step == self.run.begun_at_step + 1
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
                return self._emergency(step, round_, snapshot, metadata, share_snapshot)
            if round_.stop:
                self.events.emit(ev.StopRequested(step=step))
                return StepOutcome(stop=True, departure_pending=self.run.departure_pending)
            if round_.early_warning and not round_.busy:
                # Some VM is at elevated risk: every rank takes a checkpoint now (in the
                # background, as a periodic one) so a notice that follows finds a recent one.
                self._periodic_save(step, snapshot, metadata, share_snapshot, kind="early")
                self._warning_handled = self._warning_handled or self._warning_pending()
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
        self.run.last_round_step, self.run.last_round_at = step, now
        notice = self.watcher.notice if self.watcher is not None else None
        rank, size = self.comm.rank(), self.comm.size()
        if notice is not None and self.host not in self.run.handled_leavers:
            if not self.run.leaving and not self._notice_logged:
                self._notice_logged = True
                self.events.emit(ev.Notice(source=notice.source, reason=notice.reason,
                                           detected_at=notice.detected_at, deadline=notice.deadline))
        deadline = notice.deadline if notice is not None else None
        warned = self._warning_pending()
        if warned and not self._warning_logged:
            self._warning_logged = True
            warning = self.watcher.warning if self.watcher is not None else None
            if warning is not None:
                self.events.emit(ev.EarlyWarning(source=warning.source, reason=warning.reason,
                                                 detected_at=warning.detected_at))
        summed = self.comm.allreduce_sum(encode_notice(rank, size, deadline, self._stop_requested(),
                                                       self.manager.save_in_flight, elapsed, warned))
        round_ = decode_notice(summed, size, self.run.hosts if len(self.run.hosts) == size else None)
        self.notice_rounds += 1
        # Every rank got the same sum, so every rank picks the same next check step.
        self.run.next_check_step = step + steps_until_next_check(
            round_.elapsed_s, steps, self.config.check_interval_s, self.config.max_check_every_steps)
        return round_

    def _warning_pending(self) -> bool:
        """This rank's watcher has an early warning no checkpoint has answered yet."""
        return not self._warning_handled and self.watcher is not None and self.watcher.warning is not None

    def _stop_requested(self) -> bool:
        """The master looks at the store in the background; the collective shares its latest answer."""
        return self.comm.rank() == self.run.master and self.stop_poller.requested

    def _emergency(self, step: int, round_: NoticeRound, snapshot: Callable[[], Mapping[str, Any]],
                   metadata: Callable[[], dict[str, Any]], share_snapshot: ShareSnapshot | None) -> StepOutcome:
        rank, size = self.comm.rank(), self.comm.size()
        window = self.config.notice_window_s or DEFAULT_NOTICE_WINDOW_S
        deadline = (round_.deadline or self.clocks.wall() + window) - self.config.leave_margin_s
        leaving_hosts = [self.run.hosts[r] for r in round_.leaving]
        self.events.emit(ev.NoticeAgreed(step=step, leaving=tuple(leaving_hosts), deadline=deadline, size=size))

        # A background save still in flight gets part of the window; its commit (if it still
        # holds the lease) is independent of the emergency step, so nothing can tear.
        waited = self.manager.save_in_flight
        if waited:
            self.events.emit(ev.WaitInflight(step=step))
            try:
                self.manager.wait(timeout=max(0.0, (deadline - self.clocks.wall()) / 3))
            except Exception as exc:
                log.warning("in-flight checkpoint did not finish before the emergency save: %s", exc)

        was_master = rank == self.run.master
        new_master = elect_master(size, round_.leaving)
        if new_master != self.run.master:
            self._move_lease(new_master)
            self.events.emit(ev.Election(step=step, old_master=self.run.master, new_master=new_master,
                                         old_master_host=self.run.hosts[self.run.master],
                                         new_master_host=self.run.hosts[new_master],
                                         lease_generation=self.lease.generation if rank == new_master else None))
            self.run.master = new_master

        committed = self.save_now(step, snapshot(), metadata(), coordinator=new_master, deadline=deadline,
                                   kind="emergency", share_snapshot=share_snapshot)
        self.run.handled_leavers.update(leaving_hosts)
        self.run.departure_pending = True
        if rank in round_.leaving:
            self.run.leaving = True
            publish_leaving(self.manager.store, self.host, deadline=round_.deadline,
                            instance_id=self.watcher.instance_id if self.watcher is not None else None)
            self.events.emit(ev.LeavePublished(step=step, deadline=round_.deadline, was_master=was_master))
        return StepOutcome(emergency_step=step, committed=committed, leaving=self.run.leaving,
                           departure_pending=True)

    def _move_lease(self, master: int) -> None:
        """Release the lease unless this rank is ``master``, which takes it (all ranks agreed).

        A failure here is logged, never raised: a master without the lease cannot commit
        (its saves are abandoned and reported), but training goes on.
        """
        try:
            if self.comm.rank() == master:
                if not self.lease.held:
                    self.lease.acquire(steal=True)
            elif self.lease.held:
                self.lease.release()
        except CheckpointError as exc:
            log.error("checkpoint-master lease hand-over failed: %s", exc)
            self.events.emit(ev.LeaseError(error=str(exc)))

    def save_now(self, step: int, tensors: Mapping[str, Any], meta: dict[str, Any], *, coordinator: int,
                  deadline: float | None, kind: str, share_snapshot: ShareSnapshot | None = None) -> bool:
        """Synchronous sharded save on every rank; returns (on every rank) whether it committed."""
        rank, size = self.comm.rank(), self.comm.size()
        self.events.emit(ev.SaveStart(step=step, kind=kind, size=size))
        t0 = self.clocks.monotonic()
        error = None
        try:
            self.manager.save(step, tensors, meta, rank=rank, world_size=size,
                              gather=self.comm.allgather_json, coordinator=coordinator,
                              lease=self.lease if rank == coordinator else None, deadline=deadline,
                              snapshot=share_snapshot)
        except CommitConflictError:
            pass  # the step is already durable (a periodic save of the same step got there first)
        except Exception as exc:  # reported below; training goes on either way
            error = f"{type(exc).__name__}: {exc}"
        stats = self.manager.last_stats
        outcome = self.comm.broadcast_json({"ok": error is None, "error": error}, coordinator)
        self.events.emit(ev.SaveEnd(step=step, kind=kind, seconds=self.clocks.monotonic() - t0,
                                    bytes=stats.bytes_written if stats and stats.step == step else 0))
        if outcome["ok"]:
            if rank == coordinator:
                self.events.emit(ev.Commit(step=step, kind=kind, size=size, lease_generation=self.lease.generation))
        else:
            self.events.emit(ev.SaveFailed(step=step, kind=kind, error=outcome["error"]))
        return bool(outcome["ok"])

    def _periodic_save(self, step: int, snapshot: Callable[[], Mapping[str, Any]],
                       metadata: Callable[[], dict[str, Any]], share_snapshot: ShareSnapshot | None,
                       kind: str = "periodic") -> None:
        rank, size = self.comm.rank(), self.comm.size()
        master = self.run.master
        t0 = time.perf_counter()
        def done(manifest: Any, error: BaseException | None) -> None:
            if isinstance(error, CommitConflictError):
                # After a rollback the ring replays steps; this one is already durable.
                self.events.emit(ev.SaveSkipped(step=step, reason="already committed"))
            elif error is not None:
                self.events.emit(ev.SaveFailed(step=step, kind=kind, error=f"{type(error).__name__}: {error}"))
            elif manifest is not None:  # the coordinator
                self.events.emit(ev.Commit(step=step, kind=kind, size=size, bytes=manifest.nbytes,
                                           lease_generation=manifest.lease_generation))

        started = self.manager.save_async(
            step, snapshot(), metadata(), rank=rank, world_size=size, coordinator=master,
            lease=self.lease if rank == master else None, if_busy="wait",  # not busy: agreed above
            on_done=done, snapshot=share_snapshot)
        if started:
            self.events.emit(ev.AsyncSave(step=step, stall_ms=(time.perf_counter() - t0) * 1e3, size=size,
                                          kind=None if kind == "periodic" else kind))


def _make_watcher(config: TransientConfig, host: str) -> NoticeSource | None:
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


__all__ = ["CheckpointError", "Clocks", "Collectives", "NoticeSource", "StepOutcome", "TransientConfig",
           "TransientImpl", "default_host"]
