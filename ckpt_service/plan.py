"""The save plan: a pure, deterministic split of a state into per-rank writes.

Every rank computes the same plan from the same tensor specs and world size,
without communicating. Tensors are grouped by dtype; within a group they are
laid end to end in name order, forming one flat *virtual buffer*. Each buffer is
cut into *pieces* of at most ``piece_bytes``; a piece is one zarr array written
by one rank. Pieces are then assigned to ranks greedily, largest first, to the
least-loaded rank (LPT). Which of several equally large pieces a rank gets changes no
rank's bytes, so that choice balances the number of tensors each rank's share touches:
a device-to-host snapshot pays per tensor, and a small model's share is mostly such costs.

Why flat groups rather than one array per tensor: a model has hundreds of small
variables (biases, BN statistics, optimizer slots). Packing them keeps the
number of objects proportional to the state's size, not to its variable count,
and lets the split balance bytes exactly regardless of tensor shapes.

Balance guarantee (property-tested): with ``P = piece_bytes`` and ``T`` the
total, every rank is assigned at most ``T / W + P`` bytes, where by default
``P = max(T / (4 W), MIN_PIECE_BYTES)``, i.e. at most 1.25x the ideal share
plus 64 KiB. Every byte of every tensor is assigned to exactly one rank, and
the plan does not depend on the order in which tensors are given.
"""
from __future__ import annotations

import bisect
import hashlib
import heapq
import json
import math
from dataclasses import astuple, dataclass
from functools import cached_property, lru_cache
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from ckpt_service.errors import BadTensorNameError, CheckpointError

MIN_PIECE_BYTES = 64 * 1024
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024  # <= 8 MiB keeps GCS uploads single-request
PIECES_PER_RANK = 4


class UnsupportedDtypeError(CheckpointError, TypeError):
    """A tensor's dtype cannot be stored (object, string, structured...)."""


class BadTensorSpecError(CheckpointError, ValueError):
    """A tensor spec's shape has a negative size."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, little-endian, e.g. "float32"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclass(frozen=True)
class TensorPlacement:
    """Where a tensor lives inside its dtype group's flat buffer (in elements)."""

    spec: TensorSpec
    offset: int

    @property
    def stop(self) -> int:
        return self.offset + self.spec.size


@dataclass(frozen=True)
class WriteItem:
    """One piece: elements [start, stop) of a group's flat buffer, written by ``rank``."""

    group: str
    index: int
    start: int
    stop: int
    chunk_elements: int
    itemsize: int
    rank: int

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.itemsize


@dataclass(frozen=True)
class SavePlan:
    world_size: int
    piece_bytes: int
    placements: tuple[TensorPlacement, ...]  # sorted by (group, name)
    items: tuple[WriteItem, ...]  # sorted by (group, index)

    def for_rank(self, rank: int) -> tuple[WriteItem, ...]:
        return tuple(item for item in self.items if item.rank == rank)

    def bytes_per_rank(self) -> list[int]:
        loads = [0] * self.world_size
        for item in self.items:
            loads[item.rank] += item.nbytes
        return loads

    @property
    def total_bytes(self) -> int:
        return sum(p.spec.nbytes for p in self.placements)

    @cached_property
    def digest(self) -> str:
        """sha256 of the plan's canonical JSON: writers of one save show they planned alike by it.

        Computed once per plan (plans are cached and immutable; cached_property writes the
        instance's ``__dict__``, which a frozen dataclass allows).
        """
        body = {"world_size": self.world_size, "piece_bytes": self.piece_bytes,
                "placements": [[p.spec.name, list(p.spec.shape), p.spec.dtype, p.offset] for p in self.placements],
                "items": [astuple(i) for i in self.items]}
        return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()

    def group_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for p in self.placements:
            sizes[p.spec.dtype] = max(sizes.get(p.spec.dtype, 0), p.stop)
        return sizes

    def tensors_for_rank(self, rank: int) -> set[str]:
        """Names of the tensors whose bytes this rank writes (what it must snapshot)."""
        mine = self.for_rank(rank)
        return {
            p.spec.name
            for p in self.placements
            if p.spec.size
            and any(i.group == p.spec.dtype and i.start < p.stop and p.offset < i.stop for i in mine)
        }


def validate_tensor_name(name: str) -> str:
    """Names are free-form (``dense/kernel:0`` is fine) but must not look like an escape."""
    if not isinstance(name, str) or not name:
        raise BadTensorNameError(f"tensor name {name!r} must be a non-empty string")
    if name.startswith("/") or "\x00" in name or "\\" in name or ".." in name.split("/"):
        raise BadTensorNameError(
            f"tensor name {name!r} is absolute or contains '..', NUL or backslash; "
            "use a relative name such as 'layer1/kernel'"
        )
    return name


def spec_of(name: str, array: Any) -> TensorSpec:
    """Spec of an array-like without copying it: numpy arrays, and device tensors or
    variables that expose ``shape`` and a numpy-convertible ``dtype`` (TensorFlow's
    ``as_numpy_dtype``)."""
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        array = np.asarray(array)
    dtype = np.dtype(getattr(array.dtype, "as_numpy_dtype", array.dtype))
    if not _storable(dtype):
        raise UnsupportedDtypeError(
            f"tensor {name!r} has dtype {dtype}; only bool, integer (8 to 64 bits), float (16, 32 or 64 bits) "
            "and complex (64 or 128 bits) arrays can be checkpointed (convert it to one of those numeric dtypes "
            "first)"
        )
    return TensorSpec(validate_tensor_name(name), tuple(int(d) for d in array.shape), dtype.newbyteorder("<").name)


#: the dtypes zarr v3 stores (little-endian names); extended precision (float128, complex256) is not one
STORABLE_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
     "float64", "complex64", "complex128"])


def _storable(dtype: np.dtype[Any]) -> bool:
    return dtype.fields is None and dtype.kind in "biufc" and dtype.newbyteorder("<").name in STORABLE_DTYPES


def specs_of(tensors: Mapping[str, Any]) -> list[TensorSpec]:
    return [spec_of(name, arr) for name, arr in tensors.items()]


def checked_spec(name: str, value: Any) -> TensorSpec:
    """``value``'s spec under ``name``: a TensorSpec already in normal form is taken as is
    (spec_of's dtype normalisation costs microseconds per tensor), anything else goes through spec_of."""
    if (isinstance(value, TensorSpec) and value.name == name and isinstance(value.shape, tuple)
            and all(type(d) is int and d >= 0 for d in value.shape)
            and isinstance(value.dtype, str) and is_storable_dtype_name(value.dtype)):
        validate_tensor_name(name)
        return value
    spec = spec_of(name, value)
    if any(d < 0 for d in spec.shape):
        raise BadTensorSpecError(f"tensor {name!r}: shape {tuple(value.shape)!r} has a negative size")
    return spec


@lru_cache(maxsize=64)
def is_storable_dtype_name(dtype: str) -> bool:
    """Whether ``dtype`` is a name spec_of produces (storable kind, little-endian normal form)."""
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        return False
    return _storable(np_dtype) and np_dtype.newbyteorder("<").name == dtype


class TensorSpecs(Mapping[str, TensorSpec]):
    """An immutable name -> :class:`TensorSpec` mapping, checked once, when it is made.

    A save whose data comes from a share snapshot is given the state's specs on every save.
    Checking a few hundred of them costs about half a millisecond of each save's stall, so a
    save given a ``TensorSpecs`` takes them as checked, and finds its cached plan by identity.
    """

    __slots__ = ("_by_name", "_specs", "_hash")

    def __init__(self, tensors: Mapping[str, Any]) -> None:
        """``tensors`` maps names to TensorSpecs, or to anything :func:`spec_of` accepts."""
        self._by_name = {name: checked_spec(name, value) for name, value in tensors.items()}
        self._specs = tuple(self._by_name.values())
        self._hash = hash(self._specs)

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        return self._specs

    def __getitem__(self, name: str) -> TensorSpec:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._specs)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorSpecs):
            return other is self or (other._hash == self._hash and other._specs == self._specs)
        return super().__eq__(other)

    def __repr__(self) -> str:
        return f"TensorSpecs({len(self._specs)} tensors)"


def default_piece_bytes(total_bytes: int, world_size: int) -> int:
    return max(MIN_PIECE_BYTES, math.ceil(total_bytes / (PIECES_PER_RANK * world_size)))


def make_save_plan(
    specs: Iterable[TensorSpec],
    world_size: int,
    *,
    piece_bytes: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> SavePlan:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ordered = sorted(specs, key=lambda s: (s.dtype, s.name))
    names = [s.name for s in ordered]
    if len(set(names)) != len(names):
        raise BadTensorNameError("duplicate tensor names in the state")

    placements: list[TensorPlacement] = []
    group_size: dict[str, int] = {}
    for spec in ordered:
        offset = group_size.get(spec.dtype, 0)
        placements.append(TensorPlacement(spec, offset))
        group_size[spec.dtype] = offset + spec.size

    total = sum(s.nbytes for s in ordered)
    piece_bytes = piece_bytes or default_piece_bytes(total, world_size)

    pieces: list[tuple[str, int, int, int, int, int]] = []  # group, index, start, stop, chunk, itemsize
    for group in sorted(group_size):
        itemsize = np.dtype(group).itemsize
        chunk = max(1, min(chunk_bytes, piece_bytes) // itemsize)
        # Pieces are whole numbers of chunks, so no chunk is shared by two writers.
        piece = max(chunk, (piece_bytes // itemsize) // chunk * chunk)
        size = group_size[group]
        for index, start in enumerate(range(0, size, piece)):
            pieces.append((group, index, start, min(size, start + piece), chunk, itemsize))

    # LPT: largest piece first onto the least-loaded rank; ties broken by identity,
    # so the result is a pure function of the inputs.
    order = sorted(pieces, key=lambda p: (-(p[3] - p[2]) * p[5], p[0], p[1]))
    heap = [(0, rank) for rank in range(world_size)]
    quota: dict[int, list[int]] = {}  # piece bytes -> how many pieces of that size each rank takes
    for _group, _index, start, stop, _chunk, itemsize in order:
        load, rank = heapq.heappop(heap)
        nbytes = (stop - start) * itemsize
        quota.setdefault(nbytes, [0] * world_size)[rank] += 1
        heapq.heappush(heap, (load + nbytes, rank))
    assigned = _spread_tensors(pieces, placements, quota, world_size)

    items = tuple(
        WriteItem(g, i, a, b, c, isz, assigned[(g, i)]) for g, i, a, b, c, isz in pieces
    )
    return SavePlan(world_size, piece_bytes, tuple(placements), items)


def _spread_tensors(pieces: list[tuple[str, int, int, int, int, int]], placements: list[TensorPlacement],
                    quota: dict[int, list[int]], world_size: int) -> dict[tuple[str, int], int]:
    """Hand out each size class of pieces within its per-rank quota, piece with the most tensors
    first, to the rank whose share touches the fewest tensors so far (ties: lowest rank)."""
    bounds: dict[str, tuple[list[int], list[int]]] = {}  # per group: starts and stops of non-empty tensors
    for p in placements:
        if p.spec.size:
            starts, stops = bounds.setdefault(p.spec.dtype, ([], []))
            starts.append(p.offset)
            stops.append(p.stop)

    def tensors_in(group: str, start: int, stop: int) -> int:
        starts, stops = bounds.get(group, ([], []))
        return bisect.bisect_left(starts, stop) - bisect.bisect_right(stops, start)

    touched = [0] * world_size
    assigned: dict[tuple[str, int], int] = {}
    by_size: dict[int, list[tuple[int, str, int]]] = {}
    for group, index, start, stop, _chunk, itemsize in pieces:
        by_size.setdefault((stop - start) * itemsize, []).append((tensors_in(group, start, stop), group, index))
    for nbytes in sorted(by_size, reverse=True):
        left = list(quota[nbytes])
        for count, group, index in sorted(by_size[nbytes], key=lambda p: (-p[0], p[1], p[2])):
            rank = min((r for r in range(world_size) if left[r]), key=lambda r: (touched[r], r))
            left[rank] -= 1
            touched[rank] += count
            assigned[(group, index)] = rank
    return assigned


def plan_reads(placements: Iterable[TensorPlacement], world_size: int) -> dict[int, list[str]]:
    """Partition whole tensors among ``world_size`` readers, balancing bytes (LPT).

    Used when M readers restore a state written by N writers and each reader
    should fetch only its share.
    """
    heap = [(0, rank) for rank in range(world_size)]
    result: dict[int, list[str]] = {rank: [] for rank in range(world_size)}
    for p in sorted(placements, key=lambda p: (-p.spec.nbytes, p.spec.name)):
        load, rank = heapq.heappop(heap)
        result[rank].append(p.spec.name)
        heapq.heappush(heap, (load + p.spec.nbytes, rank))
    return result
