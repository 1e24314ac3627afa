"""CheckpointManager: sharded, atomically committed checkpoints in any ObjectStore.

Roles in a multi-writer save (every rank calls ``save`` with the same state specs):

1. all ranks: compute the same :class:`~ckpt_service.plan.SavePlan` (no communication);
2. all ranks: write their pieces (zarr arrays under keys unique to this attempt);
3. all ranks: hand a small shard record to ``gather``;
4. coordinator: check that the records cover the plan exactly, write the
   manifest, ``fence()`` the master lease if one is given, then create the commit
   marker create-only. Only then does the step exist for readers;
5. coordinator: apply retention.

A save that misses its deadline, loses the lease or finds the step already
committed raises and commits nothing: the previous committed step stays the latest.

Commits are ordered by the fence number their fence wrote into the lease (a counter the lease
object keeps): a committed step that a lower step's commit supersedes (its save began after the
step's fence: an old master's marker that landed after
its successor committed, or the steps above a rollback) is not listed, not restored by
default, and deleted by retention (:mod:`ckpt_service.reader`, :mod:`ckpt_service.commit`).
A save's ``deadline`` bounds every store call it makes (see :mod:`ckpt_service.deadline`).

The manager is one front for three parts: :class:`~ckpt_service.writer.CheckpointWriter`
(saves), :class:`~ckpt_service.reader.CheckpointReader` (restores, verification) and
:class:`~ckpt_service.collector.StepCollector` (retention).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping

from ckpt_service.arguments import checked_deadline, checked_names, checked_step
from ckpt_service.collector import StepCollector
from ckpt_service.errors import BadMetadataError, BadSnapshotError, CommitConflictError
from ckpt_service.gather import Gather
from ckpt_service.lease import Lease
from ckpt_service.manifest import CommitMarker, Manifest
from ckpt_service.piece_io import checked_compression
from ckpt_service.plan import DEFAULT_CHUNK_BYTES, SavePlan, TensorSpec, TensorSpecs
from ckpt_service.plan_cache import PLAN_CACHE_SIZE, PlanCache
from ckpt_service.read_plan import checked_partition
from ckpt_service.reader import Checkpoint, CheckpointReader, VerifyReport
from ckpt_service.retention import RetentionPolicy
from ckpt_service.share import DeferredShare, ShareSnapshot, prepare_share
from ckpt_service.stores import ObjectStore, open_store
from ckpt_service.writer import CheckpointWriter, SaveStats

__all__ = [
    "BadMetadataError", "BadSnapshotError", "Checkpoint", "CheckpointManager", "CommitConflictError",
    "DeferredShare", "PLAN_CACHE_SIZE", "SaveStats", "ShareSnapshot", "VerifyReport", "prepare_share",
]


class CheckpointManager:
    """Save and restore numbered checkpoints under a store URL (or an ObjectStore)."""

    def __init__(
        self,
        store: str | ObjectStore,
        *,
        max_to_keep: int | None = 3,
        keep_every_n_steps: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        compression: str = "none",
        io_threads: int = 8,
        abandoned_after_s: float = 600.0,
        gather_timeout_s: float = 600.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``abandoned_after_s``: how long an uncommitted step's files, the files of a committed step
        its manifest does not refer to, or a temp file of a write killed midway, stay untouched
        before gc takes them for abandoned (younger ones may belong to a save in flight). Those ages
        are measured on the store's own clock (the one its mtimes come from), so a manager whose
        clock is off cannot take another process's save in flight for abandoned; ``clock`` replaces
        it (tests move it)."""
        compression = checked_compression(compression)  # refused here, not at the first save
        self.store = open_store(store) if isinstance(store, str) else store
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="ckpt-io")
        # saves with a deadline upload here, never queued behind a background save's uploads
        self._urgent_io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="ckpt-urgent-io")
        self._collector = StepCollector(
            self.store, RetentionPolicy(max_to_keep, keep_every_n_steps, abandoned_after_s), clock=clock, io=self._io)
        self._reader = CheckpointReader(self.store, self._io)
        self._writer = CheckpointWriter(self.store, self._io, PlanCache(chunk_bytes), compression=compression,
                                        gather_timeout_s=gather_timeout_s, after_commit=self._collect_after,
                                        urgent_io=self._urgent_io)

    # ------------------------------------------------------------------ settings

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def max_to_keep(self) -> int | None:
        return self._collector.policy.max_to_keep

    @property
    def keep_every_n_steps(self) -> int | None:
        return self._collector.policy.keep_every_n_steps

    @property
    def abandoned_after_s(self) -> float:
        return self._collector.policy.abandoned_after_s

    @property
    def clock(self) -> Callable[[], float] | None:
        """The clock ages are measured against; None: the store's own."""
        return self._collector.clock

    @property
    def chunk_bytes(self) -> int:
        return self._writer.plans.chunk_bytes

    @property
    def compression(self) -> str:
        return self._writer.compression

    @property
    def gather_timeout_s(self) -> float:
        return self._writer.gather_timeout_s

    @property
    def last_stats(self) -> SaveStats | None:
        """What this rank did in its last save (the one that ended last, foreground or background)."""
        return self._writer.last_stats

    # ------------------------------------------------------------------ saving

    def plan(self, specs: Iterable[TensorSpec] | TensorSpecs, world_size: int = 1) -> SavePlan:
        """The save plan of ``specs`` over ``world_size`` writers (cached: plans are immutable and
        planning a few hundred tensors costs about a millisecond of every save's stall)."""
        return self._writer.plan(specs, world_size)

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
        """Write this rank's share of ``tensors`` and, on the coordinator, commit step ``step``.

        ``tensors`` maps names to arrays (anything ``numpy.asarray`` accepts; device tensors
        must be copied to host memory by the caller). With a ``snapshot`` (see
        :data:`ShareSnapshot`), the data comes from it instead and ``tensors`` only needs to
        give each tensor's shape and dtype (arrays, variables, or :class:`TensorSpec` values).
        Returns the committed manifest on the coordinator, None on the other ranks.

        ``deadline`` (epoch seconds, e.g. a preemption notice's end less a margin) bounds every
        store call of the save: piece uploads, the store gather, the manifest, the lease fence
        and the commit marker, with their retries and read-backs, each get a request timeout and
        a retry deadline derived from the time left, so a slow or faulty store makes the save
        give up before the deadline instead of after it. Such a save leaves retention to the next
        save without a deadline. Without one, the store's own retry policy applies unchanged.

        ``attempt`` names this save attempt: the same id on every rank of one save, a new one for
        each save (the same step saved again after a rollback is a new attempt), 1-64 characters
        of ``[A-Za-z0-9._-]``. Every shard record carries it with the step and the plan's digest,
        and the coordinator commits only records of its own step, attempt and plan. A multi-writer
        save without ``gather`` (records gathered through the store) must pass one, or it raises
        BadAttemptError before writing anything; with a collective ``gather`` it is optional.

        Nothing is committed when it raises: SaveAbandonedError (the deadline passed, or the
        store could not do its part before it), WriterFailedError (a writer reported an error),
        IncompleteShardRecordsError (or MismatchedShardRecordsError: a record of another step,
        attempt or plan, or pieces outside the step or of another writer), LeaseLostError,
        OutOfOrderSaveError (a save without a lease of a step older than the latest committed one,
        or a rollback under the lease below a step committed without one), CommitConflictError (a
        valid commit of the step exists), or the error of this rank's own share or writes. An
        existing commit of the step that is not valid (superseded, made before this lease holder's
        tenure, its manifest missing or not matching, or a piece failing verification) is replaced
        instead; a save with a deadline, which has no time to verify it, always replaces it (see
        :mod:`ckpt_service.commit`). The one exception is WriteOutcomeUnknownError: the commit
        marker was sent but neither its answer nor reading it back came in time, so the step may
        or may not be committed (list the steps to know).
        """
        deadline = checked_deadline(deadline)  # NaN or infinity would never expire or overflow timeouts
        return self._writer.save(step, tensors, metadata, rank=rank, world_size=world_size, gather=gather,
                                 coordinator=coordinator, lease=lease, deadline=deadline, snapshot=snapshot,
                                 attempt=attempt)

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
        """Snapshot this rank's share into host memory, then persist and commit in the background.

        The caller is blocked only while the snapshot is taken. At most one save is in flight, so
        memory stays bounded by one snapshot of this rank's share: if one is still running,
        ``if_busy="skip"`` drops this request (returns False) and ``"wait"`` blocks until the
        previous one finishes; if that one failed, its error is logged (not raised here) and
        this save starts. Concurrent callers are served one at a time: two can never both
        start a save. A multi-writer background save gathers records through the
        store unless ``gather`` is given (it then runs on the background thread), and so needs
        an ``attempt`` id (see :meth:`save`).
        ``on_done(manifest, error)`` is called on the background thread when it ends.
        ``snapshot`` supplies the share instead of ``tensors``, as in :meth:`save`; if it
        raises or returns arrays that do not fit the plan, nothing is started. A
        :class:`DeferredShare` is assembled and checked on the background thread (the caller
        pays only for taking it); if that fails, the save fails as a failed write does.
        A background save's error is raised by :meth:`wait`; one never waited for is logged
        when the next save starts.
        """
        return self._writer.save_async(step, tensors, metadata, rank=rank, world_size=world_size, gather=gather,
                                       coordinator=coordinator, lease=lease, if_busy=if_busy, on_done=on_done,
                                       snapshot=snapshot, attempt=attempt)

    def wait(self, timeout: float | None = None) -> Manifest | None:
        """Block until the in-flight async save is done; re-raise its error. TimeoutError if not done."""
        return self._writer.wait(timeout)

    @property
    def save_in_flight(self) -> bool:
        return self._writer.save_in_flight

    def cancel_inflight(self, reason: str = "cancelled by the caller") -> bool:
        """Cancel the background save in flight (if any; returns whether there was one). Never blocks.

        The save stops at its next check (between piece uploads, before each poll of the store
        gather, before each step of the commit) and fails with SaveCancelledError (a
        SaveAbandonedError): nothing is committed, and its ``on_done`` and :meth:`wait` report
        that error. One whose commit marker was already sent is past cancelling. Requests it had
        sent run on to their own end, on its own threads: a save with a ``deadline`` started now
        does not wait for them (it uploads on executor threads of its own). Every rank of a
        multi-writer save should cancel its own share (e.g. at the same step boundary).
        """
        return self._writer.cancel_inflight(reason)

    # ----------------------------------------------------------------- reading

    def all_steps(self) -> list[int]:
        """Committed steps that no lower step's commit supersedes, ascending."""
        return self._reader.all_steps()

    def latest_step(self) -> int | None:
        return self._reader.latest_step()

    def restorable_step(self) -> int | None:
        """The newest committed step that verifies in full (every piece read and checked): the step
        :meth:`restore` would return. Readers of one partitioned restore pass it to all of them as
        ``step=`` (a partitioned restore without a step never falls back on its own). None when
        nothing is committed; CorruptCheckpointError when no step verifies."""
        return self._reader.restorable_step()

    def commit_marker(self, step: int) -> CommitMarker:
        return self._reader.commit_marker(step)

    def manifest(self, step: int) -> Manifest:
        return self._reader.manifest(step)

    def restore(
        self,
        step: int | None = None,
        *,
        names: Iterable[str] | None = None,
        partition: tuple[int, int] | None = None,
        expected: Mapping[str, Any] | None = None,
    ) -> Checkpoint:
        """Load a committed step (the latest by default), verifying every checksum.

        ``names`` restricts the tensors read; ``partition=(rank, world_size)`` makes each of
        ``world_size`` readers read a byte-balanced share of whole tensors (any reader count
        can read any writer count). ``expected`` maps names to arrays or ``(shape, dtype)``
        and raises StructureMismatchError on any difference from the tensors restored (with
        ``names``, those; otherwise all stored ones). When the latest step fails
        verification and no step was asked for, the previous committed step is tried, with
        a warning naming what failed; a step removed or re-committed while being read is
        gone, not corrupt: the steps are listed again. A superseded step is never restored by
        default, only when asked for by number (while gc has not removed it). A step that is
        not a non-negative integer raises BadStepError; a partition that is not
        ``(reader, readers)`` with ``0 <= reader < readers``, BadPartitionError.
        """
        step = None if step is None else checked_step(step)
        partition = None if partition is None else checked_partition(partition)
        names = checked_names(names)  # read once, however many steps are tried; one string is refused
        return self._reader.restore(step, names=names, partition=partition, expected=expected)

    def verify(self, step: int) -> VerifyReport:
        """Read every piece of ``step`` and check every checksum; never raises for corruption."""
        return self._reader.verify(step)

    # ---------------------------------------------------------------- retention

    def delete(self, step: int) -> None:
        """Delete a step: the commit marker first, so it is never visible half-deleted."""
        self._collector.delete(checked_step(step))

    def _collect_after(self, step: int) -> list[int]:
        return self._collector.collect(protect=step)  # the step just committed stays, superseded or not

    def gc(self, keep: int | None = None) -> list[int]:
        """Apply retention; also remove superseded steps, abandoned uncommitted steps older than
        the latest, and the files of committed steps that their manifests do not refer to.

        Never deletes the latest committed step, nor an uncommitted step that is newer than
        it, nor any file written to within ``abandoned_after_s`` by the store's clock (it may
        still be being written). Temp files of writes killed midway (local store) go once that
        old too. Safe to run from several processes at once. Returns the steps removed.
        """
        return self._collector.collect(keep)

    # ---------------------------------------------------------------- lifetime

    def close(self) -> None:
        try:
            self._writer.close()
        finally:
            self._io.shutdown(wait=True)
            self._urgent_io.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
