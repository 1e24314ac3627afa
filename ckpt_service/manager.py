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
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, Union, runtime_checkable

import numpy as np

from ckpt_service import layout
from ckpt_service.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NothingToRestoreError,
    SaveAbandonedError,
    StructureMismatchError,
)
from ckpt_service.gather import Gather, StoreGather, single_rank_gather
from ckpt_service.lease import Lease
from ckpt_service.manifest import CommitMarker, Manifest, PieceRecord, TensorEntry, crc32c
from ckpt_service.piece_io import chunk_keys, decode_piece, encode_piece
from ckpt_service.plan import (
    DEFAULT_CHUNK_BYTES,
    BadTensorSpecError,
    SavePlan,
    TensorSpec,
    TensorSpecs,
    WriteItem,
    checked_spec,
    make_save_plan,
    plan_reads,
    spec_of,
)
from ckpt_service.retention import steps_to_delete
from ckpt_service.stores import ObjectStore, open_store
from ckpt_service.stores.base import WriteOutcomeUnknownError

log = logging.getLogger(__name__)


@runtime_checkable
class DeferredShare(Protocol):
    """A share snapshot taken by reference, whose piece arrays are built later.

    An asynchronous save calls ``assemble()`` on its background thread, so the caller pays
    only for taking the references. What it holds must keep the values it had when it was
    taken, e.g. TensorFlow tensors that alias variable buffers (TensorFlow copies a buffer
    before updating it in place while a read of it is alive). ``assemble`` returns what a
    :data:`ShareSnapshot` would have returned, and should drop those references as it goes.
    """

    def assemble(self) -> Sequence[np.ndarray]:
        ...


#: Supplies this rank's share of a save: ``snapshot(plan, rank)`` returns one host array per
#: ``plan.for_rank(rank)`` item, in order, holding elements ``[item.start, item.stop)`` of the
#: ``item.group`` buffer (1-D, dtype ``item.group``), or a :class:`DeferredShare` that builds them
#: later. The arrays must not change afterwards: an asynchronous save writes them from a background
#: thread. It lets a framework read a device-resident state in one call instead of one host copy per
#: tensor.
ShareSnapshot = Callable[[SavePlan, int], Union[Sequence[np.ndarray], DeferredShare]]

#: This rank's checked pieces, or a call that assembles and checks them (a deferred share).
Share = Union[list[tuple[WriteItem, np.ndarray]], Callable[[], list[tuple[WriteItem, np.ndarray]]]]

#: Plans kept per manager: one model's saves alternate between a few world sizes at most.
PLAN_CACHE_SIZE = 8


class CommitConflictError(CheckpointError, FileExistsError):
    """This step was already committed (by another master); the earlier commit stands."""


class BadMetadataError(CheckpointError, TypeError):
    """Checkpoint metadata must be a JSON-serialisable dict."""


class BadSnapshotError(CheckpointError, ValueError):
    """A share snapshot does not match this rank's pieces of the plan, or a tensor has no data."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]
    manifest: Manifest = field(repr=False)


@dataclass(frozen=True)
class VerifyReport:
    step: int
    ok: bool
    problems: tuple[str, ...]
    bytes_checked: int


@dataclass(frozen=True)
class SaveStats:
    """What one rank did in its last save (for event logs and benchmarks)."""

    step: int
    rank: int
    bytes_written: int
    stall_s: float  # time the caller was blocked (the snapshot, for async saves)
    write_s: float
    committed: bool


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
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``abandoned_after_s``: how long an uncommitted step's files, or a temp file of a write
        killed midway, stay untouched before gc takes them for abandoned (younger ones may belong to
        a save in flight). ``clock`` gives wall-clock seconds for those ages (tests move it)."""
        self.store = open_store(store) if isinstance(store, str) else store
        self.max_to_keep = max_to_keep
        self.keep_every_n_steps = keep_every_n_steps
        self.chunk_bytes = chunk_bytes
        self.compression = compression
        self.abandoned_after_s = abandoned_after_s
        self.gather_timeout_s = gather_timeout_s
        self.clock = clock
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="ckpt-io")
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-persist")
        self._inflight: Future[Manifest | None] | None = None
        self._inflight_lock = threading.Lock()
        self._plans: OrderedDict[tuple[tuple[TensorSpec, ...] | TensorSpecs, int], SavePlan] = OrderedDict()
        self._plans_lock = threading.Lock()
        self.last_stats: SaveStats | None = None

    @property
    def url(self) -> str:
        return self.store.url

    # ------------------------------------------------------------------ saving

    def plan(self, specs: Iterable[TensorSpec] | TensorSpecs, world_size: int = 1) -> SavePlan:
        """The save plan of ``specs`` over ``world_size`` writers (cached: plans are immutable and
        planning a few hundred tensors costs about a millisecond of every save's stall)."""
        # A TensorSpecs is its own key: its hash is computed once and a lookup matches it by identity.
        specs_key: tuple[TensorSpec, ...] | TensorSpecs = specs if isinstance(specs, TensorSpecs) else tuple(specs)
        key = (specs_key, world_size)
        with self._plans_lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = make_save_plan(specs_key.specs if isinstance(specs_key, TensorSpecs) else specs_key, world_size,
                              chunk_bytes=self.chunk_bytes)
        with self._plans_lock:
            self._plans[key] = plan
            while len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        return plan

    def _plan_and_share(self, tensors: Mapping[str, Any], rank: int, world_size: int,
                        snapshot: ShareSnapshot | None) -> tuple[SavePlan, Share]:
        plan = self.plan(_specs(tensors, data_needed=snapshot is None), world_size)
        if snapshot is None:
            return plan, prepare_share(plan, rank, tensors)
        taken = snapshot(plan, rank)
        if isinstance(taken, DeferredShare):
            return plan, lambda: _checked_share(plan, rank, taken.assemble())
        return plan, _checked_share(plan, rank, taken)

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
    ) -> Manifest | None:
        """Write this rank's share of ``tensors`` and, on the coordinator, commit step ``step``.

        ``tensors`` maps names to arrays (anything ``numpy.asarray`` accepts; device tensors
        must be copied to host memory by the caller). With a ``snapshot`` (see
        :data:`ShareSnapshot`), the data comes from it instead and ``tensors`` only needs to
        give each tensor's shape and dtype (arrays, variables, or :class:`TensorSpec` values).
        Returns the committed manifest on the coordinator, None on the other ranks.
        """
        t0 = time.perf_counter()
        try:
            plan, share = self._plan_and_share(tensors, rank, world_size, snapshot)
        except Exception as exc:
            self._report_failed_share(step, rank, world_size, gather, coordinator, deadline, exc)
            raise
        return self._save_planned(step, plan, share, _checked_metadata(metadata), rank, gather,
                                  coordinator, lease, deadline, stall_start=t0)

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
    ) -> bool:
        """Snapshot this rank's share into host memory, then persist and commit in the background.

        The caller is blocked only while the snapshot is taken. At most one save is in flight, so
        memory stays bounded by one snapshot of this rank's share: if one is still running,
        ``if_busy="skip"`` drops this request (returns False) and ``"wait"`` blocks until the
        previous one finishes. A multi-writer background save gathers records through the
        store unless ``gather`` is given (it then runs on the background thread).
        ``on_done(manifest, error)`` is called on the background thread when it ends.
        ``snapshot`` supplies the share instead of ``tensors``, as in :meth:`save`; if it
        raises or returns arrays that do not fit the plan, nothing is started. A
        :class:`DeferredShare` is assembled and checked on the background thread (the caller
        pays only for taking it); if that fails, the save fails as a failed write does.
        """
        if if_busy not in ("skip", "wait"):
            raise ValueError(f"if_busy must be 'skip' or 'wait', not {if_busy!r}")
        with self._inflight_lock:
            busy = self._inflight is not None and not self._inflight.done()
        if busy:
            if if_busy == "skip":
                log.info("checkpoint of step %d skipped: the previous save is still being persisted", step)
                return False
            self.wait()
        else:
            self._raise_background_error()
        t0 = time.perf_counter()
        # The snapshot is exactly this rank's pieces, in contiguous host buffers.
        try:
            plan, share = self._plan_and_share(tensors, rank, world_size, snapshot)
        except Exception as exc:
            # the other ranks' background saves gather through the store; tell the coordinator
            self._report_failed_share(step, rank, world_size, gather, coordinator, None, exc)
            raise
        stall = time.perf_counter() - t0
        meta = _checked_metadata(metadata)
        with self._inflight_lock:
            future = self._bg.submit(
                self._save_planned, step, plan, share, meta, rank, gather, coordinator, lease, None,
                stall_s=stall,
            )
            self._inflight = future
        if on_done is not None:
            future.add_done_callback(lambda f: on_done(None if f.exception() else f.result(), f.exception()))
        return True

    def _report_failed_share(self, step: int, rank: int, world_size: int, gather: Gather | None,
                             coordinator: int, deadline: float | None, exc: BaseException) -> None:
        """A rank that could not build its share still reaches the gather with an error record.

        Otherwise the other ranks would wait on it (a collective gather: forever; the store
        gather: until its timeout) before the coordinator abandons the step.
        """
        if world_size <= 1:
            return
        if gather is None:
            if rank == coordinator:
                return  # the others post their records to the store and do not wait for this rank
            gather = StoreGather(self.store, step, rank, world_size, coordinator=coordinator, deadline=deadline,
                                 timeout_s=self.gather_timeout_s)
        try:
            gather({"rank": rank, "error": f"{type(exc).__name__}: {exc}", "pieces": [], "bytes": 0})
        except Exception as gather_exc:  # the caller needs the original error, not this one
            log.warning("could not report the failed share of step %d to the other ranks: %s", step, gather_exc)

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

    def _raise_background_error(self) -> None:
        with self._inflight_lock:
            future, self._inflight = self._inflight, None
        if future is not None and future.exception() is not None:
            log.error("the previous background checkpoint failed: %s", future.exception())

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
        deadline: float | None,
        *,
        stall_start: float | None = None,
        stall_s: float | None = None,
    ) -> Manifest | None:
        world_size = plan.world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        t_write = time.perf_counter()
        if gather is None:
            gather = single_rank_gather if world_size == 1 else StoreGather(
                self.store, step, rank, world_size, coordinator=coordinator, deadline=deadline,
                timeout_s=self.gather_timeout_s)
        try:
            if callable(share):  # deferred: assembled here, on the writing thread
                share = share()
            record = self._write_share(step, rank, share, deadline)
        except Exception as exc:
            # Every rank must still reach the gather, or the others would wait on it forever;
            # the coordinator sees the error record and abandons the step.
            gather({"rank": rank, "error": f"{type(exc).__name__}: {exc}", "pieces": [], "bytes": 0})
            raise
        write_s = time.perf_counter() - t_write
        records = gather(record)
        manifest = None
        if rank == coordinator:
            if records is None:
                raise CheckpointError("the gather returned no records on the coordinator")
            manifest = self._commit(step, plan, records, metadata, lease, deadline)
        stall = stall_s if stall_s is not None else time.perf_counter() - (stall_start or t_write)
        self.last_stats = SaveStats(step, rank, record["bytes"], stall, write_s, manifest is not None)
        return manifest

    def _write_share(self, step: int, rank: int, share: list[tuple[WriteItem, np.ndarray]],
                     deadline: float | None) -> dict[str, Any]:
        nonce = uuid.uuid4().hex[:12]
        pieces: list[PieceRecord] = []
        uploads: list[Future[int]] = []
        for item, flat in share:
            if deadline is not None and time.time() > deadline:
                raise SaveAbandonedError(
                    f"step {step}: rank {rank} ran out of time before writing all its pieces; nothing "
                    "was committed and the previous checkpoint stays the latest")
            prefix = layout.piece_prefix(step, item.group, item.index, nonce)
            for key, data in encode_piece(flat, item.chunk_elements, self.compression).items():
                uploads.append(self._io.submit(self.store.put, prefix + key, data))
            pieces.append(PieceRecord(item.group, item.index, item.start, item.stop, item.chunk_elements,
                                      prefix, crc32c(flat), item.nbytes, rank))
        for future in uploads:
            future.result()
        return {"rank": rank, "nonce": nonce, "pieces": [asdict(p) for p in pieces],
                "bytes": sum(p.nbytes for p in pieces)}

    def _commit(self, step: int, plan: SavePlan, records: list[dict[str, Any]], metadata: dict[str, Any],
                lease: Lease | None, deadline: float | None) -> Manifest:
        failed = [f"rank {r['rank']}: {r['error']}" for r in records if r.get("error")]
        if failed:
            raise SaveAbandonedError(f"step {step}: writers failed ({'; '.join(failed)}); nothing was committed")
        pieces = sorted((PieceRecord(**p) for r in records for p in r["pieces"]),
                        key=lambda p: (p.group, p.index))
        got = [(p.group, p.index, p.start, p.stop) for p in pieces]
        want = [(i.group, i.index, i.start, i.stop) for i in plan.items]
        if got != want:
            raise SaveAbandonedError(
                f"step {step}: the writers' shard records do not cover the save plan exactly "
                f"({len(got)} pieces reported, {len(want)} planned); nothing was committed")
        manifest = Manifest(
            step=step,
            world_size=plan.world_size,
            created_at=time.time(),
            tensors=tuple(TensorEntry(p.spec.name, p.spec.shape, p.spec.dtype, p.spec.dtype, p.offset)
                          for p in plan.placements),
            pieces=tuple(pieces),
            metadata=metadata,
            lease_generation=lease.generation if lease is not None else None,
        )
        token = uuid.uuid4().hex
        body = manifest.to_json()
        mkey = layout.manifest_key(step, token)
        self.store.put(mkey, body)
        generation = lease.fence() if lease is not None else None
        if deadline is not None and time.time() > deadline:
            raise SaveAbandonedError(f"step {step}: the deadline passed before the commit; nothing was committed")
        marker = CommitMarker(step, mkey, crc32c(body), token, time.time(), generation)
        # A lost reply is resolved by reading the marker back (its token is this attempt's):
        # applied is committed, not applied raises the store's error, unknown says so.
        try:
            created = self.store.create_exclusive(layout.commit_key(step), marker.to_json())
        except WriteOutcomeUnknownError as exc:
            raise WriteOutcomeUnknownError(
                f"step {step}: the commit marker write got no answer and could not be read back, so the step may "
                f"or may not be committed in {self.url}; list the committed steps once the store is reachable "
                f"({exc})") from exc
        if not created:
            raise CommitConflictError(
                f"step {step} is already committed in {self.url}; the existing commit stands")
        log.info("committed step %d (%d bytes, %d writers) to %s", step, manifest.nbytes,
                 plan.world_size, self.url)
        try:
            self.gc()
        except CheckpointError as exc:  # retention is housekeeping: never fail a commit for it
            log.warning("retention after step %d failed: %s", step, exc)
        return manifest

    # ----------------------------------------------------------------- reading

    def all_steps(self) -> list[int]:
        """Committed steps, ascending."""
        steps = (layout.parse_commit_key(k) for k in self.store.list(layout.COMMITS_PREFIX))
        return sorted(s for s in steps if s is not None)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def commit_marker(self, step: int) -> CommitMarker:
        key = layout.commit_key(step)
        try:
            data = self.store.get(key)
        except KeyError:
            raise NothingToRestoreError(
                f"step {step} is not committed in {self.url} (committed: {self.all_steps() or 'none'})"
            ) from None
        return CommitMarker.from_json(data, where=f"{self.url}/{key}")

    def manifest(self, step: int) -> Manifest:
        marker = self.commit_marker(step)
        where = f"{self.url}/{marker.manifest_key}"
        try:
            body = self.store.get(marker.manifest_key)
        except KeyError:
            raise CorruptCheckpointError(f"{where} (named by the commit of step {step}) is missing") from None
        if crc32c(body) != marker.manifest_crc32c:
            raise CorruptCheckpointError(f"{where} does not match the checksum in the commit marker")
        return Manifest.from_json(body, where=where)

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
        and raises StructureMismatchError on any difference. When the latest step fails
        verification and no step was asked for, the previous committed step is tried, with
        a warning naming what failed.
        """
        candidates = [step] if step is not None else list(reversed(self.all_steps()))
        if not candidates:
            raise NothingToRestoreError(
                f"no committed checkpoint in {self.url}: nothing to restore (start from scratch, or check "
                "the URL)")
        failures: list[str] = []
        for candidate in candidates:
            try:
                return self._load(candidate, names, partition, expected)
            except CorruptCheckpointError as exc:
                if step is not None:
                    raise
                failures.append(f"step {candidate}: {exc}")
                log.warning("checkpoint step %d failed verification (%s); falling back to the previous "
                            "committed step", candidate, exc)
        raise CorruptCheckpointError("every committed step failed verification: " + "; ".join(failures))

    def _load(self, step: int, names: Iterable[str] | None, partition: tuple[int, int] | None,
              expected: Mapping[str, Any] | None) -> Checkpoint:
        manifest = self.manifest(step)
        entries = {t.name: t for t in manifest.tensors}
        if expected is not None:
            _check_expected(entries, expected, step)
        wanted = list(entries) if names is None else list(names)
        if partition is not None:
            reader, readers = partition
            share = set(plan_reads([entries[n].placement for n in wanted], readers)[reader])
            wanted = [n for n in wanted if n in share]
        missing = [n for n in wanted if n not in entries]
        if missing:
            raise StructureMismatchError(f"step {step} has no tensors named {missing}")
        # Per needed piece, the hull of the elements the wanted tensors occupy in it: a reader
        # fetches only the chunks under that range (all of them, for a full restore).
        reads: list[tuple[PieceRecord, int, int]] = []
        for piece in manifest.pieces:
            spans = [(max(entries[n].offset, piece.start), min(entries[n].offset + entries[n].size, piece.stop))
                     for n in wanted if _overlaps(entries[n], piece)]
            if spans:
                reads.append((piece, min(a for a, _ in spans), max(b for _, b in spans)))
        out = {n: np.empty(entries[n].size, dtype=entries[n].dtype) for n in wanted}
        for (piece, lo_read, _hi), flat in zip(reads, self._io.map(lambda r: self._read_piece(*r), reads)):
            for name in wanted:
                entry = entries[name]
                if _overlaps(entry, piece):
                    lo, hi = max(entry.offset, piece.start), min(entry.offset + entry.size, piece.stop)
                    out[name][lo - entry.offset:hi - entry.offset] = flat[lo - lo_read:hi - lo_read]
        tensors = {n: out[n].reshape(entries[n].shape) for n in wanted}
        return Checkpoint(step, tensors, dict(manifest.metadata), manifest)

    def _read_piece(self, piece: PieceRecord, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """Group elements [start, stop) (default: the whole piece) from one piece, verified."""
        start = piece.start if start is None else start
        stop = piece.stop if stop is None else stop
        where = f"{self.url}/{piece.key}"
        lo, hi = start - piece.start, stop - piece.start  # positions inside the piece
        objects: dict[str, bytes | None] = {}
        for key in chunk_keys(piece.stop - piece.start, piece.chunk_elements, lo, hi):
            try:
                objects[key] = self.store.get(piece.key + key)
            except KeyError:
                objects[key] = None
        flat = decode_piece(objects, where=where, start=lo, stop=hi)  # verifies each chunk's crc32c
        whole = (start, stop) == (piece.start, piece.stop)
        if flat.size != hi - lo or (whole and crc32c(flat) != piece.crc32c):
            raise CorruptCheckpointError(
                f"{where} (group {piece.group}, elements {piece.start}-{piece.stop}) does not match its "
                "recorded crc32c")
        return flat

    def verify(self, step: int) -> VerifyReport:
        """Read every piece of ``step`` and check every checksum; never raises for corruption."""
        try:
            manifest = self.manifest(step)
        except CorruptCheckpointError as exc:
            return VerifyReport(step, False, (str(exc),), 0)
        problems: list[str] = []
        checked = 0

        def check(piece: PieceRecord) -> str | None:
            try:
                self._read_piece(piece)
            except CorruptCheckpointError as exc:
                names = [t.name for t in manifest.tensors if _overlaps(t, piece)]
                return f"tensors {names}: {exc}"
            return None

        for piece, problem in zip(manifest.pieces, self._io.map(check, manifest.pieces)):
            if problem:
                problems.append(problem)
            else:
                checked += piece.nbytes
        return VerifyReport(step, not problems, tuple(problems), checked)

    # ---------------------------------------------------------------- retention

    def delete(self, step: int) -> None:
        """Delete a step: the commit marker first, so it is never visible half-deleted."""
        self.store.delete(layout.commit_key(step))
        self.store.delete_prefix(layout.step_prefix(step))

    def gc(self, keep: int | None = None) -> list[int]:
        """Apply retention; also remove abandoned uncommitted steps older than the latest.

        Never deletes the latest committed step, nor an uncommitted step that is newer than
        it or was written to within ``abandoned_after_s`` (it may still be being written).
        Temp files of writes killed midway (local store) go once that old too.
        """
        now = self.clock()
        self.store.sweep_temporary(self.abandoned_after_s, now=now)
        committed = self.all_steps()
        if not committed:
            return []
        doomed = steps_to_delete(committed, keep if keep is not None else self.max_to_keep,
                                 self.keep_every_n_steps)
        for step in doomed:
            self.delete(step)
        latest = committed[-1]
        for name in self.store.list_dirs(layout.STEPS_PREFIX):
            uncommitted = layout.parse_step_dir(name)
            if uncommitted is None or uncommitted in committed or uncommitted >= latest:
                continue
            keys = list(self.store.list(layout.step_prefix(uncommitted)))
            infos = [i for i in (self.store.stat(k) for k in keys) if i is not None]
            if infos and now - max(i.mtime for i in infos) > self.abandoned_after_s:
                self.store.delete_prefix(layout.step_prefix(uncommitted))
                doomed.append(uncommitted)
        if doomed:
            log.info("retention removed steps %s from %s", doomed, self.url)
        return doomed

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._bg.shutdown(wait=True)
            self._io.shutdown(wait=True)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _overlaps(entry: TensorEntry, piece: PieceRecord) -> bool:
    return (entry.group == piece.group and entry.size > 0
            and entry.offset < piece.stop and piece.start < entry.offset + entry.size)


def prepare_share(plan: SavePlan, rank: int, tensors: Mapping[str, Any]) -> list[tuple[WriteItem, np.ndarray]]:
    """This rank's pieces, each one contiguous little-endian host array (one copy of its bytes).

    Device tensors are converted to host arrays only if they hold bytes of this rank's share.
    """
    hosted: dict[str, np.ndarray] = {}

    def flat_of(name: str) -> np.ndarray:
        if name not in hosted:
            hosted[name] = np.asarray(tensors[name]).reshape(-1)  # a view for numpy arrays
        return hosted[name]

    share = []
    for item in plan.for_rank(rank):
        out = np.empty(item.stop - item.start, dtype=np.dtype(item.group).newbyteorder("<"))
        for p in plan.placements:
            if p.spec.dtype != item.group or not (p.offset < item.stop and item.start < p.stop):
                continue
            lo, hi = max(p.offset, item.start), min(p.stop, item.stop)
            out[lo - item.start:hi - item.start] = flat_of(p.spec.name)[lo - p.offset:hi - p.offset]
        share.append((item, out))
    return share


def _specs(tensors: Mapping[str, Any], *, data_needed: bool) -> TensorSpecs | list[TensorSpec]:
    """Specs of ``tensors``; a TensorSpec value stands for a tensor whose data a share snapshot supplies."""
    if isinstance(tensors, TensorSpecs):
        if data_needed and tensors:
            raise _no_data_error(next(iter(tensors)))
        return tensors  # checked when it was made
    specs = []
    for name, value in tensors.items():
        if not isinstance(value, TensorSpec):
            specs.append(spec_of(name, value))
            continue
        if data_needed:
            raise _no_data_error(name)
        try:
            specs.append(checked_spec(name, value))
        except BadTensorSpecError as exc:
            raise BadSnapshotError(str(exc)) from exc
    return specs


def _no_data_error(name: str) -> BadSnapshotError:
    return BadSnapshotError(f"tensor {name!r} is given as a TensorSpec, which holds no data: pass its array, "
                            "or a share snapshot that supplies the data")


def _checked_share(plan: SavePlan, rank: int, arrays: Sequence[Any]) -> list[tuple[WriteItem, np.ndarray]]:
    """Pair a share snapshot's arrays with this rank's pieces, checked, as little-endian contiguous arrays."""
    items = plan.for_rank(rank)
    arrays = list(arrays)
    if len(arrays) != len(items):
        raise BadSnapshotError(
            f"the share snapshot returned {len(arrays)} arrays, but rank {rank} writes {len(items)} pieces")
    share = []
    for item, array in zip(items, arrays):
        flat = np.asarray(array)
        want = np.dtype(item.group).newbyteorder("<")
        size = item.stop - item.start
        if flat.ndim != 1 or flat.size != size or flat.dtype.newbyteorder("<") != want:
            raise BadSnapshotError(
                f"piece {item.index} of group {item.group} (elements {item.start}-{item.stop}, rank {rank}): "
                f"the share snapshot returned {flat.dtype} {flat.shape}, expected {item.group} ({size},)")
        share.append((item, np.ascontiguousarray(flat, dtype=want)))  # no copy in the normal case
    return share


def _checked_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise BadMetadataError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata)))
    except (TypeError, ValueError) as exc:
        raise BadMetadataError(
            f"checkpoint metadata must be JSON-serialisable ({exc}); convert numpy scalars with "
            "int()/float() and arrays with .tolist(), or save arrays as tensors") from exc


def _check_expected(entries: Mapping[str, TensorEntry], expected: Mapping[str, Any], step: int) -> None:
    problems = []
    for name, want in expected.items():
        if name not in entries:
            problems.append(f"{name}: missing from the checkpoint")
            continue
        if isinstance(want, tuple) and len(want) == 2 and not isinstance(want[0], int):
            shape, dtype = tuple(want[0]), np.dtype(want[1])
        else:
            arr = np.asarray(want)
            shape, dtype = arr.shape, arr.dtype
        entry = entries[name]
        # byte order is normalised to little-endian on save, so it is not a mismatch
        if tuple(entry.shape) != tuple(shape) or np.dtype(entry.dtype) != dtype.newbyteorder("<"):
            problems.append(f"{name}: stored {entry.shape} {entry.dtype}, expected {tuple(shape)} {dtype}")
    extra = sorted(set(entries) - set(expected))
    if extra:
        problems.append(f"not expected but stored: {extra}")
    if problems:
        raise StructureMismatchError(f"step {step} does not match the expected structure: " + "; ".join(problems))
