"""The one test suite every ObjectStore backend must pass.

Subclass :class:`StoreConformance` in a ``Test*`` class and implement
``make_store()`` to return a fresh, empty store (see ``tests/test_stores.py``)::

    class TestMemoryStore(StoreConformance):
        def make_store(self) -> ObjectStore:
            return MemoryStore()

The commit protocol and the master lease rely on exactly these properties, so a
backend that fails here must not be used for checkpoints.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import pytest

from ckpt_service.deadline import Deadline
from ckpt_service.errors import (
    BadStoreKeyError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreUnavailableError,
)
from ckpt_service.stores.base import ObjectInfo, ObjectStore, WriteOutcomeUnknownError
from ckpt_service.testing.delegating import DelegatingStore

BAD_KEYS = ["", "/abs", "../up", "a/../b", "a//b", "./a", "a/.", "a/", "a\\b", "nul\x00byte"]
PAYLOADS = {
    "empty": b"",
    "one-byte": b"x",
    "all-byte-values": bytes(range(256)) * 3,
    "zeros": b"\x00" * 4096,
    "crlf": b"line\r\nline\n\r",
}
RACERS = 8
LARGE_SIZE = 9 * 1024 * 1024  # above the 8 MiB multipart limit of GCS clients


def stat_of(store: ObjectStore, key: str) -> ObjectInfo:
    """The info of an object the test has written (its absence fails the test)."""
    info = store.stat(key)
    assert info is not None, f"{key} is missing from {store!r}"
    return info


class StoreConformance:
    """Backend-independent behaviour of :class:`ObjectStore`."""

    #: run the > 8 MiB round trip (resumable uploads on GCS)
    large_objects: bool = True

    def make_store(self) -> ObjectStore:
        raise NotImplementedError

    @pytest.fixture
    def store(self) -> Iterator[ObjectStore]:
        store = self.make_store()
        yield store
        store.close()

    # ---- plain reads and writes ----------------------------------------------------------

    @pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
    def test_round_trip(self, store: ObjectStore, payload: bytes) -> None:
        store.put("dir/obj", payload)
        assert store.get("dir/obj") == payload

    def test_put_returns_the_generation_stat_reports(self, store: ObjectStore) -> None:
        gen = store.put("k", b"abc")
        info = store.stat("k")
        assert info is not None
        assert (info.key, info.size, info.generation) == ("k", 3, gen)
        assert isinstance(info.generation, int) and info.generation > 0

    def test_stat_mtime_is_wall_clock_seconds(self, store: ObjectStore) -> None:
        before = time.time()
        store.put("k", b"abc")
        info = store.stat("k")
        assert info is not None
        # Same machine, so the clocks agree to far better than an hour: this catches
        # milliseconds/nanoseconds or a missing value, not timing.
        assert abs(info.mtime - before) < 3600

    def test_overwrite_replaces_content_and_increases_generation(self, store: ObjectStore) -> None:
        gens = [store.put("k", f"v{i}".encode()) for i in range(5)]
        assert store.get("k") == b"v4"
        assert gens == sorted(gens) and len(set(gens)) == len(gens), gens
        assert stat_of(store, "k").generation == gens[-1]

    def test_every_kind_of_write_moves_the_generation_up(self, store: ObjectStore) -> None:
        """The lease's generations order commits (a marker records the one its fence wrote): create,
        compare-and-swap and plain writes of one object must each give a strictly larger one."""
        gens = [store.put("lease", b"a", if_generation_match=0)]
        gens.append(store.put("lease", b"b", if_generation_match=gens[-1]))
        gens.append(store.put("lease", b"c"))
        gens.append(store.put_resolved("lease", b"d", if_generation_match=gens[-1]))
        gens.append(store.put("lease", b"e", if_generation_match=gens[-1]))
        assert all(x < y for x, y in zip(gens, gens[1:])), gens

    def test_store_time_is_on_the_clock_of_mtimes_and_leaves_nothing(self, store: ObjectStore) -> None:
        before = store.store_time()
        store.put("k", b"abc")
        after = store.store_time()
        info = stat_of(store, "k")
        assert before - 1.0 <= info.mtime <= after + 1.0, (before, info.mtime, after)
        assert list(store.list()) == ["k"], "the clock probe was left behind"

    def test_keys_with_spaces_and_unicode(self, store: ObjectStore) -> None:
        key = "run one/tensör #1/part=0.bin"
        store.put(key, b"data")
        assert store.get(key) == b"data"
        assert list(store.list("run one/")) == [key]

    def test_stat_and_exists_of_absent_key(self, store: ObjectStore) -> None:
        assert store.stat("absent") is None
        assert not store.exists("absent")
        store.put("present", b"")
        assert store.exists("present")
        assert stat_of(store, "present").size == 0

    def test_get_of_absent_key_raises_object_not_found(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFoundError, match="absent") as info:
            store.get("dir/absent")
        assert isinstance(info.value, KeyError)

    def test_delete_is_idempotent(self, store: ObjectStore) -> None:
        store.put("a/b", b"1")
        store.put("a/c", b"2")
        store.delete("a/b")
        assert store.stat("a/b") is None
        with pytest.raises(ObjectNotFoundError):
            store.get("a/b")
        store.delete("a/b")
        store.delete("never/existed")
        assert store.get("a/c") == b"2"

    def test_recreate_after_delete(self, store: ObjectStore) -> None:
        store.put("k", b"old")
        store.delete("k")
        store.put("k", b"new", if_generation_match=0)
        assert store.get("k") == b"new"

    # ---- conditional writes --------------------------------------------------------------

    def test_create_only_second_write_loses(self, store: ObjectStore) -> None:
        gen = store.put("lock", b"first", if_generation_match=0)
        with pytest.raises(PreconditionFailedError):
            store.put("lock", b"second", if_generation_match=0)
        assert store.get("lock") == b"first"
        assert stat_of(store, "lock").generation == gen

    def test_compare_and_swap_succeeds_with_current_generation(self, store: ObjectStore) -> None:
        g1 = store.put("lease", b"one", if_generation_match=0)
        g2 = store.put("lease", b"two", if_generation_match=g1)
        assert g2 > g1
        assert store.get("lease") == b"two"
        g3 = store.put("lease", b"three", if_generation_match=g2)
        assert g3 > g2
        assert stat_of(store, "lease").generation == g3

    def test_compare_and_swap_fails_with_stale_generation(self, store: ObjectStore) -> None:
        g1 = store.put("lease", b"one")
        g2 = store.put("lease", b"two")
        assert g2 != g1
        with pytest.raises(PreconditionFailedError):
            store.put("lease", b"zombie", if_generation_match=g1)
        assert store.get("lease") == b"two"
        assert stat_of(store, "lease").generation == g2

    def test_compare_and_swap_on_absent_key_fails(self, store: ObjectStore) -> None:
        with pytest.raises(PreconditionFailedError):
            store.put("absent", b"x", if_generation_match=123456789)
        assert store.stat("absent") is None

    def test_create_only_after_delete_wins_again(self, store: ObjectStore) -> None:
        store.put("k", b"a", if_generation_match=0)
        store.delete("k")
        store.put("k", b"b", if_generation_match=0)
        assert store.get("k") == b"b"

    def test_create_exclusive(self, store: ObjectStore) -> None:
        assert store.create_exclusive("commit/marker", b"token-a") is True
        assert store.create_exclusive("commit/marker", b"token-b") is False
        assert store.get("commit/marker") == b"token-a"
        # The same token read back means "this writer's object is the one stored".
        assert store.create_exclusive("commit/marker", b"token-a") is True

    def test_racing_create_only_writers_have_exactly_one_winner(self, store: ObjectStore) -> None:
        results = _race(lambda i: store.put("race/put", f"writer-{i}".encode(), if_generation_match=0))
        winners = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
        losers = [r for r in results if isinstance(r, BaseException)]
        assert len(winners) == 1, results
        assert all(isinstance(r, PreconditionFailedError) for r in losers), losers
        assert store.get("race/put") == f"writer-{winners[0]}".encode()

    def test_racing_create_exclusive_has_exactly_one_winner(self, store: ObjectStore) -> None:
        results = _race(lambda i: store.create_exclusive("race/excl", f"token-{i}".encode()))
        assert results.count(True) == 1, results
        assert all(r in (True, False) for r in results), results
        assert store.get("race/excl") == f"token-{results.index(True)}".encode()

    def test_failed_conditional_writes_leave_nothing_behind(self, store: ObjectStore) -> None:
        store.put("a/x", b"1", if_generation_match=0)
        for _ in range(3):
            with pytest.raises(PreconditionFailedError):
                store.put("a/x", b"2", if_generation_match=0)
            with pytest.raises(PreconditionFailedError):
                store.put("a/y", b"2", if_generation_match=42)
        assert list(store.list("")) == ["a/x"]

    # ---- reading back an ambiguous conditional write ---------------------------------------

    def test_get_versioned_pairs_the_bytes_with_their_generation(self, store: ObjectStore) -> None:
        assert store.get_versioned("k") is None
        g1 = store.put("k", b"one")
        assert store.get_versioned("k") == (b"one", g1)
        g2 = store.put("k", b"two", if_generation_match=g1)
        assert store.get_versioned("k") == (b"two", g2) and stat_of(store, "k").generation == g2
        store.delete("k")
        assert store.get_versioned("k") is None

    def test_create_applied_but_every_reply_lost_is_reported_as_done(self, store: ObjectStore) -> None:
        flaky = LostReplies(store, apply=True)
        assert flaky.create_exclusive("commit", b"token-mine") is True
        assert flaky.failed_puts == 1
        assert store.get("commit") == b"token-mine"

    def test_create_applied_then_refused_on_retry_is_reported_as_done(self, store: ObjectStore) -> None:
        # the client retried the applied write and got a 412 from its own first attempt
        flaky = LostReplies(store, apply=True, error=PreconditionFailedError("412 on the retry"))
        gen = flaky.put_resolved("commit", b"token-mine", if_generation_match=0)
        assert gen == stat_of(store, "commit").generation

    def test_compare_and_swap_applied_but_reply_lost_returns_the_new_generation(self, store: ObjectStore) -> None:
        g1 = store.put("lease", b"holder-1", if_generation_match=0)
        g2 = LostReplies(store, apply=True).put_resolved("lease", b"holder-1-renewed", if_generation_match=g1)
        assert g2 > g1 and store.get_versioned("lease") == (b"holder-1-renewed", g2)

    def test_write_never_applied_raises_the_store_error(self, store: ObjectStore) -> None:
        g1 = store.put("lease", b"holder-1", if_generation_match=0)
        flaky = LostReplies(store, apply=False)
        with pytest.raises(StoreUnavailableError) as info:
            flaky.put_resolved("lease", b"holder-1-renewed", if_generation_match=g1)
        assert not isinstance(info.value, WriteOutcomeUnknownError)  # known: nothing changed
        with pytest.raises(StoreUnavailableError):
            flaky.create_exclusive("commit", b"token-mine")
        assert store.get_versioned("lease") == (b"holder-1", g1) and store.stat("commit") is None

    def test_another_writer_won_while_the_reply_was_lost(self, store: ObjectStore) -> None:
        flaky = LostReplies(store, apply=False, meanwhile=lambda: store.put("commit", b"token-other"))
        assert flaky.create_exclusive("commit", b"token-mine") is False
        g1 = store.put("lease", b"holder-1")
        flaky = LostReplies(store, apply=False, meanwhile=lambda: store.put("lease", b"holder-2"))
        with pytest.raises(PreconditionFailedError, match="another writer"):
            flaky.put_resolved("lease", b"holder-1-renewed", if_generation_match=g1)

    def test_reply_and_read_back_both_lost_is_an_unknown_outcome(self, store: ObjectStore) -> None:
        flaky = LostReplies(store, apply=True, read_back_fails=True)
        with pytest.raises(WriteOutcomeUnknownError, match="may or may not"):
            flaky.create_exclusive("commit", b"token-mine")
        assert store.get("commit") == b"token-mine"  # it was applied: why "unknown" must not say "failed"

    def test_sweep_temporary_never_touches_an_object(self, store: ObjectStore) -> None:
        keys = ["commits/000000000001.json", "steps/000000000001/data/x", "lease/master.json"]
        for key in keys:
            store.put(key, key.encode())
        # even with everything taken for a century old
        assert store.sweep_temporary(0.0, now=time.time() + 100 * 365 * 86400) == 0
        assert list(store.list()) == sorted(keys)
        assert all(store.get(k) == k.encode() for k in keys)

    # ---- listing --------------------------------------------------------------------------

    def test_list_by_prefix(self, store: ObjectStore) -> None:
        keys = ["top", "a/1", "a/b/2", "a/b/c/3", "ab/4", "b/5"]
        for key in keys:
            store.put(key, key.encode())
        assert list(store.list()) == sorted(keys)
        assert list(store.list("")) == sorted(keys)
        assert list(store.list("a/")) == ["a/1", "a/b/2", "a/b/c/3"]
        assert list(store.list("a")) == ["a/1", "a/b/2", "a/b/c/3", "ab/4"]
        assert list(store.list("a/b/")) == ["a/b/2", "a/b/c/3"]
        assert list(store.list("a/b/c/3")) == ["a/b/c/3"]
        assert list(store.list("zzz")) == []
        assert list(store.list("nope/")) == []

    def test_list_of_empty_store(self, store: ObjectStore) -> None:
        assert list(store.list()) == []

    def test_list_dirs_and_delete_prefix(self, store: ObjectStore) -> None:
        for key in ["ckpt/step-2/a", "ckpt/step-10/b", "ckpt/step-10/c/d", "ckpt/LATEST", "other/x"]:
            store.put(key, b"")
        assert store.list_dirs("ckpt/") == ["step-10", "step-2"]
        assert store.delete_prefix("ckpt/step-10/") == 2
        assert list(store.list("ckpt/")) == ["ckpt/LATEST", "ckpt/step-2/a"]

    # ---- keys -----------------------------------------------------------------------------

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_bad_keys_are_rejected(self, store: ObjectStore, key: str) -> None:
        with pytest.raises(BadStoreKeyError):
            store.put(key, b"x")
        with pytest.raises(BadStoreKeyError):
            store.get(key)
        with pytest.raises(BadStoreKeyError):
            store.stat(key)
        with pytest.raises(BadStoreKeyError):
            store.delete(key)
        assert list(store.list()) == []

    # ---- concurrency and size -------------------------------------------------------------

    def test_concurrent_puts_from_a_thread_pool(self, store: ObjectStore) -> None:
        payloads = {f"shards/{i:03d}": bytes([i]) * (1000 + i) for i in range(24)}
        with ThreadPoolExecutor(max_workers=8) as pool:
            gens = list(pool.map(lambda kv: store.put(*kv), payloads.items()))
        assert all(isinstance(g, int) for g in gens)
        assert list(store.list("shards/")) == sorted(payloads)
        with ThreadPoolExecutor(max_workers=8) as pool:
            got = dict(zip(payloads, pool.map(store.get, payloads)))
        assert got == payloads

    def test_a_view_within_a_deadline_works_on_the_same_objects(self, store: ObjectStore) -> None:
        """What a save with a deadline writes through the bounded view is what everyone else reads."""
        view = store.within(Deadline(time.time() + 60.0))
        gen = view.put("k", b"through the view")
        assert store.get("k") == b"through the view" and stat_of(store, "k").generation == gen
        assert view.get_versioned("k") == (b"through the view", gen)
        assert view.create_exclusive("commit", b"token-a") is True
        assert view.create_exclusive("commit", b"token-b") is False and store.get("commit") == b"token-a"
        assert view.put_resolved("k", b"swapped", if_generation_match=gen) > gen
        assert list(view.list("")) == list(store.list("")) == ["commit", "k"]
        view.delete("k")
        assert not store.exists("k")

    def test_large_object_round_trip(self, store: ObjectStore) -> None:
        if not self.large_objects:
            pytest.skip("backend opted out of large objects")
        data = bytes(range(251)) * (LARGE_SIZE // 251 + 1)
        gen1 = store.put("big/blob", data)
        assert store.get("big/blob") == data
        assert stat_of(store, "big/blob").size == len(data)
        gen2 = store.put("big/blob", data[::-1])
        assert gen2 > gen1
        assert store.get("big/blob") == data[::-1]


class LostReplies(DelegatingStore):
    """A store in front of ``inner`` whose conditional writes all end in an error, like a write
    whose replies a network lost: ``apply`` says whether the server applied it first, ``meanwhile``
    runs (another writer) before it, and ``read_back_fails`` makes reading it back fail too.
    Backend-independent; tests/test_gcs_faults.py does the same over a real network to GCS."""

    def __init__(self, inner: ObjectStore, *, apply: bool, error: Exception | None = None,
                 meanwhile: Callable[[], object] | None = None, read_back_fails: bool = False) -> None:
        super().__init__(inner)
        self.apply, self.meanwhile = apply, meanwhile
        self.error = error or StoreUnavailableError("gave up after retrying (connection reset by peer)")
        self.read_back_fails = read_back_fails
        self.failed_puts = 0

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if if_generation_match is None:
            return self.inner.put(key, data)
        if self.meanwhile is not None:
            self.meanwhile()
        if self.apply:
            self.inner.put(key, data, if_generation_match=if_generation_match)
        self.failed_puts += 1
        raise self.error

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        if self.read_back_fails:
            raise StoreUnavailableError("read-back: connection reset by peer")
        return self.inner.get_versioned(key)


def _race(write: Callable[[int], object]) -> list[object]:
    """Run ``write(i)`` for RACERS threads released together; return each result or exception."""
    barrier = threading.Barrier(RACERS)
    results: list[object] = [None] * RACERS

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = write(i)
        except BaseException as exc:  # collected and asserted on by the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
