"""Every store backend against the shared conformance suite, plus store URLs and typed errors.

GCSStore runs against a real fake-gcs-server through the real google-cloud-storage client.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from gcs_emulator import GCSEmulator  # the gcs_emulator_session fixture comes from conftest.py

from ckpt_service.errors import BadStoreURLError, MissingCredentialsError, StoreUnavailableError
from ckpt_service.stores import LocalStore, MemoryStore, ObjectStore, open_store
from ckpt_service.stores.base import WriteOutcome, classify_write
from ckpt_service.stores.gcs import GCSStore
from ckpt_service.testing.store_conformance import StoreConformance

REPO_ROOT = Path(__file__).resolve().parent.parent


class TestMemoryStore(StoreConformance):
    def make_store(self) -> ObjectStore:
        return MemoryStore()


class TestLocalStore(StoreConformance):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path / "store"

    def make_store(self) -> ObjectStore:
        return LocalStore(self.root, fsync=False)

    def test_temporary_and_lock_files_are_not_listed(self, store: ObjectStore) -> None:
        store.put("a/b", b"1", if_generation_match=0)  # creates the lock file
        (self.root / "a" / ".tmp-b.deadbeef").write_bytes(b"partial")
        (self.root / ".tmp-c.cafe").write_bytes(b"partial")
        assert list(store.list()) == ["a/b"]

    # ---- sweeping what writes killed midway left behind ------------------------------------

    def _age(self, path: Path, seconds: float) -> None:
        t = time.time() - seconds
        os.utime(path, (t, t))

    def test_sweep_removes_old_temp_files_and_the_folders_they_leave_empty(self, store: LocalStore) -> None:
        store.put("commits/000000000001.json", b"marker", if_generation_match=0)
        store.put("steps/000000000001/data/x", b"published")
        old_commit_tmp = self.root / "commits" / ".tmp-000000000002.json.aa"
        old_piece_tmp = self.root / "steps" / "000000000002" / "data" / "f4" / "00000.n1" / ".tmp-0.bb"
        for tmp in (old_commit_tmp, old_piece_tmp):
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(b"partial")
            self._age(tmp, 700)
        for folder in [old_piece_tmp.parent, *old_piece_tmp.parent.parents]:
            if folder == self.root:
                break
            self._age(folder, 5)  # young folders: they go only because the sweep emptied them
        self._age(self.root / "steps" / "000000000001" / "data" / "x", 10**6)  # old, but published
        assert store.sweep_temporary(600) == 2
        assert not old_commit_tmp.exists() and not (self.root / "steps" / "000000000002").exists()
        assert (self.root / "commits").is_dir()  # still holds the committed marker
        assert list(store.list()) == ["commits/000000000001.json", "steps/000000000001/data/x"]
        assert (self.root / ".hvdt.lock").exists() and self.root.is_dir()

    def test_sweep_keeps_young_temp_files_and_young_empty_folders(self, store: LocalStore) -> None:
        young = self.root / "steps" / "000000000003" / "data" / ".tmp-0.cc"  # a write in flight
        young.parent.mkdir(parents=True)
        young.write_bytes(b"partial")
        fresh_dir = self.root / "steps" / "000000000004" / "data"  # a writer's next folder, made just now
        fresh_dir.mkdir(parents=True)
        old_dir = self.root / "steps" / "000000000000"
        old_dir.mkdir()
        self._age(old_dir, 700)
        assert store.sweep_temporary(600) == 0
        assert young.read_bytes() == b"partial" and fresh_dir.is_dir()
        assert not old_dir.exists()  # empty and untouched for longer than the threshold
        # the same young file, seen from a clock past the threshold
        assert store.sweep_temporary(600, now=time.time() + 601) == 1
        assert not young.exists()

    def test_sweep_of_a_store_that_does_not_exist_yet(self, store: LocalStore) -> None:
        assert store.sweep_temporary(0) == 0
        assert not self.root.exists()

    def test_write_recreates_a_folder_a_sweep_removed_under_it(self, store: LocalStore, monkeypatch) -> None:
        """A sweep may remove an empty folder between a write's mkdir and its open: the write makes
        it again instead of failing."""
        import builtins

        import ckpt_service.stores.local as local_module

        real_open, swept = builtins.open, []

        def open_after_a_sweep(path, *args, **kwargs):
            if not swept and Path(path).name.startswith(".tmp-"):
                swept.append(Path(path).parent)
                Path(path).parent.rmdir()  # what the sweep does to a folder it finds empty
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(local_module, "open", open_after_a_sweep, raising=False)
        store.put("steps/000000000005/data/x", b"payload")
        assert swept == [self.root / "steps" / "000000000005" / "data"]
        assert store.get("steps/000000000005/data/x") == b"payload"

    def test_write_survives_a_sweep_inside_its_mkdir(self, store: LocalStore, monkeypatch) -> None:
        """mkdir(parents=True) makes the parents, then the leaf: a sweep that removes a just-made,
        still empty parent in between makes the leaf's mkdir fail; the write makes them again."""
        real_mkdir, swept = Path.mkdir, []
        target = self.root / "steps" / "000000000006" / "data"

        def mkdir_raced_by_a_sweep(self_: Path, mode: int = 0o777, parents: bool = False,
                                   exist_ok: bool = False) -> None:
            if self_ == target and not swept:
                real_mkdir(self_.parent, parents=True, exist_ok=True)
                swept.append(self_.parent)
                self_.parent.rmdir()
                real_mkdir(self_, mode)  # FileNotFoundError: the parent is gone
            real_mkdir(self_, mode, parents, exist_ok)

        monkeypatch.setattr(Path, "mkdir", mkdir_raced_by_a_sweep)
        store.put("steps/000000000006/data/x", b"payload")
        assert swept == [self.root / "steps" / "000000000006"]
        assert store.get("steps/000000000006/data/x") == b"payload"


@pytest.fixture(scope="module")
def gcs_bucket(gcs_emulator_session: GCSEmulator) -> str:
    return gcs_emulator_session.new_bucket("conformance")


class TestGCSStore(StoreConformance):
    @pytest.fixture(autouse=True)
    def _location(self, gcs_emulator_session: GCSEmulator, gcs_bucket: str) -> None:
        self.emulator = gcs_emulator_session
        self.bucket = gcs_bucket
        self.prefix = f"runs/{uuid.uuid4().hex[:12]}"  # a fresh, empty store per test

    def make_store(self) -> ObjectStore:
        return GCSStore(self.bucket, self.prefix)

    def test_keys_live_under_the_prefix(self, store: GCSStore) -> None:
        store.put("a/b", b"1")
        client = self.emulator.client()
        names = [b.name for b in client.list_blobs(self.bucket, prefix=self.prefix)]
        assert names == [f"{self.prefix}/a/b"]
        blob = client.bucket(self.bucket).get_blob(f"{self.prefix}/a/b")
        info = store.stat("a/b")
        assert info.generation == blob.generation
        assert info.mtime == blob.updated.timestamp()

    def test_prefixes_are_isolated(self, store: GCSStore) -> None:
        sibling = GCSStore(self.bucket, self.prefix + "x")  # shares a string prefix, not a folder
        store.put("k", b"mine")
        sibling.put("k", b"sibling")
        assert list(store.list()) == ["k"]
        assert store.get("k") == b"mine"
        assert sibling.get("k") == b"sibling"

    def test_folder_placeholders_are_not_keys(self, store: GCSStore) -> None:
        bucket = self.emulator.client().bucket(self.bucket)
        bucket.blob(f"{self.prefix}/dir/").upload_from_string(b"")
        store.put("dir/real", b"1")
        assert list(store.list()) == ["dir/real"]

    def test_store_without_prefix_uses_the_whole_bucket(self) -> None:
        store = GCSStore(self.emulator.new_bucket("noprefix"))
        assert store.url.startswith("gs://noprefix-")
        store.put("x/y", b"1")
        assert list(store.list()) == ["x/y"]
        assert self.emulator.client().bucket(store.bucket_name).blob("x/y").download_as_bytes() == b"1"

    def test_reusable_after_close(self, store: GCSStore) -> None:
        store.put("k", b"1")
        store.close()
        assert store.get("k") == b"1"

    @pytest.mark.parametrize("op", ["stat", "get", "put", "list"])
    def test_missing_bucket_is_a_typed_error_naming_the_fix(self, op: str) -> None:
        store = GCSStore(f"no-such-bucket-{uuid.uuid4().hex[:8]}", "p")
        call = {
            "stat": lambda: store.stat("k"),
            "get": lambda: store.get("k"),
            "put": lambda: store.put("k", b"x", if_generation_match=0),
            "list": lambda: list(store.list()),
        }[op]
        with pytest.raises(StoreUnavailableError) as info:
            call()
        message = str(info.value)
        assert store.bucket_name in message
        assert "does not exist or is not visible" in message
        assert f"gcloud storage buckets create gs://{store.bucket_name}" in message

    def test_open_store_round_trip(self) -> None:
        bucket = self.emulator.new_bucket("url")
        store = open_store(f"gs://{bucket}/runs/r1/")
        assert isinstance(store, GCSStore)
        store.put("step-1/manifest.json", b"{}", if_generation_match=0)
        assert open_store(f"gs://{bucket}/runs/r1").get("step-1/manifest.json") == b"{}"
        assert list(open_store(f"gs://{bucket}").list()) == ["runs/r1/step-1/manifest.json"]


# ---- reading back an ambiguous write (pure) ----------------------------------------------------


@pytest.mark.parametrize(
    "stored, expected_generation, outcome",
    [
        ((b"mine", 7), 0, WriteOutcome.APPLIED),  # created, reply lost
        ((b"mine", 7), 5, WriteOutcome.APPLIED),  # swapped, reply lost
        (None, 0, WriteOutcome.NOT_APPLIED),  # create never reached the server
        ((b"before", 5), 5, WriteOutcome.NOT_APPLIED),  # swap never applied
        ((b"theirs", 7), 0, WriteOutcome.SUPERSEDED),  # another create won
        ((b"theirs", 7), 5, WriteOutcome.SUPERSEDED),  # another swap won
        (None, 5, WriteOutcome.SUPERSEDED),  # deleted since: the generation expected is gone
    ],
)
def test_classify_write(stored, expected_generation, outcome) -> None:
    assert classify_write(stored, b"mine", expected_generation) is outcome


def test_default_get_versioned_refuses_an_object_that_changes_while_read() -> None:
    class Racing(MemoryStore):
        """Uses the base class's read-back; another writer replaces the object between its reads."""

        get_versioned = ObjectStore.get_versioned

        def get(self, key: str) -> bytes:
            data = super().get(key)
            if self.race:
                self.put(key, b"theirs")
            return data

    store = Racing()
    store.race = False
    gen = store.put("k", b"mine")
    assert store.get_versioned("k") == (b"mine", gen)
    assert store.get_versioned("absent") is None
    store.race = True
    with pytest.raises(StoreUnavailableError, match="changed while being read back"):
        store.get_versioned("k")


# ---- store URLs ------------------------------------------------------------------------------


def test_open_store_gs_url_is_lazy_and_parsed() -> None:
    store = open_store("gs://my-bucket/runs/r1")
    assert isinstance(store, GCSStore)
    assert (store.bucket_name, store.prefix, store.url) == ("my-bucket", "runs/r1", "gs://my-bucket/runs/r1")
    bare = open_store("gs://my-bucket")
    assert (bare.prefix, bare.url) == ("", "gs://my-bucket")


@pytest.mark.parametrize("url", ["gs://", "gs:///runs/r1", "gs:/bucket"])
def test_open_store_gs_without_bucket(url: str) -> None:
    with pytest.raises(BadStoreURLError, match="bucket"):
        open_store(url)


def test_open_store_rejects_prefix_escaping_the_bucket() -> None:
    with pytest.raises(BadStoreURLError):
        GCSStore("")
    with pytest.raises(ValueError):
        open_store("gs://bucket/a/../../b")


def test_open_store_file_url_and_plain_path(tmp_path: Path) -> None:
    by_url = open_store(f"file://{tmp_path}/s")
    by_path = open_store(str(tmp_path / "s"))
    assert isinstance(by_url, LocalStore) and isinstance(by_path, LocalStore)
    assert by_url.root == by_path.root == tmp_path / "s"
    by_url.put("k", b"v")
    assert by_path.get("k") == b"v"


def test_open_store_file_url_with_host_is_rejected() -> None:
    with pytest.raises(BadStoreURLError, match="no host"):
        open_store("file://otherhost/data")


def test_open_store_memory_url_names_a_shared_store() -> None:
    name = f"memory://shared-{uuid.uuid4().hex}"
    first = open_store(name)
    assert isinstance(first, MemoryStore)
    first.put("k", b"v")
    assert open_store(name).get("k") == b"v"
    assert open_store(name) is first


@pytest.mark.parametrize("url", ["s3://bucket/x", "http://example.invalid/x", "", "   "])
def test_open_store_bad_urls(url: str) -> None:
    with pytest.raises(BadStoreURLError):
        open_store(url)


# ---- credentials --------------------------------------------------------------------------


def test_missing_credentials_is_a_typed_error_naming_the_fix(tmp_path: Path) -> None:
    """No emulator, no ADC: the first operation says how to log in. Nothing leaves 127.0.0.1."""
    script = textwrap.dedent(
        """
        import sys
        from ckpt_service.errors import MissingCredentialsError
        from ckpt_service.stores import open_store
        store = open_store("gs://some-bucket/runs/r1")  # lazy: no client yet
        try:
            store.stat("k")
        except MissingCredentialsError as exc:
            print(f"{type(exc).__name__}|{isinstance(exc, PermissionError)}|{exc}")
            sys.exit(0)
        sys.exit("no MissingCredentialsError")
        """
    )
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "PYTHONPATH": str(REPO_ROOT),
        "NO_GCE_CHECK": "true",
        # Belt and braces: should anything still probe the metadata server, it hits a closed local port.
        "GCE_METADATA_HOST": "127.0.0.1:9",
        "GCE_METADATA_IP": "127.0.0.1:9",
    }
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in env and "STORAGE_EMULATOR_HOST" not in env
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    name, is_permission_error, message = proc.stdout.strip().split("|", 2)
    assert (name, is_permission_error) == (MissingCredentialsError.__name__, "True")
    assert "gcloud auth application-default login" in message
    assert "GOOGLE_APPLICATION_CREDENTIALS" in message


def test_local_list_prefix_cannot_climb_out_of_the_root(tmp_path: Path) -> None:
    from ckpt_service.errors import BadStoreKeyError

    store = LocalStore(tmp_path / "root", fsync=False)
    with pytest.raises(BadStoreKeyError):
        list(store.list("../../etc/host"))


def test_local_store_writes_parts_and_reads_straight_into_a_buffer(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_parts("a/b", (b"head", memoryview(b"body"), b"crc!"))
    assert store.get("a/b") == b"headbodycrc!"
    buf = bytearray(8)
    assert store.get_into("a/b", memoryview(buf)) == (8, b"crc!") and bytes(buf) == b"headbody"
    short = bytearray(16)
    assert store.get_into("a/b", memoryview(short)) == (12, b"")  # a short object says so
    assert store.get_into("missing", memoryview(buf)) is None
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint16", "bool", "complex64"])
@pytest.mark.parametrize("size,chunk", [(10, 4), (8, 4), (1, 5), (0, 3), (1000, 7)])
def test_uncompressed_pieces_are_byte_identical_to_zarrs_and_read_both_ways(dtype: str, size: int,
                                                                            chunk: int) -> None:
    """The framing that skips zarr's per-chunk machinery writes exactly zarr's objects, and the
    direct reader agrees with zarr on every range (the on-store format is unchanged)."""
    import numpy as np

    from ckpt_service.piece_io import _zarr_decode, decode_piece, encode_piece, piece_objects

    flat = (np.random.default_rng(size).random(size) * 100).astype(dtype)
    by_zarr = encode_piece(flat, chunk)
    framed = {key: b"".join(make()) for key, make in piece_objects(flat, chunk).items()}
    assert framed == by_zarr
    for lo, hi in ((0, size), (1, max(1, size - 1)), (size // 2, size)):
        ours = decode_piece(framed, where="t", start=lo, stop=hi)
        theirs = _zarr_decode(by_zarr, where="t", start=lo, stop=hi)
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)


def test_a_flipped_bit_in_a_chunk_read_straight_into_the_tensor_is_caught(tmp_path: Path) -> None:
    import numpy as np

    from ckpt_service.errors import CorruptCheckpointError
    from ckpt_service.manager import CheckpointManager

    state = {"w": np.arange(3 * 2**20, dtype=np.float32)}  # pieces of whole chunks, read into "w" directly
    with CheckpointManager(str(tmp_path), max_to_keep=None) as mgr:
        mgr.save(1, state)
        assert np.array_equal(mgr.restore(1).tensors["w"], state["w"])
        chunk = max((p for p in tmp_path.rglob("*") if p.parent.name == "c"), key=lambda p: p.stat().st_size)
        data = bytearray(chunk.read_bytes())
        data[100] ^= 1
        chunk.write_bytes(bytes(data))
        with pytest.raises(CorruptCheckpointError, match="crc32c"):
            mgr.restore(1)
