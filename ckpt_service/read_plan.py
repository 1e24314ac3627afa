"""What a restore reads (pure): which tensors, which element range of which piece, and where it goes.

Any reader count can read any writer count: a reader picks its tensors
(:func:`select_tensors`), then fetches from each piece only the hull of the elements those
tensors occupy in it (:func:`piece_reads`), so a resharding reader fetches only the chunks
under its own tensors. A local read goes a chunk at a time (:func:`chunk_reads`): each chunk's
elements split at the tensors' bounds, so a chunk is read straight into the tensors it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np
from numpy.typing import NDArray

from ckpt_service.arguments import exact_int
from ckpt_service.errors import BadPartitionError, StructureMismatchError
from ckpt_service.manifest import PieceRecord, TensorEntry
from ckpt_service.plan import plan_reads


@dataclass(frozen=True)
class PieceRead:
    """Group elements [start, stop) of one piece."""

    piece: PieceRecord
    start: int
    stop: int


def overlaps(entry: TensorEntry, piece: PieceRecord) -> bool:
    return (entry.group == piece.group and entry.size > 0
            and entry.offset < piece.stop and piece.start < entry.offset + entry.size)


def select_tensors(entries: Mapping[str, TensorEntry], names: Iterable[str] | None,
                   partition: tuple[int, int] | None, step: int) -> list[str]:
    """The tensors to read: ``names`` (default: all), and of those, with ``partition=(reader, readers)``,
    this reader's byte-balanced share of whole tensors."""
    wanted = list(entries) if names is None else list(names)
    missing = [n for n in wanted if n not in entries]
    if missing:
        raise StructureMismatchError(f"step {step} has no tensors named {missing}")
    if partition is not None:
        reader, readers = checked_partition(partition)
        share = set(plan_reads([entries[n].placement for n in wanted], readers)[reader])
        wanted = [n for n in wanted if n in share]
    return wanted


def checked_partition(partition: Any) -> tuple[int, int]:
    """``partition`` as ``(reader, readers)`` ints with 0 <= reader < readers, or BadPartitionError."""
    pair = tuple(partition) if isinstance(partition, (tuple, list)) and len(partition) == 2 else (None, None)
    reader, readers = exact_int(pair[0]), exact_int(pair[1])
    if reader is None or readers is None or not 0 <= reader < readers:
        raise BadPartitionError(
            f"partition {partition!r} is not (reader, readers): two integers with 0 <= reader < readers, "
            "e.g. (hvd.rank(), hvd.size()); or pass partition=None to read every tensor")
    return reader, readers


def piece_reads(pieces: Iterable[PieceRecord], entries: Mapping[str, TensorEntry],
                wanted: Iterable[str]) -> list[PieceRead]:
    """Per piece that holds bytes of a wanted tensor, the hull of the elements they occupy in it."""
    chosen = [entries[n] for n in wanted]
    reads = []
    for piece in pieces:
        spans = [(max(e.offset, piece.start), min(e.offset + e.size, piece.stop))
                 for e in chosen if overlaps(e, piece)]
        if spans:
            reads.append(PieceRead(piece, min(a for a, _ in spans), max(b for _, b in spans)))
    return reads


def empty_tensors(entries: Mapping[str, TensorEntry], wanted: Iterable[str]) -> dict[str, NDArray[Any]]:
    """Flat buffers for the wanted tensors, filled by :func:`place`."""
    return {n: np.empty(entries[n].size, dtype=entries[n].dtype) for n in wanted}


def place(out: Mapping[str, NDArray[Any]], entries: Mapping[str, TensorEntry], read: PieceRead,
          flat: NDArray[Any]) -> None:
    """Copy the elements ``flat`` holds (those of ``read``) into the flat tensors of ``out`` they belong to."""
    piece = read.piece
    for name, buffer in out.items():
        entry = entries[name]
        if overlaps(entry, piece):
            lo, hi = max(entry.offset, piece.start), min(entry.offset + entry.size, piece.stop)
            buffer[lo - entry.offset:hi - entry.offset] = flat[lo - read.start:hi - read.start]


def destination(out: Mapping[str, NDArray[Any]], entries: Mapping[str, TensorEntry],
                read: PieceRead) -> NDArray[Any] | None:
    """The slice of one wanted tensor that holds every element of ``read``, if one does (most of
    a large state): it is read into directly, saving a copy; None leaves it to :func:`place`."""
    for name, buffer in out.items():
        entry = entries[name]
        if entry.group == read.piece.group and entry.offset <= read.start and read.stop <= entry.offset + entry.size:
            return buffer[read.start - entry.offset:read.stop - entry.offset]
    return None


def check_expected(entries: Mapping[str, TensorEntry], expected: Mapping[str, Any], step: int,
                   names: Iterable[str] | None = None) -> None:
    """Raise StructureMismatchError unless the tensors restored (``names``, default: every stored one)
    are exactly ``expected`` (names to arrays or ``(shape, dtype)``)."""
    restored = set(entries) if names is None else set(names)
    problems = []
    for name, want in expected.items():
        if name not in entries:
            problems.append(f"{name}: missing from the checkpoint")
            continue
        if name not in restored:
            problems.append(f"{name}: expected but not among the names restored")
            continue
        if isinstance(want, tuple) and len(want) == 2 and not isinstance(want[0], int):
            shape, dtype = tuple(want[0]), np.dtype(want[1])
        else:
            arr = np.asarray(want)
            shape, dtype = arr.shape, arr.dtype
        entry = entries[name]
        # byte order is normalised to little-endian on save, so it is not a mismatch
        if tuple(entry.shape) != tuple(shape) or np.dtype(entry.dtype) != dtype.newbyteorder("<"):
            problems.append(f"{name}: stored {entry.shape} {entry.dtype}, expected {tuple(shape)} {dtype}")
    extra = sorted(restored & set(entries) - set(expected))
    if extra:
        problems.append(f"not expected but {'stored' if names is None else 'restored'}: {extra}")
    if problems:
        raise StructureMismatchError(f"step {step} does not match the expected structure: " + "; ".join(problems))


#: (tensor name, first element, end element) of a run of a chunk's elements in that tensor's flat
#: buffer, or (None, 0, n): n elements no wanted tensor holds (the hull's gaps, a partial edge chunk)
Span = tuple["str | None", int, int]


@dataclass(frozen=True)
class ChunkRead:
    """One chunk object of a piece: its index, and where its elements go, in order."""

    index: int
    spans: tuple[Span, ...]
    padding: int  # elements of fill after the piece's end (only the last chunk has any)


def chunk_reads(read: PieceRead, size: int, chunk: int, entries: Mapping[str, TensorEntry],
                wanted: Iterable[str]) -> list[ChunkRead]:
    """Every chunk (of ``chunk`` elements) of a piece of ``size`` elements that holds elements of
    ``read``, each split at the wanted tensors' bounds: a reader fills them straight into the
    tensors, a chunk at a time, however the pieces cut across the tensors."""
    piece = read.piece
    lo, hi = read.start - piece.start, read.stop - piece.start  # inside the piece
    chosen = sorted((entries[n] for n in wanted if overlaps(entries[n], piece)), key=lambda e: e.offset)
    out = []
    for i in range(lo // chunk, (hi - 1) // chunk + 1) if hi > lo else ():
        first, end = piece.start + i * chunk, piece.start + min(size, (i + 1) * chunk)  # group elements
        spans: list[Span] = []
        at = first
        for e in chosen:
            a, b = max(at, e.offset), min(end, e.offset + e.size)
            if a >= b:
                continue
            if a > at:
                spans.append((None, 0, a - at))
            spans.append((e.name, a - e.offset, b - e.offset))
            at = b
        if at < end:
            spans.append((None, 0, end - at))
        out.append(ChunkRead(i, tuple(spans), (i + 1) * chunk - (end - piece.start)))
    return out
