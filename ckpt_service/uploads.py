"""A rank's share of a save in the store: its pieces uploaded in parallel under keys unique to the
attempt, and the wait for them, bounded by the save's deadline and ended early by a cancel.

Each piece is framed, checksummed and written on the I/O executor's threads; a local store gets
the caller's arrays straight into its files (``put_parts``). What has started when the wait ends
(the deadline passed, an upload failed, the save was cancelled) runs on to its own end and leaves
objects for gc; what has not is cancelled.
"""
from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Executor, Future
from concurrent.futures import wait as wait_futures
from typing import Callable, Iterable

from ckpt_service import layout
from ckpt_service.cancel import CancelToken, check
from ckpt_service.deadline import Deadline
from ckpt_service.errors import SaveAbandonedError, SaveCancelledError, StoreDeadlineError
from ckpt_service.manifest import PieceRecord, crc32c
from ckpt_service.piece_io import Parts, piece_objects
from ckpt_service.shard_records import ShardRecord
from ckpt_service.share import Piece
from ckpt_service.stores.base import ObjectStore
from ckpt_service.stores.local import LocalStore


def write_share(store: ObjectStore, io: Executor, compression: str, step: int, rank: int, share: list[Piece], *,
            writes: Deadline | None, deadline: Deadline | None, attempt: str | None, plan_digest: str,
            cancel: CancelToken | None = None) -> ShardRecord:
    """Upload this rank's pieces under keys unique to this attempt; returns its shard record.

    Each upload ends by ``writes``; waiting for them ends at ``deadline`` at the latest (a
    request stalled inside one socket operation may overrun its own window a little), or
    when the save is cancelled.
    """
    store = store if writes is None else store.within(writes)
    nonce = uuid.uuid4().hex[:12]
    pieces: list[PieceRecord] = []
    uploads: list[Future[int]] = []
    for item, flat in share:
        if writes is not None and writes.expired(time.time()):
            _cancel(uploads)
            raise abandoned(step, f"rank {rank} ran out of time before writing all its pieces")
        if cancel is not None and cancel.cancelled:
            _cancel(uploads)
            cancel.check(step, f"before rank {rank} wrote all its pieces")
        prefix = layout.piece_prefix(step, item.group, item.index, nonce)
        # each upload frames and checksums its own chunk: that work runs on the io threads
        for key, make in piece_objects(flat, item.chunk_elements, compression).items():
            uploads.append(io.submit(_put, store, prefix + key, make, cancel, step))
        pieces.append(PieceRecord(item.group, item.index, item.start, item.stop, item.chunk_elements,
                                  prefix, crc32c(flat), item.nbytes, rank))
    await_uploads(step, rank, uploads, deadline, cancel)
    return ShardRecord(rank, tuple(pieces), nonce, step=step, attempt=attempt, plan=plan_digest)

def await_uploads(step: int, rank: int, uploads: list[Future[int]], deadline: Deadline | None,
                   cancel: CancelToken | None = None) -> None:
    """Wait for every upload, or until one fails, the deadline passes or the save is cancelled;
    what has not started then is cancelled (what has goes on to its own end and leaves objects
    for gc)."""
    timeout = None if deadline is None else max(0.0, deadline.left(time.time()))
    settled = _settled(uploads)
    wait_futures([settled] if cancel is None else [settled, cancel.fired], timeout=timeout,
                 return_when=FIRST_COMPLETED)
    pending = [f for f in uploads if not f.done()]
    failed = next((f.exception() for f in uploads if f.done() and not f.cancelled() and f.exception()), None)
    if failed is None and not pending:
        return
    _cancel(uploads)
    if cancel is not None and (cancel.cancelled or isinstance(failed, SaveCancelledError)):
        cancel.check(step, f"before rank {rank}'s uploads were done")
    if isinstance(failed, StoreDeadlineError):
        raise abandoned(step, f"rank {rank} could not write its pieces before the deadline ({failed})") from failed
    if failed is not None:
        raise failed
    raise abandoned(step, f"{len(pending)} of rank {rank}'s uploads were not done by the deadline")


def _put(store: ObjectStore, key: str, make: Callable[[], Parts], cancel: CancelToken | None = None,
         step: int = 0) -> int:
    check(cancel, step, "before all its pieces were uploaded")  # one queued behind a cancel starts nothing
    parts = make()
    if type(store) is LocalStore:  # not a wrapper or subclass that overrides put
        return store.put_parts(key, parts)  # straight from the caller's arrays to the file
    return store.put(key, parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts))


def _settled(futures: list[Future[int]]) -> Future[None]:
    """A future done once every one of ``futures`` is, or as soon as one fails or is cancelled."""
    settled: Future[None] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def landed(future: Future[int]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if future.cancelled() or future.exception() is not None or last:
            with lock:
                if not settled.done():
                    settled.set_result(None)

    if not futures:
        settled.set_result(None)
    for future in futures:
        future.add_done_callback(landed)
    return settled


def _cancel(futures: Iterable[Future[int]]) -> None:
    for future in futures:
        future.cancel()  # a no-op on one that is running or done


def abandoned(step: int, what: str) -> SaveAbandonedError:
    return SaveAbandonedError(f"step {step}: {what}; nothing was committed and the previous checkpoint stays "
                              "the latest")
