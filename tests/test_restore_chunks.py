"""The local restore's chunk-by-chunk read: which bytes of which chunk go where (pure), the crc32c
of a piece combined from its chunks', the scatter read, and restores whose pieces cut across
many tensors (every byte lands once, a stale chunk from another piece is caught)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
from ckpt_helpers import assert_same_state
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_service.errors import CorruptCheckpointError
from ckpt_service.manager import CheckpointManager
from ckpt_service.manifest import PieceRecord, TensorEntry
from ckpt_service.piece_io import crc32c_combine
from ckpt_service.read_plan import PieceRead, chunk_reads, piece_reads
from ckpt_service.stores import LocalStore


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_crc32c_combine_is_the_crc32c_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) == google_crc32c.value(a + b)


def test_crc32c_combine_rejects_a_negative_length() -> None:
    with pytest.raises(ValueError, match="len2"):
        crc32c_combine(0, 0, -1)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[dict[str, TensorEntry], list[str], PieceRecord, int]:
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=8))
    entries, offset = {}, 0
    for i, size in enumerate(sizes):
        entries[f"t{i}"] = TensorEntry(f"t{i}", (size,), "float32", "float32", offset)
        offset += size
    start = draw(st.integers(0, offset))
    stop = draw(st.integers(start, offset))
    piece = PieceRecord(index=0, writer=0, key="p/", group="float32", start=start, stop=stop,
                        nbytes=(stop - start) * 4, crc32c=0, chunk_elements=draw(st.integers(1, 16)))
    wanted = draw(st.lists(st.sampled_from(sorted(entries)), unique=True))
    return entries, wanted, piece, piece.chunk_elements


@settings(max_examples=300)
@given(layouts())
def test_chunk_reads_cover_each_chunk_once_and_place_every_wanted_element_once(
        layout: tuple[dict[str, TensorEntry], list[str], PieceRecord, int]) -> None:
    entries, wanted, piece, chunk = layout
    size = piece.stop - piece.start
    placed: list[tuple[str, int]] = []
    for read in piece_reads([piece], entries, wanted):
        chunks = chunk_reads(read, size, chunk, entries, wanted)
        assert [c.index for c in chunks] == sorted({c.index for c in chunks})
        for c in chunks:
            assert sum(b - a for _, a, b in c.spans) + c.padding == chunk  # the whole chunk, nothing more
            assert c.padding == (max(0, (c.index + 1) * chunk - size))
            at = piece.start + c.index * chunk  # group element the next span begins at
            for name, a, b in c.spans:
                assert b > a
                if name is not None:
                    assert name in wanted and entries[name].offset + a == at and b <= entries[name].size
                    placed += [(name, e) for e in range(a, b)]
                at += b - a
    want = [(n, e - entries[n].offset) for n in wanted
            for e in range(max(entries[n].offset, piece.start), min(entries[n].offset + entries[n].size, piece.stop))]
    assert sorted(placed) == sorted(want)


def test_get_into_parts_scatters_one_object_and_refuses_a_wrong_size(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("o", bytes(range(10)))
    a, b, c = bytearray(3), bytearray(0), bytearray(7)
    assert store.get_into_parts("o", [memoryview(a), memoryview(b), memoryview(c)]) == (10, 10)
    assert bytes(a + c) == bytes(range(10))
    assert store.get_into_parts("o", [memoryview(bytearray(11))]) == (0, 10)
    assert store.get_into_parts("missing", [memoryview(bytearray(1))]) is None


def many_tensors() -> dict[str, np.ndarray]:
    """2,000 one-element tensors (more than one preadv's buffers in a chunk) and two that straddle chunks."""
    rng = np.random.default_rng(3)
    state = {f"v{i:04d}": rng.standard_normal(1).astype(np.float32) for i in range(2000)}
    state["w"] = rng.standard_normal((77, 33)).astype(np.float32)
    state["x"] = rng.standard_normal(5000).astype(np.float32)
    return state


@pytest.fixture
def saved(tmp_path: Path):
    with CheckpointManager(str(tmp_path / "store"), max_to_keep=None, chunk_bytes=16 * 1024) as mgr:
        mgr.save(1, many_tensors(), {}, rank=0, world_size=1)
        mgr.save(2, {k: v + 1 for k, v in many_tensors().items()}, {})
        yield mgr


def test_local_restore_of_pieces_cut_across_many_tensors_is_bit_exact(saved: CheckpointManager) -> None:
    want = many_tensors()
    assert type(saved.store) is LocalStore
    assert_same_state(saved.restore(1).tensors, want)
    assert_same_state(saved.restore(1, names=["x", "v0007"]).tensors, {"x": want["x"], "v0007": want["v0007"]})
    merged: dict[str, np.ndarray] = {}
    for reader in range(3):
        merged.update(saved.restore(1, partition=(reader, 3)).tensors)
    assert_same_state(merged, want)


def test_a_chunk_from_another_checkpoint_passes_its_own_crc32c_but_fails_the_piece(
        saved: CheckpointManager) -> None:
    root = Path(saved.store.url)
    old, new = (saved.manifest(s).pieces[0] for s in (1, 2))
    assert old.chunk_elements == new.chunk_elements and old.stop - old.start == new.stop - new.start
    shutil.copyfile(root / f"{new.key}c/1", root / f"{old.key}c/1")  # well-framed, but step 2's bytes
    with pytest.raises(CorruptCheckpointError, match="does not match its recorded crc32c"):
        saved.restore(1)


def test_metadata_describing_another_size_is_corrupt(saved: CheckpointManager) -> None:
    piece = saved.manifest(1).pieces[0]
    entries = {t.name: t for t in saved.manifest(1).tensors}
    read = PieceRead(piece, piece.start, piece.stop)
    assert chunk_reads(read, piece.stop - piece.start, piece.chunk_elements, entries, list(entries))
    meta = Path(saved.store.url) / f"{piece.key}zarr.json"
    described = json.loads(meta.read_text())
    described["shape"] = [piece.stop - piece.start + 1]
    meta.write_text(json.dumps(described))
    with pytest.raises(CorruptCheckpointError, match="zarr metadata describes"):
        saved.restore(1)
