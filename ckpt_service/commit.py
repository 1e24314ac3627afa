"""The coordinator's commit: check the writers' records, write the manifest, fence, create the marker.

The commit marker is created create-only and last, after the lease is fenced: a step
exists for readers only once it is, and of two masters racing for one step, one wins.

With a deadline every request of the commit ends by it. Until the marker write is sent,
running out of time means nothing was committed (SaveAbandonedError). Once it is sent, the
answer decides, or if none came, reading the marker back: this attempt's marker is there
(committed), it is not (SaveAbandonedError), or the read-back failed too, and then the
outcome is unknown and is reported as such (WriteOutcomeUnknownError), never as a failure.

Ordering. The marker records the lease fence number its fence wrote and the number the lease
held when the save began (``based_on``); a lower step whose save began at or after a higher
step's fence supersedes it (:mod:`ckpt_service.manifest`): a rollback, or a successor's commit
in place of an old master's. A save already under way when a higher step was committed
supersedes nothing, so a slow background save can never hide the step committed after it.
A save without a lease of a step older than the latest committed one is refused before its
manifest (OutOfOrderSaveError): nothing could order it after the newer step, which would stay
the latest. The exception is a newer step that fails verification (only a save without a
deadline has time to read it): the save goes on, and the damaged step stays, never restored.
A save with a lease of a lower step is a rollback and supersedes the higher steps, unless one
of them was committed without a lease (refused too).

Re-committing a step whose marker exists. Only a commit whose fence is newer than the existing
marker's may replace it (a marker without a fence is older than any fence), deadline or not:
an old master that resumes after its successor committed the step gets CommitConflictError.
Such a marker is then replaced, by a compare-and-swap on its object generation, when it does
not stand for a valid commit: it is unreadable, superseded, made before this lease holder's
tenure began (an older master's), or its manifest is missing or does not match its checksum,
or, for a save without a deadline, a piece fails verification (the whole step is read).
Otherwise CommitConflictError: a genuine commit of the step stands. A save with a deadline (an
emergency save) cannot afford to read the step back, and reporting "already committed" for a
step that may be corrupt would lose it; its own commit is complete and fenced under a newer
fence, so it takes the existing one's place. The replaced commit's files are left to gc,
which keeps them for ``abandoned_after_s`` after the replacement (a restore may be reading them).
"""
from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Sequence

from ckpt_service import layout
from ckpt_service.cancel import CancelToken, check
from ckpt_service.deadline import Deadline
from ckpt_service.errors import (
    CommitConflictError,
    CorruptCheckpointError,
    LeaseLostError,
    OutOfOrderSaveError,
    PreconditionFailedError,
    SaveAbandonedError,
    StoreDeadlineError,
)
from ckpt_service.lease import Lease
from ckpt_service.manifest import CommitMarker, Manifest, TensorEntry, crc32c
from ckpt_service.plan import SavePlan
from ckpt_service.reader import CheckpointReader, list_commits, read_marker
from ckpt_service.shard_records import ShardRecord, pieces_to_commit
from ckpt_service.stores.base import ObjectStore, WriteOutcomeUnknownError

log = logging.getLogger(__name__)

#: how often a commit looks at an existing marker again when it changed under the compare-and-swap
MARKER_ATTEMPTS = 4
#: threads that read an existing step back to verify it on a conflict
VERIFY_THREADS = 4


def build_manifest(step: int, plan: SavePlan, records: Sequence[ShardRecord], metadata: dict[str, Any],
                   lease_generation: int | None, attempt: str | None = None) -> Manifest:
    """The manifest of ``step`` (pure but for its timestamp); raises unless the records are all of this
    step, ``attempt`` and plan, and cover the plan."""
    return Manifest(
        step=step,
        world_size=plan.world_size,
        created_at=time.time(),
        tensors=tuple(TensorEntry(p.spec.name, p.spec.shape, p.spec.dtype, p.spec.dtype, p.offset)
                      for p in plan.placements),
        pieces=pieces_to_commit(step, plan, records, attempt=attempt),
        metadata=metadata,
        lease_generation=lease_generation,
        attempt=attempt,
    )


def commit_step(store: ObjectStore, step: int, plan: SavePlan, records: Sequence[ShardRecord],
                metadata: dict[str, Any], lease: Lease | None, deadline: Deadline | None = None, *,
                attempt: str | None = None, cancel: CancelToken | None = None,
                based_on: int | None = None) -> Manifest:
    """Commit ``step`` from every writer's record of save ``attempt``; returns its manifest, whose
    ``lease_generation`` is the one the commit's fence wrote (its marker's). The manifest in the store,
    written before the fence, holds the generation held then: the marker's is the one that orders commits.

    Raises WriterFailedError, IncompleteShardRecordsError or its MismatchedShardRecordsError
    (bad records, or records of another step, attempt or plan), OutOfOrderSaveError (older than
    a step it cannot supersede), LeaseLostError (fenced out), SaveAbandonedError (deadline),
    CommitConflictError (a valid commit of the step exists),
    WriteOutcomeUnknownError (the marker write's outcome is unknown), SaveCancelledError (``cancel``
    was set before the marker was sent; it is checked before each step). Nothing is committed
    unless it returns, or that last error says the outcome is unknown.

    ``based_on`` is the fence number the lease held when the save began (default: the one it holds
    now): the commit supersedes only higher steps fenced by then.
    """
    if lease is not None and based_on is None:
        based_on = lease.generation
    manifest = build_manifest(step, plan, records, metadata, lease.generation if lease is not None else None,
                              attempt)
    token = uuid.uuid4().hex
    body = manifest.to_json()
    mkey = layout.manifest_key(step, token)
    bounded = store if deadline is None else store.within(deadline)
    try:
        check(cancel, step, "before its commit")
        _check_order(store, bounded, step, lease, deadline)
        check(cancel, step, "before its manifest was written")
        bounded.put(mkey, body)
        check(cancel, step, "before the lease fence")
        generation = lease.fence(deadline=deadline) if lease is not None else None
    except (StoreDeadlineError, WriteOutcomeUnknownError) as exc:
        if deadline is None or not _out_of_time(exc):
            raise
        # the marker was never sent: whatever the fence's fate, the step is not committed
        raise SaveAbandonedError(f"step {step}: the manifest or the lease fence could not be written before the "
                                 f"deadline ({exc}); nothing was committed") from exc
    if lease is not None and based_on is not None and based_on < (lease.acquired_generation or 0):
        # begun under an earlier tenure of this holder (it released, another master may have committed,
        # and it took the lease again): what this save knew of the store is stale
        raise LeaseLostError(f"step {step}: this save began under lease fence {based_on}, before this holder took "
                             f"the lease again (fence {lease.acquired_generation}); nothing was committed")
    if deadline is not None and deadline.expired(time.time()):
        raise SaveAbandonedError(f"step {step}: the deadline passed before the commit; nothing was committed")
    check(cancel, step, "before its commit marker was written")  # the last point a cancel can stop it
    marker = CommitMarker(step, mkey, crc32c(body), token, time.time(), generation,
                          based_on if generation is not None else None,
                          lease.lineage if lease is not None and generation is not None else None)
    # A lost reply is resolved by reading the marker back (its token is this attempt's):
    # applied is committed, not applied raises the store's error, unknown says so.
    try:
        _write_marker(store, bounded, marker, lease, deadline)
    except WriteOutcomeUnknownError as exc:
        when = " before the deadline" if deadline is not None else ""
        raise WriteOutcomeUnknownError(
            f"step {step}: the commit marker write got no answer{when} and could not be read back, so the step "
            f"may or may not be committed in {store.url}; list the committed steps once the store is reachable "
            f"({exc})") from exc
    except StoreDeadlineError as exc:  # not sent, or sent and read back as not applied
        raise SaveAbandonedError(f"step {step}: the commit marker could not be written before the deadline, and "
                                 f"it is not in the store; nothing was committed ({exc})") from exc
    log.info("committed step %d (%d bytes, %d writers) to %s", step, manifest.nbytes, plan.world_size, store.url)
    return replace(manifest, lease_generation=generation)


def _check_order(store: ObjectStore, bounded: ObjectStore, step: int, lease: Lease | None,
                 deadline: Deadline | None) -> None:
    """Refuse a commit of ``step`` that the committed steps above it would outrank.

    One listing of ``commits/``; markers are read only when a step above this one is listed
    (a save in order reads none, which matters under a deadline).
    """
    higher = [s for s in (layout.parse_commit_key(k) for k in bounded.list(layout.COMMITS_PREFIX))
              if s is not None and s > step]
    if not higher:
        return
    if lease is None:
        newer = [s for s in list_commits(bounded).committed if s > step]
        restorable = newer if deadline is not None else _restorable(store, newer)
        if restorable:
            raise OutOfOrderSaveError(
                f"step {step} is older than step {restorable[-1]}, the latest committed in {store.url}: a save "
                "without a lease cannot be ordered after it, so it would never be restored; save a step after the "
                "latest, or pass the master lease to roll back")
        if newer:
            log.warning("step %d: the newer committed steps %s of %s fail verification; committing below them",
                        step, newer, store.url)
        return
    # Holding the lease, this commit supersedes every higher step fenced before the save began.
    unordered = [s for s, (gone, marker) in ((s, read_marker(bounded, s)) for s in higher)
                 if not gone and (marker is None or marker.order is None or marker.order.lineage != lease.lineage)]
    if unordered:
        raise OutOfOrderSaveError(
            f"step {step} is older than step(s) {unordered} of {store.url}, committed without a lease or by another "
            "run (another lease lineage): a rollback cannot supersede them; delete them first or save a step after "
            "them")


def _write_marker(store: ObjectStore, bounded: ObjectStore, marker: CommitMarker, lease: Lease | None,
                  deadline: Deadline | None) -> None:
    """Create the marker, or replace an existing one that is not a valid commit; CommitConflictError else."""
    step, key, data = marker.step, layout.commit_key(marker.step), marker.to_json()
    for _ in range(MARKER_ATTEMPTS):
        if bounded.create_exclusive(key, data):
            return
        existing = bounded.get_versioned(key)
        if existing is None:
            continue  # deleted since (gc of a superseded step): create it again
        reason = _why_replaceable(store, bounded, marker, existing[0], lease, deadline)
        if reason is None:
            raise CommitConflictError(f"step {step} is already committed in {store.url}; the existing commit stands")
        try:
            bounded.put_resolved(key, data, if_generation_match=existing[1])
        except PreconditionFailedError:
            continue  # another writer moved it meanwhile: look at what is there now
        log.warning("step %d: replaced its existing commit marker in %s: %s", step, store.url, reason)
        return
    raise CommitConflictError(f"step {step}: its commit marker in {store.url} kept changing under this commit "
                              f"({MARKER_ATTEMPTS} tries); another master is committing it")


def _why_replaceable(store: ObjectStore, bounded: ObjectStore, new: CommitMarker, existing: bytes,
                     lease: Lease | None, deadline: Deadline | None) -> str | None:
    """Why the existing marker ``existing`` of ``new.step`` may give way to ``new`` (None: it stands)."""
    step = new.step
    where = f"{store.url}/{layout.commit_key(step)}"
    try:
        marker = CommitMarker.from_json(existing, where=where)
    except CorruptCheckpointError as exc:
        return f"it is unreadable ({exc})"
    if marker.order is not None and marker.lineage != new.lineage:
        return f"it was made by another run (lease lineage {marker.lineage}), whose fence numbers order nothing here"
    if marker.fence is not None and (new.fence is None or new.fence <= marker.fence):
        log.warning("step %d: its commit under fence %s stands; this commit's fence (%s) is not newer", step,
                    marker.fence, new.fence)
        return None  # a commit can only be replaced by one fenced after it
    made, tenure = marker.fence, lease.acquired_generation if lease is not None else None
    if made is not None and tenure is not None and made < tenure:
        return f"it was made under lease fence {made}, before this holder's tenure (fence {tenure})"
    try:
        body = bounded.get(marker.manifest_key)
    except KeyError:
        return f"its manifest {marker.manifest_key} is missing"
    if crc32c(body) != marker.manifest_crc32c:
        return f"its manifest {marker.manifest_key} does not match the checksum in the marker"
    if deadline is not None:
        return "it cannot be verified in the time the deadline leaves, and this commit is complete"
    if step in list_commits(bounded).superseded:
        return "it is superseded by a lower step committed in its place"
    problems = _problems(store, step)
    if problems:
        return "it fails verification: " + "; ".join(problems)
    return None


def _problems(store: ObjectStore, step: int) -> tuple[str, ...]:
    """What fails when ``step`` is read back in full (nothing: it verifies)."""
    with ThreadPoolExecutor(max_workers=VERIFY_THREADS, thread_name_prefix="ckpt-verify") as io:
        return CheckpointReader(store, io).verify(step).problems


def _restorable(store: ObjectStore, steps: Sequence[int]) -> list[int]:
    """The ``steps`` that verify in full, ascending; read newest first, stopping at the first that does."""
    for step in sorted(steps, reverse=True):
        if not _problems(store, step):
            return [s for s in steps if s <= step]
    return []


def _out_of_time(exc: BaseException) -> bool:
    """Whether a store error is (or an unknown write outcome comes from) running out of time."""
    return isinstance(exc, StoreDeadlineError) or isinstance(exc.__cause__, StoreDeadlineError)
