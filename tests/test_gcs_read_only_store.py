"""The read-only ``gs://`` store that host discovery uses (JSON API over requests), against
fake-gcs-server, directly and through the fault proxy."""
from __future__ import annotations

import uuid
from typing import Iterator

import pytest
from fault_proxy import FaultProxy
from gcs_emulator import GCSEmulator

from ckpt_service.errors import MissingBucketError, ObjectNotFoundError, StoreUnavailableError
from ckpt_service.stores.gcs import GCSStore
from ckpt_service.stores.gcs_json import GCSReadOnlyStore, ReadOnlyStoreError


@pytest.fixture
def written(gcs_emulator_session: GCSEmulator) -> Iterator[GCSStore]:
    """A prefix of a bucket written through the full client: five records, one in another run's prefix."""
    bucket = gcs_emulator_session.new_bucket("readonly")
    store = GCSStore(bucket, f"runs/{uuid.uuid4().hex[:8]}", client=gcs_emulator_session.client())
    for i in range(5):
        store.put(f"hosts/leaving/w-{i}.json", f'{{"host": "w-{i}"}}'.encode())
    store.put("control/stop", b"x")
    GCSStore(bucket, "runs/other", client=gcs_emulator_session.client()).put("hosts/leaving/z.json", b"{}")
    yield store


def reader(store: GCSStore, **kwargs: object) -> GCSReadOnlyStore:
    return GCSReadOnlyStore(store.bucket_name, store.prefix, **kwargs)  # type: ignore[arg-type]


def test_reads_what_the_full_client_wrote(written: GCSStore, gcs_emulator_session: GCSEmulator,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator_session.url)
    ro = reader(written, page_size=2)  # three pages for the five records
    assert list(ro.list("hosts/leaving/")) == [f"hosts/leaving/w-{i}.json" for i in range(5)]
    assert list(ro.list()) == ["control/stop", *[f"hosts/leaving/w-{i}.json" for i in range(5)]]
    assert ro.get("hosts/leaving/w-3.json") == b'{"host": "w-3"}'
    info, full = ro.stat("control/stop"), written.stat("control/stop")
    assert info is not None and full is not None
    assert (info.key, info.size, info.generation) == ("control/stop", 1, full.generation)
    assert abs(info.mtime - full.mtime) < 1.0
    assert ro.stat("hosts/leaving/none.json") is None
    with pytest.raises(ObjectNotFoundError):
        ro.get("hosts/leaving/none.json")
    with pytest.raises(ReadOnlyStoreError, match="read-only"):
        ro.put("control/stop", b"y")
    with pytest.raises(ReadOnlyStoreError, match="read-only"):
        ro.delete("control/stop")
    assert written.get("control/stop") == b"x"
    ro.close()


def test_a_missing_bucket_is_named(gcs_emulator_session: GCSEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator_session.url)
    with pytest.raises(MissingBucketError, match="no-such-bucket-hvdt.*gcloud storage buckets create"):
        list(GCSReadOnlyStore("no-such-bucket-hvdt", "r").list())


def test_transient_errors_are_retried_then_reported(written: GCSStore, gcs_emulator_session: GCSEmulator,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with FaultProxy(gcs_emulator_session.url) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        ro = reader(written, attempts=3, timeout=2.0)
        proxy.fail_next(2, status=503)  # absorbed by the third attempt
        assert ro.get("control/stop") == b"x"
        assert proxy.outcomes() == ["injected-503", "injected-503", "forwarded"]
        proxy.fail_next(3, status=503)  # every attempt fails
        with pytest.raises(StoreUnavailableError, match="HTTP 503"):
            ro.get("control/stop")
        assert proxy.pending_faults() == 0
