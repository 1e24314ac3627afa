"""The edges of the checkpoint API: bad arguments get a typed error before anything is written,
concurrent and failing background saves are reported, and one rank's bad input ends the save at once."""
from __future__ import annotations

import numpy as np
import pytest

from ckpt_service.errors import BadMetadataError
from ckpt_service.manager import CheckpointManager
from ckpt_service.plan import UnsupportedDtypeError, spec_of
from ckpt_service.stores import MemoryStore, ObjectStore

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
