"""The edges of the checkpoint API: bad arguments get a typed error before anything is written,
concurrent and failing background saves are reported, and one rank's bad input ends the save at once."""
from __future__ import annotations

import enum
import json
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
from ckpt_helpers import DelegatingStore, assert_same_state

from ckpt_service.errors import (
    BadMetadataError,
    BadPartitionError,
    BadRankError,
    BadStepError,
    BadTensorNameError,
    CheckpointError,
    StructureMismatchError,
    WriterFailedError,
)
from ckpt_service.manager import CheckpointManager, prepare_share
from ckpt_service.manifest import checked_metadata
from ckpt_service.plan import SavePlan, UnsupportedDtypeError, spec_of
from ckpt_service.stores import LocalStore, MemoryStore, ObjectStore
from hvd_transient.cli.ckpt import main as ckpt_main

STATE = {"a": np.arange(10, dtype=np.float32), "b": np.ones((2, 3), dtype=np.int64), "c": np.zeros(4, np.float64)}


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def mgr(store: MemoryStore):
    with CheckpointManager(store, max_to_keep=None) as manager:
        yield manager


def written(store: ObjectStore) -> list[str]:
    return list(store.list(""))


class GatedStore(DelegatingStore):
    """Holds every piece upload until ``gate`` is set, so that a background save stays in flight."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.gate = threading.Event()

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if "/data/" in key:
            assert self.gate.wait(60), "the test never opened the gate"
        return super().put(key, data, if_generation_match=if_generation_match)


# ------------------------------------------------------------------ steps, ranks, coordinators


@pytest.mark.parametrize("step", [5.0, "5", True, np.bool_(True), -1, None, 2**70 * 1.0])
def test_a_step_that_is_not_a_non_negative_integer_is_refused_before_anything_is_written(mgr, store, step) -> None:
    for call in (lambda: mgr.save(step, STATE), lambda: mgr.save_async(step, STATE)):
        with pytest.raises(BadStepError, match="non-negative integers"):
            call()
    assert written(store) == []
    if step is not None:  # restore(None) is the latest step
        with pytest.raises(BadStepError):
            mgr.restore(step)
    with pytest.raises(BadStepError):
        mgr.delete(step)


def test_numpy_integer_steps_save_restore_and_delete(mgr) -> None:
    assert mgr.save(np.int64(7), STATE) is not None
    assert mgr.save_async(np.uint32(8), STATE) and mgr.wait(timeout=60) is not None
    assert mgr.all_steps() == [7, 8] and all(type(s) is int for s in mgr.all_steps())
    assert mgr.restore(np.int32(7)).step == 7
    mgr.delete(np.int64(7))
    assert mgr.all_steps() == [8]
    assert isinstance(BadStepError("x"), (CheckpointError, ValueError, TypeError))


@pytest.mark.parametrize("rank,world_size,coordinator,what", [
    (0, 2, 2, "coordinator 2"), (0, 2, -1, "coordinator -1"), (0, 2, 1.0, "coordinator 1.0"),
    (2, 2, 0, "rank 2"), (-1, 2, 0, "rank -1"), (0, 0, 0, "world_size 0"), (0, True, 0, "world_size True"),
])
def test_ranks_outside_the_world_are_refused_before_anything_is_written(mgr, store, rank, world_size, coordinator,
                                                                         what) -> None:
    kwargs = {"rank": rank, "world_size": world_size, "coordinator": coordinator}
    with pytest.raises(BadRankError, match=what):
        mgr.save(1, STATE, **kwargs)
    with pytest.raises(BadRankError, match=what):
        mgr.save_async(1, STATE, **kwargs)
    assert written(store) == [] and not mgr.save_in_flight


# ------------------------------------------------------------------ concurrent and failing background saves


def test_a_save_async_call_while_another_is_starting_one_does_not_start_a_second(store) -> None:
    gated = GatedStore(store)  # keeps the started save in flight until the gate opens
    entered, release = threading.Event(), threading.Event()
    results: dict[int, bool] = {}

    def snapshot(plan: SavePlan, rank: int) -> list[np.ndarray]:
        entered.set()
        assert release.wait(60)  # holds the first call between its busy check and its start
        return [flat for _item, flat in prepare_share(plan, rank, STATE)]

    mgr = CheckpointManager(gated, max_to_keep=None)
    try:
        first = threading.Thread(target=lambda: results.update({1: mgr.save_async(1, STATE, snapshot=snapshot)}))
        first.start()
        assert entered.wait(60)
        assert mgr.save_async(2, STATE) is False  # at once: neither a second save nor a wait behind the first
        release.set()
        first.join(60)
        assert results == {1: True} and mgr.save_in_flight
        assert mgr.save_async(3, STATE) is False
        gated.gate.set()
        assert mgr.wait(timeout=60) is not None
        assert mgr.all_steps() == [1]
    finally:
        release.set()
        gated.gate.set()
        mgr.close()


def test_two_threads_calling_save_async_at_once_start_one_save(store) -> None:
    gated = GatedStore(store)
    barrier = threading.Barrier(2)
    results: dict[int, bool] = {}

    def call(step: int) -> None:
        barrier.wait(60)
        results[step] = mgr.save_async(step, STATE)

    mgr = CheckpointManager(gated, max_to_keep=None)
    try:
        threads = [threading.Thread(target=call, args=(step,)) for step in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results.values()) == [False, True], results  # at most one save in flight
        gated.gate.set()
        assert mgr.wait(timeout=60) is not None
        assert mgr.all_steps() == [next(step for step, ok in results.items() if ok)]
    finally:
        gated.gate.set()
        mgr.close()


def test_save_async_that_waits_logs_the_previous_failure_and_starts_the_new_save(store, caplog) -> None:
    release = threading.Event()

    class Released(logging.Handler):  # the failing save ends only once the next caller waits for it
        def emit(self, record: logging.LogRecord) -> None:
            if "waits for the previous save" in record.getMessage():
                release.set()

    def failing_gather(record):
        assert release.wait(60)
        raise RuntimeError("network down")

    handler = Released()
    logging.getLogger("ckpt_service.writer").addHandler(handler)
    try:
        with CheckpointManager(store, max_to_keep=None) as mgr, caplog.at_level(logging.INFO):
            assert mgr.save_async(1, STATE, gather=failing_gather)
            assert mgr.save_async(2, STATE, if_busy="wait")  # neither raises the old error nor drops this save
            assert mgr.wait(timeout=60) is not None
            assert mgr.all_steps() == [2]
    finally:
        logging.getLogger("ckpt_service.writer").removeHandler(handler)
    failures = [r for r in caplog.records if "previous background checkpoint failed" in r.getMessage()]
    assert len(failures) == 1 and "network down" in failures[0].getMessage()


# ------------------------------------------------------------------ metadata


@pytest.mark.parametrize("metadata,named", [
    ({"loss": float("nan")}, "metadata['loss']"),
    ({"sched": {"lrs": [0.1, float("inf")]}}, "metadata['sched']['lrs'][1]"),
    ({"lr": np.float32(0.1)}, "metadata['lr'] is of type float32"),
    ({1: "a", "1": "b"}, "key 1 of type int"),
    ({"nested": {2.5: 1}}, "metadata['nested'] has the key 2.5"),
])
def test_metadata_that_is_not_strict_json_is_refused_naming_the_entry(mgr, store, metadata, named) -> None:
    with pytest.raises(BadMetadataError) as raised:
        mgr.save(1, STATE, metadata)
    assert named in str(raised.value)
    assert written(store) == []


def test_metadata_that_contains_itself_is_refused(mgr) -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(BadMetadataError, match="contains itself"):
        mgr.save(1, STATE, {"loop": loop})


def test_strict_json_metadata_round_trips(mgr) -> None:
    metadata = {"epoch": 3, "lr": np.float64(0.5), "ok": True, "none": None, "t": (1, 2), "d": {"x": [1.5]}}
    mgr.save(1, STATE, metadata)
    assert mgr.restore().metadata == {"epoch": 3, "lr": 0.5, "ok": True, "none": None, "t": [1, 2], "d": {"x": [1.5]}}


class Epochs(enum.IntEnum):
    THIRD = 3


@pytest.mark.parametrize("metadata", [
    {"step": 1200, "world_size": 2, "lr": 0.01, "ok": True, "none": None, "name": "run\u00e9", "big": 2**70,
     "neg": -0.0},
    {"lr": np.float64(0.5), "epoch": Epochs.THIRD},  # subclasses of float and int: the full check
    {"t": (1, 2), "d": {"x": [1.5]}},
    {},
])
def test_checked_metadata_is_the_json_round_trip(metadata) -> None:
    """Flat metadata is copied without the round trip (the common case, on the training thread): same result."""
    expected = json.loads(json.dumps(metadata, allow_nan=False))
    copied = checked_metadata(metadata)
    assert copied == expected and copied is not metadata
    assert [type(v) for v in copied.values()] == [type(v) for v in expected.values()]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_flat_metadata_with_a_non_finite_float_is_refused(value: float) -> None:
    with pytest.raises(BadMetadataError, match=r"metadata\['loss'\]"):
        checked_metadata({"step": 1, "loss": value})


@pytest.mark.parametrize("asynchronous", [False, True])
def test_bad_metadata_on_one_rank_ends_the_save_of_every_rank_at_once(asynchronous: bool) -> None:
    """The coordinator abandons the step on the bad rank's error record, not after its gather timeout."""
    store = MemoryStore()
    managers = [CheckpointManager(store, max_to_keep=None, gather_timeout_s=3600.0) for _ in range(2)]
    outcome: dict[str, BaseException | None] = {}

    def coordinator() -> None:
        try:
            managers[0].save(2, STATE, {"epoch": 1}, rank=0, world_size=2, attempt="a1")
            outcome["rank0"] = None
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome["rank0"] = exc

    try:
        thread = threading.Thread(target=coordinator)
        thread.start()
        with pytest.raises(BadMetadataError, match="float32"):
            if asynchronous:
                managers[1].save_async(2, STATE, {"lr": np.float32(0.1)}, rank=1, world_size=2, attempt="a1")
            else:
                managers[1].save(2, STATE, {"lr": np.float32(0.1)}, rank=1, world_size=2, attempt="a1")
        thread.join(timeout=120)  # a hang guard only: without the error record it would wait an hour
        assert not thread.is_alive()
        assert isinstance(outcome["rank0"], WriterFailedError)
        assert "rank 1: BadMetadataError" in str(outcome["rank0"])
        assert managers[0].all_steps() == []
    finally:
        for m in managers:
            m.close()


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype", ["longdouble", "clongdouble"])
def test_extended_precision_is_an_unsupported_dtype(mgr, store, dtype: str) -> None:
    array = np.zeros(3, dtype=dtype)
    if array.dtype in (np.dtype("float64"), np.dtype("complex128")):
        pytest.skip("long double is double on this platform")
    with pytest.raises(UnsupportedDtypeError, match="float .16, 32 or 64 bits"):
        spec_of("x", array)
    with pytest.raises(UnsupportedDtypeError, match=str(array.dtype)):
        mgr.save(1, {"x": array})
    assert written(store) == []


# ------------------------------------------------------------------ restores


@pytest.mark.parametrize("partition", [(2, 2), (-1, 2), (1.5, 2), (0, 0), (True, 2), (0, 1, 2), "01", 3])
def test_a_bad_partition_is_a_typed_error_naming_the_valid_form(mgr, partition) -> None:
    mgr.save(1, STATE)
    with pytest.raises(BadPartitionError, match=r"0 <= reader < readers"):
        mgr.restore(partition=partition)


def test_partitions_of_numpy_integers_cover_the_state(mgr) -> None:
    mgr.save(1, STATE)
    merged: dict[str, np.ndarray] = {}
    for reader in np.arange(3):
        merged.update(mgr.restore(partition=(reader, np.int64(3))).tensors)
    assert_same_state(merged, STATE)


def test_expected_structure_is_compared_with_the_named_tensors_only(mgr) -> None:
    mgr.save(1, STATE)
    ckpt = mgr.restore(names=iter(["a"]), expected={"a": STATE["a"]})  # "b" and "c" are stored, not restored
    assert_same_state(ckpt.tensors, {"a": STATE["a"]})
    with pytest.raises(StructureMismatchError, match="b: expected but not among the names restored"):
        mgr.restore(names=["a"], expected={"a": STATE["a"], "b": STATE["b"]})
    with pytest.raises(StructureMismatchError, match="zz: missing from the checkpoint"):
        mgr.restore(names=["a"], expected={"a": STATE["a"], "zz": STATE["b"]})
    with pytest.raises(StructureMismatchError, match=r"not expected but restored: \['a'\]"):
        mgr.restore(names=["a", "c"], expected={"c": STATE["c"]})
    with pytest.raises(StructureMismatchError, match="a: stored"):
        mgr.restore(names=["a"], expected={"a": ((10,), "float64")})
    with pytest.raises(StructureMismatchError, match=r"not expected but stored: \['b', 'c'\]"):
        mgr.restore(expected={"a": STATE["a"]})  # without names, the whole stored structure


# ------------------------------------------------------------------ export


def test_export_of_a_tensor_named_file(tmp_path: Path, capsys) -> None:
    state = {"file": np.arange(3.0), "a/b:0": np.ones(2, np.int8), "x.npy": np.zeros(1)}
    with CheckpointManager(LocalStore(tmp_path / "store"), max_to_keep=None) as mgr:
        mgr.save(4, state, {"epoch": 1})
    out = tmp_path / "out"  # .npz is appended, as np.savez does
    assert ckpt_main(["export", str(tmp_path / "store"), "--step", "4", str(out)]) == 0
    assert str(out) + ".npz" in capsys.readouterr().out
    with np.load(str(out) + ".npz", allow_pickle=False) as data:
        assert_same_state({k: data[k] for k in data.files if k != "__metadata__"}, state)
        assert json.loads(str(data["__metadata__"])) == {"epoch": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npz", "store"]


def test_export_of_a_tensor_named_like_the_metadata_entry_is_refused(tmp_path: Path, capsys) -> None:
    with CheckpointManager(LocalStore(tmp_path / "store"), max_to_keep=None) as mgr:
        mgr.save(4, {"__metadata__": np.arange(3.0), "w": np.ones(2)})
    out = tmp_path / "out.npz"
    assert ckpt_main(["export", str(tmp_path / "store"), "--step", "4", str(out)]) != 0
    assert "'__metadata__'" in capsys.readouterr().err
    assert not out.exists()
    assert issubclass(BadTensorNameError, ValueError)
