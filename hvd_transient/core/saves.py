"""Checkpoint saves on the ring: synchronous (emergency, final) and background (periodic, early),
their attempt ids, the latest step this rank knows committed, and the master's look before a final save.

Every rank starts the same saves in the same order; a failure on one rank (its snapshot, its
share, the master's look at the store) becomes an outcome every rank learns, never a raise
between two collectives.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Callable, Iterator, Mapping

from ckpt_service.errors import BadSnapshotError
from ckpt_service.manager import CommitConflictError, ShareSnapshot
from ckpt_service.manifest import checked_metadata
from hvd_transient.core.background import BackgroundCalls
from hvd_transient.core.config import FINAL_SAVE_CHECK_TIMEOUT_S
from hvd_transient.core.interfaces import ProtocolParts
from hvd_transient.telemetry import schema as ev

log = logging.getLogger(__name__)


class FailedSnapshot(Mapping[str, Any]):
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


def take_snapshot(rank: int, step: int, snapshot: Callable[[], Mapping[str, Any]],
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
        return FailedSnapshot(BadSnapshotError(
            f"rank {rank} could not take its snapshot of step {step} "
            f"({type(exc).__name__}: {exc}); the save fails on every rank and the previous checkpoint "
            "stays the latest")), {}


class Saves:
    """This rank's saves: ``on_save_started(step)`` hears of each background save once its snapshot is taken."""

    def __init__(self, parts: ProtocolParts, background: BackgroundCalls,
                 on_save_started: Callable[[int], None]) -> None:
        self.p = parts
        self._background = background
        self._on_save_started = on_save_started
        # The latest step this rank knows committed (the coordinator learns a background save's
        # commit on its thread); the master shares it in the notice round.
        self._commit_lock = threading.Lock()
        self._committed_step: int | None = None
        self._async_outcome_pending = False  # a background save's on_done has not run yet

    @property
    def committed_step(self) -> int | None:
        return self._committed_step

    def busy(self) -> bool:
        """A background save is in flight, or its outcome is not recorded yet."""
        return self.p.manager.save_in_flight or self._async_outcome_pending

    def _note_committed(self, step: int) -> None:
        with self._commit_lock:
            if self._committed_step is None or step > self._committed_step:
                self._committed_step = step

    def save_now(self, step: int, tensors: Mapping[str, Any], meta: dict[str, Any], *, coordinator: int,
                 deadline: float | None, kind: str, share_snapshot: ShareSnapshot | None = None) -> bool:
        """Synchronous sharded save on every rank; returns (on every rank) whether the step is committed.

        A step that an earlier save already committed counts as committed (reported as skipped).
        """
        p = self.p
        rank, size = p.comm.rank(), p.comm.size()
        attempt = p.run.next_attempt(step)
        p.events.emit(ev.SaveStart(step=step, kind=kind, size=size))
        t0 = p.clocks.monotonic()
        error, already, manifest = None, False, None
        try:
            manifest = p.manager.save(step, tensors, meta, rank=rank, world_size=size,
                                      gather=p.comm.allgather_json, coordinator=coordinator,
                                      lease=p.lease if rank == coordinator else None, deadline=deadline,
                                      snapshot=share_snapshot, attempt=attempt)
        except CommitConflictError:
            already = True  # the step is already durable (a periodic save of the same step got there first)
        except Exception as exc:  # reported below; training goes on either way
            error = f"{type(exc).__name__}: {exc}"
        stats = p.manager.last_stats
        outcome = p.comm.broadcast_json({"ok": error is None, "error": error, "already": already},
                                        coordinator, name="save-outcome")
        p.events.emit(ev.SaveEnd(step=step, kind=kind, seconds=p.clocks.monotonic() - t0,
                                 bytes=stats.bytes_written if stats and stats.step == step else 0))
        if outcome["ok"]:
            self._note_committed(step)
            if outcome["already"]:  # this save wrote no commit: say so, not that it committed
                p.events.emit(ev.SaveSkipped(step=step, reason="already committed"))
            elif manifest is not None:  # the coordinator; the generation its commit's fence wrote
                p.events.emit(ev.Commit(step=step, kind=kind, size=size, lease_generation=manifest.lease_generation))
        else:
            p.events.emit(ev.SaveFailed(step=step, kind=kind, error=outcome["error"]))
        return bool(outcome["ok"])

    def start_background(self, step: int, snapshot: Callable[[], Mapping[str, Any]],
                         metadata: Callable[[], dict[str, Any]], share_snapshot: ShareSnapshot | None,
                         kind: str = "periodic") -> None:
        """Start a background save of ``step`` on every rank (all agreed that no rank is busy).

        Never raises: a rank whose snapshot or share fails reports it to the save's gather, so the
        coordinator abandons the step, and the failure is logged here; the ranks learn at the next
        round (through the committed step the master reports) that it did not commit.
        """
        p = self.p
        rank, size = p.comm.rank(), p.comm.size()
        master = p.run.master
        attempt = p.run.next_attempt(step)
        t0 = time.perf_counter()
        def done(manifest: Any, error: BaseException | None) -> None:
            try:
                if isinstance(error, CommitConflictError):
                    # After a rollback the ring replays steps; this one is already durable.
                    self._note_committed(step)
                    p.events.emit(ev.SaveSkipped(step=step, reason="already committed"))
                elif error is not None:
                    p.events.emit(ev.SaveFailed(step=step, kind=kind, error=f"{type(error).__name__}: {error}"))
                elif manifest is not None:  # the coordinator
                    self._note_committed(step)
                    p.events.emit(ev.Commit(step=step, kind=kind, size=size, bytes=manifest.nbytes,
                                            lease_generation=manifest.lease_generation))
            finally:
                self._async_outcome_pending = False

        tensors, meta = take_snapshot(rank, step, snapshot, metadata)
        self._on_save_started(step)
        self._async_outcome_pending = True
        try:
            started = p.manager.save_async(
                step, tensors, meta, rank=rank, world_size=size, coordinator=master,
                lease=p.lease if rank == master else None, if_busy="wait",  # not busy: agreed above
                on_done=done, snapshot=share_snapshot, attempt=attempt)
        except Exception as exc:  # this rank's share failed; the save's gather has its error record
            self._async_outcome_pending = False
            p.events.emit(ev.SaveFailed(step=step, kind=kind, error=f"{type(exc).__name__}: {exc}"))
            return
        if not started:
            self._async_outcome_pending = False
        if started:
            p.events.emit(ev.AsyncSave(step=step, stall_ms=(time.perf_counter() - t0) * 1e3, size=size,
                                       kind=None if kind == "periodic" else kind))

    def final_save_needed(self, step: int) -> bool:
        """Every rank: whether a final save of ``step`` is needed; the master's view of the store decides.

        Only the master reads the store, and every rank gets its answer from one broadcast, so
        every rank takes the same branch. If the master cannot read the store, the error is
        broadcast instead and every rank answers True: a save of a step that is already
        committed is reported as skipped, and one the store refuses fails cleanly on every rank.
        """
        p = self.p
        master = p.run.master
        answer: dict[str, Any] | None = None
        if p.comm.rank() == master:
            # bounded: the other ranks wait in the broadcast for this look at the store
            try:
                latest = self._background.submit(p.manager.latest_step).result(timeout=FINAL_SAVE_CHECK_TIMEOUT_S)
                answer = {"needed": latest != step, "error": None}
            except FutureTimeoutError:
                answer = {"needed": True,
                          "error": f"the store did not answer within {FINAL_SAVE_CHECK_TIMEOUT_S:g} s"}
            except Exception as exc:  # shared below, not raised: the other ranks are in the broadcast
                answer = {"needed": True, "error": f"{type(exc).__name__}: {exc}"}
        answer = p.comm.broadcast_json(answer, master, name="final-save")
        assert answer is not None
        if answer["error"] is not None:
            log.warning("the master could not read the latest committed step (%s); saving step %d anyway",
                        answer["error"], step)
        return bool(answer["needed"])


__all__ = ["FailedSnapshot", "Saves", "take_snapshot"]
