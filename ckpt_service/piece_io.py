"""Encoding one piece (a 1-D slice of a dtype group) as a zarr v3 array, and back.

Encoding happens into an in-memory zarr store; the caller uploads the resulting
objects in parallel through its ``ObjectStore``. Keeping zarr away from the I/O
means every backend gets the same retries, atomic writes and parallelism, and a
piece never exists half-written under its final keys on a local disk.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import zarr
from zarr.codecs import BloscCodec, ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from ckpt_service.errors import CorruptCheckpointError

METADATA_KEY = "zarr.json"
COMPRESSIONS = ("none", "zstd", "blosc")


def _compressors(compression: str) -> tuple[object, ...] | None:
    if compression == "none":
        return None  # weights barely compress; CPU time matters more in a notice window
    if compression == "zstd":
        return (ZstdCodec(level=1),)
    if compression == "blosc":
        return (BloscCodec(cname="lz4", clevel=1, shuffle="shuffle"),)
    raise ValueError(f"unknown compression {compression!r}; choose one of {', '.join(COMPRESSIONS)}")


def encode_piece(flat: np.ndarray, chunk_elements: int, compression: str = "none") -> dict[str, bytes]:
    """Return the zarr objects (relative key -> bytes) that hold ``flat``."""
    staging: dict[str, object] = {}
    array = zarr.create_array(
        store=MemoryStore(staging),
        shape=flat.shape,
        chunks=(max(1, min(chunk_elements, flat.size or 1)),),
        dtype=flat.dtype,
        compressors=_compressors(compression),
        fill_value=0,
        config={"write_empty_chunks": True},
    )
    if flat.size:
        array[:] = flat
    return {key: buf.to_bytes() for key, buf in staging.items()}  # type: ignore[attr-defined]


def chunk_keys(size: int, chunk_elements: int) -> list[str]:
    """Keys of a piece's objects, computed rather than listed (one request fewer per piece)."""
    n_chunks = -(-size // max(1, chunk_elements)) if size else 0
    return [METADATA_KEY] + [f"c/{i}" for i in range(n_chunks)]


def decode_piece(objects: Mapping[str, bytes | None], *, where: str) -> np.ndarray:
    """Rebuild the flat array from its objects (a missing chunk reads as its fill value)."""
    if objects.get(METADATA_KEY) is None:
        raise CorruptCheckpointError(f"{where}: zarr metadata is missing")
    proto = default_buffer_prototype()
    staging = {k: proto.buffer.from_bytes(v) for k, v in objects.items() if v is not None}
    try:
        array = zarr.open_array(store=MemoryStore(staging), mode="r")
        return np.asarray(array[:])
    except Exception as exc:  # zarr raises many types for corrupt metadata or codecs
        raise CorruptCheckpointError(f"{where}: cannot decode zarr data ({exc})") from exc
