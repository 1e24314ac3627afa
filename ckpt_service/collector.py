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
  killed before a later attempt committed the step, other attempts' manifests and shard
  records; the committed attempt's records stay with the step) once untouched for
  ``abandoned_after_s``: a save of that step may still be writing them,
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
from typing import Callable, Iterable

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
        # step -> (its marker's token, its files) when a pass found every file referenced: the
        # same files under the same commit need no second look at the manifest
        self._clean: dict[int, tuple[str, frozenset[str]]] = {}

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
        files = _files_by_step(self.store.list(layout.STEPS_PREFIX))  # one listing for the rest
        unmarked = [s for s in files if s not in listing.markers]
        for step in uncommitted_before_latest(unmarked, committed):
            if is_abandoned(self._last_written(files[step]), now, self.policy.abandoned_after_s):
                self.store.delete_prefix(layout.step_prefix(step))
                doomed.append(step)
        for step in committed:
            marker = listing.markers[step]
            if step not in doomed and marker is not None and step in files:
                self._remove_orphans(step, marker, files[step], now)
        self._clean = {s: seen for s, seen in self._clean.items() if s in listing.markers and s not in doomed}
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

    def _remove_orphans(self, step: int, marker: CommitMarker, keys: list[str], now: float) -> int:
        """Delete the files of ``step`` (``keys``) its manifest does not refer to, once old; returns how many."""
        listed = frozenset(keys)
        if self._clean.get(step) == (marker.token, listed):
            return 0
        manifest = self._manifest(marker)
        if manifest is None:
            return 0  # never guess what an unreadable commit refers to
        prefix = layout.step_prefix(step)
        referenced = {p.key for p in manifest.pieces}
        # the committed attempt's shard records go with the step: no age to look up for each
        records = layout.records_prefix(step, manifest.attempt) if manifest.attempt else None
        units: dict[str, list[str]] = {}  # a piece prefix (or a lone object) no manifest refers to -> its keys
        for key in keys:
            parts = key[len(prefix):].split("/")
            if parts[0] == "data" and len(parts) > 3:
                unit = prefix + "/".join(parts[:3]) + "/"  # data/<group>/<index>.<nonce>/
                if unit in referenced:
                    continue
            elif key == marker.manifest_key or (records is not None and key.startswith(records)):
                continue
            else:
                unit = key  # another attempt's manifest, a shard record
            units.setdefault(unit, []).append(key)
        if units and read_marker(self.store, step)[1] != marker:
            return 0  # re-committed since the listing: the files may be the new commit's; look next time
        removed, pending = 0, False
        for unit_keys in units.values():
            # a save of this step may still be writing them, a restore of a replaced commit reading them
            if is_abandoned(self._last_written(unit_keys), now, self.policy.abandoned_after_s):
                for key in unit_keys:
                    self.store.delete(key)
                removed += len(unit_keys)
            else:
                pending = True
        if not pending:
            self._clean[step] = (marker.token, listed - {k for u in units.values() for k in u})
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

    def _last_written(self, keys: list[str]) -> float | None:
        """When the newest of some files was written (None if none is left)."""
        infos = [i for i in (self.store.stat(k) for k in keys) if i is not None]
        return max(i.mtime for i in infos) if infos else None


def _files_by_step(keys: Iterable[str]) -> dict[int, list[str]]:
    """Pure: the keys of a listing of ``steps/``, by step."""
    files: dict[int, list[str]] = {}
    for key in keys:
        step = layout.parse_step_dir(key[len(layout.STEPS_PREFIX):].split("/", 1)[0])
        if step is not None:
            files.setdefault(step, []).append(key)
    return files
