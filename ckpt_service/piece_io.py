"""Encoding one piece (a 1-D slice of a dtype group) as a zarr v3 array, and back.

Encoding happens into an in-memory zarr store; the caller uploads the resulting
objects in parallel through its ``ObjectStore``. Every chunk ends with zarr's
crc32c codec, so a reader that needs only part of a piece (a resharding
restore) fetches and verifies just the chunks it reads; the manifest's crc32c
covers the whole piece. Keeping zarr away from the I/O
means every backend gets the same retries, atomic writes and parallelism, and a
piece never exists half-written under its final keys on a local disk.

Uncompressed pieces (the default) skip zarr's per-chunk machinery, which runs at a few
hundred MB/s: their chunks are framed here exactly as zarr frames them (the raw
little-endian elements, the last chunk padded with the fill value 0, then the crc32c of
those bytes as 4 little-endian bytes), so the objects are byte-identical and either
path reads what the other wrote. A local restore reads such chunks one file at a time,
in parallel, straight into the tensors (:func:`read_plain_chunk`), and checks the piece's
crc32c by combining its chunks' (:func:`crc32c_combine`) instead of reading it all again.
"""
from __future__ import annotations

import contextlib
import functools
import json
from typing import Any, Callable, Iterator, Mapping, Sequence

import google_crc32c
import numpy as np
import zarr
from numpy.typing import NDArray
from zarr.abc.codec import BytesBytesCodec
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec
from zarr.core.buffer import Buffer, default_buffer_prototype
from zarr.storage import MemoryStore

from ckpt_service.errors import BadCompressionError, CorruptCheckpointError
from ckpt_service.manifest import crc32c

METADATA_KEY = "zarr.json"
COMPRESSIONS = ("none", "zstd", "blosc")


def checked_compression(compression: Any) -> str:
    """``compression`` if pieces can be written with it; BadCompressionError naming the allowed values."""
    if not isinstance(compression, str) or compression not in COMPRESSIONS:
        raise BadCompressionError(
            f"compression {compression!r} is not one the checkpoint format knows: choose one of "
            f"{', '.join(repr(c) for c in COMPRESSIONS)} ('none', the default, suits weights, which barely compress)")
    return compression


def _compressors(compression: str) -> tuple[BytesBytesCodec, ...]:
    if compression == "none":
        codecs: tuple[BytesBytesCodec, ...] = ()  # weights barely compress; CPU time matters in a notice window
    elif compression == "zstd":
        codecs = (ZstdCodec(level=1),)
    elif compression == "blosc":
        codecs = (BloscCodec(cname="lz4", clevel=1, shuffle="shuffle"),)
    else:
        checked_compression(compression)  # raises: not one of COMPRESSIONS
    return codecs + (Crc32cCodec(),)


def _create(store: MemoryStore, shape: tuple[int, ...], chunk_elements: int, dtype: np.dtype[Any],
            compression: str) -> zarr.Array[Any]:
    return zarr.create_array(
        store=store,
        shape=shape,
        chunks=(max(1, min(chunk_elements, shape[0] or 1)),),
        dtype=dtype,
        compressors=_compressors(compression),
        fill_value=0,
        config={"write_empty_chunks": True},
    )


@functools.lru_cache(maxsize=256)
def _metadata(size: int, chunk_elements: int, dtype: np.dtype[Any]) -> bytes:
    """zarr's own metadata object of an uncompressed piece (pieces of a plan share a few shapes)."""
    staging: dict[str, Buffer] = {}
    _create(MemoryStore(staging), (size,), chunk_elements, dtype, "none")
    return staging[METADATA_KEY].to_bytes()


Parts = tuple["bytes | memoryview", ...]  # an object's bytes, in order, uncopied


def _framed(flat: NDArray[Any], start: int, chunk: int) -> Parts:
    """One uncompressed chunk object: elements [start, start + chunk), zero-padded, then their crc32c."""
    part = flat[start:start + chunk]
    pad = bytes((chunk - part.size) * flat.itemsize)
    crc = google_crc32c.extend(crc32c(part), pad) if pad else crc32c(part)
    return part.data.cast("B"), pad, int(crc).to_bytes(4, "little")


def piece_objects(flat: NDArray[Any], chunk_elements: int, compression: str = "none") -> dict[str, Callable[[], Parts]]:
    """The zarr objects (relative key -> a function making its parts) that hold ``flat``.

    Uncompressed chunks are made by their functions, so that the uploading threads checksum
    them in parallel, and are views of ``flat`` (a store that takes parts writes them without
    a copy); compressed pieces are encoded by zarr here.
    """
    if compression != "none":
        encoded = encode_piece(flat, chunk_elements, compression)
        return {key: functools.partial(tuple, (data,)) for key, data in encoded.items()}
    flat = np.ascontiguousarray(flat)
    if not flat.dtype.isnative and flat.dtype.itemsize > 1:
        raise ValueError("pieces are little-endian arrays")
    chunk = max(1, min(chunk_elements, flat.size or 1))
    meta = _metadata(flat.size, chunk_elements, flat.dtype.newbyteorder("<"))
    objects: dict[str, Callable[[], Parts]] = {METADATA_KEY: functools.partial(tuple, (meta,))}
    for i, start in enumerate(range(0, flat.size, chunk)):
        objects[f"c/{i}"] = functools.partial(_framed, flat, start, chunk)
    return objects


def encode_piece(flat: NDArray[Any], chunk_elements: int, compression: str = "none") -> dict[str, bytes]:
    """Return the zarr objects (relative key -> bytes) that hold ``flat``, encoded by zarr."""
    staging: dict[str, Buffer] = {}
    array = _create(MemoryStore(staging), flat.shape, chunk_elements, flat.dtype, compression)
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


def plain_layout(metadata: bytes | None, *, where: str) -> tuple[int, int, np.dtype[Any]] | None:
    """(size, chunk elements, dtype) of an uncompressed 1-D piece from its zarr metadata, None for
    any other piece (left to zarr); CorruptCheckpointError if the metadata is missing."""
    if metadata is None:
        raise CorruptCheckpointError(f"{where}: zarr metadata is missing")
    return _plain_layout(metadata)


def _plain_layout(metadata: bytes) -> tuple[int, int, np.dtype[Any]] | None:
    """(size, chunk elements, dtype) of an uncompressed 1-D piece, or None for anything else
    (left to zarr)."""
    try:
        meta = json.loads(metadata)
        codecs = meta["codecs"]
        endian = codecs[0].get("configuration", {}).get("endian", "little")
        if ([c.get("name") for c in codecs] != ["bytes", "crc32c"] or endian != "little"
                or meta.get("zarr_format") != 3 or meta["chunk_grid"]["name"] != "regular"
                or meta["chunk_key_encoding"] != {"name": "default", "configuration": {"separator": "/"}}):
            return None
        (size,), (chunk,) = meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"]
        dtype = np.dtype(meta["data_type"]).newbyteorder("<")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    if dtype.kind not in "biufc" or not isinstance(size, int) or not isinstance(chunk, int) or chunk < 1:
        return None
    return size, chunk, dtype


def decode_piece(objects: Mapping[str, bytes | None], *, where: str, start: int = 0,
                 stop: int | None = None, out: NDArray[Any] | None = None) -> NDArray[Any]:
    """Elements [start, stop) of a piece from its objects; every chunk read is checksum-verified.

    ``out`` (of the right size and dtype), if given, receives the elements and is returned: a
    restore decodes straight into the tensor a read lies in.
    """
    metadata = objects.get(METADATA_KEY)
    if metadata is None:
        raise CorruptCheckpointError(f"{where}: zarr metadata is missing")
    plain = _plain_layout(metadata)
    if plain is None:
        decoded = _zarr_decode(objects, where=where, start=start, stop=stop)
        if out is None or out.shape != decoded.shape or out.dtype != decoded.dtype:
            return decoded  # not cast into ``out``: the caller sees that it is not what it asked for
        out[:] = decoded
        return out
    return _decode_plain(plain, objects.get, None, where=where, start=start, stop=stop, out=out)


#: reads an object's first ``len(buffer)`` bytes into ``buffer``: (bytes read, the rest of the object),
#: or None if there is no such object
GetInto = Callable[[str, memoryview], "tuple[int, bytes] | None"]


def read_plain(metadata: bytes | None, get: Callable[[str], bytes | None], get_into: GetInto, *, where: str,
               start: int, stop: int, out: NDArray[Any] | None) -> NDArray[Any] | None:
    """:func:`decode_piece` of an uncompressed piece through ``get`` and ``get_into``: every whole
    chunk is read straight into ``out`` and verified there. None if the piece is not uncompressed."""
    if metadata is None:
        raise CorruptCheckpointError(f"{where}: zarr metadata is missing")
    plain = _plain_layout(metadata)
    return None if plain is None else _decode_plain(plain, get, get_into, where=where, start=start, stop=stop,
                                                    out=out)


def _decode_plain(plain: tuple[int, int, np.dtype[Any]], get: Callable[[str], bytes | None],
                  get_into: GetInto | None, *, where: str, start: int, stop: int | None,
                  out: NDArray[Any] | None) -> NDArray[Any]:
    size, chunk, dtype = plain
    stop = size if stop is None else min(stop, size)
    if out is None or out.shape != (max(0, stop - start),) or out.dtype != dtype:
        out = np.empty(max(0, stop - start), dtype=dtype)
    for i in range(start // chunk, (stop - 1) // chunk + 1) if stop > start else ():
        lo, hi = max(start, i * chunk), min(stop, (i + 1) * chunk)
        if get_into is not None and hi - lo == chunk:
            target = out[lo - start:hi - start]
            with _folder_is_corrupt(where, f"c/{i}"):
                got = get_into(f"c/{i}", target.data.cast("B"))
            if got is None or got[0] != target.nbytes or len(got[1]) != 4:
                raise CorruptCheckpointError(f"{where}: chunk c/{i} is missing or has the wrong length")
            if crc32c(target) != int.from_bytes(got[1], "little"):
                raise CorruptCheckpointError(f"{where}: chunk c/{i} fails its crc32c")
            continue
        with _folder_is_corrupt(where, f"c/{i}"):
            data = get(f"c/{i}")
        if data is None or len(data) != chunk * dtype.itemsize + 4:
            raise CorruptCheckpointError(f"{where}: chunk c/{i} is missing or has the wrong length")
        body = np.frombuffer(data, dtype=np.uint8, count=len(data) - 4)
        if crc32c(body) != int.from_bytes(data[-4:], "little"):
            raise CorruptCheckpointError(f"{where}: chunk c/{i} fails its crc32c")
        skip = (lo - i * chunk) * dtype.itemsize
        out[lo - start:hi - start] = np.frombuffer(data, dtype=dtype, count=hi - lo, offset=skip)
    return out


@contextlib.contextmanager
def _folder_is_corrupt(where: str, key: str) -> Iterator[None]:
    """A folder where a local piece's chunk file belongs is a damaged piece, not a failed read: it
    is reported as corrupt (verify lists it, restore falls back) like a missing chunk. Other
    OSErrors (EIO, a stale NFS handle) may pass, so they are not taken for corruption."""
    try:
        yield
    except IsADirectoryError:
        raise CorruptCheckpointError(
            f"{where}: chunk {key} is a folder, not a file; the piece cannot be read (restore an earlier step)"
        ) from None


#: scatter-reads an object into buffers in order: (bytes read, the object's size), or None if there
#: is no such object
GetIntoParts = Callable[[str, Sequence[memoryview]], "tuple[int, int] | None"]


def read_plain_chunk(get_into_parts: GetIntoParts, index: int, parts: Sequence[NDArray[Any]], padding: int, *,
                     where: str) -> int:
    """Read chunk ``c/{index}`` of an uncompressed piece straight into ``parts`` (its elements, in
    order: slices of the tensors they belong to, or scratch for elements nobody wants) and verify
    its crc32c there. Returns the crc32c of its elements without the padding (``padding`` bytes of
    fill after the piece's end), from which :func:`crc32c_combine` makes the whole piece's."""
    pad, tail = np.empty(padding, np.uint8), np.empty(4, np.uint8)
    buffers = [p.data.cast("B") for p in (*parts, pad, tail) if p.nbytes]
    want = sum(len(b) for b in buffers)
    with _folder_is_corrupt(where, f"c/{index}"):
        got = get_into_parts(f"c/{index}", buffers)
    if got is None or got != (want, want):
        raise CorruptCheckpointError(f"{where}: chunk c/{index} is missing or has the wrong length")
    crc = 0
    for part in parts:
        crc = _extend(crc, part)
    if int(_extend(crc, pad)) != int.from_bytes(tail.tobytes(), "little"):
        raise CorruptCheckpointError(f"{where}: chunk c/{index} fails its crc32c")
    return crc


def _extend(crc: int, data: NDArray[Any]) -> int:
    view = data.view()
    view.flags.writeable = False  # the C extension takes read-only buffers only
    return int(google_crc32c.extend(crc, view))


_CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _mult_mod_p(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order, as zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1
    return p


def _x_pow_2n() -> tuple[int, ...]:
    """x**(2**k) modulo the polynomial, k = 0..31."""
    powers = [1 << 30]  # x**1
    for _ in range(31):
        powers.append(_mult_mod_p(powers[-1], powers[-1]))
    return tuple(powers)


_X_POW_2N = _x_pow_2n()


@functools.lru_cache(maxsize=64)
def _x_pow_8n(n: int) -> int:
    """x**(8 n) modulo the polynomial: shifting a crc past n zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _mult_mod_p(_X_POW_2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of ``a + b`` from ``crc1`` = crc32c(a), ``crc2`` = crc32c(b) and ``len2`` = len(b)
    (zlib's ``crc32_combine`` for the Castagnoli polynomial): the chunks of a piece are checked
    in parallel and the piece's own crc32c follows without reading its bytes a second time."""
    if len2 < 0:
        raise ValueError(f"len2 must be >= 0, got {len2}")
    return _mult_mod_p(_x_pow_8n(len2), crc1) ^ crc2


def _zarr_decode(objects: Mapping[str, bytes | None], *, where: str, start: int,
                 stop: int | None) -> NDArray[Any]:
    proto = default_buffer_prototype()
    staging = {k: proto.buffer.from_bytes(v) for k, v in objects.items() if v is not None}
    try:
        array = zarr.open_array(store=MemoryStore(staging), mode="r")
        # zarr reads an absent chunk as the fill value; every chunk of a piece is written
        # (write_empty_chunks), so an absent one is a lost object, never zeros
        missing = _absent_chunks(staging, array, start, stop)
        if not missing:
            return np.asarray(array[start:stop])
    except Exception as exc:  # zarr raises many types for corrupt metadata or codecs
        raise CorruptCheckpointError(
            f"{where}: a chunk fails its crc32c or cannot be decoded ({exc})") from exc
    raise CorruptCheckpointError(
        f"{where}: chunk{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
        f"{'are' if len(missing) > 1 else 'is'} missing; the piece cannot be read (restore an earlier step)")


def _absent_chunks(staging: Mapping[str, Buffer], array: zarr.Array[Any], start: int,
                   stop: int | None) -> list[str]:
    """Keys of the chunks holding elements [start, stop) of a 1-D ``array`` that ``staging`` lacks."""
    if len(array.shape) != 1:
        raise ValueError(f"a piece is a 1-D array, this one has shape {array.shape}")
    size, chunk = array.shape[0], array.chunks[0]
    stop = size if stop is None else min(stop, size)
    needed = range(start // chunk, (stop - 1) // chunk + 1) if stop > start else range(0)
    return [key for i in needed if (key := array.metadata.encode_chunk_key((i,))) not in staging]
