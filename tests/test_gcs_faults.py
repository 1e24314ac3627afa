"""GCSStore under injected faults: a real client, a real fake-gcs-server, a fault proxy between.

Objects here stay at or under 8 MiB (single multipart requests): fake-gcs-server
appends a re-sent resumable chunk instead of replacing it, which real GCS does not.
"""
from __future__ import annotations

import statistics
import time
import uuid
from typing import Any, Iterator

import numpy as np
import pytest
from fault_proxy import Chaos, FaultProxy, is_download, is_upload
from gcs_emulator import EmulatorError, GCSEmulator  # the gcs_emulator_session fixture comes from conftest.py
from google.cloud.storage.retry import DEFAULT_RETRY

from ckpt_service import layout
from ckpt_service.errors import LeaseLostError, PreconditionFailedError, SaveAbandonedError, StoreUnavailableError
from ckpt_service.lease import Lease, LeaseHeldError
from ckpt_service.manager import CheckpointManager, CommitConflictError
from ckpt_service.manifest import Manifest
from ckpt_service.stores.base import WriteOutcomeUnknownError
from ckpt_service.stores.gcs import MULTIPART_LIMIT, GCSStore

pytestmark = pytest.mark.timed  # bounds wall-clock times

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


def proxied_store(emulator: GCSEmulator, proxy: FaultProxy, bucket: str, retry: Any) -> Iterator[GCSStore]:
    """A store of its own behind the (reset) fault proxy, with the given retry policy."""
    proxy.reset()
    client = emulator.client(endpoint=proxy.url)
    yield GCSStore(bucket, f"t-{uuid.uuid4().hex[:12]}", client=client, retry=retry)
    proxy.reset()
    client.close()


@pytest.fixture
def giving_up(gcs_emulator_session: GCSEmulator, proxy: FaultProxy, bucket: str) -> Iterator[GCSStore]:
    yield from proxied_store(gcs_emulator_session, proxy, bucket, GIVE_UP_FAST)


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
    assert giving_up.stat(lease.key).generation == lease.object_generation
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
    assert lease.held and giving_up.stat(lease.key).generation == lease.object_generation
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
    assert renewed > first and store.stat(lease.key).generation == lease.object_generation
    assert lease.fence() > renewed  # and the generation it holds is the current one


def test_lease_fence_never_applied_keeps_the_lease(giving_up: GCSStore, proxy: FaultProxy) -> None:
    """A renewal refused before the server saw it is a store error, not a lost lease."""
    lease = Lease(giving_up, "master-a")
    first = lease.acquire()
    stored = lease.object_generation
    proxy.fail_next(10**6, status=503, match=is_upload)
    with pytest.raises(StoreUnavailableError) as info:
        lease.fence()
    assert not isinstance(info.value, (LeaseLostError, WriteOutcomeUnknownError))
    proxy.reset()
    assert lease.generation == first and giving_up.stat(lease.key).generation == stored
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


# ---- emergency saves: every store call bounded by the save's deadline ----------------------------
#
# The store keeps the library's own retry policy (DEFAULT_RETRY: backoff up to 60 s, 120 s in all,
# 60 s per request), which is what lets one save overrun a notice window by a minute. Each save
# below is given a deadline DEADLINE_IN seconds away and must return or raise by deadline + SLACK_S.
# The save aims to be over by deadline - margin (its calls' windows end there); SLACK_S only
# absorbs what no window can bound on a shared 2-core test machine: scheduling delays of the
# client, proxy and emulator threads, interpreter pauses and the unwinding of a timed-out socket
# (measured: every save here ends 0.3 s or more before its deadline). It is an order of magnitude
# below the overruns it guards against (a 60 s request timeout, a 120 s retry deadline).

DEADLINE_IN = 4.0
SLACK_S = 2.0
#: a reply held longer than this never arrives within a save's window
LATE = DEADLINE_IN + 10.0


@pytest.fixture
def lib_store(gcs_emulator_session: GCSEmulator, proxy: FaultProxy, bucket: str) -> Iterator[GCSStore]:
    """A store behind the proxy with the library's default retry policy and request timeout."""
    yield from proxied_store(gcs_emulator_session, proxy, bucket, DEFAULT_RETRY)


@pytest.fixture
def healthy(gcs_emulator_session: GCSEmulator, lib_store: GCSStore) -> Iterator[GCSStore]:
    """The same bucket and prefix, bypassing the proxy: what really is in the store."""
    client = gcs_emulator_session.client()
    yield GCSStore(lib_store.bucket_name, lib_store.prefix, client=client)
    client.close()


def state(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    # at 64 KiB chunks, about 25 requests per save (pieces, manifest, lease fence, marker)
    return {"w": rng.standard_normal(120_000).astype(np.float32), "b": rng.standard_normal(17),
            "step": np.array(step, np.int64)}


def timed_save(mgr: CheckpointManager, step: int, **kw: object) -> tuple[object, float]:
    """Save ``step`` with a deadline DEADLINE_IN s away: (manifest or the error raised, seconds past the deadline)."""
    deadline = time.time() + DEADLINE_IN
    try:
        outcome: object = mgr.save(step, state(step), deadline=deadline, **kw)
    except (SaveAbandonedError, WriteOutcomeUnknownError) as exc:
        outcome = exc
    return outcome, time.time() - deadline


def assert_restores(mgr: CheckpointManager, step: int) -> None:
    got = mgr.restore(step).tensors
    for name, want in state(step).items():
        np.testing.assert_array_equal(got[name], want, err_msg=f"step {step}: {name}")


def manager(store: GCSStore, **kw: object) -> CheckpointManager:
    return CheckpointManager(store, max_to_keep=None, chunk_bytes=64 * 1024, **kw)


def is_cas(req) -> bool:
    """A compare-and-swap on an existing object (the lease renewal)."""
    return is_upload(req) and "ifGenerationMatch=" in req.path and "ifGenerationMatch=0" not in req.path


def is_lease_read_back(req) -> bool:
    return is_download(req) and "lease" in req.path


def test_deadline_save_whose_replies_all_come_late_abandons_in_time(lib_store: GCSStore, healthy: GCSStore,
                                                                   proxy: FaultProxy) -> None:
    """(a) Every request reaches the server, every reply is held past the deadline."""
    with manager(lib_store, abandoned_after_s=0.0) as mgr:
        mgr.save(1, state(1))
        proxy.reset()  # forget what step 1 sent
        proxy.delay_replies(LATE)
        outcome, late = timed_save(mgr, 2)
        assert isinstance(outcome, SaveAbandonedError), outcome
        assert late <= SLACK_S, f"raised {late:.2f} s after the deadline"
        assert "delayed-reply" in proxy.outcomes(is_upload)
        proxy.reset()  # the held replies go out now
        # nothing committed, no marker, the pieces it wrote left for gc
        assert healthy.stat(layout.commit_key(2)) is None and manager(healthy).all_steps() == [1]
        assert list(healthy.list(layout.step_prefix(2)))
        assert_restores(mgr, 1)
        mgr.save(3, state(3))  # no faults: commits, and its retention collects step 2's leftovers
        assert mgr.all_steps() == [1, 3] and not list(healthy.list(layout.step_prefix(2)))
        assert_restores(mgr, 3)


def test_deadline_save_whose_marker_write_is_blackholed_abandons_in_time(lib_store: GCSStore, healthy: GCSStore,
                                                                       proxy: FaultProxy) -> None:
    """(c) The marker write never reaches the server nor gets an answer; reading it back shows it absent."""
    with manager(lib_store) as mgr:
        mgr.save(1, state(1))
        proxy.reset()  # forget what step 1 sent
        proxy.blackhole(match=is_create_only)
        outcome, late = timed_save(mgr, 2)
        assert isinstance(outcome, SaveAbandonedError), outcome
        assert "commit marker" in str(outcome) and "nothing was committed" in str(outcome)
        assert late <= SLACK_S, f"raised {late:.2f} s after the deadline"
        assert set(proxy.outcomes(is_create_only)) == {"blackholed"}
        assert proxy.outcomes(is_commit_read_back) == ["forwarded"]  # resolved by reading it back, in time
        proxy.reset()
        assert healthy.stat(layout.commit_key(2)) is None and mgr.all_steps() == [1]
        assert_restores(mgr, 1)
        assert mgr.save(2, state(2)) is not None and mgr.all_steps() == [1, 2]  # the same step, no conflict
        assert_restores(mgr, 2)


def test_deadline_save_whose_marker_and_read_back_are_blackholed_says_unknown_in_time(
        lib_store: GCSStore, healthy: GCSStore, proxy: FaultProxy) -> None:
    """Neither the write nor its read-back is answered before the deadline: the outcome is unknown
    and reported so, never as a failure (here it was in fact not applied)."""
    with manager(lib_store) as mgr:
        mgr.save(1, state(1))
        proxy.reset()  # forget what step 1 sent
        proxy.blackhole(match=is_create_only)
        proxy.blackhole(match=is_commit_read_back)
        outcome, late = timed_save(mgr, 2)
        assert isinstance(outcome, WriteOutcomeUnknownError), outcome
        assert "step 2: the commit marker write got no answer before the deadline" in str(outcome)
        assert late <= SLACK_S, f"raised {late:.2f} s after the deadline"
        proxy.reset()
        assert healthy.stat(layout.commit_key(2)) is None and mgr.all_steps() == [1]
        assert mgr.save(2, state(2)) is not None
        assert_restores(mgr, 2)


def test_deadline_save_whose_applied_marker_is_never_confirmed_says_unknown_in_time(
        lib_store: GCSStore, proxy: FaultProxy) -> None:
    """The marker is applied but its replies, and those of reading it back, come after the deadline:
    reporting a failure would be wrong, the step is committed."""
    with manager(lib_store) as mgr:
        mgr.save(1, state(1))
        proxy.reset()  # forget what step 1 sent
        proxy.delay_replies(LATE, match=is_create_only)
        proxy.blackhole(match=is_commit_read_back)
        outcome, late = timed_save(mgr, 2)
        assert isinstance(outcome, WriteOutcomeUnknownError), outcome
        assert late <= SLACK_S, f"raised {late:.2f} s after the deadline"
        proxy.reset()
        assert mgr.all_steps() == [1, 2]
        assert_restores(mgr, 2)
        with pytest.raises(CommitConflictError):
            mgr.save(2, state(2))


def test_deadline_save_whose_lease_fence_is_blackholed_abandons_and_keeps_the_lease(
        lib_store: GCSStore, healthy: GCSStore, proxy: FaultProxy) -> None:
    """The lease renewal inside the save is never answered; reading the lease back shows it unchanged:
    the save abandons before writing the marker, and the holder still holds the lease."""
    lease = Lease(lib_store, "master-a")
    held = lease.acquire()
    with manager(lib_store) as mgr:
        mgr.save(1, state(1), lease=lease)
        held = lease.generation
        proxy.reset()
        proxy.blackhole(match=is_cas)
        outcome, late = timed_save(mgr, 2, lease=lease)
        assert isinstance(outcome, SaveAbandonedError), outcome
        assert "lease fence" in str(outcome)
        assert late <= SLACK_S, f"raised {late:.2f} s after the deadline"
        assert "blackholed" in proxy.outcomes(is_cas) and "forwarded" in proxy.outcomes(is_lease_read_back)
        assert proxy.outcomes(is_create_only) == []  # the marker was never sent
        proxy.reset()
        assert lease.generation == held and healthy.stat(lease.key).generation == lease.object_generation
        assert mgr.all_steps() == [1]
        assert mgr.save(2, state(2), lease=lease) is not None and mgr.all_steps() == [1, 2]
        assert_restores(mgr, 2)


def run_saves(mgr: CheckpointManager, steps: range, lease: Lease) -> dict[int, tuple[object, float]]:
    """Each step saved with a deadline DEADLINE_IN s away, under whatever the proxy injects."""
    return {step: timed_save(mgr, step, lease=lease) for step in steps}


def check_outcomes(mgr: CheckpointManager, healthy: GCSStore, runs: dict[int, tuple[object, float]]) -> None:
    """Every save ended in time; each committed one restores bit-exactly, no abandoned one is committed.
    Called once the proxy is quiet, so the listing is what the store really holds."""
    late = {step: round(over, 2) for step, (_, over) in runs.items() if over > SLACK_S}
    assert not late, f"saves that ended more than {SLACK_S} s after their deadline: {late}"
    listed = set(manager(healthy).all_steps())
    for step, (outcome, _) in runs.items():
        if isinstance(outcome, SaveAbandonedError):
            assert step not in listed, f"step {step} raised {outcome!r} yet is committed"
            assert healthy.stat(layout.commit_key(step)) is None
        elif not isinstance(outcome, WriteOutcomeUnknownError):  # unknown: either may be true
            assert outcome is not None and step in listed, f"step {step} returned but is not committed"
    for step in sorted(listed):
        assert_restores(mgr, step)


def test_deadline_saves_under_mixed_faults_end_in_time(lib_store: GCSStore, healthy: GCSStore,
                                                       proxy: FaultProxy) -> None:
    """(b) 503s, resets before and after the server, truncated replies, and replies held from half a
    second to past the deadline, on every kind of request, the lease renewal included."""
    lease = Lease(lib_store, "master-a")
    lease.acquire()
    with manager(lib_store) as mgr:
        mgr.save(1, state(1), lease=lease)
        proxy.mix(Chaos(p_503=0.08, p_reset_before=0.04, p_reset_after=0.04, p_truncate=0.04, p_delay=0.1,
                        delay_s=(0.5, LATE), seed=1))
        runs = run_saves(mgr, range(2, 8), lease)
        proxy.reset()
        check_outcomes(mgr, healthy, runs)
        assert_restores(mgr, 1)
        assert mgr.save(8, state(8), lease=lease) is not None  # a later save without faults commits
        assert_restores(mgr, 8)


#: saves of the long mixed-fault run (it is part of `make test`: about half a second each)
MIXED_SAVES = 20


def test_many_deadline_saves_under_mixed_faults(lib_store: GCSStore, healthy: GCSStore, proxy: FaultProxy) -> None:
    """Faults at rates a bad hour of a real bucket might show: every save ends in time, every save that
    committed restores bit-exactly, none that raised SaveAbandonedError is committed. The retry policy
    backs off in milliseconds (FAST_RETRY's delays; the deadline still sets its timeout) so that the
    run's length goes to faults and saves rather than to sleeping."""
    fast = GCSStore(lib_store.bucket_name, lib_store.prefix, client=lib_store.client, retry=FAST_RETRY)
    lease = Lease(fast, "master-a")
    lease.acquire()
    with manager(fast) as mgr:
        proxy.mix(Chaos(p_503=0.03, p_reset_before=0.02, p_reset_after=0.02, p_truncate=0.02, p_delay=0.03,
                        delay_s=(0.1, 1.0), seed=2))
        runs = run_saves(mgr, range(1, MIXED_SAVES + 1), lease)
        faults = sum(outcome != "forwarded" for outcome in proxy.outcomes())
        proxy.reset()
        check_outcomes(mgr, healthy, runs)
        committed = [s for s, (outcome, _) in runs.items() if isinstance(outcome, Manifest)]
        ends = [DEADLINE_IN + over for _, over in runs.values()]
        print(f"{len(committed)}/{MIXED_SAVES} committed, {faults} faults injected; save length median "
              f"{statistics.median(ends):.2f} s, max {max(ends):.2f} s, deadline {DEADLINE_IN} s")
        assert faults > MIXED_SAVES  # the run did meet faults
        assert len(committed) >= MIXED_SAVES // 2  # and most saves still commit


# The only lease holder must not lose the lease to its own earlier fence write (a flake of the mixed-fault run
# above, reproduced deterministically): a CAS request that reaches the server after its read-back said "not
# applied", and a write found landed whose write on top then fails.


def test_fence_cas_that_reaches_the_server_after_its_read_back(lib_store: GCSStore, healthy: GCSStore,
                                                                proxy: FaultProxy) -> None:
    """(A) The fence's CAS requests are held *before* the server: the client times out, the window is
    spent (StoreDeadlineError, attempted), the read-back says NOT_APPLIED, the save abandons. Then the
    first CAS request reaches the server and is applied (its retries are refused). The Lease was never
    told: the next save, with no faults at all, raises LeaseLostError."""
    lease = Lease(lib_store, "master-a")
    lease.acquire()
    with manager(lib_store) as mgr:
        mgr.save(1, state(1), lease=lease)
        before = healthy.stat(lease.key).generation
        proxy.reset()
        proxy.slow_down(LATE, match=is_cas)  # a slow link (or a starved proxy / server under load)
        outcome, late = timed_save(mgr, 2, lease=lease)
        assert isinstance(outcome, SaveAbandonedError) and "lease fence" in str(outcome), outcome
        assert not isinstance(outcome.__cause__, WriteOutcomeUnknownError)  # read back as not applied
        assert late <= SLACK_S
        assert healthy.stat(lease.key).generation == before  # true when it was read back
        proxy.reset()  # the held requests go to the server now: the first CAS is applied
        landed_by = time.monotonic() + 10.0
        while healthy.stat(lease.key).generation == before:  # forwarded on the proxy's threads
            assert time.monotonic() < landed_by, "the held CAS never reached the server"
            time.sleep(0.05)
        assert mgr.save(3, state(3), lease=lease) is not None  # before: LeaseLostError
        assert_restores(mgr, 3)


def test_found_out_fence_whose_write_on_top_fails(lib_store: GCSStore, healthy: GCSStore,
                                                  proxy: FaultProxy) -> None:
    """(C) Save 2's fence CAS is applied but its replies come late and its read-back is never answered:
    WriteOutcomeUnknownError (_unresolved = D1). Save 3's fence: the CAS on the held generation is
    refused (412), reading back finds D1 (_unresolved cleared), the CAS on top of D1 is never answered
    and read back as not applied: StoreDeadlineError, the Lease still at the old generation and D1
    forgotten. Save 4, without faults: LeaseLostError."""
    lease = Lease(lib_store, "master-a")
    lease.acquire()
    with manager(lib_store) as mgr:
        mgr.save(1, state(1), lease=lease)
        proxy.reset()
        proxy.delay_replies(LATE, match=is_cas)
        proxy.blackhole(match=is_lease_read_back)
        outcome, _ = timed_save(mgr, 2, lease=lease)
        assert isinstance(outcome, (SaveAbandonedError, WriteOutcomeUnknownError)), outcome
        assert isinstance(outcome.__cause__, WriteOutcomeUnknownError), outcome.__cause__
        proxy.reset()

        cas_seen = []

        def cas_after_the_first(req) -> bool:
            if not is_cas(req):
                return False
            cas_seen.append(req)
            return len(cas_seen) > 1  # the first CAS (on the held generation) goes through: 412

        proxy.blackhole(match=cas_after_the_first)
        outcome, _ = timed_save(mgr, 3, lease=lease)
        assert isinstance(outcome, SaveAbandonedError) and "lease fence" in str(outcome), outcome
        assert "blackholed" in proxy.outcomes(is_cas)
        proxy.reset()
        assert mgr.save(4, state(4), lease=lease) is not None  # before: LeaseLostError
        assert_restores(mgr, 4)
