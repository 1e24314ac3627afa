"""Encoding one piece (a 1-D slice of a dtype group) as a zarr v3 array, and back.

Encoding happens into an in-memory zarr store; the caller uploads the resulting
objects in parallel through its ``ObjectStore``. Every chunk ends with zarr's
crc32c codec, so a reader that needs only part of a piece (a resharding
restore) fetches and verifies just the chunks it reads; the manifest's crc32c
covers the whole piece. Keeping zarr away from the I/O
means every backend gets the same retries, atomic writes and parallelism, and a
piece never exists half-written under its final keys on a local disk.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import zarr
from numpy.typing import NDArray
from zarr.abc.codec import BytesBytesCodec
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec
from zarr.core.buffer import Buffer, default_buffer_prototype
from zarr.storage import MemoryStore

from ckpt_service.errors import CorruptCheckpointError

METADATA_KEY = "zarr.json"
COMPRESSIONS = ("none", "zstd", "blosc")


def _compressors(compression: str) -> tuple[BytesBytesCodec, ...]:
    if compression == "none":
        codecs: tuple[BytesBytesCodec, ...] = ()  # weights barely compress; CPU time matters in a notice window
    elif compression == "zstd":
        codecs = (ZstdCodec(level=1),)
    elif compression == "blosc":
        codecs = (BloscCodec(cname="lz4", clevel=1, shuffle="shuffle"),)
    else:
        raise ValueError(f"unknown compression {compression!r}; choose one of {', '.join(COMPRESSIONS)}")
    return codecs + (Crc32cCodec(),)


def encode_piece(flat: NDArray[Any], chunk_elements: int, compression: str = "none") -> dict[str, bytes]:
    """Return the zarr objects (relative key -> bytes) that hold ``flat``."""
    staging: dict[str, Buffer] = {}
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
    return {key: buf.to_bytes() for key, buf in staging.items()}


def chunk_keys(size: int, chunk_elements: int, start: int = 0, stop: int | None = None) -> list[str]:
    """Keys of the objects holding elements [start, stop) of a piece, computed rather than
    listed (one request fewer per piece)."""
    stop = size if stop is None else stop
    if stop <= start:
        return [METADATA_KEY]
    step = max(1, chunk_elements)
    return [METADATA_KEY] + [f"c/{i}" for i in range(start // step, (stop - 1) // step + 1)]


def decode_piece(objects: Mapping[str, bytes | None], *, where: str, start: int = 0,
                 stop: int | None = None) -> NDArray[Any]:
    """Elements [start, stop) of a piece from its objects; every chunk read is checksum-verified."""
    if objects.get(METADATA_KEY) is None:
        raise CorruptCheckpointError(f"{where}: zarr metadata is missing")
    proto = default_buffer_prototype()
    staging = {k: proto.buffer.from_bytes(v) for k, v in objects.items() if v is not None}
    try:
        array = zarr.open_array(store=MemoryStore(staging), mode="r")
        return np.asarray(array[start:stop])
    except Exception as exc:  # zarr raises many types for corrupt metadata or codecs
        raise CorruptCheckpointError(
            f"{where}: a chunk fails its crc32c or cannot be decoded ({exc})") from exc
