"""Cold restore for a frontend: the run's latest committed checkpoint, and the counters it was saved at."""
from __future__ import annotations

import logging
from typing import Any, Mapping

from ckpt_service.manager import CheckpointManager
from ckpt_service.reader import Checkpoint
from ckpt_service.stores import open_store
from hvd_transient.core.control import clear_stop

log = logging.getLogger(__name__)


def latest_checkpoint(store: str, *, expected: Mapping[str, Any] | None = None,
                      cold_start: bool = True) -> Checkpoint | None:
    """The newest committed step of ``store`` that verifies, resharded to one reader; None if there is none.

    ``expected``: the live state's specs by name, which the checkpoint must match. On a ``cold_start``
    (an elastic job's launch) a stop request left in the store was for the previous launch: it is
    cleared first.
    """
    if cold_start:
        clear_stop(open_store(store))
    with CheckpointManager(store, max_to_keep=None) as manager:
        if manager.latest_step() is None:
            return None
        ckpt = manager.restore(expected=expected)
    log.info("restored step %d from %s", ckpt.step, store)
    return ckpt


def restored_summary(ckpt: Checkpoint) -> dict[str, Any]:
    """What a frontend reports of a cold restore: the metadata, the step and how many ranks wrote it."""
    return {**ckpt.metadata, "step": ckpt.step, "writers": ckpt.manifest.world_size}


def restored_counters(metadata: Mapping[str, Any], counters: Mapping[str, Any]) -> dict[str, int]:
    """``counters`` updated with the values the checkpoint holds for them (the others unchanged)."""
    return {key: int(metadata[key]) if key in metadata else value for key, value in counters.items()}
