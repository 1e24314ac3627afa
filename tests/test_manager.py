"""CheckpointManager against every store backend (GCS through fake-gcs-server)."""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

import numpy as np
import pytest
from ckpt_helpers import BACKENDS, assert_same_state, flip_one_byte_of_a_chunk, make_backend_store, sample_state

from ckpt_service import layout
from ckpt_service.deadline import (
    ATTEMPT_SHARE,
    COMMIT_RESERVE_S,
    DEFAULT_MARGIN_S,
    MIN_ATTEMPT_S,
    READBACK_RESERVE_S,
    CallWindow,
    Deadline,
    call_window,
)
from ckpt_service.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    NothingToRestoreError,
    SaveAbandonedError,
    StoreDeadlineError,
    StoreUnavailableError,
    StructureMismatchError,
    WriterFailedError,
)
from ckpt_service.manager import (
    BadMetadataError,
    BadSnapshotError,
    CheckpointManager,
    CommitConflictError,
    DeferredShare,
)
from ckpt_service.manifest import CommitMarker, crc32c
from ckpt_service.plan import SavePlan, TensorSpecs, spec_of
from ckpt_service.share import is_deferred
from ckpt_service.stores import MemoryStore
from ckpt_service.stores.base import WriteOutcomeUnknownError
from ckpt_service.testing.store_conformance import LostReplies
from hvd_transient import store_keys as keys

pytestmark = pytest.mark.timed  # bounds wall-clock times


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    return make_backend_store(request.param, tmp_path, request)


@pytest.fixture
def mgr(store):
    manager = CheckpointManager(store, max_to_keep=None, chunk_bytes=4096)
    yield manager
    manager.close()


def save_multiwriter(mgr: CheckpointManager, step: int, state, world: int, **kw):
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = mgr.save(step, state, {"epoch": 1}, rank=rank, world_size=world, attempt=f"a{step}", **kw)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_round_trip_and_metadata(mgr) -> None:
    state = sample_state()
    manifest = mgr.save(7, state, {"epoch": 2, "lr": 0.1, "data": {"position": 640}})
    assert manifest is not None and manifest.step == 7
    ckpt = mgr.restore()
    assert ckpt.step == 7
    assert ckpt.metadata == {"epoch": 2, "lr": 0.1, "data": {"position": 640}}
    assert_same_state(ckpt.tensors, state)
    assert mgr.all_steps() == [7]


def test_steps_are_listed_in_order_and_restorable_by_number(mgr) -> None:
    for step in (10, 20, 30):
        mgr.save(step, sample_state(step))
    assert mgr.all_steps() == [10, 20, 30]
    assert mgr.restore().step == 30
    assert_same_state(mgr.restore(step=10).tensors, sample_state(10))
    with pytest.raises(NothingToRestoreError, match="not committed"):
        mgr.restore(step=15)


@pytest.mark.parametrize("writers,readers", [(3, 1), (3, 2), (2, 4)])
def test_n_writers_m_readers(mgr, writers, readers) -> None:
    state = sample_state(scale=4)
    results = save_multiwriter(mgr, 5, state, writers)
    assert results[0] is not None and all(results[r] is None for r in range(1, writers))
    manifest = mgr.manifest(5)
    assert manifest.world_size == writers
    assert {p.writer for p in manifest.pieces} == set(range(writers))
    merged: dict[str, np.ndarray] = {}
    for reader in range(readers):
        part = mgr.restore(partition=(reader, readers)).tensors
        assert not set(part) & set(merged), "readers must not overlap"
        merged.update(part)
    assert_same_state(merged, state)


def test_uncommitted_step_is_invisible(mgr, store) -> None:
    mgr.save(1, sample_state(1))

    def failing_gather(record):
        raise RuntimeError("coordinator vanished")

    with pytest.raises(RuntimeError):
        mgr.save(2, sample_state(2), gather=failing_gather)
    assert any(k.startswith(layout.step_prefix(2)) for k in store.list("steps/")), "pieces were written"
    assert mgr.all_steps() == [1]
    assert mgr.restore().step == 1


def test_missed_deadline_commits_nothing(mgr) -> None:
    mgr.save(1, sample_state(1))
    with pytest.raises(SaveAbandonedError, match="previous checkpoint stays the latest"):
        mgr.save(2, sample_state(2), deadline=time.time() - 1)
    assert mgr.all_steps() == [1]


def test_second_commit_of_a_step_is_refused_and_first_stands(mgr) -> None:
    first = sample_state(1)
    mgr.save(3, first)
    with pytest.raises(CommitConflictError, match="already committed"):
        mgr.save(3, sample_state(2))
    assert_same_state(mgr.restore(step=3).tensors, first)


def test_flipped_byte_is_detected_and_restore_falls_back(mgr, store, caplog) -> None:
    mgr.save(1, sample_state(1))
    mgr.save(2, sample_state(2))
    flip_one_byte_of_a_chunk(store, 2)
    report = mgr.verify(2)
    assert not report.ok and "crc32c" in report.problems[0]
    assert mgr.verify(1).ok
    with caplog.at_level(logging.WARNING):
        ckpt = mgr.restore()
    assert ckpt.step == 1
    assert_same_state(ckpt.tensors, sample_state(1))
    assert "step 2 failed verification" in caplog.text
    with pytest.raises(CorruptCheckpointError):
        mgr.restore(step=2)


def test_tampered_manifest_is_corrupt(mgr, store) -> None:
    mgr.save(1, sample_state(1))
    marker = mgr.commit_marker(1)
    body = json.loads(store.get(marker.manifest_key))
    body["metadata"] = {"evil": True}
    store.put(marker.manifest_key, json.dumps(body).encode())
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        mgr.restore(step=1)


def test_format_version_mismatch_is_a_clear_error(mgr, store) -> None:
    mgr.save(1, sample_state(1))
    marker = mgr.commit_marker(1)
    body = json.loads(store.get(marker.manifest_key))
    body["format_version"] = 99
    data = json.dumps(body).encode()
    store.put(marker.manifest_key, data)
    fixed = CommitMarker(1, marker.manifest_key, crc32c(data), marker.token, marker.committed_at)
    store.put(layout.commit_key(1), fixed.to_json())
    with pytest.raises(FormatVersionError, match="format version 99"):
        mgr.restore(step=1)


def test_expected_structure_mismatch(mgr) -> None:
    state = sample_state()
    mgr.save(1, state)
    expected = dict(state)
    expected["dense/kernel:0"] = np.zeros((512, 99), np.float32)
    with pytest.raises(StructureMismatchError, match="dense/kernel:0"):
        mgr.restore(expected=expected)
    with pytest.raises(StructureMismatchError, match="missing"):
        mgr.restore(expected={**state, "new_layer": ((3,), "float32")})
    assert_same_state(mgr.restore(expected=state).tensors, state)


def test_nothing_to_restore(mgr) -> None:
    with pytest.raises(NothingToRestoreError, match="nothing to restore"):
        mgr.restore()


def test_bad_metadata(mgr) -> None:
    with pytest.raises(BadMetadataError, match="JSON"):
        mgr.save(1, sample_state(), {"x": object()})
    assert mgr.all_steps() == []


def test_async_save_stalls_only_for_the_snapshot_and_commits(mgr) -> None:
    state = sample_state(scale=8)
    assert mgr.save_async(1, state, {"epoch": 1})
    # mutating the live state after the call must not leak into the checkpoint
    original = {k: v.copy() for k, v in state.items()}
    state["dense/kernel:0"][:] = 0
    manifest = mgr.wait(timeout=60)
    assert manifest is not None and manifest.step == 1
    assert mgr.last_stats is not None and mgr.last_stats.stall_s >= 0
    assert_same_state(mgr.restore().tensors, original)


def test_async_save_while_busy_skips_or_waits(store) -> None:
    gate = threading.Event()

    def slow_gather(record):
        gate.wait(30)
        return [record]

    mgr = CheckpointManager(store, max_to_keep=None)
    try:
        assert mgr.save_async(1, sample_state(1), gather=slow_gather)
        assert mgr.save_in_flight
        assert mgr.save_async(2, sample_state(2)) is False  # skipped: one in flight
        with pytest.raises(TimeoutError):
            mgr.wait(timeout=0.05)
        gate.set()
        assert mgr.save_async(3, sample_state(3), if_busy="wait")
        mgr.wait(timeout=60)
        assert mgr.all_steps() == [1, 3]
    finally:
        gate.set()
        mgr.close()


def test_background_error_surfaces_on_wait(mgr) -> None:
    def broken_gather(record):
        raise RuntimeError("network down")

    mgr.save_async(1, sample_state(), gather=broken_gather)
    with pytest.raises(RuntimeError, match="network down"):
        mgr.wait(timeout=60)
    assert mgr.all_steps() == []


def test_retention_keeps_latest_and_every_n(store) -> None:
    mgr = CheckpointManager(store, max_to_keep=2, keep_every_n_steps=100)
    try:
        for step in (50, 100, 150, 200, 250, 300):
            mgr.save(step, {"w": np.full(10, step, np.float32)})
        assert mgr.all_steps() == [100, 200, 250, 300]
        assert not list(store.list(layout.step_prefix(50))), "deleted steps leave no data behind"
    finally:
        mgr.close()


def test_gc_removes_abandoned_but_not_in_progress_steps(store) -> None:
    mgr = CheckpointManager(store, max_to_keep=5, abandoned_after_s=0.0)

    def failing_gather(record):
        raise RuntimeError("died")

    try:
        with pytest.raises(RuntimeError):
            mgr.save(1, sample_state(), gather=failing_gather)  # abandoned older attempt
        mgr.save(2, sample_state())
        with pytest.raises(RuntimeError):
            mgr.save(3, sample_state(), gather=failing_gather)  # newer than latest: maybe in progress
        # the retention pass that follows the commit of step 2 collected the abandoned step 1
        assert not list(store.list(layout.step_prefix(1)))
        assert mgr.gc() == []
        assert list(store.list(layout.step_prefix(3))), "a step newer than the latest is never collected"
        assert mgr.gc(keep=1) == [] and mgr.all_steps() == [2]
    finally:
        mgr.close()


def test_gc_ages_abandoned_steps_by_the_manager_clock(store) -> None:
    clock = [time.time()]
    mgr = CheckpointManager(store, max_to_keep=5, clock=lambda: clock[0])

    def failing_gather(record):
        raise RuntimeError("died")

    try:
        with pytest.raises(RuntimeError):
            mgr.save(1, sample_state(), gather=failing_gather)
        mgr.save(2, sample_state())
        assert list(store.list(layout.step_prefix(1))), "written just now: it may still be in flight"
        clock[0] += mgr.abandoned_after_s + 1
        assert mgr.gc() == [1]
        assert not list(store.list(layout.step_prefix(1))) and mgr.all_steps() == [2]
    finally:
        mgr.close()


# ---- a commit marker write whose answer is lost -----------------------------------------------


def test_commit_applied_but_every_reply_lost_is_reported_as_committed(store) -> None:
    state = sample_state(3)
    with CheckpointManager(LostReplies(store, apply=True), max_to_keep=None) as lossy:
        manifest = lossy.save(5, state, {"epoch": 2})
        assert manifest is not None and manifest.step == 5
        assert lossy.last_stats is not None and lossy.last_stats.committed
    with CheckpointManager(store, max_to_keep=None) as mgr:
        assert mgr.all_steps() == [5] and mgr.verify(5).ok
        assert_same_state(mgr.restore().tensors, state)
        with pytest.raises(CommitConflictError):
            mgr.save(5, state)


def test_commit_never_applied_is_reported_as_failed_and_commits_nothing(store) -> None:
    state = sample_state(3)
    with CheckpointManager(LostReplies(store, apply=False), max_to_keep=None) as lossy:
        with pytest.raises(StoreUnavailableError) as info:
            lossy.save(5, state)
        assert not isinstance(info.value, WriteOutcomeUnknownError)
        assert lossy.all_steps() == []
    with CheckpointManager(store, max_to_keep=None) as mgr:
        assert mgr.save(5, state) is not None  # the step is free: the failed attempt left no marker
        assert_same_state(mgr.restore().tensors, state)


def test_commit_whose_read_back_fails_too_says_the_outcome_is_unknown(store) -> None:
    with CheckpointManager(LostReplies(store, apply=True, read_back_fails=True), max_to_keep=None) as lossy:
        with pytest.raises(WriteOutcomeUnknownError, match="step 5: .*may or may not be committed"):
            lossy.save(5, sample_state(3))


def test_partitioned_restore_reads_only_the_chunks_it_needs(tmp_path) -> None:
    """A reader of one small tensor fetches a few chunks, not whole pieces, and they are verified."""
    from ckpt_service.stores import MemoryStore

    class CountingStore(MemoryStore):
        read_bytes = 0

        def get(self, key: str) -> bytes:
            data = super().get(key)
            CountingStore.read_bytes += len(data)
            return data

    store = CountingStore()
    rng = np.random.default_rng(0)
    state = {"big": rng.standard_normal(2_000_000).astype(np.float32),
             "small": rng.standard_normal(1000).astype(np.float32)}
    with CheckpointManager(store, chunk_bytes=64 * 1024) as mgr:
        mgr.save(1, state)
        CountingStore.read_bytes = 0
        got = mgr.restore(names=["small"]).tensors
        np.testing.assert_array_equal(got["small"], state["small"])
        assert CountingStore.read_bytes < 4 * 64 * 1024 + 20_000  # a chunk or two, not 8 MB
        # a corrupted chunk under the small tensor is caught by its own checksum
        entry = mgr.manifest(1).tensor("small")
        piece = next(p for p in mgr.manifest(1).pieces if p.start <= entry.offset < p.stop)
        key = f"{piece.key}c/{(entry.offset - piece.start) // piece.chunk_elements}"
        data = bytearray(store.get(key))
        data[3] ^= 0xFF
        store.put(key, bytes(data))
        with pytest.raises(CorruptCheckpointError, match="crc32c"):
            mgr.restore(step=1, names=["small"])


# ------------------------------------------------------------------ share snapshots


def share_of(state: dict[str, np.ndarray], plan: SavePlan, rank: int) -> list[np.ndarray]:
    """What a share snapshot returns, computed independently: slices of each group's flat buffer."""
    groups: dict[str, list[np.ndarray]] = {}
    for p in plan.placements:  # sorted by (group, name), i.e. buffer order
        groups.setdefault(p.spec.dtype, []).append(state[p.spec.name].reshape(-1).astype(p.spec.dtype))
    flat = {g: np.concatenate(parts) for g, parts in groups.items()}
    return [flat[item.group][item.start:item.stop].copy() for item in plan.for_rank(rank)]


def specs_only(state: dict[str, np.ndarray]) -> dict[str, object]:
    return {name: spec_of(name, arr) for name, arr in state.items()}


def test_share_snapshot_supplies_the_data_of_a_multiwriter_save(mgr) -> None:
    state = sample_state(scale=4)
    calls: list[int] = []

    def snapshot(plan: SavePlan, rank: int) -> list[np.ndarray]:
        calls.append(rank)
        return share_of(state, plan, rank)

    # the tensors only give shapes and dtypes: zeros here, so restoring `state` proves where data came from
    zeros = {name: np.zeros_like(arr) for name, arr in state.items()}
    save_multiwriter(mgr, 4, zeros, 3, snapshot=snapshot)
    assert sorted(calls) == [0, 1, 2]
    assert_same_state(mgr.restore().tensors, state)


def test_async_save_from_a_share_snapshot_of_specs(mgr) -> None:
    state = sample_state(scale=8)
    assert mgr.save_async(1, specs_only(state), {"epoch": 1},
                          snapshot=lambda plan, rank: share_of(state, plan, rank))
    manifest = mgr.wait(timeout=60)
    assert manifest is not None and manifest.step == 1
    assert_same_state(mgr.restore().tensors, state)


def test_plans_are_cached_per_specs_and_world_size() -> None:
    with CheckpointManager(MemoryStore(), chunk_bytes=4096) as mgr:
        specs = list(specs_only(sample_state()).values())
        assert mgr.plan(specs, 2) is mgr.plan(tuple(specs), 2)
        assert mgr.plan(specs, 3) is not mgr.plan(specs, 2)
        assert mgr.plan(specs, 3).world_size == 3
        for world in range(4, 20):  # evicts the oldest
            mgr.plan(specs, world)
        assert mgr.plan(specs, 19) is mgr.plan(specs, 19)


def test_a_tensor_specs_plan_is_found_by_the_same_or_an_equal_tensor_specs() -> None:
    with CheckpointManager(MemoryStore(), chunk_bytes=4096) as mgr:
        state = sample_state()
        checked = TensorSpecs(specs_only(state))
        plan = mgr.plan(checked, 2)
        assert plan == mgr.plan(list(checked.values()), 2)  # the same plan as from a list
        assert mgr.plan(checked, 2) is plan
        assert mgr.plan(TensorSpecs(specs_only(state)), 2) is plan
        # a save given it takes the specs as checked and its data from the snapshot
        assert mgr.save_async(1, checked, snapshot=lambda plan, rank: share_of(state, plan, rank))
        mgr.wait(timeout=60)
        assert_same_state(mgr.restore().tensors, state)


def _too_long(arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [np.concatenate([arrays[0], arrays[0][:1]])] + arrays[1:]


def _wrong_dtype(arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [arrays[0].astype(np.float64 if arrays[0].dtype != np.float64 else np.float32)] + arrays[1:]


@pytest.mark.parametrize("spoil,match", [
    (_too_long, "expected"),
    (_wrong_dtype, "expected"),
    (lambda arrays: arrays[:-1], "returned .* arrays"),
    (lambda arrays: [arrays[0].reshape(1, -1)] + arrays[1:], "expected"),
])
def test_a_bad_share_snapshot_is_refused_and_commits_nothing(spoil, match) -> None:
    state = sample_state()
    with CheckpointManager(MemoryStore(), max_to_keep=None) as mgr:
        mgr.save(1, state)

        def bad(plan: SavePlan, rank: int) -> list[np.ndarray]:
            return spoil(share_of(state, plan, rank))

        with pytest.raises(BadSnapshotError, match=match):
            mgr.save_async(2, state, snapshot=bad)
        assert not mgr.save_in_flight
        with pytest.raises(BadSnapshotError, match=match):
            mgr.save(3, state, snapshot=bad)
        assert mgr.all_steps() == [1]
        assert_same_state(mgr.restore().tensors, state)


class TakenShare:
    """A DeferredShare: the arrays are computed when assembled, on whichever thread does it."""

    def __init__(self, make: Callable[[], list[np.ndarray]]) -> None:
        self.make = make
        self.threads: list[threading.Thread] = []

    def assemble(self) -> list[np.ndarray]:
        self.threads.append(threading.current_thread())
        return self.make()


class NotAssembled:
    assemble = None  # blocked, as a protocol member can be


def test_is_deferred_answers_as_isinstance_of_the_protocol() -> None:
    class Declared(DeferredShare):
        def assemble(self) -> list[np.ndarray]:
            return []

    taken = [TakenShare(list), Declared(), NotAssembled(), [np.zeros(3)], (np.zeros(3),), np.zeros(3), None]
    assert [is_deferred(t) for t in taken] == [isinstance(t, DeferredShare) for t in taken]
    assert [is_deferred(t) for t in taken] == [True, True] + [False] * 5


def test_a_deferred_share_is_assembled_on_the_background_thread() -> None:
    state = sample_state(scale=4)
    with CheckpointManager(MemoryStore(), max_to_keep=None) as mgr:
        taken: list[TakenShare] = []

        def snapshot(plan: SavePlan, rank: int) -> TakenShare:
            taken.append(TakenShare(lambda: share_of(state, plan, rank)))
            return taken[-1]

        assert mgr.save_async(1, specs_only(state), snapshot=snapshot)
        assert mgr.wait(timeout=60) is not None
        assert len(taken[0].threads) == 1 and taken[0].threads[0] is not threading.current_thread()
        mgr.save(2, specs_only(state), snapshot=snapshot)  # a synchronous save assembles it too
        assert taken[1].threads == [threading.current_thread()]
        assert mgr.all_steps() == [1, 2]
        assert_same_state(mgr.restore().tensors, state)


@pytest.mark.parametrize("spoil,error", [
    (_too_long, BadSnapshotError),
    (lambda arrays: arrays[:-1], BadSnapshotError),
    (lambda arrays: (_ for _ in ()).throw(MemoryError("no room for the pieces")), MemoryError),
])
def test_a_deferred_share_that_fails_to_assemble_fails_the_save_and_commits_nothing(spoil, error) -> None:
    state = sample_state()
    with CheckpointManager(MemoryStore(), max_to_keep=None) as mgr:
        mgr.save(1, state)

        def bad(plan: SavePlan, rank: int) -> TakenShare:
            return TakenShare(lambda: spoil(share_of(state, plan, rank)))

        assert mgr.save_async(2, specs_only(state), snapshot=bad)  # started: it fails in the background
        with pytest.raises(error):
            mgr.wait(timeout=60)
        with pytest.raises(error):
            mgr.save(3, specs_only(state), snapshot=bad)
        assert mgr.all_steps() == [1]
        assert_same_state(mgr.restore().tensors, state)


def test_big_endian_snapshot_arrays_are_stored_little_endian() -> None:
    state = {"w": np.arange(100, dtype=np.float32)}
    with CheckpointManager(MemoryStore()) as mgr:
        mgr.save(1, state, snapshot=lambda plan, rank: [a.astype(">f4") for a in share_of(state, plan, rank)])
        assert_same_state(mgr.restore().tensors, state)


def test_specs_without_a_share_snapshot_are_an_error() -> None:
    with CheckpointManager(MemoryStore()) as mgr:
        with pytest.raises(BadSnapshotError, match="holds no data"):
            mgr.save(1, specs_only(sample_state()))
        with pytest.raises(BadSnapshotError, match="holds no data"):
            mgr.save_async(1, specs_only(sample_state()))
        with pytest.raises(BadSnapshotError, match="holds no data"):
            mgr.save(1, TensorSpecs(specs_only(sample_state())))
        assert mgr.all_steps() == []


@pytest.mark.parametrize("asynchronous,deferred", [(False, False), (True, False), (True, True)])
def test_a_rank_whose_snapshot_fails_tells_the_coordinator_at_once(asynchronous: bool, deferred: bool) -> None:
    """The coordinator abandons the step on the failed rank's error record, not after its gather timeout."""
    state = sample_state()
    store = MemoryStore()
    managers = [CheckpointManager(store, max_to_keep=None, gather_timeout_s=3600.0) for _ in range(2)]
    try:
        managers[0].save(1, state)
        outcome: dict[str, BaseException | None] = {}

        def coordinator() -> None:
            try:
                managers[0].save(2, state, rank=0, world_size=2, attempt="a2")
                outcome["rank0"] = None
            except BaseException as exc:  # noqa: BLE001 - checked below
                outcome["rank0"] = exc

        def lost() -> list[np.ndarray]:
            raise RuntimeError("device lost")

        def broken(plan: SavePlan, rank: int) -> list[np.ndarray] | TakenShare:
            return TakenShare(lost) if deferred else lost()

        thread = threading.Thread(target=coordinator)
        thread.start()
        with pytest.raises(RuntimeError, match="device lost"):
            if deferred:  # the share is taken, then fails on the background thread
                assert managers[1].save_async(2, state, rank=1, world_size=2, snapshot=broken, attempt="a2")
                managers[1].wait(timeout=120)
            elif asynchronous:
                managers[1].save_async(2, state, rank=1, world_size=2, snapshot=broken, attempt="a2")
            else:
                managers[1].save(2, state, rank=1, world_size=2, snapshot=broken, attempt="a2")
        thread.join(timeout=120)  # a hang guard only: without the error record it would wait an hour
        assert not thread.is_alive()
        assert isinstance(outcome["rank0"], WriterFailedError)
        assert "rank 1: RuntimeError: device lost" in str(outcome["rank0"])
        assert managers[0].all_steps() == [1]
    finally:
        for m in managers:
            m.close()


# ------------------------------------------------------------------ shard records and failures


def test_shard_records_keep_their_json_form() -> None:
    from ckpt_service.manifest import PieceRecord
    from ckpt_service.shard_records import ShardRecord

    piece = PieceRecord("float32", 0, 0, 10, 10, "steps/000000000001/data/float32/00000.abc/", 123, 40, 1)
    record = ShardRecord(1, (piece,), "abc", step=1, attempt="r1-1-0", plan="d" * 64)
    body = record.to_json()
    assert list(body) == ["rank", "step", "attempt", "plan", "nonce", "pieces", "bytes"]
    assert body["pieces"][0]["key"] == piece.key and body["bytes"] == 40
    assert ShardRecord.from_json(json.loads(json.dumps(body))) == record
    failed = ShardRecord.failed(2, RuntimeError("disk full"), step=1, attempt="r1-1-0", plan=None).to_json()
    assert failed == {"rank": 2, "step": 1, "attempt": "r1-1-0", "plan": None, "error": "RuntimeError: disk full",
                      "pieces": [], "bytes": 0}


def test_records_that_do_not_cover_the_plan_commit_nothing() -> None:
    from ckpt_service.errors import IncompleteShardRecordsError

    def dropping_gather(record):
        return [{**record, "pieces": record["pieces"][1:]}]

    def garbled_gather(record):
        return [{"rank": "zero"}]

    with CheckpointManager(MemoryStore(), max_to_keep=None, chunk_bytes=4096) as mgr:
        mgr.save(1, sample_state(1))
        for gather in (dropping_gather, garbled_gather):
            with pytest.raises(IncompleteShardRecordsError):
                mgr.save(2, sample_state(2), gather=gather)
        assert mgr.all_steps() == [1]


def test_a_background_failure_never_waited_for_is_logged_when_the_next_save_starts(caplog) -> None:
    def broken_gather(record):
        raise RuntimeError("network down")

    with CheckpointManager(MemoryStore(), max_to_keep=None) as mgr:
        assert mgr.save_async(1, sample_state(), gather=broken_gather)
        deadline = time.time() + 60
        while mgr.save_in_flight and time.time() < deadline:
            time.sleep(0.01)
        with caplog.at_level(logging.ERROR):
            assert mgr.save_async(2, sample_state())  # not refused for the earlier failure
        failures = [r for r in caplog.records if "previous background checkpoint failed" in r.getMessage()]
        assert len(failures) == 1 and failures[0].exc_info is not None
        assert mgr.wait(timeout=60) is not None and mgr.all_steps() == [2]


def test_run_store_keys_of_the_training_side() -> None:
    assert keys.events_key("w-1", 4242, 3) == "events/w-1.4242.000003.jsonl"
    assert keys.is_events_key(keys.events_key("w-1", 4242, 3)) and not keys.is_events_key("events/x.json")
    assert keys.leaving_key("w-1") == "hosts/leaving/w-1.json"
    assert keys.host_of_leaving_key(keys.leaving_key("w-1")) == "w-1"
    assert keys.host_of_leaving_key("hosts/leaving/.json") is None
    assert keys.STOP_KEY == "control/stop"
    # none of them lies under the prefixes retention lists and deletes
    for key in (keys.events_key("h", 1, 0), keys.leaving_key("h"), keys.STOP_KEY, layout.LEASE_KEY):
        assert not key.startswith((layout.STEPS_PREFIX, layout.COMMITS_PREFIX))


# ---- saves with a deadline: the time budget of each store call ------------------------------------

#: how far past its deadline a save may end: its store calls end before it, so this only covers
#: thread scheduling on a loaded test machine (the saves below end before their deadline)
SLACK_S = 1.0


def test_a_deadline_ends_store_calls_a_margin_before_it() -> None:
    d = Deadline(100.0)
    assert d.end == 100.0 - DEFAULT_MARGIN_S and d.left(90.0) == pytest.approx(10.0 - DEFAULT_MARGIN_S)
    assert not d.expired(d.end - 0.01) and d.expired(d.end) and d.left(101.0) < 0
    with pytest.raises(ValueError):
        Deadline(100.0, margin_s=-1.0)


def test_the_share_writes_leave_the_commit_its_reserve_but_never_the_whole_window() -> None:
    long = Deadline(1000.0, margin_s=0.0)
    assert long.before_commit(970.0).end == pytest.approx(1000.0 - COMMIT_RESERVE_S)  # 30 s left: the full reserve
    short = Deadline(1000.0, margin_s=0.0)
    assert short.before_commit(996.0).end == pytest.approx(999.0)  # 4 s left: a quarter of it
    assert short.before_commit(1001.0).end == 1000.0  # nothing left: nothing to keep
    assert long.before_commit(970.0).margin_s == long.margin_s


def test_a_call_window_runs_to_the_deadline_and_a_conditional_write_keeps_time_to_read_back() -> None:
    d = Deadline(1000.0, margin_s=0.0)
    assert call_window(d, 990.0) == CallWindow(990.0, 1000.0)
    assert call_window(d, 990.0, conditional_write=True) == CallWindow(990.0, 1000.0 - READBACK_RESERVE_S)
    # with 1.5 s left, a third of it is kept for the read-back
    assert call_window(d, 998.5, conditional_write=True) == CallWindow(998.5, pytest.approx(999.5))
    assert call_window(d, 1000.0 - MIN_ATTEMPT_S / 2) is None  # not even one request fits
    assert call_window(d, 1001.0) is None


def test_each_attempt_times_out_inside_the_window_leaving_room_for_a_retry() -> None:
    w = CallWindow(0.0, 10.0)
    assert w.attempt_timeout(0.0, default_s=60.0) == ATTEMPT_SHARE * 10.0  # a stall costs half the window
    assert w.attempt_timeout(8.0, default_s=60.0) == pytest.approx(2.0)  # never past its end
    assert w.attempt_timeout(0.0, default_s=1.0) == 1.0  # never longer than the client's own timeout
    assert w.attempt_timeout(10.0 - MIN_ATTEMPT_S / 2, default_s=60.0) is None
    assert CallWindow(0.0, 0.15).attempt_timeout(0.0, default_s=60.0) == MIN_ATTEMPT_S


def test_gcs_calls_keep_the_library_policy_without_a_deadline_and_fit_the_window_with_one() -> None:
    """The policy each client call is made with (no request is sent: the call is a stand-in)."""
    from google.api_core import exceptions as gexc

    from ckpt_service.stores.gcs import GCSStore

    plain = GCSStore("bucket", "p")
    assert plain._run("get", lambda retry, timeout: (retry, timeout)) == (plain.retry, plain.timeout)
    assert plain._run("put", lambda r, t: (r, t), conditional=True) == (plain.conditional_retry, plain.timeout)

    start = time.time()
    bounded = GCSStore("bucket", "p", retry=plain.retry.with_delay(initial=0.01, maximum=0.05),
                       deadline=Deadline(start + 1.0, margin_s=0.0))
    retry, timeout = bounded._run("get", lambda r, t: (r, t))
    assert retry is None and 0 < timeout <= ATTEMPT_SHARE * 1.0  # the attempts are driven by the window

    attempts: list[tuple[float, float]] = []  # (sent at, its timeout)

    def unavailable(_retry: object, timeout: float) -> None:
        attempts.append((time.time(), timeout))
        raise gexc.ServiceUnavailable("try again")

    with pytest.raises(StoreDeadlineError) as info:
        bounded._run("put", unavailable)
    assert info.value.attempted and len(attempts) > 1  # retried, then gave up by the window's end
    assert all(sent + timeout <= start + 1.0 + 0.01 for sent, timeout in attempts)  # 0.01: clock reads apart
    assert time.time() <= start + 1.0 + SLACK_S

    spent = GCSStore("bucket", "p", deadline=Deadline(time.time() - 1.0))
    sent_before = len(attempts)
    with pytest.raises(StoreDeadlineError) as info:
        spent._run("put", unavailable, conditional=True)
    assert not info.value.attempted and len(attempts) == sent_before


def test_a_write_never_sent_for_lack_of_time_is_not_read_back() -> None:
    """Only a write that was sent can have been applied: one refused before sending is not ambiguous."""
    class OutOfTime(MemoryStore):
        reads = 0

        def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
            raise StoreDeadlineError("no time left; not sent", attempted=False)

        def get_versioned(self, key: str) -> tuple[bytes, int] | None:
            OutOfTime.reads += 1
            return super().get_versioned(key)

    with pytest.raises(StoreDeadlineError):
        OutOfTime().create_exclusive("commits/x", b"token")
    assert OutOfTime.reads == 0


def test_a_local_store_whose_lock_is_held_abandons_the_save_in_time(tmp_path) -> None:
    import fcntl

    from ckpt_service.stores import LocalStore

    store = LocalStore(tmp_path / "store", fsync=False)
    with CheckpointManager(store, max_to_keep=None) as mgr:
        mgr.save(1, sample_state(1))
        with open(store.root / ".hvdt.lock", "a+b") as stuck:  # another writer stuck inside the lock
            fcntl.flock(stuck, fcntl.LOCK_EX)
            deadline = time.time() + 2.0
            with pytest.raises(SaveAbandonedError, match="step 2: .*nothing was committed"):
                mgr.save(2, sample_state(2), deadline=deadline)
            assert time.time() <= deadline + SLACK_S
            fcntl.flock(stuck, fcntl.LOCK_UN)
        assert mgr.all_steps() == [1]
        assert_same_state(mgr.restore().tensors, sample_state(1))
        assert mgr.save(2, sample_state(2), deadline=time.time() + 30) is not None and mgr.all_steps() == [1, 2]


def test_waiting_for_uploads_ends_at_the_deadline_even_if_the_store_ignores_it() -> None:
    """A store whose writes hang and know nothing of deadlines: the save still returns in time."""
    release = threading.Event()

    class Hanging(MemoryStore):
        def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
            if key.startswith(layout.STEPS_PREFIX) and not release.is_set():
                release.wait()
            return super().put(key, data, if_generation_match=if_generation_match)

    with CheckpointManager(Hanging(), max_to_keep=None, io_threads=2) as mgr:
        try:
            deadline = time.time() + 1.5
            with pytest.raises(SaveAbandonedError, match="uploads were not done by the deadline"):
                mgr.save(1, sample_state(1), deadline=deadline)
            assert time.time() <= deadline + SLACK_S
        finally:
            release.set()
        assert mgr.all_steps() == []
        assert mgr.save(2, sample_state(2)) is not None


def test_a_coordinator_whose_peer_never_reports_abandons_at_the_deadline() -> None:
    with CheckpointManager(MemoryStore(), max_to_keep=None) as mgr:
        deadline = time.time() + 1.5
        with pytest.raises(SaveAbandonedError, match=r"ranks \[1\] did not report"):
            mgr.save(1, sample_state(1), rank=0, world_size=2, deadline=deadline, attempt="a1")
        assert time.time() <= deadline + SLACK_S and mgr.all_steps() == []
