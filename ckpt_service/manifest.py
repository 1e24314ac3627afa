"""Manifest and commit-marker formats (JSON, versioned) and their validation.

A step exists for readers only if ``COMMIT`` parses, names a manifest, and that
manifest's crc32c matches the one recorded in the marker.

A marker's ``fence`` is the fence number its commit wrote into the master lease (a counter
the lease object keeps, +1 on every write of it: :mod:`ckpt_service.lease`), and its
``based_on`` the number the lease held when that save began. A committed step is
*superseded* when a lower committed step's save began after the step's fence: the lower
step knew of it and was committed in its place (a rollback, or a successor master's commit
made after an old master's fence). A save that was already under way when a higher step
was committed (a slow background save) supersedes nothing. Markers without a fence (saves
without a lease, and markers of older versions) neither supersede nor are superseded. See
:func:`superseded_steps`.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping  # not typing's alias: its isinstance goes through typing first
from dataclasses import asdict, dataclass, field
from typing import Any

import google_crc32c
import numpy as np
from numpy.typing import NDArray

from ckpt_service.errors import BadMetadataError, CorruptCheckpointError, FormatVersionError
from ckpt_service.plan import TensorPlacement, TensorSpec

FORMAT_NAME = "hvd-transient-checkpoint"
FORMAT_VERSION = 1


def crc32c(data: bytes | NDArray[Any]) -> int:
    """crc32c of bytes, or of an array's raw bytes without copying them."""
    if isinstance(data, np.ndarray):
        view = np.ascontiguousarray(data).view()
        view.flags.writeable = False  # the C extension takes read-only buffers only
        return int(google_crc32c.value(view))
    return int(google_crc32c.value(data))


@dataclass(frozen=True)
class PieceRecord:
    """What a writer wrote: one piece of a dtype group's flat buffer."""

    group: str
    index: int
    start: int
    stop: int
    chunk_elements: int
    key: str  # zarr array prefix in the store
    crc32c: int  # of the piece's raw little-endian bytes
    nbytes: int
    writer: int


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    group: str
    offset: int

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def placement(self) -> TensorPlacement:
        return TensorPlacement(TensorSpec(self.name, self.shape, self.dtype), self.offset)


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    created_at: float
    tensors: tuple[TensorEntry, ...]
    pieces: tuple[PieceRecord, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    lease_generation: int | None = None
    attempt: str | None = None  # the save attempt whose writers' records the commit took
    format_version: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_json(self) -> bytes:
        body = asdict(self)
        body["format"] = FORMAT_NAME
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> "Manifest":
        body = _load_json(data, where)
        if body.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{where} is not a {FORMAT_NAME} manifest")
        version = body.get("format_version")
        if version != FORMAT_VERSION:
            raise FormatVersionError(
                f"{where} has format version {version}; this hvd-transient reads version "
                f"{FORMAT_VERSION}. Upgrade hvd-transient (or restore with the version that wrote it)."
            )
        try:
            return cls(
                step=int(body["step"]),
                world_size=int(body["world_size"]),
                created_at=float(body["created_at"]),
                tensors=tuple(
                    TensorEntry(t["name"], tuple(t["shape"]), t["dtype"], t["group"], int(t["offset"]))
                    for t in body["tensors"]
                ),
                pieces=tuple(PieceRecord(**p) for p in body["pieces"]),
                metadata=dict(body.get("metadata") or {}),
                lease_generation=body.get("lease_generation"),
                attempt=body.get("attempt"),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"{where} is malformed: {exc!r}") from exc


@dataclass(frozen=True)
class CommitMarker:
    step: int
    manifest_key: str
    manifest_crc32c: int
    token: str
    committed_at: float
    fence: int | None = None  # the lease fence number this commit wrote (None: no lease)
    based_on: int | None = None  # the fence number the lease held when the save began
    lineage: str | None = None  # the run whose fence numbers these are (the lease object's)
    format_version: int = FORMAT_VERSION

    @property
    def order(self) -> Order | None:
        """(fence, based_on, lineage) when all are there: what orders this commit among the others."""
        if self.fence is None or self.based_on is None or self.lineage is None:
            return None
        return Order(self.fence, self.based_on, self.lineage)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> "CommitMarker":
        body = _load_json(data, where)
        # a marker written by an older version records the store's own generation of the lease, which
        # orders nothing across stores or coarse clocks: it is read as a marker without a fence
        body.pop("lease_generation", None)
        try:
            marker = cls(**body)
        except TypeError as exc:
            raise CorruptCheckpointError(f"{where} is malformed: {exc}") from exc
        check_marker_fields(marker, where)
        return marker


def check_marker_fields(marker: CommitMarker, where: str) -> None:
    """CorruptCheckpointError unless every field of ``marker`` has its type (JSON gives any)."""
    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    problems = [name for name, ok in (
        ("step", integer(marker.step) and marker.step >= 0),
        ("manifest_key", isinstance(marker.manifest_key, str) and bool(marker.manifest_key)),
        ("manifest_crc32c", integer(marker.manifest_crc32c)),
        ("token", isinstance(marker.token, str)),
        ("committed_at", isinstance(marker.committed_at, (int, float)) and not isinstance(marker.committed_at, bool)),
        ("fence", marker.fence is None or (integer(marker.fence) and marker.fence > 0)),
        ("based_on", marker.based_on is None or (integer(marker.based_on) and 0 <= marker.based_on
                                                  and (marker.fence is None or marker.based_on < marker.fence))),
        ("lineage", marker.lineage is None or (isinstance(marker.lineage, str) and bool(marker.lineage))),
        ("format_version", integer(marker.format_version)),
    ) if not ok]
    if problems:
        raise CorruptCheckpointError(f"{where} is malformed: bad {', '.join(problems)}")


@dataclass(frozen=True)
class Order:
    """Where a commit stands among the others of its lineage: the fence number it wrote, and the one its
    save began at."""

    fence: int
    based_on: int
    lineage: str = ""

    def supersedes(self, higher: Order) -> bool:
        """Whether this commit, of a lower step, supersedes ``higher``: same lineage, begun after its fence."""
        return self.lineage == higher.lineage and self.based_on >= higher.fence


def superseded_steps(orders: Mapping[int, Order | None]) -> frozenset[int]:
    """Pure: the steps of ``orders`` (step -> its marker's order) that a lower step supersedes: a lower
    step of the same lineage whose save began at or after this step's fence (``based_on >= fence``).
    A step without an order is never in it and never supersedes another."""
    superseded: set[int] = set()
    latest_start: dict[str, int] = {}  # lineage -> the latest ``based_on`` among the lower steps seen so far
    for step in sorted(orders):
        order = orders[step]
        if order is None:
            continue
        start = latest_start.get(order.lineage)
        if start is not None and start >= order.fence:
            superseded.add(step)
        latest_start[order.lineage] = order.based_on if start is None else max(start, order.based_on)
    return frozenset(superseded)


def checked_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``metadata`` as the manifest will hold it (a JSON round trip), or BadMetadataError.

    Strict JSON only, so that every reader (``inspect --json`` included) parses it back to the
    same value: string keys (json.dumps would turn ``1`` into ``"1"``, silently merging it with a
    ``"1"`` key), finite numbers (NaN and infinity are not JSON), and lists, dicts, strings,
    numbers, booleans and None. The error names the offending entry.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise BadMetadataError(f"metadata must be a dict, got {type(metadata).__name__}")
    flat = _flat_copy(metadata)
    if flat is not None:
        return flat
    _check_json_value(metadata, "metadata", set())
    try:
        copied: dict[str, Any] = json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as exc:  # not expected after the walk; kept as a last line
        raise BadMetadataError(f"checkpoint metadata must be strict JSON ({exc})") from exc
    return copied


#: Types whose values a JSON round trip gives back equal and of the same type (exact types: a subclass,
#: numpy.float64 or an IntEnum member, takes the walk and the round trip).
_PLAIN_SCALARS = frozenset({str, int, bool, type(None)})


def _flat_copy(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """``checked_metadata``'s result for flat metadata (string keys, plain scalars or finite floats),
    which the JSON round trip would copy unchanged; None where any entry needs the full check.

    A periodic save's metadata (step, world size, learning rate) is such a dict, and it is checked
    on the training thread during the save's stall: the round trip cost more than the copy.
    """
    copied = dict(metadata)
    for key, value in copied.items():
        kind = type(value)
        if type(key) is not str or not (kind in _PLAIN_SCALARS or (kind is float and math.isfinite(value))):
            return None
    return copied


def _check_json_value(value: Any, where: str, open_containers: set[int]) -> None:
    """Raise BadMetadataError naming the first entry under ``where`` that is not strict JSON."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadMetadataError(f"{where} is {value!r}, which JSON cannot hold; store a finite number, "
                                   "None or a string such as 'nan' instead")
        return
    if not isinstance(value, (Mapping, list, tuple)):
        raise BadMetadataError(
            f"{where} is of type {type(value).__name__}, which is not JSON-serialisable; convert numpy scalars with "
            "int()/float() and arrays with .tolist(), or save arrays as tensors")
    if id(value) in open_containers:
        raise BadMetadataError(f"{where} contains itself; metadata must be a tree of plain values")
    open_containers.add(id(value))
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise BadMetadataError(
                    f"{where} has the key {key!r} of type {type(key).__name__}; metadata keys must be strings "
                    "(JSON would turn it into a string and could merge it with another key)")
            _check_json_value(item, f"{where}[{key!r}]", open_containers)
    else:
        for i, item in enumerate(value):
            _check_json_value(item, f"{where}[{i}]", open_containers)
    open_containers.discard(id(value))


def _load_json(data: bytes, where: str) -> dict[str, Any]:
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise CorruptCheckpointError(f"{where} is not a JSON object")
    return body
