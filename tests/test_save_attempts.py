"""Every save attempt has an identity, and a commit names data of one attempt only.

A step saved twice (a coordinator that died, a rollback, the step saved again) must commit one
attempt's data or nothing; writers that disagree on the step, the attempt or the state must
commit nothing; a multi-writer save through the store must say which attempt it is.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable

import numpy as np
import pytest
from ckpt_helpers import make_backend_store
from fake_collectives import FakeCollectives, ThreadGroup

from ckpt_service import layout
from ckpt_service.errors import (
    BadAttemptError,
    CheckpointError,
    IncompleteShardRecordsError,
    MismatchedShardRecordsError,
    SaveAbandonedError,
)
from ckpt_service.manager import CheckpointManager
from ckpt_service.plan import SavePlan, make_save_plan, specs_of
from ckpt_service.stores import MemoryStore, ObjectStore
from ckpt_service.testing.delegating import DelegatingStore

pytestmark = pytest.mark.timed  # bounds wall-clock times

N = 40_000  # float32 elements per tensor: two tensors make five pieces over two writers


def filled(value: float) -> dict[str, np.ndarray]:
    return {"a": np.full(N, value, np.float32), "b": np.full(N, value, np.float32)}


def values_of(ckpt_tensors: dict[str, np.ndarray]) -> set[float]:
    return {float(v) for arr in ckpt_tensors.values() for v in np.unique(arr)}


def run_ranks(*calls: Callable[[], Any]) -> list[Any]:
    """Run each call on its own thread; return results (exceptions are returned, not raised)."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return results


def nothing_of(store: ObjectStore, step: int) -> bool:
    """No commit marker and no manifest of ``step``."""
    return (not store.exists(layout.commit_key(step))
            and not any("/manifest." in k for k in store.list(layout.step_prefix(step))))


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path) -> ObjectStore:
    return make_backend_store(request.param, tmp_path, request)


# ------------------------------------------------------------------ a replayed step (store gather)

def test_a_replay_does_not_pick_up_the_records_of_an_abandoned_attempt(store) -> None:
    """Rank 1 of 2 saves step 5 (1.0) and its coordinator never commits; rank 0 then saves step 5
    again (2.0) in another attempt: it must not gather rank 1's old record."""
    with CheckpointManager(store, max_to_keep=None, gather_timeout_s=1.0) as mgr:
        assert mgr.save(5, filled(1.0), rank=1, world_size=2, attempt="ring-a-5-0") is None  # not the coordinator
        with pytest.raises(SaveAbandonedError, match=r"ranks \[1\] did not report"):
            mgr.save(5, filled(2.0), rank=0, world_size=2, attempt="ring-b-5-0")
        assert mgr.all_steps() == [] and nothing_of(store, 5)


def test_a_replay_commits_only_its_own_attempts_data(store) -> None:
    """The abandoned attempt's record stays in the store while the replay's coordinator polls; the
    replay's own rank 1 reports late (once the coordinator has read what its first listing found):
    only 2.0 is committed."""
    listed = threading.Event()
    listings = []

    class Watching(DelegatingStore):  # the coordinator's view: says when it lists records a second time
        def list(self, prefix: str = ""):
            if "/records/" in prefix:
                listings.append(prefix)
                if len(listings) == 2:
                    listed.set()
            return self.inner.list(prefix)

    with CheckpointManager(store, max_to_keep=None) as old, \
            CheckpointManager(Watching(store), max_to_keep=None, gather_timeout_s=60) as rank0, \
            CheckpointManager(store, max_to_keep=None) as rank1:
        old.save(5, filled(1.0), rank=1, world_size=2, attempt="ring-a-5-0")

        def late_rank1() -> object:
            assert listed.wait(20), "the coordinator never looked for records twice"
            return rank1.save(5, filled(2.0), rank=1, world_size=2, attempt="ring-b-5-0")

        manifest, other = run_ranks(lambda: rank0.save(5, filled(2.0), rank=0, world_size=2, attempt="ring-b-5-0"),
                                    late_rank1)
        assert other is None and manifest is not None and manifest.step == 5
        assert values_of(rank0.restore(5).tensors) == {2.0}
        assert {p.writer for p in manifest.pieces} == {0, 1}


def test_a_failed_record_of_an_abandoned_attempt_does_not_abandon_the_replay(store) -> None:
    def broken(plan: SavePlan, rank: int) -> list[np.ndarray]:
        raise RuntimeError("device lost")

    with CheckpointManager(store, max_to_keep=None) as mgr, CheckpointManager(store, max_to_keep=None) as peer:
        with pytest.raises(RuntimeError, match="device lost"):
            mgr.save(5, filled(1.0), rank=1, world_size=2, snapshot=broken, attempt="ring-a-5-0")
        failed = [k for k in store.list(layout.step_prefix(5) + "records/")]
        assert failed == [layout.record_key(5, "ring-a-5-0", 1)]  # the error record the replay must ignore
        body = json.loads(store.get(failed[0]))  # it names its save: step, attempt and plan
        assert (body["step"], body["attempt"], body["error"]) == (5, "ring-a-5-0", "RuntimeError: device lost")
        assert body["plan"] == mgr.plan(specs_of(filled(1.0)), 2).digest
        manifest, other = run_ranks(lambda: mgr.save(5, filled(2.0), rank=0, world_size=2, attempt="ring-b-5-0"),
                                    lambda: peer.save(5, filled(2.0), rank=1, world_size=2, attempt="ring-b-5-0"))
        assert manifest is not None and other is None
        assert values_of(mgr.restore().tensors) == {2.0}


# ------------------------------------------------------------------ writers that disagree

def collective_save(store: ObjectStore, saves: list[dict[str, Any]],
                    tamper: Callable[[int, dict[str, Any]], dict[str, Any]] | None = None) -> list[Any]:
    """Each entry of ``saves`` is one rank's save keywords; records meet through an in-process allgather."""
    group = ThreadGroup(len(saves))
    managers = [CheckpointManager(store, max_to_keep=None) for _ in saves]

    def gather_of(rank: int) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
        comm = FakeCollectives(group, rank)
        return lambda record: comm.allgather_json(tamper(rank, record) if tamper else record)

    try:
        return run_ranks(*(lambda r=r: managers[r].save(  # type: ignore[misc]
            rank=r, world_size=len(saves), gather=gather_of(r), **saves[r]) for r in range(len(saves))))
    finally:
        for m in managers:
            m.close()


@pytest.fixture
def committed() -> tuple[ObjectStore, CheckpointManager]:
    store = MemoryStore()
    mgr = CheckpointManager(store, max_to_keep=None)
    mgr.save(1, filled(1.0))
    yield store, mgr
    mgr.close()


def assert_rejected(outcome: Any, *names: str) -> None:
    assert isinstance(outcome, MismatchedShardRecordsError), outcome
    assert isinstance(outcome, IncompleteShardRecordsError) and isinstance(outcome, ValueError)
    assert isinstance(outcome, CheckpointError)
    for name in names:
        assert name in str(outcome), (name, str(outcome))


def test_writers_of_different_states_commit_nothing(committed) -> None:
    """{a, b} on rank 0, {c} on rank 1: the same dtype and size, so the piece ranges agree; the plans do not."""
    store, mgr = committed
    two = {"a": np.full(N, 2.0, np.float32), "b": np.full(N, 2.0, np.float32)}
    one = {"c": np.full(2 * N, 3.0, np.float32)}
    plans = [make_save_plan(specs_of(s), 2) for s in (two, one)]
    assert [(i.group, i.index, i.start, i.stop) for i in plans[0].items] == \
        [(i.group, i.index, i.start, i.stop) for i in plans[1].items]  # what the coverage check alone compares
    coordinator, _ = collective_save(store, [dict(step=2, tensors=two), dict(step=2, tensors=one)])
    assert_rejected(coordinator, "rank 1", "planned another state")
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1 and nothing_of(store, 2)
    assert values_of(mgr.restore().tensors) == {1.0}


def test_writers_of_different_steps_commit_nothing(committed) -> None:
    store, mgr = committed
    coordinator, _ = collective_save(store, [dict(step=10, tensors=filled(2.0)), dict(step=11, tensors=filled(2.0))])
    assert_rejected(coordinator, "rank 1 wrote step 11")
    assert mgr.all_steps() == [1] and nothing_of(store, 10) and nothing_of(store, 11)
    mgr.gc()
    assert mgr.verify(1).ok


def test_writers_of_different_attempts_commit_nothing(committed) -> None:
    store, mgr = committed
    coordinator, _ = collective_save(store, [dict(step=2, tensors=filled(2.0), attempt="x-2-0"),
                                             dict(step=2, tensors=filled(2.0), attempt="x-2-1")])
    assert_rejected(coordinator, "rank 1 wrote attempt 'x-2-1'")
    assert mgr.all_steps() == [1] and nothing_of(store, 2)


def test_pieces_outside_the_step_or_of_another_writer_commit_nothing(committed) -> None:
    store, mgr = committed

    def elsewhere(rank: int, record: dict[str, Any]) -> dict[str, Any]:
        if rank != 1:
            return record
        moved = [{**p, "key": p["key"].replace(layout.step_prefix(2), layout.step_prefix(3))} for p in record["pieces"]]
        return {**record, "pieces": moved}

    def stolen(rank: int, record: dict[str, Any]) -> dict[str, Any]:
        return {**record, "pieces": [{**p, "writer": 0} for p in record["pieces"]]} if rank == 1 else record

    coordinator, _ = collective_save(store, [dict(step=2, tensors=filled(2.0))] * 2, tamper=elsewhere)
    assert_rejected(coordinator, "rank 1's piece", "lies outside step 2")
    coordinator, _ = collective_save(store, [dict(step=2, tensors=filled(2.0))] * 2, tamper=stolen)
    assert_rejected(coordinator, "rank 1's piece", "names writer 0")
    assert mgr.all_steps() == [1] and nothing_of(store, 2)


def test_records_of_an_older_version_are_rejected(committed) -> None:
    store, mgr = committed

    def old(rank: int, record: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in record.items() if k not in ("step", "attempt", "plan")}

    coordinator, _ = collective_save(store, [dict(step=2, tensors=filled(2.0))] * 2, tamper=old)
    assert_rejected(coordinator, "names no step")
    assert mgr.all_steps() == [1] and nothing_of(store, 2)


def test_writers_that_agree_commit_through_a_collective_with_or_without_an_attempt(committed) -> None:
    store, mgr = committed
    for step, attempt in ((2, None), (3, "ring-3-0")):
        manifest, other = collective_save(store, [dict(step=step, tensors=filled(float(step)), attempt=attempt)] * 2)
        assert manifest is not None and other is None, (manifest, other)
    assert mgr.all_steps() == [1, 2, 3] and values_of(mgr.restore(3).tensors) == {3.0}


# ------------------------------------------------------------------ the attempt id itself

class Recording(DelegatingStore):
    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.puts: list[str] = []

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        self.puts.append(key)
        return super().put(key, data, if_generation_match=if_generation_match)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_multi_writer_store_gather_save_without_an_attempt_writes_nothing(rank: int) -> None:
    store = Recording(MemoryStore())
    with CheckpointManager(store, max_to_keep=None) as mgr:
        with pytest.raises(BadAttemptError, match="needs attempt=") as info:
            mgr.save(5, filled(1.0), rank=rank, world_size=2)
        assert isinstance(info.value, ValueError) and isinstance(info.value, CheckpointError)
        with pytest.raises(BadAttemptError, match="needs attempt="):
            mgr.save_async(5, filled(1.0), rank=rank, world_size=2)

        def broken(plan: SavePlan, r: int) -> list[np.ndarray]:
            raise RuntimeError("device lost")  # not even a failed share's record may be written

        with pytest.raises(BadAttemptError):
            mgr.save(5, filled(1.0), rank=rank, world_size=2, snapshot=broken)
        assert not mgr.save_in_flight
    assert store.puts == [] and list(store.inner.list("")) == []


@pytest.mark.parametrize("attempt", ["", ".", "..", "-x", "a/b", "a b", "x" * 65, "é"])
def test_an_attempt_unusable_in_keys_is_refused_before_anything_is_written(attempt: str) -> None:
    store = Recording(MemoryStore())
    with CheckpointManager(store, max_to_keep=None) as mgr:
        with pytest.raises(BadAttemptError, match="not usable in store keys"):
            mgr.save(5, filled(1.0), rank=1, world_size=2, attempt=attempt)
        with pytest.raises(BadAttemptError, match="not usable in store keys"):
            mgr.save(5, filled(1.0), attempt=attempt)  # checked on single-writer saves too
    assert store.puts == []


def test_single_writer_saves_need_no_attempt_and_records_go_under_the_attempt() -> None:
    store = Recording(MemoryStore())
    with CheckpointManager(store, max_to_keep=None) as mgr:
        assert mgr.save(1, filled(1.0)) is not None  # one writer: no gather at all
        assert not any("/records/" in k for k in store.puts)
        run_ranks(lambda: mgr.save(2, filled(2.0), rank=0, world_size=2, attempt="r.1_x-2-0"),
                  lambda: mgr.save(2, filled(2.0), rank=1, world_size=2, attempt="r.1_x-2-0"))
        assert sorted(k for k in store.puts if "/records/" in k) == [
            layout.step_prefix(2) + "records/r.1_x-2-0/rank-00000.json",
            layout.step_prefix(2) + "records/r.1_x-2-0/rank-00001.json"]
        assert mgr.all_steps() == [1, 2]


def test_the_plan_digest_is_stable_and_names_the_plan() -> None:
    specs = specs_of(filled(1.0))
    plan = make_save_plan(specs, 2)
    assert plan.digest == make_save_plan(list(reversed(specs)), 2).digest  # order-free, like the plan
    assert len(plan.digest) == 64 and plan.digest is plan.digest  # computed once
    assert plan.digest != make_save_plan(specs, 3).digest
    assert plan.digest != make_save_plan(specs_of({"c": np.zeros(2 * N, np.float32)}), 2).digest
    # pinned: the same plan has the same digest in every process (no hash seeds, no object ids)
    assert make_save_plan(specs_of({"w": np.zeros(4, np.float32)}), 1).digest == (
        "793e20185d97ae9756097fb7d53db393dc9ad0b9223d73a89ec38862785f5731")
