"""Reading committed checkpoints: listing steps, restoring (any reader count), verifying.

A step exists for readers only once its commit marker does; every byte read is checked
against the checksums the manifest and its chunks carry.
"""
from __future__ import annotations

import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from numpy.typing import NDArray

from ckpt_service import layout
from ckpt_service.errors import CorruptCheckpointError, NothingToRestoreError
from ckpt_service.manifest import CommitMarker, Manifest, PieceRecord, crc32c
from ckpt_service.piece_io import METADATA_KEY, chunk_keys, decode_piece, read_plain
from ckpt_service.read_plan import (
    PieceRead,
    check_expected,
    destination,
    empty_tensors,
    overlaps,
    piece_reads,
    place,
    select_tensors,
)
from ckpt_service.stores.base import ObjectStore
from ckpt_service.stores.local import LocalStore

log = logging.getLogger(__name__)


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


def committed_steps(store: ObjectStore) -> list[int]:
    """The steps committed in ``store``, ascending."""
    steps = (layout.parse_commit_key(k) for k in store.list(layout.COMMITS_PREFIX))
    return sorted(s for s in steps if s is not None)


class CheckpointReader:
    """Reads the committed steps of one store; pieces are fetched in parallel on ``io``."""

    def __init__(self, store: ObjectStore, io: Executor) -> None:
        self.store = store
        self._io = io

    @property
    def url(self) -> str:
        return self.store.url

    def all_steps(self) -> list[int]:
        """Committed steps, ascending."""
        return committed_steps(self.store)

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
        verification and no step was asked for, the previous committed step is tried, with
        a warning naming what failed.
        """
        candidates = [step] if step is not None else list(reversed(self.all_steps()))
        if not candidates:
            raise NothingToRestoreError(
                f"no committed checkpoint in {self.url}: nothing to restore (start from scratch, or check "
                "the URL)")
        failures: list[str] = []
        for candidate in candidates:
            try:
                return self._load(candidate, names, partition, expected)
            except CorruptCheckpointError as exc:
                if step is not None:
                    raise
                failures.append(f"step {candidate}: {exc}")
                log.warning("checkpoint step %d failed verification (%s); falling back to the previous "
                            "committed step", candidate, exc)
        raise CorruptCheckpointError("every committed step failed verification: " + "; ".join(failures))

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
        targets = [destination(out, entries, read) for read in reads]
        for read, target, flat in zip(reads, targets, self._io.map(self._read, reads, targets)):
            if target is None:
                place(out, entries, read, flat)
        tensors = {n: flat.reshape(entries[n].shape) for n, flat in out.items()}
        return Checkpoint(step, tensors, dict(manifest.metadata), manifest)

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
        """Read every piece of ``step`` and check every checksum; never raises for corruption."""
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
