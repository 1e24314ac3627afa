"""Saving: plan, write this rank's share, gather the shard records, commit on the coordinator.

Synchronous saves run on the caller's thread; an asynchronous save takes the share on
the caller's thread and does the rest on one background thread, one save at a time.

A save with a deadline hands a :class:`~ckpt_service.deadline.Deadline` to every part that
touches the store (piece uploads, the store gather, the commit and its lease fence), each
of which bounds its calls by it; the share writes and the gather end early enough to leave
the commit its reserve, and waiting for the uploads stops at the deadline. Running out of
time raises SaveAbandonedError and commits nothing. Retention is left to the next save
without a deadline (or ``gc()``): under a slow store it could take the rest of the window,
which belongs to the caller once the step is committed.

A background save can be cancelled (:meth:`CheckpointWriter.cancel_inflight`): its
:class:`~ckpt_service.cancel.CancelToken` is checked between piece uploads, before each of
the store gather's polls and before each step of the commit up to the marker, and the save
then raises SaveCancelledError and commits nothing. Saves with a deadline upload on an
executor of their own (``urgent_io``), so they never queue behind a background save's
uploads; the I/O that a cancelled save had already sent runs on to its own end there.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, cast

from ckpt_service import layout
from ckpt_service.arguments import checked_ranks, checked_step
from ckpt_service.cancel import CancelToken
from ckpt_service.commit import commit_step
from ckpt_service.deadline import Deadline
from ckpt_service.errors import (
    BadAttemptError,
    CheckpointError,
    SaveCancelledError,
)
from ckpt_service.gather import Gather, StoreGather, single_rank_gather
from ckpt_service.lease import Lease
from ckpt_service.manifest import Manifest, checked_metadata
from ckpt_service.plan import SavePlan, TensorSpec, TensorSpecs
from ckpt_service.plan_cache import PlanCache
from ckpt_service.shard_records import ShardRecord
from ckpt_service.share import Piece, Share, ShareSnapshot, checked_share, is_deferred, prepare_share, specs_to_save
from ckpt_service.stores.base import ObjectStore
from ckpt_service.uploads import write_share

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveStats:
    """What one rank did in its last save (for event logs and benchmarks)."""

    step: int
    rank: int
    bytes_written: int
    stall_s: float  # time the caller was blocked (the snapshot, for async saves)
    write_s: float
    committed: bool


class CheckpointWriter:
    """Saves numbered steps to one store; piece uploads run in parallel on ``io``.

    ``after_commit(step)`` runs on the coordinator after each commit of a save without a deadline
    (retention, which must keep ``step``); a CheckpointError from it is logged, never raised: the
    commit stands.

    Saves with a deadline upload on ``urgent_io`` (default: ``io``, shared); give them an executor
    of their own so that their uploads never wait behind a background save's.
    """

    def __init__(self, store: ObjectStore, io: Executor, plans: PlanCache, *, compression: str = "none",
                 gather_timeout_s: float = 600.0, after_commit: Callable[[int], object] | None = None,
                 urgent_io: Executor | None = None) -> None:
        self.store = store
        self.plans = plans
        self.compression = compression
        self.gather_timeout_s = gather_timeout_s
        self.after_commit = after_commit
        self._stats_lock = threading.Lock()  # saves on the caller's and the background thread record stats
        self._last_stats: SaveStats | None = None
        self._io = io
        self._urgent_io = urgent_io if urgent_io is not None else io
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-persist")
        self._inflight: Future[Manifest | None] | None = None
        self._inflight_cancel: CancelToken | None = None  # the token of the save in _inflight
        self._inflight_lock = threading.Lock()
        self._start_lock = threading.Lock()  # held by save_async from its busy check to its submit

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def last_stats(self) -> SaveStats | None:
        """What this rank did in the save that ended last (of any thread)."""
        with self._stats_lock:
            return self._last_stats

    def _record_stats(self, stats: SaveStats) -> None:
        with self._stats_lock:
            self._last_stats = stats

    def plan(self, specs: Iterable[TensorSpec] | TensorSpecs, world_size: int = 1) -> SavePlan:
        return self.plans.plan(specs, world_size)

    def _take_share(self, plan: SavePlan, tensors: Mapping[str, Any], rank: int,
                    snapshot: ShareSnapshot | None) -> Share:
        if snapshot is None:
            return prepare_share(plan, rank, tensors)
        taken = snapshot(plan, rank)
        if is_deferred(taken):
            deferred = taken
            return lambda: checked_share(plan, rank, deferred.assemble())
        return checked_share(plan, rank, cast("Sequence[Any]", taken))  # not deferred: the arrays

    def save(
        self,
        step: int,
        tensors: Mapping[str, Any],
        metadata: Mapping[str, Any] | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        gather: Gather | None = None,
        coordinator: int = 0,
        lease: Lease | None = None,
        deadline: float | None = None,
        snapshot: ShareSnapshot | None = None,
        attempt: str | None = None,
    ) -> Manifest | None:
        """See :meth:`ckpt_service.manager.CheckpointManager.save`."""
        step = checked_step(step)
        rank, world_size, coordinator = checked_ranks(rank, world_size, coordinator)
        t0 = time.perf_counter()
        _check_attempt(step, attempt, world_size, gather)
        based_on = _known_fence(lease)
        bound = Deadline(deadline) if deadline is not None else None
        plan, share, meta = self._prepare(step, tensors, metadata, rank, world_size, gather, coordinator, bound,
                                          attempt, snapshot)
        return self._save_planned(step, plan, share, meta, rank, gather, coordinator, lease, bound, attempt=attempt,
                                  stall_start=t0, based_on=based_on)

    def save_async(
        self,
        step: int,
        tensors: Mapping[str, Any],
        metadata: Mapping[str, Any] | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        gather: Gather | None = None,
        coordinator: int = 0,
        lease: Lease | None = None,
        if_busy: str = "skip",
        on_done: Callable[[Manifest | None, BaseException | None], None] | None = None,
        snapshot: ShareSnapshot | None = None,
        attempt: str | None = None,
    ) -> bool:
        """See :meth:`ckpt_service.manager.CheckpointManager.save_async`."""
        if if_busy not in ("skip", "wait"):
            raise ValueError(f"if_busy must be 'skip' or 'wait', not {if_busy!r}")
        step = checked_step(step)
        rank, world_size, coordinator = checked_ranks(rank, world_size, coordinator)
        _check_attempt(step, attempt, world_size, gather)
        # One caller at a time gets from the busy check to the submit, so two threads can
        # never both start a save, nor one replace the other's before its outcome is reported.
        # A caller that would skip a busy save does not queue behind another's start either.
        if not self._start_lock.acquire(blocking=if_busy == "wait"):
            log.info("checkpoint of step %d skipped: another save is being started", step)
            return False
        try:
            with self._inflight_lock:
                previous = self._inflight
            if previous is not None and not previous.done():
                if if_busy == "skip":
                    log.info("checkpoint of step %d skipped: the previous save is still being persisted", step)
                    return False
                log.info("checkpoint of step %d waits for the previous save to be persisted", step)
                wait_futures([previous])  # its error is logged below; it is no reason to drop this save
            self._log_background_error()
            # the commits this save knows of: it supersedes none made while it runs in the background
            based_on = _known_fence(lease)
            t0 = time.perf_counter()
            # The snapshot is exactly this rank's pieces, in contiguous host buffers.
            plan, share, meta = self._prepare(step, tensors, metadata, rank, world_size, gather, coordinator, None,
                                              attempt, snapshot)
            stall = time.perf_counter() - t0
            token = CancelToken()
            future = self._bg.submit(
                self._save_planned, step, plan, share, meta, rank, gather, coordinator, lease, None,
                attempt=attempt, stall_s=stall, cancel=token, based_on=based_on,
            )
            with self._inflight_lock:
                self._inflight, self._inflight_cancel = future, token
        finally:
            self._start_lock.release()
        if on_done is not None:
            done = on_done
            future.add_done_callback(lambda f: done(None if f.exception() else f.result(), f.exception()))
        return True

    def wait(self, timeout: float | None = None) -> Manifest | None:
        """Block until the in-flight async save is done; re-raise its error. TimeoutError if not done."""
        with self._inflight_lock:
            future = self._inflight
        if future is None:
            return None
        try:
            return future.result(timeout=timeout)  # concurrent.futures.TimeoutError is a TimeoutError
        finally:
            if future.done():  # its outcome is reported once, here
                with self._inflight_lock:
                    if self._inflight is future:
                        self._inflight = None

    @property
    def save_in_flight(self) -> bool:
        with self._inflight_lock:
            return self._inflight is not None and not self._inflight.done()

    def cancel_inflight(self, reason: str) -> bool:
        """Cancel the background save in flight, if any; returns whether there was one to cancel.

        It stops at its next check (between uploads, before a gather poll, before each step of the
        commit) and fails with SaveCancelledError, committing nothing; one whose commit marker was
        already sent is past cancelling and ends as the store decides. A request it has sent runs
        on to its own end: :meth:`wait` tells when it is over. Never blocks.
        """
        with self._inflight_lock:
            future, token = self._inflight, self._inflight_cancel
        if future is None or token is None or future.done():
            return False
        if token.cancel(reason):
            log.info("cancelled the background checkpoint in flight: %s", reason)
        return True

    def _log_background_error(self) -> None:
        """Log how the finished background save failed, if it did, and forget it.

        Called when the next save starts, not by ``wait``: a caller that never waited still
        learns of the failure from the log, and the new save is not refused for an old one.
        A caller that wants the error raised gets it from :meth:`wait`.
        """
        with self._inflight_lock:
            future, self._inflight = self._inflight, None
        if future is None:
            return
        error = future.exception()
        if isinstance(error, SaveCancelledError):
            log.info("the previous background checkpoint was cancelled: %s", error)
        elif error is not None:
            log.error("the previous background checkpoint failed: %s", error, exc_info=error)

    def close(self) -> None:
        """Wait for the in-flight save (re-raising its error), then stop the background thread."""
        try:
            self.wait()
        finally:
            self._bg.shutdown(wait=True)

    def _prepare(self, step: int, tensors: Mapping[str, Any], metadata: Mapping[str, Any] | None, rank: int,
                 world_size: int, gather: Gather | None, coordinator: int, deadline: Deadline | None,
                 attempt: str | None, snapshot: ShareSnapshot | None) -> tuple[SavePlan, Share, dict[str, Any]]:
        """Plan, take this rank's share and check the metadata; a failure still reaches the gather
        (as a failed record), so the other ranks learn of it instead of waiting for this one."""
        plan: SavePlan | None = None
        try:
            plan = self.plan(specs_to_save(tensors, data_needed=snapshot is None), world_size)
            return plan, self._take_share(plan, tensors, rank, snapshot), checked_metadata(metadata)
        except Exception as exc:
            self._report_failed_share(step, rank, world_size, gather, coordinator, deadline, attempt, plan, exc)
            raise

    def _report_failed_share(self, step: int, rank: int, world_size: int, gather: Gather | None,
                             coordinator: int, deadline: Deadline | None, attempt: str | None,
                             plan: SavePlan | None, exc: BaseException) -> None:
        """A rank that could not build its share still reaches the gather with an error record.

        Otherwise the other ranks would wait on it (a collective gather: forever; the store
        gather: until its timeout) before the coordinator abandons the step.
        """
        if world_size <= 1:
            return
        if gather is None:
            if rank == coordinator:
                return  # the others post their records to the store and do not wait for this rank
            gather = self._store_gather(step, rank, world_size, attempt, coordinator, deadline)
        # a rank that could not even plan has no digest: the step and attempt say which save failed
        digest = plan.digest if plan is not None else None
        try:
            gather(ShardRecord.failed(rank, exc, step=step, attempt=attempt, plan=digest).to_json())
        except Exception as gather_exc:  # the caller needs the original error, not this one
            log.warning("could not report the failed share of step %d to the other ranks: %s", step, gather_exc)

    def _save_planned(
        self,
        step: int,
        plan: SavePlan,
        share: Share,
        metadata: dict[str, Any],
        rank: int,
        gather: Gather | None,
        coordinator: int,
        lease: Lease | None,
        deadline: Deadline | None,
        *,
        attempt: str | None = None,
        stall_start: float | None = None,
        stall_s: float | None = None,
        cancel: CancelToken | None = None,
        based_on: int | None = None,
    ) -> Manifest | None:
        world_size = plan.world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        t_write = time.perf_counter()
        # the share writes and the gather leave the commit its reserve
        writes = deadline.before_commit(time.time()) if deadline is not None else None
        if gather is None:
            gather = single_rank_gather if world_size == 1 else self._store_gather(
                step, rank, world_size, attempt, coordinator, writes, cancel)
        try:
            pieces = share() if callable(share) else share  # a deferred share is assembled here
            record = self._write_share(step, rank, pieces, writes, deadline, attempt, plan.digest, cancel)
        except SaveCancelledError:
            raise  # every rank cancels its own share of the save: no one waits for this rank's record
        except Exception as exc:
            # Every rank must still reach the gather, or the others would wait on it forever;
            # the coordinator sees the error record and abandons the step.
            try:
                gather(ShardRecord.failed(rank, exc, step=step, attempt=attempt, plan=plan.digest).to_json())
            except Exception as gather_exc:  # the caller needs the original error, not this one
                log.warning("could not report the failed write of step %d to the other ranks: %s", step, gather_exc)
            raise
        write_s = time.perf_counter() - t_write
        gathered = gather(record.to_json())
        manifest = None
        if rank == coordinator:
            if gathered is None:
                raise CheckpointError("the gather returned no records on the coordinator")
            records = [ShardRecord.from_json(r) for r in gathered]
            manifest = commit_step(self.store, step, plan, records, metadata, lease, deadline, attempt=attempt,
                                   cancel=cancel, based_on=based_on)
            if deadline is None:
                self._apply_retention(step)
            else:
                log.debug("step %d had a deadline: retention is left to the next save without one", step)
        stall = stall_s if stall_s is not None else time.perf_counter() - (stall_start or t_write)
        self._record_stats(SaveStats(step, rank, record.nbytes, stall, write_s, manifest is not None))
        return manifest

    def _apply_retention(self, step: int) -> None:
        if self.after_commit is None:
            return
        try:
            self.after_commit(step)
        except CheckpointError as exc:  # retention is housekeeping: never fail a commit for it
            log.warning("retention after step %d failed: %s", step, exc)

    def _store_gather(self, step: int, rank: int, world_size: int, attempt: str | None, coordinator: int,
                      deadline: Deadline | None, cancel: CancelToken | None = None) -> StoreGather:
        if attempt is None:  # _check_attempt refused such a save before it wrote anything
            raise _attempt_required(step)
        return StoreGather(self.store, step, rank, world_size, attempt=attempt, coordinator=coordinator,
                           deadline=deadline, timeout_s=self.gather_timeout_s, cancel=cancel)

    def _write_share(self, step: int, rank: int, share: list[Piece], writes: Deadline | None,
                     deadline: Deadline | None, attempt: str | None, plan_digest: str,
                     cancel: CancelToken | None = None) -> ShardRecord:
        """Upload this rank's pieces (:func:`~ckpt_service.uploads.write_share`); a save with a
        deadline uploads on the urgent executor."""
        io = self._io if deadline is None else self._urgent_io
        return write_share(self.store, io, self.compression, step, rank, share, writes=writes, deadline=deadline,
                           attempt=attempt, plan_digest=plan_digest, cancel=cancel)


def _known_fence(lease: Lease | None) -> int | None:
    """The fence number a save begun now knows of (its ``based_on``): 0 for a lease not held, so a save begun
    then can never commit under a tenure taken later."""
    if lease is None:
        return None
    held = lease.generation
    return 0 if held is None else held


def _check_attempt(step: int, attempt: str | None, world_size: int, gather: Gather | None) -> None:
    """Refuse, before anything is written, an attempt id unusable in keys, or a multi-writer save
    through the store without one: its coordinator could not tell its writers' records from
    those an earlier attempt of the same step left behind."""
    if attempt is not None:
        layout.check_attempt(attempt)
    elif world_size > 1 and gather is None:
        raise _attempt_required(step)


def _attempt_required(step: int) -> BadAttemptError:
    return BadAttemptError(
        f"step {step}: a multi-writer save that gathers its shard records through the store needs "
        "attempt=<id>, the same on every rank of this save and new for each save (e.g. derived from "
        "the ring's membership, the step and a save counter); nothing was written")
