"""The hvd-transient checkpoint service: sharded, atomically committed checkpoints.

    from ckpt_service import CheckpointManager
    mgr = CheckpointManager("gs://bucket/runs/r1", max_to_keep=3)   # or a local path
    mgr.save(step, {"w": array}, metadata={"epoch": 3})
    ckpt = mgr.restore()            # latest committed; restore(step=N) for a given one
    ckpt.step, ckpt.tensors, ckpt.metadata
    mgr.all_steps()

Importing this package does not import zarr or cloud clients until they are used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_service.errors import (
    BadAttemptError,
    BadMetadataError,
    BadPartitionError,
    BadRankError,
    BadSnapshotError,
    BadStepError,
    BadStoreKeyError,
    BadStoreURLError,
    BadTensorNameError,
    CheckpointError,
    CommitConflictError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteShardRecordsError,
    LeaseLostError,
    MismatchedShardRecordsError,
    MissingCredentialsError,
    NothingToRestoreError,
    ObjectNotFoundError,
    OutOfOrderSaveError,
    PreconditionFailedError,
    SaveAbandonedError,
    SaveCancelledError,
    StoreDeadlineError,
    StoreUnavailableError,
    StructureMismatchError,
    WriterFailedError,
)

if TYPE_CHECKING:
    from ckpt_service.cancel import CancelToken
    from ckpt_service.deadline import Deadline
    from ckpt_service.gather import StoreGather
    from ckpt_service.lease import Lease, LeaseHeldError
    from ckpt_service.manager import Checkpoint, CheckpointManager, DeferredShare
    from ckpt_service.plan import BadTensorSpecError, TensorSpec, TensorSpecs
    from ckpt_service.stores import open_store

_LAZY = {
    "CancelToken": "ckpt_service.cancel",
    "Deadline": "ckpt_service.deadline",
    "CheckpointManager": "ckpt_service.manager",
    "Checkpoint": "ckpt_service.manager",
    "DeferredShare": "ckpt_service.manager",
    "TensorSpec": "ckpt_service.plan",
    "TensorSpecs": "ckpt_service.plan",
    "BadTensorSpecError": "ckpt_service.plan",
    "Lease": "ckpt_service.lease",
    "LeaseHeldError": "ckpt_service.lease",
    "StoreGather": "ckpt_service.gather",
    "open_store": "ckpt_service.stores",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckpt_service' has no attribute {name!r}")


__all__ = [
    "BadAttemptError", "BadMetadataError", "BadPartitionError", "BadRankError", "BadSnapshotError", "BadStepError",
    "BadStoreKeyError", "BadStoreURLError", "BadTensorNameError", "CheckpointError", "CommitConflictError",
    "CorruptCheckpointError", "FormatVersionError",
    "IncompleteShardRecordsError", "LeaseLostError", "MismatchedShardRecordsError", "MissingCredentialsError",
    "NothingToRestoreError", "ObjectNotFoundError", "OutOfOrderSaveError", "PreconditionFailedError",
    "SaveAbandonedError", "SaveCancelledError", "StoreDeadlineError", "StoreUnavailableError", "StructureMismatchError",
    "WriterFailedError", *_LAZY,
]
