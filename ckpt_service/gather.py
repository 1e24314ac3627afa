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
from typing import Callable, Optional

from ckpt_service.errors import SaveAbandonedError
from ckpt_service.layout import record_key
from ckpt_service.shard_records import RecordJSON
from ckpt_service.stores.base import ObjectStore

log = logging.getLogger(__name__)

Gather = Callable[[RecordJSON], Optional[list[RecordJSON]]]


def single_rank_gather(record: RecordJSON) -> list[RecordJSON]:
    return [record]


class StoreGather:
    """Each rank writes ``records/rank-N.json``; the coordinator polls until all W are there.

    Polling is the only way to wait on an object store; the interval grows to
    ``max_interval_s`` so a slow writer does not cost a request storm.
    """

    def __init__(self, store: ObjectStore, step: int, rank: int, world_size: int, *,
                 coordinator: int = 0, deadline: float | None = None, timeout_s: float = 600.0,
                 max_interval_s: float = 0.5) -> None:
        self.store, self.step, self.rank, self.world_size = store, step, rank, world_size
        self.coordinator = coordinator
        self.deadline = deadline if deadline is not None else time.time() + timeout_s
        self.max_interval_s = max_interval_s

    def __call__(self, record: RecordJSON) -> list[RecordJSON] | None:
        self.store.put(record_key(self.step, self.rank), json.dumps(record).encode())
        if self.rank != self.coordinator:
            return None
        missing = set(range(self.world_size))
        records: dict[int, RecordJSON] = {}
        interval = 0.005
        while True:
            for rank in sorted(missing):
                try:
                    records[rank] = json.loads(self.store.get(record_key(self.step, rank)))
                except KeyError:
                    continue
            missing -= set(records)
            if not missing:
                return [records[r] for r in range(self.world_size)]
            if time.time() >= self.deadline:
                raise SaveAbandonedError(
                    f"step {self.step}: ranks {sorted(missing)} did not report their shards before the "
                    "deadline; the save was abandoned and the previous checkpoint stays the latest"
                )
            time.sleep(min(interval, max(0.0, self.deadline - time.time())))
            interval = min(self.max_interval_s, interval * 2)
