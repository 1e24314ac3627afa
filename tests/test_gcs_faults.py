"""GCSStore under injected faults: a real client, a real fake-gcs-server, a fault proxy between.

Objects here stay at or under 8 MiB (single multipart requests): fake-gcs-server
appends a re-sent resumable chunk instead of replacing it, which real GCS does not.
"""
from __future__ import annotations

import uuid
from typing import Iterator

import numpy as np
import pytest
from fault_proxy import FaultProxy, is_download, is_upload
from gcs_emulator import EmulatorError, GCSEmulator  # the gcs_emulator_session fixture comes from conftest.py
from google.cloud.storage.retry import DEFAULT_RETRY

from ckpt_service.errors import LeaseLostError, PreconditionFailedError, StoreUnavailableError
from ckpt_service.lease import Lease, LeaseHeldError
from ckpt_service.manager import CheckpointManager, CommitConflictError
from ckpt_service.stores.base import WriteOutcomeUnknownError
from ckpt_service.stores.gcs import MULTIPART_LIMIT, GCSStore

# The library's retry policy with short waits, so absorbing faults costs milliseconds.
FAST_RETRY = DEFAULT_RETRY.with_delay(initial=0.01, maximum=0.1, multiplier=2.0).with_timeout(20.0)


@pytest.fixture(scope="module")
def proxy(gcs_emulator_session: GCSEmulator) -> Iterator[FaultProxy]:
    with FaultProxy(gcs_emulator_session.url) as running:
        yield running


@pytest.fixture(scope="module")
def bucket(gcs_emulator_session: GCSEmulator) -> str:
    return gcs_emulator_session.new_bucket("faults")


@pytest.fixture
def store(gcs_emulator_session: GCSEmulator, proxy: FaultProxy, bucket: str) -> Iterator[GCSStore]:
    proxy.reset()
    client = gcs_emulator_session.client(endpoint=proxy.url)
    store = GCSStore(bucket, f"t-{uuid.uuid4().hex[:12]}", client=client, retry=FAST_RETRY)
    yield store
    client.close()
    assert proxy.pending_faults() == 0, "an armed fault was never triggered"


@pytest.fixture
def direct(gcs_emulator_session: GCSEmulator, store: GCSStore) -> GCSStore:
    """The same bucket and prefix, bypassing the proxy (a second, healthy writer)."""
    return GCSStore(store.bucket_name, store.prefix, client=gcs_emulator_session.client())


def test_503s_on_upload_are_absorbed_by_the_client_retry(store: GCSStore, proxy: FaultProxy) -> None:
    proxy.fail_next(3, status=503, match=is_upload)
    gen = store.put("shard/0", b"payload")
    assert proxy.outcomes(is_upload) == ["injected-503"] * 3 + ["forwarded"]
    assert store.get("shard/0") == b"payload"
    assert store.stat("shard/0").generation == gen


def test_503s_on_conditional_upload_are_absorbed(store: GCSStore, proxy: FaultProxy) -> None:
    proxy.fail_next(2, status=503, match=is_upload)
    assert store.create_exclusive("commit", b"token-1") is True
    assert proxy.outcomes(is_upload) == ["injected-503", "injected-503", "forwarded"]


def test_503s_and_429s_on_download_are_absorbed(store: GCSStore, proxy: FaultProxy) -> None:
    store.put("k", b"v" * 1000)
    proxy.fail_next(1, status=503, match=is_download)
    proxy.fail_next(1, status=429, match=is_download)
    assert store.get("k") == b"v" * 1000
    assert proxy.outcomes(is_download) == ["injected-503", "injected-429", "forwarded"]


def test_persistent_503s_become_a_typed_error(store: GCSStore, proxy: FaultProxy) -> None:
    impatient = GCSStore(
        store.bucket_name,
        store.prefix,
        client=store.client,
        retry=DEFAULT_RETRY.with_delay(initial=0.01, maximum=0.05).with_timeout(0.5),
    )
    proxy.fail_next(10**6, status=503, match=is_download)
    impatient.put("k", b"v")
    with pytest.raises(StoreUnavailableError, match="gave up after retrying"):
        impatient.get("k")
    assert proxy.outcomes(is_download).count("injected-503") >= 2  # it did retry
    proxy.reset()  # disarm the rest


def test_lost_response_of_a_winning_create_is_reported_as_won(store: GCSStore, proxy: FaultProxy) -> None:
    proxy.drop_response_of_next(match=is_upload)
    assert store.create_exclusive("commit", b"token-mine") is True
    # The first attempt was applied and its reply lost; the retry then lost to our own object.
    assert proxy.outcomes(is_upload) == ["dropped-response", "forwarded"]
    assert [s.status for s in proxy.seen if is_upload(s.request)] == [200, 412]
    assert store.get("commit") == b"token-mine"


def test_lost_response_surfaces_as_precondition_failed_on_the_raw_put(store: GCSStore, proxy: FaultProxy) -> None:
    """Why create_exclusive must read back: the bare put reports a loss although it won."""
    proxy.drop_response_of_next(match=is_upload)
    with pytest.raises(PreconditionFailedError):
        store.put("commit", b"token-mine", if_generation_match=0)
    assert store.get("commit") == b"token-mine"


def test_competing_writer_is_reported_as_lost(store: GCSStore, direct: GCSStore, proxy: FaultProxy) -> None:
    assert direct.create_exclusive("commit", b"token-other") is True
    assert store.create_exclusive("commit", b"token-mine") is False
    # Same when our request's reply is lost too: the server refused it, the retry is refused again.
    proxy.drop_response_of_next(match=is_upload)
    assert store.create_exclusive("commit", b"token-mine") is False
    assert [s.status for s in proxy.seen if is_upload(s.request)] == [412, 412, 412]
    assert store.get("commit") == b"token-other"


def test_lost_response_of_a_compare_and_swap(store: GCSStore, proxy: FaultProxy) -> None:
    """A CAS applied whose reply was lost reports PreconditionFailed; reading back shows our data."""
    gen = store.put("lease", b"holder-1", if_generation_match=0)
    proxy.drop_response_of_next(match=is_upload)
    with pytest.raises(PreconditionFailedError):
        store.put("lease", b"holder-1-renewed", if_generation_match=gen)
    assert store.get("lease") == b"holder-1-renewed"
    assert store.stat("lease").generation > gen


def test_lost_download_response_is_retried(store: GCSStore, proxy: FaultProxy) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    store.put("k", data)
    proxy.drop_response_of_next(match=is_download)
    assert store.get("k") == data
    assert proxy.outcomes(is_download) == ["dropped-response", "forwarded"]


def test_fault_sized_object_at_the_multipart_limit(store: GCSStore, proxy: FaultProxy) -> None:
    data = b"\xa5" * MULTIPART_LIMIT  # the largest single-request upload
    proxy.fail_next(1, status=503, match=is_upload)
    store.put("big", data)
    assert proxy.outcomes(is_upload) == ["injected-503", "forwarded"]
    assert store.get("big") == data


def test_unmatched_requests_pass_through(store: GCSStore, proxy: FaultProxy) -> None:
    proxy.fail_next(1, status=503, match=lambda r: r.method == "DELETE")
    store.put("k", b"v")
    assert store.get("k") == b"v"
    assert proxy.pending_faults() == 1
    store.delete("k")  # takes the 503, then is retried
    assert store.stat("k") is None
    assert [s.outcome for s in proxy.seen if s.request.method == "DELETE"] == ["injected-503", "forwarded"]


def test_fixture_guard_rejects_an_emulator_that_ignores_preconditions(gcs_emulator_session: GCSEmulator) -> None:
    """Seen through a proxy that strips ifGenerationMatch, the real server looks like a lax emulator."""

    def strip_preconditions(path: str) -> str:
        base, _, query = path.partition("?")
        kept = [p for p in query.split("&") if p and not p.startswith("ifGenerationMatch=")]
        return base + ("?" + "&".join(kept) if kept else "")

    with FaultProxy(gcs_emulator_session.url, rewrite_path=strip_preconditions) as lax:
        lax_emulator = GCSEmulator(lax.url, gcs_emulator_session.process, gcs_emulator_session.log_path)
        with pytest.raises(EmulatorError, match="does not enforce ifGenerationMatch"):
            lax_emulator.assert_enforces_preconditions()
    gcs_emulator_session.assert_enforces_preconditions()  # and the real one passes


# ---- every reply of a write lost: the client gives up although the server applied it ------------

# The library's policy with a short deadline: once it gives up, the write's outcome is ambiguous.
GIVE_UP_FAST = DEFAULT_RETRY.with_delay(initial=0.01, maximum=0.05, multiplier=2.0).with_timeout(1.0)


@pytest.fixture
def giving_up(gcs_emulator_session: GCSEmulator, proxy: FaultProxy, bucket: str) -> Iterator[GCSStore]:
    proxy.reset()
    client = gcs_emulator_session.client(endpoint=proxy.url)
    yield GCSStore(bucket, f"t-{uuid.uuid4().hex[:12]}", client=client, retry=GIVE_UP_FAST)
    proxy.reset()
    client.close()


def is_create_only(req) -> bool:
    return is_upload(req) and "ifGenerationMatch=0" in req.path


def test_every_reply_of_a_create_lost_the_raw_put_gives_up(giving_up: GCSStore, proxy: FaultProxy) -> None:
    proxy.drop_response_of_next(match=is_upload, count=10**6)
    with pytest.raises(StoreUnavailableError):
        giving_up.put("commit", b"token-mine", if_generation_match=0)
    proxy.reset()
    assert giving_up.get("commit") == b"token-mine"  # yet the write was applied


def test_every_reply_of_a_create_lost_is_resolved_by_reading_back(giving_up: GCSStore, proxy: FaultProxy) -> None:
    proxy.drop_response_of_next(match=is_upload, count=10**6)
    assert giving_up.create_exclusive("commit", b"token-mine") is True
    assert "dropped-response" in proxy.outcomes(is_upload)
    # a write the server refused stays refused, however its replies fare
    assert giving_up.create_exclusive("commit", b"token-other") is False


def test_save_whose_commit_replies_are_all_lost_reports_the_commit(giving_up: GCSStore, proxy: FaultProxy) -> None:
    """The commit marker's create-only write is applied but no reply arrives: save() must say
    committed (it is: listed, restorable, and saving it again conflicts), not failed."""
    tensors = {"w": np.arange(5000, dtype=np.float32), "b": np.ones(3, np.float64)}
    with CheckpointManager(giving_up, max_to_keep=None) as mgr:
        proxy.drop_response_of_next(match=is_create_only, count=10**6)
        manifest = mgr.save(7, tensors, metadata={"epoch": 1})
        assert "dropped-response" in proxy.outcomes(is_create_only)
        proxy.reset()
        assert manifest.step == 7 and mgr.all_steps() == [7]
        restored = mgr.restore()
        np.testing.assert_array_equal(restored.tensors["w"], tensors["w"])
        assert mgr.verify(7).ok
        with pytest.raises(CommitConflictError):
            mgr.save(7, tensors)


def test_lease_write_whose_replies_are_all_lost_keeps_the_lease(giving_up: GCSStore, proxy: FaultProxy) -> None:
    lease = Lease(giving_up, "master-a")
    first = lease.acquire()
    proxy.drop_response_of_next(match=is_upload, count=10**6)
    renewed = lease.fence()  # applied, reply lost: still ours, at the generation now stored
    proxy.reset()
    assert renewed > first and lease.held
    assert giving_up.stat(lease.key).generation == renewed
    other = Lease(giving_up, "master-b")
    with pytest.raises(LeaseHeldError, match="held by 'master-a'"):
        other.acquire()


TENSORS = {"w": np.arange(5000, dtype=np.float32), "b": np.ones(3, np.float64)}


def is_commit_read_back(req) -> bool:
    return is_download(req) and "commits%2F" in req.path


def test_save_whose_commit_reply_is_lost_once_reports_the_commit(store: GCSStore, proxy: FaultProxy) -> None:
    """The retry path: the client re-sends the applied create and gets a 412 from its own marker."""
    with CheckpointManager(store, max_to_keep=None) as mgr:
        proxy.drop_response_of_next(match=is_create_only)
        manifest = mgr.save(3, TENSORS)
        assert [s.status for s in proxy.seen if is_create_only(s.request)] == [200, 412]
        assert manifest is not None and manifest.step == 3 and mgr.all_steps() == [3]
        assert mgr.last_stats is not None and mgr.last_stats.committed
        np.testing.assert_array_equal(mgr.restore().tensors["w"], TENSORS["w"])


def test_save_whose_commit_never_reaches_the_server_reports_failure(giving_up: GCSStore, proxy: FaultProxy) -> None:
    """Every create refused before the server saw it: reading back finds no marker, so save() fails
    with the store's error (not 'unknown'), nothing is committed, and the same step saves later."""
    with CheckpointManager(giving_up, max_to_keep=None) as mgr:
        proxy.fail_next(10**6, status=503, match=is_create_only)
        with pytest.raises(StoreUnavailableError) as info:
            mgr.save(7, TENSORS)
        assert not isinstance(info.value, WriteOutcomeUnknownError)
        assert set(proxy.outcomes(is_create_only)) == {"injected-503"}
        assert proxy.outcomes(is_commit_read_back) == ["forwarded"]  # it did read back
        proxy.reset()
        assert mgr.all_steps() == []
        assert mgr.save(7, TENSORS) is not None and mgr.all_steps() == [7]


def test_save_whose_commit_and_read_back_are_both_lost_says_unknown(giving_up: GCSStore, proxy: FaultProxy) -> None:
    with CheckpointManager(giving_up, max_to_keep=None) as mgr:
        proxy.drop_response_of_next(match=is_create_only, count=10**6)
        proxy.fail_next(10**6, status=503, match=is_commit_read_back)
        with pytest.raises(WriteOutcomeUnknownError, match="step 7: .*may or may not be committed"):
            mgr.save(7, TENSORS)
        proxy.reset()
        assert mgr.all_steps() == [7]  # it was applied: reporting a plain failure would have been wrong


def test_lease_acquire_and_release_whose_replies_are_all_lost(giving_up: GCSStore, proxy: FaultProxy) -> None:
    lease = Lease(giving_up, "master-a")
    proxy.drop_response_of_next(match=is_upload, count=10**6)
    generation = lease.acquire()  # created, every reply lost: read back as ours
    assert "dropped-response" in proxy.outcomes(is_upload)
    assert lease.held and giving_up.stat(lease.key).generation == generation
    with pytest.raises(LeaseHeldError, match="held by 'master-a'"):
        Lease(giving_up, "master-b").acquire()
    lease.release()  # applied, every reply lost: released
    proxy.reset()
    assert not lease.held
    assert Lease(giving_up, "master-b").acquire() > generation  # no steal needed


def test_lease_fence_whose_reply_is_lost_once(store: GCSStore, proxy: FaultProxy) -> None:
    """The retry path for a compare-and-swap: the retry gets a 412 from the renewal it made itself."""
    lease = Lease(store, "master-a")
    first = lease.acquire()
    proxy.reset()
    proxy.drop_response_of_next(match=is_upload)
    renewed = lease.fence()
    assert [s.status for s in proxy.seen if is_upload(s.request)] == [200, 412]
    assert renewed > first and store.stat(lease.key).generation == renewed
    assert lease.fence() > renewed  # and the generation it holds is the current one


def test_lease_fence_never_applied_keeps_the_lease(giving_up: GCSStore, proxy: FaultProxy) -> None:
    """A renewal refused before the server saw it is a store error, not a lost lease."""
    lease = Lease(giving_up, "master-a")
    first = lease.acquire()
    proxy.fail_next(10**6, status=503, match=is_upload)
    with pytest.raises(StoreUnavailableError) as info:
        lease.fence()
    assert not isinstance(info.value, (LeaseLostError, WriteOutcomeUnknownError))
    proxy.reset()
    assert lease.generation == first and giving_up.stat(lease.key).generation == first
    assert lease.fence() > first


def test_lost_replies_never_hide_a_lost_lease(gcs_emulator_session: GCSEmulator, giving_up: GCSStore,
                                             proxy: FaultProxy) -> None:
    """The successor took the lease; the zombie's renewal is refused (412) and every reply lost:
    reading back finds the successor's record, so the zombie learns it lost and cannot commit."""
    zombie = Lease(giving_up, "master-a")
    zombie.acquire()
    direct = GCSStore(giving_up.bucket_name, giving_up.prefix, client=gcs_emulator_session.client())
    successor = Lease(direct, "master-b")
    successor.acquire(steal=True)
    proxy.drop_response_of_next(match=is_upload, count=10**6)
    with pytest.raises(LeaseLostError):
        zombie.fence()
    assert "dropped-response" in proxy.outcomes(is_upload)
    proxy.reset()
    assert not zombie.held and successor.fence() > 0
