"""The edges of the checkpoint API: bad arguments get a typed error before anything is written,
concurrent and failing background saves are reported, and one rank's bad input ends the save at once."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from ckpt_helpers import assert_same_state

from ckpt_service.cli import main as ckpt_main
from ckpt_service.errors import (
    BadMetadataError,
    BadTensorNameError,
)
from ckpt_service.manager import CheckpointManager
from ckpt_service.plan import UnsupportedDtypeError, spec_of
from ckpt_service.stores import LocalStore, MemoryStore, ObjectStore

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
