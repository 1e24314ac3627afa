"""How writers' shard records reach the coordinator.

``ckpt_service`` needs no Horovod: a *gather* is any callable that every rank
calls with its own shard record, in JSON form (:meth:`ShardRecord.to_json`), and
that returns the list of all ranks' records on the coordinator (``None``
elsewhere). ``hvd_transient``
supplies one built on Horovod collectives; :class:`StoreGather` works through
the store itself and needs no collective at all, which is what background
(async) saves use.
"""
from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import tenacity

from ckpt_service.cancel import CancelToken, check
from ckpt_service.deadline import Deadline
from ckpt_service.errors import SaveAbandonedError, StoreDeadlineError
from ckpt_service.layout import check_attempt, record_key, records_prefix
from ckpt_service.shard_records import RecordJSON
from ckpt_service.stores.base import ObjectStore

log = logging.getLogger(__name__)

Gather = Callable[[RecordJSON], Optional[list[RecordJSON]]]


def single_rank_gather(record: RecordJSON) -> list[RecordJSON]:
    return [record]


class StoreGather:
    """Each rank writes ``records/<attempt>/rank-N.json``; the coordinator polls until all W are there.

    ``attempt`` is the save attempt every rank of this save agreed on: the coordinator lists
    and reads only that attempt's records, never those an earlier attempt of the same step
    left behind (a coordinator that died, then a rollback that saves the step again).

    Polling is the only way to wait on an object store; the interval grows to
    ``max_interval_s`` so a slow writer does not cost a request storm. Each poll is one
    listing of the step's ``records/`` (one request per 1000 ranks) rather than a read per
    missing rank, and the records it finds are read ``read_threads`` at a time: the wait
    after the last writer costs O(N / read_threads) round trips, not O(N). With a ``deadline``
    (epoch seconds, or a :class:`~ckpt_service.deadline.Deadline`), every store request ends
    by it and the coordinator stops waiting at it; without one, it waits ``timeout_s``.
    Either way, running out of time raises SaveAbandonedError. The wait is timed on the
    monotonic clock: the deadline is converted to it once, here. A ``cancel`` token is checked
    before this rank's record is written and before each poll, and ends the wait between two
    polls at once: SaveCancelledError.
    """

    def __init__(self, store: ObjectStore, step: int, rank: int, world_size: int, *, attempt: str,
                 coordinator: int = 0, deadline: float | Deadline | None = None, timeout_s: float = 600.0,
                 max_interval_s: float = 0.5, read_threads: int = 16, cancel: CancelToken | None = None) -> None:
        self.step, self.rank, self.world_size = step, rank, world_size
        self.attempt = check_attempt(attempt)
        self.coordinator = coordinator
        bound = Deadline(deadline) if isinstance(deadline, (int, float)) else deadline
        self.store = store if bound is None else store.within(bound)
        # a wall-clock deadline becomes a monotonic one once: a clock step must not stretch the wait
        self.gives_up_at = time.monotonic() + (bound.left(time.time()) if bound is not None else timeout_s)
        self.cancel = cancel
        self.max_interval_s = max_interval_s
        self.read_threads = max(1, read_threads)

    def __call__(self, record: RecordJSON) -> list[RecordJSON] | None:
        try:
            return self._gather(record)
        except StoreDeadlineError as exc:
            raise SaveAbandonedError(
                f"step {self.step}: rank {self.rank} could not exchange shard records before the deadline ({exc}); "
                "the save was abandoned and the previous checkpoint stays the latest") from exc

    def _gather(self, record: RecordJSON) -> list[RecordJSON] | None:
        check(self.cancel, self.step, f"before rank {self.rank} wrote its shard record")
        self.store.put(record_key(self.step, self.attempt, self.rank), json.dumps(record).encode())
        if self.rank != self.coordinator:
            return None
        records: dict[int, RecordJSON] = {self.rank: record}  # its own needs no read-back
        listed = records_prefix(self.step, self.attempt) + "rank-"

        def read(rank: int) -> RecordJSON | None:
            try:
                body: RecordJSON = json.loads(self.store.get(record_key(self.step, self.attempt, rank)))
                return body
            except KeyError:
                return None

        def missing() -> list[int]:
            check(self.cancel, self.step, "while the coordinator waited for the shard records")
            found = {int(stem) for key in self.store.list(listed)
                     if (stem := key[len(listed):].removesuffix(".json")).isdigit()}
            new = sorted(r for r in found if r < self.world_size and r not in records)
            for rank, body in zip(new, pool.map(read, new)):
                if body is not None:
                    records[rank] = body
            return [r for r in range(self.world_size) if r not in records]

        backoff = tenacity.wait_exponential(multiplier=0.005, max=self.max_interval_s)
        polls = tenacity.Retrying(
            retry=tenacity.retry_if_result(bool),  # some ranks still missing; store errors end the wait
            wait=lambda state: min(backoff(state), max(0.0, self.gives_up_at - time.monotonic())),
            stop=lambda state: time.monotonic() >= self.gives_up_at,
            sleep=self.cancel.sleep if self.cancel is not None else time.sleep,  # a cancel ends the pause
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        with ThreadPoolExecutor(max_workers=self.read_threads, thread_name_prefix="ckpt-gather") as pool:
            still_missing = polls(missing)
        if still_missing:
            raise SaveAbandonedError(
                f"step {self.step}: ranks {still_missing} did not report their shards before the "
                "deadline; the save was abandoned and the previous checkpoint stays the latest"
            )
        return [records[r] for r in range(self.world_size)]
