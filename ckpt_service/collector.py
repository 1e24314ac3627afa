"""Applies retention to a store: deletes old, superseded and abandoned steps, and orphaned files.

Only ``steps/`` and ``commits/`` are listed or deleted here (and temp files of killed
writes, by the store): the training side's objects in the same store are never touched.

What one pass removes:

* superseded steps (a lower step was committed under a newer lease generation, see
  :mod:`ckpt_service.manifest`): they are never restored by default, so they go whatever the
  policy; the marker first, and only while it is still the superseded one (a re-commit may
  just have put its own in its place);
* committed steps beyond the policy, marker first, so a step is never visible half-deleted;
* uncommitted steps older than the latest committed one, once untouched for ``abandoned_after_s``;
* inside each kept committed step, the files no manifest refers to (the pieces of attempts
  killed before a later attempt committed the step, other attempts' manifests, shard records)
  once untouched for ``abandoned_after_s``: a save of that step may still be writing them,
  and a restore may still be reading a commit that a re-commit replaced.

Never removed: the latest committed step, nor the step a save just committed (``protect``).

Every age is measured on the store's own clock (:meth:`ObjectStore.store_time`), the one its
objects' mtimes come from, not on this process's: a manager whose clock runs ahead would
otherwise take the files of another process's save in flight for abandoned.

Several collectors may run on one store at once (every save's retention, ``gc()``): each
tolerates what another one deleted meanwhile.
"""
from __future__ import annotations

import logging
from concurrent.futures import Executor
from typing import Callable

from ckpt_service import layout
from ckpt_service.errors import CheckpointError
from ckpt_service.manifest import CommitMarker, Manifest, crc32c
from ckpt_service.reader import list_commits, read_marker
from ckpt_service.retention import RetentionPolicy, is_abandoned, steps_to_delete, uncommitted_before_latest
from ckpt_service.stores.base import ObjectStore

log = logging.getLogger(__name__)


class StepCollector:
    """Deletes what a :class:`RetentionPolicy` no longer keeps."""

    def __init__(self, store: ObjectStore, policy: RetentionPolicy, *,
                 clock: Callable[[], float] | None = None, io: Executor | None = None) -> None:
        """``clock`` gives the time ages are measured against; None (the default) reads the store's
        own (tests pass a function to move it). Commit markers are read in parallel on ``io``."""
        self.store, self.policy, self.clock = store, policy, clock
        self._io = io

    def now(self) -> float:
        """The time ages are measured against: the store's own unless a clock was given."""
        return self.clock() if self.clock is not None else self.store.store_time()

    def delete(self, step: int) -> None:
        """Delete a step: the commit marker first, so it is never visible half-deleted."""
        self.store.delete(layout.commit_key(step))
        self.store.delete_prefix(layout.step_prefix(step))

    def collect(self, keep: int | None = None, *, protect: int | None = None) -> list[int]:
        """Apply retention (``keep`` overrides ``max_to_keep``); also remove superseded steps,
        abandoned uncommitted steps and orphaned files. Returns the steps removed.

        Never deletes the latest committed step, the step ``protect`` (the one a save just
        committed), nor an uncommitted step that is newer than the latest or was written to
        within ``abandoned_after_s`` (it may still be being written). Temp files of writes
        killed midway (local store) go once that old too.
        """
        now = self.now()
        self.store.sweep_temporary(self.policy.abandoned_after_s, now=now)
        listing = list_commits(self.store, self._io)
        doomed = [step for step in sorted(listing.superseded)
                  if step != protect and self._delete_superseded(step, listing.markers[step])]
        committed = listing.committed
        if not committed:
            return self._report(doomed)
        for step in steps_to_delete(committed, keep if keep is not None else self.policy.max_to_keep,
                                    self.policy.keep_every_n_steps):
            if step != protect:
                self.delete(step)
                doomed.append(step)
        written = (layout.parse_step_dir(name) for name in self.store.list_dirs(layout.STEPS_PREFIX))
        unmarked = [s for s in written if s is not None and s not in listing.markers]
        for step in uncommitted_before_latest(unmarked, committed):
            if is_abandoned(self._last_written(layout.step_prefix(step)), now, self.policy.abandoned_after_s):
                self.store.delete_prefix(layout.step_prefix(step))
                doomed.append(step)
        for step in committed:
            marker = listing.markers[step]
            if step not in doomed and marker is not None:
                self._remove_orphans(step, marker, now)
        return self._report(doomed)

    def _report(self, doomed: list[int]) -> list[int]:
        if doomed:
            log.info("retention removed steps %s from %s", doomed, self.store.url)
        return doomed

    def _delete_superseded(self, step: int, listed: CommitMarker | None) -> bool:
        """Delete a superseded step unless its marker changed since the listing (a re-commit)."""
        gone, now = read_marker(self.store, step)
        if gone or now is None or listed is None or now.token != listed.token:
            return False
        log.warning("step %d of %s is superseded (a lower step was committed under a newer lease generation "
                    "than its %s): deleting it", step, self.store.url, listed.lease_generation)
        self.delete(step)
        return True

    def _remove_orphans(self, step: int, marker: CommitMarker, now: float) -> int:
        """Delete the files of ``step`` its manifest does not refer to, once old; returns how many."""
        manifest = self._manifest(marker)
        if manifest is None:
            return 0  # never guess what an unreadable commit refers to
        prefix = layout.step_prefix(step)
        referenced = {p.key for p in manifest.pieces}
        units: dict[str, list[str]] = {}  # a piece prefix (or a lone object) no manifest refers to -> its keys
        for key in self.store.list(prefix):
            parts = key[len(prefix):].split("/")
            if parts[0] == "data" and len(parts) > 3:
                unit = prefix + "/".join(parts[:3]) + "/"  # data/<group>/<index>.<nonce>/
                if unit in referenced:
                    continue
            elif key == marker.manifest_key:
                continue
            else:
                unit = key  # another attempt's manifest, a shard record
            units.setdefault(unit, []).append(key)
        removed = 0
        for unit, keys in units.items():
            # a save of this step may still be writing them, a restore of a replaced commit reading them
            if is_abandoned(self._last_written(keys), now, self.policy.abandoned_after_s):
                for key in keys:
                    self.store.delete(key)
                removed += len(keys)
        if removed:
            log.info("removed %d files of step %d that its commit does not refer to", removed, step)
        return removed

    def _manifest(self, marker: CommitMarker) -> Manifest | None:
        where = f"{self.store.url}/{marker.manifest_key}"
        try:
            body = self.store.get(marker.manifest_key)
            if crc32c(body) != marker.manifest_crc32c:
                return None
            return Manifest.from_json(body, where=where)
        except (KeyError, CheckpointError):
            return None

    def _last_written(self, keys: str | list[str]) -> float | None:
        """When the newest of some files (a prefix's, or a list) was written (None if none is left)."""
        listed = list(self.store.list(keys)) if isinstance(keys, str) else keys
        infos = [i for i in (self.store.stat(k) for k in listed) if i is not None]
        return max(i.mtime for i in infos) if infos else None
