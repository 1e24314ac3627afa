"""Typed errors of the checkpoint service.

Each one subclasses the builtin a caller would naturally catch, and its message
says what was wrong and what to do about it.
"""
from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by ckpt_service."""
    cli_exit_status = 2  # the command line or configuration must change


class BadStoreURLError(CheckpointError, ValueError):
    """A store URL could not be understood."""


class StoreUnavailableError(CheckpointError, ConnectionError):
    """The store (bucket, directory) does not exist or cannot be reached."""


class MissingBucketError(StoreUnavailableError):
    """The bucket does not exist or these credentials cannot see it: the URL or the set-up is wrong."""

    @classmethod
    def naming(cls, what: str, bucket: str) -> MissingBucketError:
        return cls(f"{what}: bucket {bucket!r} does not exist or is not visible to these credentials; create it "
                   f"with `gcloud storage buckets create gs://{bucket}` or fix the URL")


class StoreDeadlineError(StoreUnavailableError, TimeoutError):
    """A store call bounded by a deadline ran out of time.

    ``attempted`` says whether any request was sent: a write that was may have been applied
    (its outcome is resolved by reading it back); one that was not is known not to be.
    """

    def __init__(self, message: str, *, attempted: bool) -> None:
        super().__init__(message)
        self.attempted = attempted


class MissingCredentialsError(CheckpointError, PermissionError):
    """No credentials were found for a cloud store."""


class ObjectNotFoundError(CheckpointError, KeyError):
    """A key does not exist in the store."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "object not found"


class PreconditionFailedError(CheckpointError):
    """A conditional write lost: the object's generation was not the expected one."""


class NothingToRestoreError(CheckpointError, FileNotFoundError):
    """The store holds no committed checkpoint (or not the requested step)."""


class FormatVersionError(CheckpointError, ValueError):
    """A checkpoint was written in a format this version cannot read."""


class BadTensorNameError(CheckpointError, ValueError):
    """A tensor name would escape the checkpoint's directory or is otherwise unusable."""


class BadStoreKeyError(CheckpointError, ValueError):
    """A store key (or listing prefix) is empty, absolute, or has '.', '..' or empty path segments."""


class StructureMismatchError(CheckpointError, ValueError):
    """A restored tensor's shape or dtype differs from what the caller expected."""


class CorruptCheckpointError(CheckpointError, IOError):
    """Stored data does not match its recorded checksum, or the manifest is unreadable."""
    cli_exit_status = 1  # the command ran and failed


class LeaseLostError(CheckpointError, RuntimeError):
    """The checkpoint-master lease is held by someone else: this process must not commit."""


class SaveAbandonedError(CheckpointError, TimeoutError):
    """A save could not finish before its deadline and was abandoned (nothing was committed)."""


class SaveCancelledError(SaveAbandonedError):
    """A save was cancelled before its commit marker was sent (an emergency save needed the store, or
    a new ring abandoned its predecessor's save): nothing was committed."""


class WriterFailedError(CheckpointError, RuntimeError):
    """A writer of a multi-writer save reported an error instead of its pieces (nothing was committed)."""


class IncompleteShardRecordsError(CheckpointError, ValueError):
    """The writers' shard records are unreadable or do not cover the save plan exactly (nothing was committed)."""


class MismatchedShardRecordsError(IncompleteShardRecordsError):
    """Writers' shard records belong to different saves: another step, save attempt or plan, or pieces
    outside the step or of another writer (nothing was committed)."""


class BadAttemptError(CheckpointError, ValueError):
    """A save attempt id is missing where one is required, or cannot be used in store keys."""


class CommitConflictError(CheckpointError, FileExistsError):
    """This step was already committed (by another master); the earlier commit stands."""


class OutOfOrderSaveError(CheckpointError, ValueError):
    """A save of a step older than the latest committed one, which its commit could not supersede."""


class BadMetadataError(CheckpointError, TypeError):
    """Checkpoint metadata must be a JSON-serialisable dict."""


class BadSnapshotError(CheckpointError, ValueError):
    """A share snapshot does not match this rank's pieces of the plan, or a tensor has no data."""


class BadStepError(CheckpointError, ValueError, TypeError):
    """A step is not a non-negative integer (bool, float and str are refused, numpy integers are taken)."""


class BadRankError(CheckpointError, ValueError):
    """A save's rank or coordinator is outside [0, world_size), or world_size is not a positive integer."""


class BadPartitionError(CheckpointError, ValueError):
    """A restore's ``partition`` is not ``(reader, readers)`` with integers 0 <= reader < readers."""


class BadDeadlineError(CheckpointError, ValueError, TypeError):
    """A save's ``deadline`` is not a finite number of epoch seconds (NaN, infinity, a string...)."""


class BadCompressionError(CheckpointError, ValueError):
    """A compression the checkpoint format does not know (the allowed values are named)."""


class BadNamesError(CheckpointError, TypeError, ValueError):
    """A restore's ``names`` is not a collection of tensor names (one string would read as its characters)."""


class StoreListingError(StoreUnavailableError):
    """Listing the store failed part-way (an unreadable folder, an I/O error): what it holds is unknown,
    so nothing may be taken as absent. Fix the store's permissions or mount, then try again."""


class CheckpointChangedError(CheckpointError, RuntimeError):
    """The step being read was re-committed or deleted while it was read; read it again."""


class InconsistentRestoreError(CheckpointError, RuntimeError):
    """Readers of one restore could not agree on one step; nothing was restored."""
