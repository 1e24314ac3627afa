"""The coordinator's commit: check the writers' records, write the manifest, fence, create the marker.

The commit marker is created create-only and last, after the lease is fenced: a step
exists for readers only once it is, and of two masters racing for one step, one wins.

With a deadline every request of the commit ends by it. Until the marker write is sent,
running out of time means nothing was committed (SaveAbandonedError). Once it is sent, the
answer decides, or if none came, reading the marker back: this attempt's marker is there
(committed), it is not (SaveAbandonedError), or the read-back failed too, and then the
outcome is unknown and is reported as such (WriteOutcomeUnknownError), never as a failure.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Sequence

from ckpt_service import layout
from ckpt_service.deadline import Deadline
from ckpt_service.errors import CommitConflictError, SaveAbandonedError, StoreDeadlineError
from ckpt_service.lease import Lease
from ckpt_service.manifest import CommitMarker, Manifest, TensorEntry, crc32c
from ckpt_service.plan import SavePlan
from ckpt_service.shard_records import ShardRecord, pieces_to_commit
from ckpt_service.stores.base import ObjectStore, WriteOutcomeUnknownError

log = logging.getLogger(__name__)


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
    )


def commit_step(store: ObjectStore, step: int, plan: SavePlan, records: Sequence[ShardRecord],
                metadata: dict[str, Any], lease: Lease | None, deadline: Deadline | None = None, *,
                attempt: str | None = None) -> Manifest:
    """Commit ``step`` from every writer's record of save ``attempt``; returns its manifest.

    Raises WriterFailedError, IncompleteShardRecordsError or its MismatchedShardRecordsError
    (bad records, or records of another step, attempt or plan), LeaseLostError
    (fenced out), SaveAbandonedError (deadline), CommitConflictError (already committed),
    WriteOutcomeUnknownError (the marker write's outcome is unknown). Nothing is committed
    unless it returns, or that last error says the outcome is unknown.
    """
    manifest = build_manifest(step, plan, records, metadata, lease.generation if lease is not None else None,
                              attempt)
    token = uuid.uuid4().hex
    body = manifest.to_json()
    mkey = layout.manifest_key(step, token)
    bounded = store if deadline is None else store.within(deadline)
    try:
        bounded.put(mkey, body)
        generation = lease.fence(deadline=deadline) if lease is not None else None
    except (StoreDeadlineError, WriteOutcomeUnknownError) as exc:
        if deadline is None or not _out_of_time(exc):
            raise
        # the marker was never sent: whatever the fence's fate, the step is not committed
        raise SaveAbandonedError(f"step {step}: the manifest or the lease fence could not be written before the "
                                 f"deadline ({exc}); nothing was committed") from exc
    if deadline is not None and deadline.expired(time.time()):
        raise SaveAbandonedError(f"step {step}: the deadline passed before the commit; nothing was committed")
    marker = CommitMarker(step, mkey, crc32c(body), token, time.time(), generation)
    # A lost reply is resolved by reading the marker back (its token is this attempt's):
    # applied is committed, not applied raises the store's error, unknown says so.
    try:
        created = bounded.create_exclusive(layout.commit_key(step), marker.to_json())
    except WriteOutcomeUnknownError as exc:
        when = " before the deadline" if deadline is not None else ""
        raise WriteOutcomeUnknownError(
            f"step {step}: the commit marker write got no answer{when} and could not be read back, so the step "
            f"may or may not be committed in {store.url}; list the committed steps once the store is reachable "
            f"({exc})") from exc
    except StoreDeadlineError as exc:  # not sent, or sent and read back as not applied
        raise SaveAbandonedError(f"step {step}: the commit marker could not be written before the deadline, and "
                                 f"it is not in the store; nothing was committed ({exc})") from exc
    if not created:
        raise CommitConflictError(f"step {step} is already committed in {store.url}; the existing commit stands")
    log.info("committed step %d (%d bytes, %d writers) to %s", step, manifest.nbytes, plan.world_size, store.url)
    return manifest


def _out_of_time(exc: BaseException) -> bool:
    """Whether a store error is (or an unknown write outcome comes from) running out of time."""
    return isinstance(exc, StoreDeadlineError) or isinstance(exc.__cause__, StoreDeadlineError)
