"""The coordinator's commit: check the writers' records, write the manifest, fence, create the marker.

The commit marker is created create-only and last, after the lease is fenced: a step
exists for readers only once it is, and of two masters racing for one step, one wins.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Sequence

from ckpt_service import layout
from ckpt_service.errors import CommitConflictError, SaveAbandonedError
from ckpt_service.lease import Lease
from ckpt_service.manifest import CommitMarker, Manifest, TensorEntry, crc32c
from ckpt_service.plan import SavePlan
from ckpt_service.shard_records import ShardRecord, pieces_to_commit
from ckpt_service.stores.base import ObjectStore, WriteOutcomeUnknownError

log = logging.getLogger(__name__)


def build_manifest(step: int, plan: SavePlan, records: Sequence[ShardRecord], metadata: dict[str, Any],
                   lease_generation: int | None) -> Manifest:
    """The manifest of ``step`` (pure but for its timestamp); raises unless the records cover the plan."""
    return Manifest(
        step=step,
        world_size=plan.world_size,
        created_at=time.time(),
        tensors=tuple(TensorEntry(p.spec.name, p.spec.shape, p.spec.dtype, p.spec.dtype, p.offset)
                      for p in plan.placements),
        pieces=pieces_to_commit(step, plan, records),
        metadata=metadata,
        lease_generation=lease_generation,
    )


def commit_step(store: ObjectStore, step: int, plan: SavePlan, records: Sequence[ShardRecord],
                metadata: dict[str, Any], lease: Lease | None, deadline: float | None) -> Manifest:
    """Commit ``step`` from every writer's record; returns its manifest.

    Raises WriterFailedError or IncompleteShardRecordsError (bad records), LeaseLostError
    (fenced out), SaveAbandonedError (deadline), CommitConflictError (already committed),
    WriteOutcomeUnknownError (the marker write's outcome is unknown). Nothing is committed
    unless it returns, or that last error says the outcome is unknown.
    """
    manifest = build_manifest(step, plan, records, metadata, lease.generation if lease is not None else None)
    token = uuid.uuid4().hex
    body = manifest.to_json()
    mkey = layout.manifest_key(step, token)
    store.put(mkey, body)
    generation = lease.fence() if lease is not None else None
    if deadline is not None and time.time() > deadline:
        raise SaveAbandonedError(f"step {step}: the deadline passed before the commit; nothing was committed")
    marker = CommitMarker(step, mkey, crc32c(body), token, time.time(), generation)
    # A lost reply is resolved by reading the marker back (its token is this attempt's):
    # applied is committed, not applied raises the store's error, unknown says so.
    try:
        created = store.create_exclusive(layout.commit_key(step), marker.to_json())
    except WriteOutcomeUnknownError as exc:
        raise WriteOutcomeUnknownError(
            f"step {step}: the commit marker write got no answer and could not be read back, so the step may "
            f"or may not be committed in {store.url}; list the committed steps once the store is reachable "
            f"({exc})") from exc
    if not created:
        raise CommitConflictError(f"step {step} is already committed in {store.url}; the existing commit stands")
    log.info("committed step %d (%d bytes, %d writers) to %s", step, manifest.nbytes, plan.world_size, store.url)
    return manifest
