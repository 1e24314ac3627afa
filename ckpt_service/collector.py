"""Applies retention to a store: deletes old, superseded and abandoned steps, and orphaned files.

Only ``steps/`` and ``commits/`` are listed or deleted here (and temp files of killed
writes, by the store): the training side's objects in the same store are never touched.

What one pass removes:

* superseded steps (a lower step was committed in their place, see :mod:`ckpt_service.manifest`),
  once one of the commits that supersede them verifies: hiding is not deleting;
* committed steps beyond the policy, below the newest restorable commit;
* uncommitted steps older than the latest committed one, once untouched for ``abandoned_after_s``;
* inside each kept committed step, the files no manifest refers to (the pieces of attempts
  killed before a later attempt committed the step, other attempts' manifests and shard
  records; the committed attempt's records stay with the step) once untouched for
  ``abandoned_after_s``, and that long after the step's marker was last written: a save of that
  step may still be writing them, and a restore may still be reading a commit that a re-commit
  replaced.

Never removed: the newest restorable commit (the newest in commit order that verifies, or the
step a save just committed, ``protect``, which its save wrote and checked) and every committed
step above it; a commit that fails verification supersedes nothing. Deleting a committed step
takes its marker first, and only while it is still the listed one (a compare-and-delete on its
generation), then the files its manifest refers to; the step's other files stay until they are
``abandoned_after_s`` old, since a save of the same step (a replay) may be writing them.

Every age is measured on the store's own clock (:meth:`ObjectStore.store_time`), the one its
objects' mtimes come from, not on this process's: a manager whose clock runs ahead would
otherwise take the files of another process's save in flight for abandoned.

Several collectors may run on one store at once (every save's retention, ``gc()``): each
tolerates what another one deleted meanwhile. A commit is read back in full whenever a pass must
know that it verifies (not the step a save just committed): a commit that verified once may be
damaged since.
"""
from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Callable, Iterable

from ckpt_service import layout
from ckpt_service.errors import CheckpointChangedError, CheckpointError, NothingToRestoreError
from ckpt_service.manifest import CommitMarker, Manifest, crc32c
from ckpt_service.reader import CheckpointReader, CommitListing, list_commits, parse_marker, read_marker
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

        Never deletes the newest restorable commit nor a committed step above it, the step
        ``protect`` (the one a save just committed, trusted to be restorable), a superseded step
        none of whose superseders verifies, nor an uncommitted step that is newer than the latest
        or was written to within ``abandoned_after_s`` (it may still be being written). Temp files
        of writes killed midway (local store) go once that old too.
        """
        now = self.now()
        self.store.sweep_temporary(self.policy.abandoned_after_s, now=now)
        listing = list_commits(self.store, self._io)
        newest, failed = self._newest_restorable(listing, protect)
        if newest is None:
            if listing.markers:
                log.warning("no commit in %s verifies: retention deletes nothing", self.store.url)
            return []
        # a commit that fails verification supersedes nothing: what it hid counts again
        effective = listing.without(failed)
        doomed: list[int] = []
        for step in sorted(effective.superseded):
            marker = effective.markers[step]
            if step == protect or marker is None:
                continue
            if any(self._restorable(s, effective.markers[s], protect) for s in effective.superseders(step)):
                log.warning("step %d of %s is superseded (a lower step was committed in its place): deleting it",
                            step, self.store.url)
                if self._delete_committed(step, marker, now):
                    doomed.append(step)
        committed = effective.committed
        for step in steps_to_delete(committed, keep if keep is not None else self.policy.max_to_keep,
                                    self.policy.keep_every_n_steps):
            marker = effective.markers[step]
            if step != protect and step < newest and marker is not None and self._delete_committed(step, marker, now):
                doomed.append(step)
        files = _files_by_step(self.store.list(layout.STEPS_PREFIX))  # one listing for the rest
        unmarked = [s for s in files if s not in listing.markers]
        for step in uncommitted_before_latest(unmarked, committed):
            if is_abandoned(self._last_written(files[step]), now, self.policy.abandoned_after_s):
                self.store.delete_prefix(layout.step_prefix(step))
                doomed.append(step)
        for step in committed:
            marker = effective.markers[step]
            if step not in doomed and marker is not None and step in files:
                self._remove_orphans(step, marker, files[step], now)
        self._clean = {s: seen for s, seen in self._clean.items() if s in listing.markers and s not in doomed}
        return self._report(doomed)

    def _report(self, doomed: list[int]) -> list[int]:
        if doomed:
            log.info("retention removed steps %s from %s", doomed, self.store.url)
        return doomed

    def _newest_restorable(self, listing: CommitListing, trusted: int | None) -> tuple[int | None, list[int]]:
        """The newest commit (in commit order) that verifies, or ``trusted`` if it comes first, and the
        commits above it that failed (None: none verifies)."""
        failed: list[int] = []
        while True:
            committed = listing.without(failed).committed
            if not committed:
                return None, failed
            top = committed[-1]
            if self._restorable(top, listing.markers[top], trusted):
                return top, failed
            log.warning("step %d of %s fails verification: retention keeps it and the newest commit that verifies",
                        top, self.store.url)
            failed.append(top)

    def _restorable(self, step: int, marker: CommitMarker | None, trusted: int | None) -> bool:
        """Whether ``step`` (under ``marker``) is the step a save just committed or verifies in full."""
        if step == trusted:
            return True
        if marker is None:
            return False
        return self._verify(step, marker)  # read again at every pass: data can be damaged at rest since

    def _verify(self, step: int, marker: CommitMarker) -> bool:
        with contextlib.ExitStack() as stack:
            io = self._io or stack.enter_context(ThreadPoolExecutor(4, thread_name_prefix="ckpt-gc-verify"))
            try:
                report = CheckpointReader(self.store, io).verify(step)
            except (CheckpointChangedError, NothingToRestoreError):
                return False  # deleted or re-committed meanwhile (another gc, a save's retention): not this commit
        if read_marker(self.store, step)[1] != marker:
            return False  # re-committed meanwhile: that is another commit, looked at next time
        return report.ok

    def _delete_committed(self, step: int, marker: CommitMarker, now: float) -> bool:
        """Delete a committed step while its marker is still ``marker``: the marker (compare-and-delete),
        then the files its manifest refers to; its other files once ``abandoned_after_s`` old (a save
        of the same step, a replay, may be writing them). Returns whether the marker was deleted."""
        key = layout.commit_key(step)
        stored = self.store.get_versioned(key)
        if stored is None or parse_marker(stored[0], self.store, step) != marker:
            return False  # gone or re-committed since the listing
        manifest = self._manifest(marker)
        if not self.store.delete_if_generation(key, stored[1]):
            return False
        keys = list(self.store.list(layout.step_prefix(step)))
        # without a readable manifest nothing is known to be this commit's: every file waits for its age
        if manifest is not None:
            owned, others = _split_by_manifest(step, manifest, marker.manifest_key, keys)
        else:
            owned, others = [], _units(step, keys)
        for k in owned:
            self.store.delete(k)
        for unit_keys in others.values():
            if is_abandoned(self._last_written(unit_keys), now, self.policy.abandoned_after_s):
                for k in unit_keys:
                    self.store.delete(k)
        return True

    def _remove_orphans(self, step: int, marker: CommitMarker, keys: list[str], now: float) -> int:
        """Delete the files of ``step`` (``keys``) its manifest does not refer to, once old; returns how many.

        Old means untouched for ``abandoned_after_s`` and the marker not written for that long either:
        the pieces of a commit that a re-commit just replaced may still be read by a restore."""
        listed = frozenset(keys)
        if self._clean.get(step) == (marker.token, listed):
            return 0
        manifest = self._manifest(marker)
        if manifest is None:
            return 0  # never guess what an unreadable commit refers to
        _owned, units = _split_by_manifest(step, manifest, marker.manifest_key, keys)
        if units:
            info = self.store.stat(layout.commit_key(step))
            if info is None or read_marker(self.store, step)[1] != marker:
                return 0  # re-committed since the listing: the files may be the new commit's; look next time
            replaced_at = info.mtime
        removed, pending = 0, False
        for unit_keys in units.values():
            # a save of this step may still be writing them, a restore of a replaced commit reading them
            last = self._last_written(unit_keys)
            if is_abandoned(None if last is None else max(last, replaced_at), now, self.policy.abandoned_after_s):
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


def _units(step: int, keys: Iterable[str]) -> dict[str, list[str]]:
    """Pure: ``step``'s files grouped into what is written together: a piece (its zarr prefix,
    ``data/<group>/<index>.<nonce>/``) or a lone object (a manifest, a shard record)."""
    prefix = layout.step_prefix(step)
    units: dict[str, list[str]] = {}
    for key in keys:
        parts = key[len(prefix):].split("/")
        unit = prefix + "/".join(parts[:3]) + "/" if parts[0] == "data" and len(parts) > 3 else key
        units.setdefault(unit, []).append(key)
    return units


def _split_by_manifest(step: int, manifest: Manifest, manifest_key: str,
                       keys: Iterable[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Pure: ``step``'s files that the commit of ``manifest`` (stored at ``manifest_key``) owns (its
    pieces, the manifest, its attempt's shard records), and the others by unit (see :func:`_units`)."""
    referenced = {p.key for p in manifest.pieces}
    records = layout.records_prefix(step, manifest.attempt) if manifest.attempt else None
    owned: list[str] = []
    others: dict[str, list[str]] = {}
    for unit, unit_keys in _units(step, keys).items():
        if unit in referenced or unit == manifest_key or (records is not None and unit.startswith(records)):
            owned += unit_keys
        else:
            others[unit] = unit_keys
    return owned, others


def _files_by_step(keys: Iterable[str]) -> dict[int, list[str]]:
    """Pure: the keys of a listing of ``steps/``, by step."""
    files: dict[int, list[str]] = {}
    for key in keys:
        step = layout.parse_step_dir(key[len(layout.STEPS_PREFIX):].split("/", 1)[0])
        if step is not None:
            files.setdefault(step, []).append(key)
    return files
