"""A restore never returns wrong data: every read path (whole, named, partitioned; the local
fast path and the generic one; compressed or not) raises on a lost or corrupt chunk."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from ckpt_helpers import assert_same_state, make_backend_store

from ckpt_service.errors import CorruptCheckpointError
from ckpt_service.manager import CheckpointManager
from ckpt_service.piece_io import decode_piece, encode_piece
from ckpt_service.read_plan import overlaps
from ckpt_service.stores import ObjectStore

CHUNK_BYTES = 4096
COMPRESSIONS = ["none", "zstd", "blosc"]


def state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    # "a" and "b" share one float32 piece: reading "a" alone reads part of it
    return {
        "a": rng.standard_normal((64, 64)).astype(np.float32),  # 16 KiB: 4 chunks
        "b": rng.standard_normal(3000).astype(np.float32),
        "c": np.arange(1000, dtype=np.int64),
    }


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path: Path) -> ObjectStore:
    return make_backend_store(request.param, tmp_path, request)


@pytest.fixture(params=COMPRESSIONS)
def mgr(request, store: ObjectStore):
    manager = CheckpointManager(store, max_to_keep=None, chunk_bytes=CHUNK_BYTES, compression=request.param)
    manager.save(1, state(), {"epoch": 1})
    yield manager
    manager.close()


def chunk_of(mgr: CheckpointManager, name: str) -> str:
    """The key of a chunk holding elements of ``name`` (its second chunk)."""
    manifest = mgr.manifest(1)
    entry = manifest.tensor(name)
    piece = next(p for p in manifest.pieces if overlaps(entry, p))
    return f"{piece.key}c/{(entry.offset - piece.start) // piece.chunk_elements + 1}"


def test_compressed_pieces_round_trip_whole_named_and_partitioned(mgr: CheckpointManager) -> None:
    want = state()
    assert_same_state(mgr.restore().tensors, want)
    assert mgr.verify(1).ok
    assert_same_state(mgr.restore(names=["a"]).tensors, {"a": want["a"]})
    merged: dict[str, np.ndarray] = {}
    for reader in range(2):
        merged.update(mgr.restore(partition=(reader, 2)).tensors)
    assert_same_state(merged, want)


def test_compressed_chunks_are_compressed(store: ObjectStore) -> None:
    zeros = {"z": np.zeros(1 << 16, dtype=np.float32)}
    sizes = {}
    for compression in COMPRESSIONS:
        with CheckpointManager(store, max_to_keep=None, chunk_bytes=CHUNK_BYTES, compression=compression) as m:
            step = COMPRESSIONS.index(compression)
            m.save(step, zeros)
            sizes[compression] = sum(len(store.get(k)) for k in store.list(f"steps/{step:012d}/data/"))
            assert_same_state(m.restore(step).tensors, zeros)
    assert sizes["zstd"] < sizes["none"] // 10 and sizes["blosc"] < sizes["none"] // 10


@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_a_lost_or_corrupt_chunk_fails_every_read_of_it(mgr: CheckpointManager, damage: str) -> None:
    key = chunk_of(mgr, "a")
    named = "c/1 is missing" if damage == "missing" else "crc32c"
    if damage == "missing":
        mgr.store.delete(key)
    else:
        data = bytearray(mgr.store.get(key))
        data[len(data) // 2] ^= 0xFF
        mgr.store.put(key, bytes(data))
    report = mgr.verify(1)
    assert not report.ok and "a" in report.problems[0]
    with pytest.raises(CorruptCheckpointError):
        mgr.restore()
    with pytest.raises(CorruptCheckpointError, match=named):
        mgr.restore(1, names=["a"])  # part of a piece: never zeros in its place
    holder = next(r for r in range(2) if "a" in _share_of(mgr, r))
    with pytest.raises(CorruptCheckpointError, match=named):
        mgr.restore(1, partition=(holder, 2))
    # what does not lie on the damaged chunk is still read, and right
    assert_same_state(mgr.restore(1, names=["c"]).tensors, {"c": state()["c"]})


def _share_of(mgr: CheckpointManager, reader: int) -> set[str]:
    from ckpt_service.plan import plan_reads

    return set(plan_reads([t.placement for t in mgr.manifest(1).tensors], 2)[reader])


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_decoding_a_range_without_one_of_its_chunks_raises(compression: str) -> None:
    flat = np.arange(3000, dtype=np.float32)
    objects: dict[str, bytes | None] = dict(encode_piece(flat, 1024, compression))
    objects["c/1"] = None
    with pytest.raises(CorruptCheckpointError, match="c/1"):
        decode_piece(objects, where="piece", start=1000, stop=1100)
    np.testing.assert_array_equal(decode_piece(objects, where="piece", start=2048, stop=2100), flat[2048:2100])
    del objects["c/1"]
    with pytest.raises(CorruptCheckpointError, match="c/1"):
        decode_piece(objects, where="piece", start=0, stop=3000)


@pytest.mark.parametrize("spoil", ["dtype", "chunks"])
def test_a_piece_whose_zarr_metadata_disagrees_with_the_manifest_fails_partial_reads(mgr: CheckpointManager,
                                                                                     spoil: str) -> None:
    piece_key = chunk_of(mgr, "a").rsplit("c/", 1)[0]
    meta = json.loads(mgr.store.get(piece_key + "zarr.json"))
    if spoil == "dtype":  # the chunks still pass their own checksums: only the manifest tells
        meta["data_type"] = "int32"
    else:
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [512]
    mgr.store.put(piece_key + "zarr.json", json.dumps(meta).encode())
    with pytest.raises(CorruptCheckpointError):
        mgr.restore(1, names=["a"])
    assert not mgr.verify(1).ok
