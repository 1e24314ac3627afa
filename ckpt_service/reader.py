"""Reading committed checkpoints: listing steps, restoring (any reader count), verifying.

A step exists for readers only once its commit marker does; every byte read is checked
against the checksums the manifest and its chunks carry.

Committed steps are those with a marker that no lower step's marker supersedes (see
:mod:`ckpt_service.manifest`): once a successor master has committed, a marker the old master
writes afterwards carries a fence older than the successor's save and is never listed,
never the latest, and never restored by default. Asked for by number (``restore(step=N)``),
a superseded step is still read while its files exist, so an operator can recover it
deliberately. The markers of a listing are read in parallel.

A commit that fails verification supersedes nothing: when the latest fails, a restore
recomputes the order without it, so the newest commit that verifies is the one read (a
damaged rollback commit does not hide the step it meant to replace).

A restore that overlaps retention or a re-commit may find the marker of the step it is
reading deleted or replaced; that step is gone, not corrupt: the steps are listed again and
the newest one is read. Asked for by number, such a step raises CheckpointChangedError
("read again"), never CorruptCheckpointError. Readers of one restore that each read a share
(``partition``) never fall back on their own: one reader's fallback would mix two steps.
"""
from __future__ import annotations

import functools
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, TypeVar

import numpy as np
from numpy.typing import NDArray

from ckpt_service import layout
from ckpt_service.errors import CheckpointChangedError, CorruptCheckpointError, NothingToRestoreError
from ckpt_service.manifest import CommitMarker, Manifest, PieceRecord, TensorEntry, crc32c, superseded_steps
from ckpt_service.piece_io import (
    METADATA_KEY,
    chunk_keys,
    crc32c_combine,
    decode_piece,
    plain_layout,
    read_plain,
    read_plain_chunk,
)
from ckpt_service.read_plan import (
    ChunkRead,
    PieceRead,
    check_expected,
    chunk_reads,
    destination,
    empty_tensors,
    overlaps,
    piece_reads,
    place,
    select_tensors,
)
from ckpt_service.stores.base import ObjectInfo, ObjectStore
from ckpt_service.stores.local import LocalStore

log = logging.getLogger(__name__)

#: how many times a restore lists the steps again when the marker of the step it reads vanished
#: or was replaced under it (retention or a re-commit running at the same time)
RELIST_ATTEMPTS = 8

_T = TypeVar("_T")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    tensors: dict[str, NDArray[Any]]
    metadata: dict[str, Any]
    manifest: Manifest = field(repr=False)


@dataclass(frozen=True)
class VerifyReport:
    step: int
    ok: bool
    problems: tuple[str, ...]
    bytes_checked: int


@dataclass(frozen=True)
class CommitListing:
    """The commit markers one listing of ``commits/`` found, read, and which of them are superseded."""

    #: step -> its marker, or None when the marker is unreadable (it is listed, and then fails
    #: verification on restore, but it cannot supersede nor be superseded)
    markers: Mapping[int, CommitMarker | None]
    superseded: frozenset[int]

    @property
    def committed(self) -> list[int]:
        """The committed steps that are not superseded, ascending."""
        return sorted(s for s in self.markers if s not in self.superseded)

    def without(self, failed: Iterable[int]) -> CommitListing:
        """The listing as if the ``failed`` steps (commits that do not verify) were not there: what they
        superseded comes back."""
        gone = set(failed)
        markers = {s: m for s, m in self.markers.items() if s not in gone}
        return CommitListing(markers, superseded_steps({s: m.order if m else None for s, m in markers.items()}))

    def superseders(self, step: int) -> list[int]:
        """The lower steps that supersede ``step`` (their saves began at or after its fence)."""
        marker = self.markers.get(step)
        order = marker.order if marker is not None else None
        if order is None:
            return []
        return [s for s, m in self.markers.items()
                if s < step and m is not None and m.order is not None and m.order.supersedes(order)]


def list_commits(store: ObjectStore, io: Executor | None = None) -> CommitListing:
    """List ``commits/`` and read every marker (in parallel on ``io`` if given). A marker deleted
    between the listing and its read is left out: that step is gone."""
    steps = sorted(s for s in (layout.parse_commit_key(k) for k in store.list(layout.COMMITS_PREFIX))
                   if s is not None)
    if io is None or len(steps) < 2:
        read = [read_marker(store, s) for s in steps]
    else:
        read = list(io.map(lambda s: read_marker(store, s), steps))
    markers = {s: marker for s, (gone, marker) in zip(steps, read) if not gone}
    superseded = superseded_steps({s: m.order if m is not None else None for s, m in markers.items()})
    if superseded:
        log.debug("superseded commits in %s (a lower step was committed in their place): %s",
                  store.url, sorted(superseded))
    return CommitListing(markers, superseded)


def read_marker(store: ObjectStore, step: int) -> tuple[bool, CommitMarker | None]:
    """(gone, marker): gone if it no longer exists; marker None if it exists but is unreadable."""
    try:
        data = store.get(layout.commit_key(step))
    except KeyError:
        return True, None
    return False, parse_marker(data, store, step)


def parse_marker(data: bytes, store: ObjectStore, step: int) -> CommitMarker | None:
    """The marker of ``step`` stored as ``data`` in ``store``; None if it is unreadable."""
    key = layout.commit_key(step)
    try:
        marker = CommitMarker.from_json(data, where=f"{store.url}/{key}")
    except CorruptCheckpointError as exc:
        log.warning("unreadable commit marker: %s", exc)
        return None
    if marker.step != step:
        log.warning("%s/%s names step %s; it is taken for unreadable", store.url, key, marker.step)
        return None
    return marker


def committed_steps(store: ObjectStore, io: Executor | None = None) -> list[int]:
    """The steps committed in ``store`` and not superseded, ascending."""
    return list_commits(store, io).committed


class CheckpointReader:
    """Reads the committed steps of one store; pieces are fetched in parallel on ``io``."""

    def __init__(self, store: ObjectStore, io: Executor) -> None:
        self.store = store
        self._io = io

    @property
    def url(self) -> str:
        return self.store.url

    def list_commits(self) -> CommitListing:
        """Every commit marker, read in parallel, and which steps are superseded."""
        return list_commits(self.store, self._io)

    def all_steps(self) -> list[int]:
        """Committed steps that are not superseded, ascending."""
        return self.list_commits().committed

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def commit_marker(self, step: int) -> CommitMarker:
        key = layout.commit_key(step)
        try:
            data = self.store.get(key)
        except KeyError:
            raise NothingToRestoreError(
                f"step {step} is not committed in {self.url} (committed: {self.all_steps() or 'none'})"
            ) from None
        return CommitMarker.from_json(data, where=f"{self.url}/{key}")

    def manifest(self, step: int) -> Manifest:
        marker = self.commit_marker(step)
        where = f"{self.url}/{marker.manifest_key}"
        try:
            body = self.store.get(marker.manifest_key)
        except KeyError:
            raise CorruptCheckpointError(f"{where} (named by the commit of step {step}) is missing") from None
        if crc32c(body) != marker.manifest_crc32c:
            raise CorruptCheckpointError(f"{where} does not match the checksum in the commit marker")
        return Manifest.from_json(body, where=where)

    def restore(
        self,
        step: int | None = None,
        *,
        names: Iterable[str] | None = None,
        partition: tuple[int, int] | None = None,
        expected: Mapping[str, Any] | None = None,
    ) -> Checkpoint:
        """Load a committed step (the latest by default), verifying every checksum.

        ``names`` restricts the tensors read; ``partition=(rank, world_size)`` makes each of
        ``world_size`` readers read a byte-balanced share of whole tensors (any reader count
        can read any writer count). ``expected`` maps names to arrays or ``(shape, dtype)``
        and raises StructureMismatchError on any difference. When the latest step fails
        verification and no step was asked for, the newest commit that verifies is read instead
        (the failed one supersedes nothing), with a warning naming what failed; with a
        ``partition`` it raises instead, since the other readers may not fall back alike (pick
        one step for all of them with :meth:`restorable_step`). A step whose marker is deleted or
        replaced while it is read is gone, not corrupt: the steps are listed again
        (``RELIST_ATTEMPTS`` times); asked for by number, it raises CheckpointChangedError.
        Superseded steps are never candidates; asked for by number, one is read all the same.
        """
        if step is not None:
            return self._load_unchanged(step, names, partition, expected)
        if partition is not None:
            return self._latest_alone(names, partition, expected)
        return self._newest(lambda s: self._load(s, names, partition, expected))

    def _latest_alone(self, names: Iterable[str] | None, partition: tuple[int, int],
                      expected: Mapping[str, Any] | None) -> Checkpoint:
        """One reader's share of the latest step, never of another: a step that fails raises (the readers
        would not all fall back alike); one removed or re-committed meanwhile is listed again."""
        for _ in range(RELIST_ATTEMPTS):
            latest = self.latest_step()
            if latest is None:
                raise NothingToRestoreError(
                    f"no committed checkpoint in {self.url}: nothing to restore (start from scratch, or check "
                    "the URL)")
            if self.store.stat(layout.commit_key(latest)) is None:
                continue  # removed since the listing
            try:
                return self._load_unchanged(latest, names, partition, expected)
            except CheckpointChangedError as exc:
                log.info("step %d changed while being restored (%s); listing the steps again", latest, exc)
            except NothingToRestoreError:
                if self.store.stat(layout.commit_key(latest)) is not None:
                    raise
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(
                    f"{exc}; readers of a partitioned restore do not fall back on their own (they would mix "
                    "steps): pick one step for all of them with restorable_step() and pass it as step=") from exc
        raise NothingToRestoreError(
            f"the latest step of {self.url} kept being removed or replaced while being restored "
            f"({RELIST_ATTEMPTS} listings); try again once retention is done")

    def restorable_step(self) -> int | None:
        """The newest committed step that verifies in full (every piece read and checked), as
        :meth:`restore` would pick it; None when nothing is committed. Readers of one partitioned
        restore pass it to all as ``step=``. Raises CorruptCheckpointError when no step verifies."""
        def check(step: int) -> int:
            report = self._verify(step)
            if not report.ok:
                raise CorruptCheckpointError("; ".join(report.problems))
            return step

        try:
            return self._newest(check)
        except NothingToRestoreError:
            if self.list_commits().markers:
                raise
            return None

    def _newest(self, attempt: Callable[[int], _T]) -> _T:
        """``attempt`` on the newest committed step it succeeds on: a step it finds corrupt
        (CorruptCheckpointError) supersedes nothing, so the order is recomputed without it."""
        failures: list[str] = []
        failed: dict[int, int] = {}  # step -> the generation of the marker that failed verification
        for _ in range(RELIST_ATTEMPTS):
            listing = self.list_commits()
            changed = False
            while not changed:
                excluded = [s for s in failed if s in listing.markers]
                candidates = list(reversed(listing.without(excluded).committed))
                if not candidates:
                    break
                candidate = candidates[0]
                before = self.store.stat(layout.commit_key(candidate))
                if before is None:
                    changed = True  # deleted since the listing
                    break
                try:
                    return attempt(candidate)
                except (CorruptCheckpointError, NothingToRestoreError) as exc:
                    after = self.store.stat(layout.commit_key(candidate))
                    if after is None or after.generation != before.generation:
                        # deleted (retention) or replaced (a re-commit) while being read: gone, not corrupt
                        log.info("step %d was removed or re-committed while being restored (%s); listing the "
                                 "steps again", candidate, exc)
                        changed = True
                        break
                    if isinstance(exc, NothingToRestoreError):
                        raise
                    failed[candidate] = before.generation
                    failures.append(f"step {candidate}: {exc}")
                    log.warning("checkpoint step %d failed verification (%s); falling back to the newest commit "
                                "before it", candidate, exc)
            if not changed:
                break
            # a failed step whose marker was replaced since is a new commit: it gets its own try
            failed = {s: g for s, g in failed.items()
                      if (info := self.store.stat(layout.commit_key(s))) is not None and info.generation == g}
        if not failures and not changed:
            raise NothingToRestoreError(
                f"no committed checkpoint in {self.url}: nothing to restore (start from scratch, or check "
                "the URL)")
        if not failures:
            raise NothingToRestoreError(
                f"the committed steps of {self.url} kept being removed or replaced while being restored "
                f"({RELIST_ATTEMPTS} listings); try again once retention is done")
        raise CorruptCheckpointError("every committed step failed verification: " + "; ".join(failures))

    def _load_unchanged(self, step: int, names: Iterable[str] | None, partition: tuple[int, int] | None,
                        expected: Mapping[str, Any] | None) -> Checkpoint:
        """:meth:`_load` of a step asked for by number: one that is re-committed or deleted while it is
        read raises CheckpointChangedError, not CorruptCheckpointError."""
        key = layout.commit_key(step)
        before = self.store.stat(key)
        try:
            return self._load(step, names, partition, expected)
        except (CorruptCheckpointError, NothingToRestoreError) as exc:
            self._raise_if_changed(step, before, exc)
            raise

    def _raise_if_changed(self, step: int, before: ObjectInfo | None, exc: BaseException) -> None:
        after = self.store.stat(layout.commit_key(step))
        if before is not None and (after is None or after.generation != before.generation):
            what = "deleted" if after is None else "re-committed"
            raise CheckpointChangedError(
                f"step {step} of {self.url} was {what} while it was being read ({exc}); read it again") from exc

    def _load(self, step: int, names: Iterable[str] | None, partition: tuple[int, int] | None,
              expected: Mapping[str, Any] | None) -> Checkpoint:
        manifest = self.manifest(step)
        entries = {t.name: t for t in manifest.tensors}
        names = None if names is None else list(names)
        if expected is not None:
            check_expected(entries, expected, step, names)
        wanted = select_tensors(entries, names, partition, step)
        reads = piece_reads(manifest.pieces, entries, wanted)
        out = empty_tensors(entries, wanted)
        if type(self.store) is LocalStore:
            reads = self._read_local(reads, out, entries)
        targets = [destination(out, entries, read) for read in reads]
        for read, target, flat in zip(reads, targets, self._io.map(self._read, reads, targets)):
            if target is None:
                place(out, entries, read, flat)
        tensors = {n: flat.reshape(entries[n].shape) for n, flat in out.items()}
        return Checkpoint(step, tensors, dict(manifest.metadata), manifest)

    def _read_local(self, reads: list[PieceRead], out: Mapping[str, NDArray[Any]],
                    entries: Mapping[str, TensorEntry]) -> list[PieceRead]:
        """Read the uncompressed pieces of ``reads`` from a local directory chunk by chunk, in
        parallel, each chunk scattered straight into the tensors it holds (one preadv per file)
        and its crc32c checked there; a whole piece's crc32c is combined from its chunks'. The
        other reads (compressed pieces) are returned, to be read whole."""
        where = {id(r): f"{self.url}/{r.piece.key}" for r in reads}
        layouts = list(self._io.map(lambda r: plain_layout(self._get(r.piece.key + METADATA_KEY), where=where[id(r)]),
                                    reads))
        rest, plain, tasks = [], [], []
        for read, found in zip(reads, layouts):
            if found is None:
                rest.append(read)
                continue
            size, chunk, dtype = found
            if size != read.piece.stop - read.piece.start or dtype.name != read.piece.group:
                raise CorruptCheckpointError(
                    f"{where[id(read)]}: its zarr metadata describes {size} {dtype.name} elements, but the "
                    f"manifest records {read.piece.stop - read.piece.start} elements of group {read.piece.group}")
            chunks = chunk_reads(read, size, chunk, entries, out)
            plain.append((read, dtype.itemsize, chunks))
            tasks += [(read, c) for c in chunks]
        done = self._io.map(functools.partial(self._read_chunk, out), tasks)
        crcs = dict(zip(((id(r), c.index) for r, c in tasks), done))
        for read, itemsize, chunks in plain:
            if (read.start, read.stop) != (read.piece.start, read.piece.stop):
                continue  # a part of a piece: its chunks are verified, the piece's crc32c covers it all
            crc = 0
            for c in chunks:
                crc = crc32c_combine(crc, crcs[id(read), c.index], sum(b - a for _, a, b in c.spans) * itemsize)
            if crc != read.piece.crc32c:
                raise CorruptCheckpointError(
                    f"{where[id(read)]} (group {read.piece.group}, elements {read.piece.start}-{read.piece.stop}) "
                    "does not match its recorded crc32c")
        return rest

    def _read_chunk(self, out: Mapping[str, NDArray[Any]], task: tuple[PieceRead, ChunkRead]) -> int:
        """Read one chunk into ``out``'s tensors (elements no tensor wants into scratch): its data crc32c."""
        read, chunk = task
        store, key = self.store, read.piece.key
        assert isinstance(store, LocalStore)
        parts = [np.empty(b, np.dtype(read.piece.group)) if name is None else out[name][a:b]
                 for name, a, b in chunk.spans]
        return read_plain_chunk(lambda k, buffers: store.get_into_parts(key + k, buffers), chunk.index, parts,
                                chunk.padding * np.dtype(read.piece.group).itemsize, where=f"{self.url}/{key}")

    def _read(self, read: PieceRead, target: NDArray[Any] | None) -> NDArray[Any]:
        return self.read_piece(read.piece, read.start, read.stop, out=target)

    def read_piece(self, piece: PieceRecord, start: int | None = None, stop: int | None = None, *,
                   out: NDArray[Any] | None = None) -> NDArray[Any]:
        """Group elements [start, stop) (default: the whole piece) from one piece, verified; into
        ``out`` if given (a buffer of exactly those elements)."""
        start = piece.start if start is None else start
        stop = piece.stop if stop is None else stop
        where = f"{self.url}/{piece.key}"
        lo, hi = start - piece.start, stop - piece.start  # positions inside the piece
        flat = None
        if type(self.store) is LocalStore:  # files are read straight into the tensors
            store = self.store
            flat = read_plain(self._get(piece.key + METADATA_KEY), lambda k: self._get(piece.key + k),
                              lambda k, buf: store.get_into(piece.key + k, buf), where=where, start=lo, stop=hi,
                              out=out)
        if flat is None:
            objects = {key: self._get(piece.key + key)
                       for key in chunk_keys(piece.stop - piece.start, piece.chunk_elements, lo, hi)}
            flat = decode_piece(objects, where=where, start=lo, stop=hi, out=out)  # verifies each chunk's crc32c
        whole = (start, stop) == (piece.start, piece.stop)
        if flat.dtype.name != piece.group or (out is not None and flat is not out):
            raise CorruptCheckpointError(
                f"{where}: its zarr metadata describes {flat.dtype.name} elements or another shape, but the "
                f"manifest records {hi - lo} elements of group {piece.group}")
        if flat.size != hi - lo or (whole and crc32c(flat) != piece.crc32c):
            raise CorruptCheckpointError(
                f"{where} (group {piece.group}, elements {piece.start}-{piece.stop}) does not match its "
                "recorded crc32c")
        return flat

    def _get(self, key: str) -> bytes | None:
        try:
            return self.store.get(key)
        except KeyError:
            return None

    def verify(self, step: int) -> VerifyReport:
        """Read every piece of ``step`` and check every checksum; never raises for corruption. A step
        re-committed or deleted while it is read raises CheckpointChangedError (read it again)."""
        before = self.store.stat(layout.commit_key(step))
        try:
            report = self._verify(step)
        except NothingToRestoreError as exc:  # its marker went between the stat and the read
            self._raise_if_changed(step, before, exc)
            raise
        if not report.ok:
            self._raise_if_changed(step, before, CorruptCheckpointError("; ".join(report.problems)))
        return report

    def _verify(self, step: int) -> VerifyReport:
        try:
            manifest = self.manifest(step)
        except CorruptCheckpointError as exc:
            return VerifyReport(step, False, (str(exc),), 0)
        problems: list[str] = []
        checked = 0

        def check(piece: PieceRecord) -> str | None:
            try:
                self.read_piece(piece)
            except CorruptCheckpointError as exc:
                names = [t.name for t in manifest.tensors if overlaps(t, piece)]
                return f"tensors {names}: {exc}"
            return None

        for piece, problem in zip(manifest.pieces, self._io.map(check, manifest.pieces)):
            if problem:
                problems.append(problem)
            else:
                checked += piece.nbytes
        return VerifyReport(step, not problems, tuple(problems), checked)
