"""Applies retention to a store: deletes old committed steps and abandoned uncommitted ones.

Only ``steps/`` and ``commits/`` are listed or deleted here (and temp files of killed
writes, by the store): the training side's objects in the same store are never touched.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from ckpt_service import layout
from ckpt_service.reader import committed_steps
from ckpt_service.retention import RetentionPolicy, is_abandoned, steps_to_delete, uncommitted_before_latest
from ckpt_service.stores.base import ObjectStore

log = logging.getLogger(__name__)


class StepCollector:
    """Deletes what a :class:`RetentionPolicy` no longer keeps."""

    def __init__(self, store: ObjectStore, policy: RetentionPolicy, *,
                 clock: Callable[[], float] = time.time) -> None:
        """``clock`` gives wall-clock seconds for the ages of files (tests move it)."""
        self.store, self.policy, self.clock = store, policy, clock

    def delete(self, step: int) -> None:
        """Delete a step: the commit marker first, so it is never visible half-deleted."""
        self.store.delete(layout.commit_key(step))
        self.store.delete_prefix(layout.step_prefix(step))

    def collect(self, keep: int | None = None) -> list[int]:
        """Apply retention (``keep`` overrides ``max_to_keep``); also remove abandoned uncommitted steps.

        Never deletes the latest committed step, nor an uncommitted step that is newer than
        it or was written to within ``abandoned_after_s`` (it may still be being written).
        Temp files of writes killed midway (local store) go once that old too.
        """
        now = self.clock()
        self.store.sweep_temporary(self.policy.abandoned_after_s, now=now)
        committed = committed_steps(self.store)
        if not committed:
            return []
        doomed = steps_to_delete(committed, keep if keep is not None else self.policy.max_to_keep,
                                 self.policy.keep_every_n_steps)
        for step in doomed:
            self.delete(step)
        written = (layout.parse_step_dir(name) for name in self.store.list_dirs(layout.STEPS_PREFIX))
        for step in uncommitted_before_latest([s for s in written if s is not None], committed):
            if is_abandoned(self._last_written(step), now, self.policy.abandoned_after_s):
                self.store.delete_prefix(layout.step_prefix(step))
                doomed.append(step)
        if doomed:
            log.info("retention removed steps %s from %s", doomed, self.store.url)
        return doomed

    def _last_written(self, step: int) -> float | None:
        """When the newest of a step's files was written (None if it has none left)."""
        infos = [i for i in (self.store.stat(k) for k in list(self.store.list(layout.step_prefix(step))))
                 if i is not None]
        return max(i.mtime for i in infos) if infos else None
