"""The plugin's saves name their attempt: a step replayed after its coordinator died commits one attempt's data.

The ranks run TransientImpl over the in-process fake collectives, each with its own view of one
shared store. In the first attempt of a step's background save, the checkpoint master "dies":
its store view refuses its shard record, so the others' records stay behind uncommitted. The
step is then saved again (after a reset on the same objects, after a relaunch with fresh ones,
or on a ring that shrank) with other data, and the new attempt's rank 1 reports only after its
coordinator has looked at the records and read what it found: the old attempt's records are
there to be misread.
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Iterator

import numpy as np
import pytest
from fake_collectives import FakeCollectives, FakeWatcher, ThreadGroup

from ckpt_service import layout
from ckpt_service.errors import StoreUnavailableError
from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import MemoryStore, ObjectStore
from ckpt_service.testing.delegating import DelegatingStore
from hvd_transient.core.config import TransientConfig
from hvd_transient.core.ring import ring_id
from hvd_transient.core.transient import TransientImpl
from hvd_transient.watchers import Notice

STEP = 4
N = 30_000


def state(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(N, value, np.float32), "v": np.full(N, value, np.float32), "i": np.full(9, value, np.int64)}


class View(DelegatingStore):
    """One rank's view of the shared store: it can refuse this rank's shard records (the rank dies
    before reporting), hold them back until ``gate`` is set, and set ``listed`` when it lists shard
    records a second time (it is a coordinator that has read all it found at its first look)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.refuse_records = False
        self.gate: threading.Event | None = None
        self.listed: threading.Event | None = None
        self.listings = 0

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if "/records/" in key:
            if self.refuse_records:
                raise StoreUnavailableError(f"injected: this rank is gone before writing {key}")
            if self.gate is not None:
                assert self.gate.wait(20), "the coordinator never looked for records twice"
        return super().put(key, data, if_generation_match=if_generation_match)

    def list(self, prefix: str = "") -> Iterator[str]:
        if "/records/" in prefix and self.listed is not None:
            self.listings += 1
            if self.listings == 2:
                self.listed.set()
        return super().list(prefix)


class Ring:
    def __init__(self, store: ObjectStore, hosts: list[str], kind: str,
                 impls: list[TransientImpl] | None = None) -> None:
        self.group = ThreadGroup(len(hosts))
        self.kind = kind
        config = TransientConfig(store=store.url, save_every_steps=STEP if kind == "periodic" else None,
                                 check_every_steps=1, async_gather_timeout_s=60.0)
        if impls is None:
            impls = [TransientImpl(config, FakeCollectives(self.group, r), host=h, watcher=FakeWatcher(),
                                   manager=CheckpointManager(View(store), max_to_keep=None, gather_timeout_s=60.0))
                     for r, h in enumerate(hosts)]
        for r, impl in enumerate(impls):
            impl.comm = FakeCollectives(self.group, r)
        self.impls = impls

    def view(self, rank: int) -> View:
        store = self.impls[rank].manager.store
        assert isinstance(store, View)
        return store

    def begin(self, step: int) -> None:
        self.group.run(lambda r: self.impls[r].begin(step))

    def save_step(self, value: float, warned: int) -> list[BaseException | None]:
        """Run step STEP (a periodic save, or an early one answering ``warned``'s warning: a rank answers
    its warning once, so each attempt warns another rank); wait for it."""
        if self.kind == "early":
            now = time.time()
            self.impls[warned].watcher.warning = Notice("aws", "vm", now, now + 120, "rebalance-recommendation",
                                                        early=True)
        self.group.run(lambda r: self.impls[r].after_step(STEP, lambda: state(value), lambda: {"value": value}))
        errors: list[BaseException | None] = []
        for impl in self.impls:
            try:
                impl.manager.wait(timeout=120)
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                errors.append(exc)
        return errors

    def ring_ids(self) -> set[str]:
        return {[e for e in i.events.events if e["event"] == "ring"][-1]["ring"] for i in self.impls}


def first_attempt_without_its_master(ring: Ring, warned: int = 1) -> str:
    """Step STEP with 1.0 everywhere; the master dies before reporting, so nothing commits."""
    ring.view(0).refuse_records = True
    errors = ring.save_step(1.0, warned=warned)
    assert isinstance(errors[0], StoreUnavailableError) and errors[1:] == [None] * (len(errors) - 1)
    ring.view(0).refuse_records = False
    [rid] = ring.ring_ids()
    return rid


def replay(ring: Ring, warned: int) -> None:
    """Step STEP again with 2.0; rank 1 reports after the coordinator has looked for records."""
    listed = threading.Event()
    ring.view(0).listed = listed
    ring.view(1).gate = listed
    assert ring.save_step(2.0, warned=warned) == [None] * len(ring.impls)


def assert_one_attempt_committed(store: ObjectStore, writers: int) -> None:
    with CheckpointManager(store, max_to_keep=None) as mgr:
        assert mgr.all_steps() == [STEP]
        ckpt = mgr.restore(STEP)
        assert ckpt.manifest.world_size == writers and ckpt.metadata == {"value": 2.0}
        assert {float(v) for arr in ckpt.tensors.values() for v in np.unique(arr)} == {2.0}


@pytest.fixture
def store() -> ObjectStore:
    return MemoryStore(uuid.uuid4().hex)


@pytest.mark.parametrize("kind", ["periodic", "early"])
def test_a_replay_after_a_reset_commits_one_attempt(store, kind) -> None:
    ring = Ring(store, ["h0", "h1", "h2"], kind)
    ring.begin(0)
    first = first_attempt_without_its_master(ring)
    ring.group.run(lambda r: ring.impls[r].note_reset(STEP - 1))
    ring.begin(STEP - 1)  # the same processes roll back and start again
    [second] = ring.ring_ids()
    assert second != first
    replay(ring, warned=2)
    assert_one_attempt_committed(store, 3)


@pytest.mark.parametrize("kind", ["periodic", "early"])
def test_a_replay_after_a_relaunch_commits_one_attempt(store, kind) -> None:
    hosts = ["h0", "h1", "h2"]
    ring = Ring(store, hosts, kind)
    ring.begin(0)
    first = first_attempt_without_its_master(ring)
    relaunched = Ring(store, hosts, kind)  # fresh processes on the same hosts
    relaunched.begin(STEP - 1)
    [second] = relaunched.ring_ids()
    assert second != first
    replay(relaunched, warned=1)
    assert_one_attempt_committed(store, 3)


@pytest.mark.parametrize("kind", ["periodic", "early"])
def test_a_replay_on_a_ring_that_shrank_commits_one_attempt(store, kind) -> None:
    ring = Ring(store, ["h0", "h1", "h2"], kind)
    ring.begin(0)
    first_attempt_without_its_master(ring, warned=2)  # h2: h1 gets the warning of the replay
    survivors = Ring(store, ["h1", "h2"], kind, impls=ring.impls[1:])  # h0 is gone: h1 is rank 0, the master
    survivors.begin(STEP - 1)
    assert [i.run.master for i in survivors.impls] == [0, 0]
    replay(survivors, warned=0)
    assert_one_attempt_committed(store, 2)


def test_every_rank_of_a_ring_derives_the_same_attempt_ids(store) -> None:
    ring = Ring(store, ["h0", "h1", "h2"], "periodic")
    ring.begin(0)
    ids = ring.ring_ids()
    assert len(ids) == 1
    [rid] = ids
    assert ring.save_step(1.0, warned=0) == [None] * 3
    records = sorted(store.list(layout.step_prefix(STEP) + "records/"))
    assert records == [layout.record_key(STEP, f"{rid}-{STEP}-0", r) for r in range(3)]
    ring.begin(STEP)
    assert len(ring.ring_ids()) == 1 and ring.ring_ids() != ids  # a new begin, a new ring id, the same members


def test_the_ring_id_is_a_function_of_the_members_in_rank_order() -> None:
    members = [("h0", "aa"), ("h1", "bb")]
    assert ring_id(members) == ring_id(list(members))
    assert ring_id(members) != ring_id(members[::-1]) and ring_id(members) != ring_id([("h0", "aa"), ("h1", "cc")])
    assert len(ring_id(members)) == 12 and ring_id(members).isalnum()
