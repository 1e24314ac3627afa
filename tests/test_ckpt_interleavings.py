"""Stateful property test of the checkpoint service: random interleavings of saves by several writers,
replays of a step, kills between any two store calls, lease steals, a master paused between its
fence and its commit marker, a background save racing a later save of the same process, gc (also
while a save is paused before its marker), a damaged commit, listing and read errors, the run moved
to another kind of store, and restores with and without partitions.

The invariant after every rule: ``restore()`` returns exactly the data of one attempt of the newest
commit that verifies (of the commit markers that landed and are still in the store, not damaged: the
highest step that no lower step's commit supersedes), or raises a typed error when nothing is
committed; partitioned readers without a step each return that step or raise, and the step
``restorable_step()`` picks gives them one attempt of it; and the newest commit that verified at the
previous check was not deleted unless a newer commit took its place.

"Processes" are managers and leases over one shared store, each through a :class:`FaultStore` that
can kill it (a BaseException, so no handler of the service runs, as with a killed process) before
or after any store call; a killed process is replaced by a fresh one, as a relaunch would.
Every attempt fills every tensor with its own value, so a restored mix of attempts shows.
"""
from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from ckpt_helpers import DelegatingStore
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from ckpt_service.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NothingToRestoreError,
    StoreListingError,
    StoreUnavailableError,
)
from ckpt_service.lease import Lease
from ckpt_service.manager import CheckpointManager
from ckpt_service.manifest import Order
from ckpt_service.stores import LocalStore, MemoryStore, ObjectStore

pytestmark = pytest.mark.timed  # bounds wall-clock times

PROCESSES = 3
STEPS = st.integers(1, 6)
WAIT_S = 20.0  # a bound on every wait of the test itself: hitting it is a hang, a failure


class Killed(BaseException):
    """The process died here (not an Exception: nothing in the service may handle it)."""


@dataclass
class Ledger:
    """What really landed: every commit-marker write the store applied, by marker bytes."""

    markers: dict[bytes, tuple[int, Order | None, float]] = field(default_factory=dict)  # -> step, order, fill
    damaged: set[bytes] = field(default_factory=set)  # markers of commits whose data was damaged
    lock: threading.Lock = field(default_factory=threading.Lock)


class FaultStore(DelegatingStore):
    """One process's view of the shared store: it can die at its N-th call, and its commit-marker
    writes can be held (a GC or VM pause between the lease fence and the marker)."""

    def __init__(self, inner: ObjectStore, ledger: Ledger) -> None:
        super().__init__(inner)
        self.ledger = ledger
        self.kill_at: int | None = None  # calls left before dying
        self.kill_after_call = False  # die after the call was applied (its reply lost with the process)
        self.hold_marker: threading.Event | None = None
        self.marker_reached = threading.Event()
        self.hold_manifest: threading.Event | None = None
        self.manifest_reached = threading.Event()
        self.list_fails = 0  # listings left to fail (an unreadable folder)
        self.get_fails = 0  # reads left to fail (a transient store error)
        self._lock = threading.Lock()

    def arm(self, kill_at: int | None, after: bool) -> None:
        with self._lock:
            self.kill_at, self.kill_after_call = kill_at, after

    def _call(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            die = self.kill_at == 0
            if self.kill_at is not None:
                self.kill_at -= 1
            after = self.kill_after_call
        if die and not after:
            raise Killed()
        result = fn()
        if die:
            raise Killed()
        return result

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if key.startswith("commits/") and self.hold_marker is not None:
            self.marker_reached.set()
            assert self.hold_marker.wait(WAIT_S), "the paused master was never released"
        hold = self.hold_manifest
        if "/manifest." in key and hold is not None:
            self.hold_manifest = None
            self.manifest_reached.set()
            assert hold.wait(WAIT_S), "the paused background save was never released"
        def put() -> int:
            generation = self.inner.put(key, data, if_generation_match=if_generation_match)
            if key.startswith("commits/"):  # noted even when the process dies before the reply
                self._note_marker(data)
            return generation

        return int(self._call(put))

    def _note_marker(self, data: bytes) -> None:
        marker = json.loads(data)
        manifest = json.loads(self.inner.get(marker["manifest_key"]))
        with self.ledger.lock:
            order = (Order(marker["fence"], marker["based_on"], marker["lineage"]) if marker.get("fence") is not None
                     else None)
            self.ledger.markers[bytes(data)] = (marker["step"], order, manifest["metadata"]["fill"])

    def get(self, key: str) -> bytes:
        with self._lock:
            fail, self.get_fails = self.get_fails > 0, max(0, self.get_fails - 1)
        if fail:
            raise StoreUnavailableError(f"{key}: injected transient read error")
        return bytes(self._call(lambda: self.inner.get(key)))

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        result: tuple[bytes, int] | None = self._call(lambda: self.inner.get_versioned(key))
        return result

    def stat(self, key: str) -> Any:
        return self._call(lambda: self.inner.stat(key))

    def delete(self, key: str) -> None:
        self._call(lambda: self.inner.delete(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            fail, self.list_fails = self.list_fails > 0, max(0, self.list_fails - 1)
        if fail:
            raise StoreListingError(f"listing {prefix}: injected unreadable folder")
        return iter(self._call(lambda: list(self.inner.list(prefix))))


class DelegatingView(DelegatingStore):
    """The shared store read through another ``get`` (a reader that meets one read error)."""

    def __init__(self, inner: ObjectStore, get: Callable[[str], bytes]) -> None:
        super().__init__(inner)
        self._get = get

    def get(self, key: str) -> bytes:
        return self._get(key)


@dataclass
class Process:
    store: FaultStore
    manager: CheckpointManager
    lease: Lease


def state(fill: float) -> dict[str, np.ndarray]:
    """Several tensors and dtypes, small chunks: every save has several pieces per writer."""
    return {
        "a": np.full(37, fill, np.float32),
        "b": np.full((5, 3), fill, np.float64),
        "c": np.full(11, int(fill), np.int32),
        "d": np.full(23, fill, np.float32),
    }


class CheckpointInterleavings(RuleBasedStateMachine):
    #: set by each test: makes the shared store the processes write to
    make_store: Callable[[], ObjectStore] = staticmethod(lambda: MemoryStore(uuid.uuid4().hex))
    #: how long a coordinator waits for the other writers' records (a killed writer's never come)
    gather_timeout_s = 0.3

    @initialize()
    def start(self) -> None:
        self.inner = self.make_store()
        self.ledger = Ledger()
        self.procs = [self._spawn(p) for p in range(PROCESSES)]
        self.master = 0
        self.procs[0].lease.acquire(steal=True)
        self.attempts = 0
        self.best: bytes | None = None  # the marker of the newest commit that verified at the last check

    def _spawn(self, p: int) -> Process:
        store = FaultStore(self.inner, self.ledger)
        manager = CheckpointManager(store, max_to_keep=2, chunk_bytes=64, gather_timeout_s=self.gather_timeout_s,
                                    abandoned_after_s=3600.0, io_threads=2)
        return Process(store, manager, Lease(store, f"p{p}-{uuid.uuid4().hex[:6]}"))

    def _restart(self, p: int) -> None:
        """A killed process is relaunched; a relaunched master takes the lease again (as a new ring does)."""
        old = self.procs[p]
        old.store.arm(None, False)
        try:
            old.manager.close()
        except BaseException:  # noqa: BLE001  (the dead process's last save failed; nothing to report)
            pass
        self.procs[p] = self._spawn(p)
        if p == self.master:
            self._take_lease(p)

    def _take_lease(self, p: int) -> None:
        try:
            self.procs[p].lease.acquire(steal=True)
        except CheckpointError:
            pass  # no master this time: the next saves are refused (LeaseLostError), never torn
        self.master = p

    def teardown(self) -> None:
        for proc in getattr(self, "procs", []):
            proc.store.arm(None, False)
            proc.store.hold_marker = None
            try:
                proc.manager.close()
            except BaseException:  # noqa: BLE001
                pass

    def _next_fill(self) -> float:
        self.attempts += 1
        return float(self.attempts)

    # ------------------------------------------------------------------ rules

    @rule(step=STEPS, world=st.integers(1, PROCESSES), background=st.booleans(),
          kill=st.none() | st.tuples(st.integers(0, PROCESSES - 1), st.integers(0, 25), st.booleans()))
    def save(self, step: int, world: int, background: bool, kill: tuple[int, int, bool] | None) -> None:
        """A save of ``step`` by the first ``world`` processes, the master coordinating (when it is
        among them), possibly replaying a step, with one process possibly killed at its N-th call."""
        writers = list(range(world))
        coordinator = self.master if self.master in writers else 0
        fill = self._next_fill()
        attempt = f"a{self.attempts}"
        if kill is not None and kill[0] in writers:
            self.procs[kill[0]].store.arm(kill[1], kill[2])
        outcomes: dict[int, BaseException | None] = {}

        def run(rank: int) -> None:
            proc = self.procs[rank]
            try:
                kwargs: dict[str, Any] = dict(rank=rank, world_size=world, coordinator=coordinator,
                                              lease=proc.lease if rank == coordinator else None, attempt=attempt)
                if background:
                    proc.manager.save_async(step, state(fill), {"fill": fill}, if_busy="wait", **kwargs)
                    proc.manager.wait(timeout=WAIT_S)
                else:
                    proc.manager.save(step, state(fill), {"fill": fill}, **kwargs)
                outcomes[rank] = None
            except BaseException as exc:  # noqa: BLE001  (judged below)
                outcomes[rank] = exc

        # The coordinator starts first and polls for records while the others write: it must never
        # take another attempt's records for this one's.
        thread = threading.Thread(target=run, args=(coordinator,))
        thread.start()
        for rank in writers:
            if rank != coordinator:
                run(rank)
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the coordinator's save hung"
        for rank in writers:
            self.procs[rank].store.arm(None, False)
        for rank, exc in outcomes.items():
            if isinstance(exc, Killed):
                self._restart(rank)
            elif exc is not None and not isinstance(exc, CheckpointError):
                raise AssertionError(f"rank {rank} failed with an untyped error: {exc!r}") from exc

    @rule(new=st.integers(0, PROCESSES - 1))
    def steal(self, new: int) -> None:
        """The ranks elect another master, which steals the lease; the old one keeps its stale lease."""
        self._take_lease(new)

    @rule(old_step=STEPS, new_step=STEPS, new=st.integers(0, PROCESSES - 1))
    def paused_master(self, old_step: int, new_step: int, new: int) -> None:
        """The master fences, then pauses before its marker; meanwhile a successor steals and commits."""
        old = self.master
        if new == old:
            new = (old + 1) % PROCESSES
        proc = self.procs[old]
        proc.store.hold_marker = threading.Event()
        proc.store.marker_reached.clear()
        old_fill = self._next_fill()
        errors: list[BaseException] = []

        def old_save() -> None:
            try:
                proc.manager.save(old_step, state(old_fill), {"fill": old_fill}, lease=proc.lease,
                                  attempt=f"a{self.attempts}")
            except CheckpointError:
                pass
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
            finally:
                proc.store.marker_reached.set()  # also when it never got as far as its marker

        thread = threading.Thread(target=old_save)
        thread.start()
        try:
            assert proc.store.marker_reached.wait(WAIT_S), "the master's save hung before its marker"
            if thread.is_alive():  # it fenced and now pauses; the ranks elect a successor, which commits
                self._take_lease(new)
                fill = self._next_fill()
                try:
                    self.procs[new].manager.save(new_step, state(fill), {"fill": fill},
                                                 lease=self.procs[new].lease, attempt=f"a{self.attempts}")
                except CheckpointError:
                    pass
        finally:
            assert proc.store.hold_marker is not None
            proc.store.hold_marker.set()
            thread.join(WAIT_S)
            proc.store.hold_marker = None
        assert not thread.is_alive(), "the paused master's save hung"
        assert not errors, f"the paused master failed with an untyped error: {errors[0]!r}"

    @rule(p=st.integers(0, PROCESSES - 1), kill=st.none() | st.integers(0, 15))
    def gc(self, p: int, kill: int | None) -> None:
        proc = self.procs[p]
        proc.store.arm(kill, False)
        try:
            proc.manager.gc()
        except Killed:
            self._restart(p)
        except CheckpointError:
            pass
        finally:
            self.procs[p].store.arm(None, False)

    @rule(bg_step=STEPS, later_step=STEPS)
    def background_then_later_save(self, bg_step: int, later_step: int) -> None:
        """The master's background save pauses before its manifest (its pieces written) while the same
        process makes a later save; then the background save goes on and fences after it."""
        proc = self.procs[self.master]
        hold = threading.Event()
        proc.store.manifest_reached.clear()
        proc.store.hold_manifest = hold
        fill = self._next_fill()
        started = False
        try:
            started = proc.manager.save_async(bg_step, state(fill), {"fill": fill}, lease=proc.lease,
                                              attempt=f"a{self.attempts}")
            if started:
                assert proc.store.manifest_reached.wait(WAIT_S) or not proc.manager.save_in_flight
                later = self._next_fill()
                try:
                    proc.manager.save(later_step, state(later), {"fill": later}, lease=proc.lease,
                                      attempt=f"a{self.attempts}", deadline=time.time() + WAIT_S)
                except CheckpointError:
                    pass
        finally:
            proc.store.hold_manifest = None
            hold.set()
            if started:
                try:
                    proc.manager.wait(timeout=WAIT_S)
                except CheckpointError:
                    pass

    @rule(step=STEPS, gc_by=st.integers(0, PROCESSES - 1))
    def gc_while_a_save_waits_at_its_marker(self, step: int, gc_by: int) -> None:
        """A save (often a replay of a step that exists) pauses before its marker while gc runs."""
        proc = self.procs[self.master]
        proc.store.hold_marker = threading.Event()
        proc.store.marker_reached.clear()
        fill = self._next_fill()
        errors: list[BaseException] = []

        def save() -> None:
            try:
                proc.manager.save(step, state(fill), {"fill": fill}, lease=proc.lease, attempt=f"a{self.attempts}")
            except CheckpointError:
                pass
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
            finally:
                proc.store.marker_reached.set()

        thread = threading.Thread(target=save)
        thread.start()
        try:
            assert proc.store.marker_reached.wait(WAIT_S)
            if gc_by != self.master:
                try:
                    self.procs[gc_by].manager.gc()
                except CheckpointError:
                    pass
        finally:
            assert proc.store.hold_marker is not None
            proc.store.hold_marker.set()
            thread.join(WAIT_S)
            proc.store.hold_marker = None
        assert not thread.is_alive() and not errors, errors

    @rule(newest=st.booleans())
    def damage(self, newest: bool) -> None:
        """A byte of a chunk of a live commit (the newest, or any) is flipped in the store."""
        live = {d: e for d, e in self._live().items() if d not in self.ledger.damaged}
        if not live:
            return
        expected = self._expected()
        data = next((d for d, (s, *_rest) in live.items() if expected and s == expected[0]), None) \
            if newest else None
        data = data or sorted(live)[0]
        step = live[data][0]
        marker = json.loads(data)
        manifest = json.loads(self.inner.get(marker["manifest_key"]))
        piece = manifest["pieces"][0]["key"]
        chunk = next((k for k in self.inner.list(piece) if "/c/" in k), None)
        if chunk is None:
            return
        body = bytearray(self.inner.get(chunk))
        body[len(body) // 2] ^= 0xFF
        self.inner.put(chunk, bytes(body))
        with self.ledger.lock:
            self.ledger.damaged.add(data)
        del step

    @rule(p=st.integers(0, PROCESSES - 1), fails=st.integers(1, 3))
    def gc_with_a_listing_error(self, p: int, fails: int) -> None:
        proc = self.procs[p]
        proc.store.list_fails = fails
        try:
            proc.manager.gc()
        except CheckpointError:
            pass
        finally:
            proc.store.list_fails = 0

    @rule(p=st.integers(0, PROCESSES - 1), at=st.integers(1, 12))
    def restore_with_a_read_error(self, p: int, at: int) -> None:
        """A read fails once in a restore: the restore returns the newest good commit or raises; it never
        takes the failure for a damaged step and returns an older one."""
        proc = self.procs[p]
        expected = self._expected()
        proc.store.get_fails = 0
        calls = {"n": 0}
        inner_get = proc.store.inner.get

        def failing_get(key: str) -> bytes:
            calls["n"] += 1
            if calls["n"] == at:
                raise StoreUnavailableError(f"{key}: injected transient read error")
            return inner_get(key)

        reader = CheckpointManager(DelegatingView(proc.store.inner, failing_get), max_to_keep=None)
        try:
            got = reader.restore()
            assert expected is not None and (got.step, got.metadata["fill"]) == expected
        except StoreUnavailableError:
            pass
        except (NothingToRestoreError, CorruptCheckpointError):
            assert expected is None
        finally:
            reader.close()

    @rule()
    def move_to_another_kind_of_store(self) -> None:
        """The run's prefix is copied to another kind of store and the processes go on there."""
        if not isinstance(self.inner, (MemoryStore, LocalStore)):
            return
        target: ObjectStore = (LocalStore(Path(tempfile.mkdtemp(prefix="moved-")) / "store", fsync=False)
                               if isinstance(self.inner, MemoryStore) else MemoryStore(uuid.uuid4().hex))
        for key in self.inner.list(""):
            target.put(key, self.inner.get(key))
        for p in range(PROCESSES):
            self.procs[p].store.arm(None, False)
            try:
                self.procs[p].manager.close()
            except BaseException:  # noqa: BLE001
                pass
        self.inner = target
        self.procs = [self._spawn(p) for p in range(PROCESSES)]
        self._take_lease(self.master)

    # -------------------------------------------------------------- invariant

    def _live(self) -> dict[bytes, tuple[int, Order | None, float]]:
        """The markers that landed and are still stored."""
        live = {}
        for data, entry in self.ledger.markers.items():
            stored = self.inner.get_versioned(f"commits/{entry[0]:012d}.json")
            if stored is not None and stored[0] == data:
                live[data] = entry
        return live

    def _newest(self) -> bytes | None:
        """The marker of the newest commit that verifies: of the live, undamaged markers, the highest step
        that no lower step's commit supersedes (its save began at or after the step's fence)."""
        good = {step: (order, data) for data, (step, order, _) in self._live().items()
                if data not in self.ledger.damaged}
        superseded = {s for s, (o, _) in good.items() if o is not None and any(
            t < s and p is not None and p.lineage == o.lineage and p.based_on >= o.fence
            for t, (p, _) in good.items())}
        candidates = [s for s in good if s not in superseded]
        return good[max(candidates)][1] if candidates else None

    def _expected(self) -> tuple[int, float] | None:
        newest = self._newest()
        if newest is None:
            return None
        step, _, fill = self.ledger.markers[newest]
        return step, fill

    def _check_not_lost(self, newest: bytes | None) -> None:
        """The commit that was the newest good one at the last check is still live, or a newer one took
        its place: a higher step, or a lower one whose save began after its fence."""
        best, self.best = self.best, newest
        if best is None or best in self._live() or best in self.ledger.damaged:
            return
        step, order, _ = self.ledger.markers[best]
        assert newest is not None, f"the newest good commit (step {step}) was deleted and nothing is left"
        now_step, now_order, _ = self.ledger.markers[newest]
        took_place = now_step >= step or (order is not None and now_order is not None
                                          and now_order.lineage == order.lineage and now_order.based_on >= order.fence)
        assert took_place, f"the newest good commit (step {step}) was deleted; step {now_step} is restored now"

    @invariant()
    def restore_returns_one_attempt_of_the_newest_commit(self) -> None:
        if not hasattr(self, "inner"):
            return
        reader = CheckpointManager(self.inner, max_to_keep=None)
        try:
            expected = self._expected()
            self._check_not_lost(self._newest())
            if expected is None:
                with pytest.raises((NothingToRestoreError, CorruptCheckpointError)):
                    reader.restore()
                return
            got = reader.restore()
            step, fill = expected
            assert (got.step, got.metadata["fill"]) == (step, fill), (
                f"restored step {got.step} of attempt fill={got.metadata['fill']}, expected step {step} fill={fill}")
            for name, want in state(fill).items():
                np.testing.assert_array_equal(got.tensors[name], want, err_msg=f"{name}: a mix of attempts")
            readers = 1 + self.attempts % 3
            latest = reader.latest_step()
            for r in range(readers):  # without a step, each reader reads the latest or raises: never falls back
                try:
                    assert reader.restore(partition=(r, readers)).step == latest
                except CorruptCheckpointError:
                    pass
            assert reader.restorable_step() == step
            parts = [reader.restore(step, partition=(r, readers)) for r in range(readers)]
            merged = {n: t for part in parts for n, t in part.tensors.items()}
            assert sorted(merged) == sorted(got.tensors)
            for name, tensor in merged.items():
                np.testing.assert_array_equal(tensor, got.tensors[name], err_msg=f"partition read of {name}")
        finally:
            reader.close()


def _run(make_store: Callable[[], ObjectStore], examples: int, steps: int, gather_timeout_s: float = 0.3) -> None:
    machine = type("Machine", (CheckpointInterleavings,),
                   {"make_store": staticmethod(make_store), "gather_timeout_s": gather_timeout_s})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def test_interleavings_memory_store() -> None:
    _run(lambda: MemoryStore(uuid.uuid4().hex), examples=100, steps=15)


def test_interleavings_local_store(tmp_path: Path) -> None:
    _run(lambda: LocalStore(tmp_path / uuid.uuid4().hex, fsync=False), examples=12, steps=8, gather_timeout_s=2.0)


def test_interleavings_gcs_emulator(gcs_emulator_session) -> None:
    from ckpt_service.stores.gcs import GCSStore

    bucket = gcs_emulator_session.new_bucket("interleave")
    _run(lambda: GCSStore(bucket, f"runs/{uuid.uuid4().hex[:8]}"), examples=5, steps=6, gather_timeout_s=3.0)
