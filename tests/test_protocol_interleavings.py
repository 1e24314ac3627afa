"""A stateful property test of the notice protocol: hypothesis interleaves notices, early warnings,
stop requests, ring resets and faults on 2-4 in-process ranks, and every step boundary is checked.

Each rule is one event of a run: a notice to one VM (GCE-like 30 s or AWS-like 120 s window),
an early warning, an operator's stop request, a fault armed on one rank (a snapshot or a share
that raises, a store that delays every call, one that fails the next puts of checkpoint data), one step
boundary on every rank, or a reset (the ring re-formed without the ranks that left, as Horovod
does after a graceful leave, possibly with a new VM joining). After every step:

* every rank took the same decision (the outcome fields that must agree), and the fake group
  checked that every rank ran the same collectives in the same order;
* a newly noticed VM got an emergency save at once, and one with no fault armed committed;
* every committed step has one commit marker and one commit event (one committer), and commit
  markers carry lease generations that grow in the order the store created them (a master that
  was replaced can never commit after its successor);
* the lease object names the elected master as its holder;
* each leaving record carries its own VM's deadline and was written once;
* no step boundary takes longer than ``STEP_BOUND_S`` (a rank that hangs in a collective fails
  the group after ``GROUP_TIMEOUT_S``), and every background save has ended within its gather
  timeout when the run ends.

The runs are derandomized (the same schedules on every CI run), but the ranks are threads: a
failure that depends on their timing may replay differently while hypothesis shrinks it, and is
then reported as flaky; the first error it prints is the finding.

Faults on the leaving records and the lease are out of scope here (tests of their own cover
them): the invariants on those objects are exact.
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from fake_collectives import FakeCollectives, FakeWatcher, ThreadGroup
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_protocol_agreement import published

from ckpt_service import layout
from ckpt_service.errors import StoreUnavailableError
from ckpt_service.manager import CheckpointManager, ShareSnapshot
from ckpt_service.manifest import CommitMarker
from ckpt_service.stores import MemoryStore
from ckpt_service.stores.base import ObjectStore
from ckpt_service.testing.delegating import DelegatingStore
from hvd_transient import store_keys as keys
from hvd_transient.core.config import TransientConfig
from hvd_transient.core.control import request_stop
from hvd_transient.core.membership import read_leaving
from hvd_transient.core.notice_round import StepOutcome
from hvd_transient.core.transient import TransientImpl
from hvd_transient.watchers import Notice

STATE = {"w": np.arange(512, dtype=np.float32), "b": np.ones(7, dtype=np.float64)}
MAX_RANKS = 4
GROUP_TIMEOUT_S = 5.0
#: the longest one step boundary may take on every rank (a healthy one takes milliseconds; the
#: slowest store here adds 50 ms to each call)
STEP_BOUND_S = 5.0
#: how long a background save's coordinator waits for the other writers' records in the store
#: (the protocol's async_gather_timeout_s): a rank whose record write failed holds it that long
GATHER_TIMEOUT_S = 1.0
LEAVE_MARGIN_S = 1.0
#: the outcome fields every rank must agree on
AGREED = ("emergency_step", "committed", "stop", "departure_pending", "check_hosts")
#: notice windows: GCE Spot's and AWS's
WINDOWS_S = {"gce-notice": 30.0, "aws-notice": 120.0}
#: how much longer each store call of a slow rank takes
SLOW_S = {"store-recovers": 0.0, "store-slow": 0.005, "store-very-slow": 0.05}
FAULTS = ["snapshot-raises", "share-raises", "store-fails-1", "store-fails-3", *SLOW_S]


class RecordingStore(DelegatingStore):
    """The run's store as every rank shares it: records each commit marker in the order they were
    created (with its lease generation) and counts the writes of each leaving record."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.commits: list[tuple[int, int | None]] = []  # (step, lease generation), creation order
        self.leaving_puts: dict[str, int] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if key.startswith(layout.COMMITS_PREFIX):
            with self._lock:  # the marker's creation and its place in the order are one
                generation = super().put(key, data, if_generation_match=if_generation_match)
                marker = CommitMarker.from_json(data, where=key)
                self.commits.append((marker.step, marker.fence))
                return generation
        if key.startswith(keys.LEAVING_PREFIX):
            with self._lock:
                self.leaving_puts[key] = self.leaving_puts.get(key, 0) + 1
        return super().put(key, data, if_generation_match=if_generation_match)


class FaultyStore(DelegatingStore):
    """One rank's view of the store: every call takes ``delay_s`` longer, and the next
    ``failing_puts`` writes of checkpoint data fail as an unreachable store does."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.delay_s = 0.0
        self.failing_puts = 0
        self._lock = threading.Lock()

    def _slow(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)  # the fault injected, not synchronisation

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        self._slow()
        if key.startswith(layout.STEPS_PREFIX):
            with self._lock:
                fail, self.failing_puts = self.failing_puts > 0, max(0, self.failing_puts - 1)
            if fail:
                raise StoreUnavailableError(f"the store did not answer the write of {key} (injected)")
        return super().put(key, data, if_generation_match=if_generation_match)

    def get(self, key: str) -> bytes:
        self._slow()
        return super().get(key)

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        self._slow()
        return super().get_versioned(key)

    def list(self, prefix: str = "") -> Any:
        self._slow()
        return super().list(prefix)


@dataclass
class Rank:
    """One worker process: its protocol object, its store and its faults."""

    impl: TransientImpl
    store: FaultyStore
    watcher: FakeWatcher
    fail_snapshot: bool = False  # its next snapshot raises
    fail_share: bool = False     # its next share snapshot (the host copy of its pieces) raises

    def snapshot(self) -> Mapping[str, Any]:
        if self.fail_snapshot:
            self.fail_snapshot = False
            raise MemoryError("host memory exhausted (injected)")
        return STATE

    def share(self) -> ShareSnapshot | None:
        """The share snapshot for this step: one that raises if armed, else the default copy."""
        if not self.fail_share:
            return None

        def take(plan: Any, rank: int) -> Any:
            self.fail_share = False
            raise OSError("device lost while copying the share (injected)")
        return take

    @property
    def fault_armed(self) -> bool:
        return self.fail_snapshot or self.fail_share or self.store.failing_puts > 0


#: the rules that need a ring (they do nothing once the run ended: rules that are never enabled
#: would make hypothesis give up on the run, and its end-of-run checks with it)
running = precondition(lambda self: bool(self.ring))


class NoticeProtocol(RuleBasedStateMachine):
    """One run of 2-4 workers sharing one store; the rules are what happens to it."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = MemoryStore.named(uuid.uuid4().hex)
        self.shared = RecordingStore(self.memory)
        self.config = TransientConfig(store=self.shared.url, save_every_steps=3, check_every_steps=1,
                                      leave_margin_s=LEAVE_MARGIN_S, max_to_keep=None,
                                      async_gather_timeout_s=GATHER_TIMEOUT_S)
        self.ranks: dict[str, Rank] = {}   # every worker that ever ran, by host
        self.ring: list[str] = []          # the current ring's hosts, in rank order
        self.group = ThreadGroup(1)
        self.step = 0
        self.deadlines: dict[str, float] = {}  # each noticed VM's own deadline
        self.handled: set[str] = set()         # VMs whose notice an emergency save answered
        self.stop_requested = False
        self.finished = False
        self.hosts_made = 0

    # ------------------------------------------------------------------ set-up

    def _new_rank(self) -> str:
        host = f"h{self.hosts_made}"
        self.hosts_made += 1
        store = FaultyStore(self.shared)
        watcher = FakeWatcher()
        manager = CheckpointManager(store, max_to_keep=None, gather_timeout_s=GATHER_TIMEOUT_S)
        impl = TransientImpl(self.config, FakeCollectives(self.group, 0), host=host, watcher=watcher,
                             manager=manager)
        impl.stop_poller.interval_s = 0.01  # the master finds a stop request within a step or two
        self.ranks[host] = Rank(impl, store, watcher)
        return host

    def _form_ring(self, hosts: list[str]) -> None:
        """Re-form the ring on ``hosts`` (Horovod's reset): a new group, then begin on every rank."""
        self.ring = hosts
        self.group = ThreadGroup(len(hosts), timeout_s=GROUP_TIMEOUT_S)
        for r, host in enumerate(hosts):
            self.ranks[host].impl.comm = FakeCollectives(self.group, r)
        impls = self._impls()
        self._timed(lambda r: impls[r].begin(self.step))
        masters = {impl.run.master for impl in impls}
        assert len(masters) == 1, f"the ranks elected different masters: {masters}"
        self._check_lease()

    @initialize(size=st.integers(2, MAX_RANKS))
    def start(self, size: int) -> None:
        self._form_ring([self._new_rank() for _ in range(size)])

    def _impls(self) -> list[TransientImpl]:
        return [self.ranks[h].impl for h in self.ring]

    def _timed(self, fn: Any) -> list[Any]:
        t0 = time.monotonic()
        results = self.group.run(fn)
        took = time.monotonic() - t0
        assert took < STEP_BOUND_S, f"a step boundary took {took:.1f} s on ring {self.ring}"
        return results

    def _pick(self, index: int) -> str:
        return self.ring[index % len(self.ring)]

    # ------------------------------------------------------------------ the world

    @running
    @rule(index=st.integers(0, MAX_RANKS - 1), what=st.sampled_from(["gce-notice", "aws-notice", "warning"]))
    def cloud_speaks(self, index: int, what: str) -> None:
        """A notice (GCE-like 30 s or AWS-like 120 s window) or an early warning reaches one VM."""
        if self.finished:
            return
        host = self._pick(index)
        now = time.time()
        if what == "warning":
            self.ranks[host].watcher.warning = Notice("aws", host, now, now + 120, "rebalance-recommendation",
                                                      early=True)
        elif host not in self.deadlines:  # a VM is revoked once
            given = Notice("test", host, now, now + WINDOWS_S[what], "preempted")
            self.deadlines[host] = given.deadline
            self.ranks[host].watcher.notice = given

    @running
    @rule(index=st.integers(0, MAX_RANKS - 1), fault=st.sampled_from(FAULTS))
    def fault_strikes(self, index: int, fault: str) -> None:
        """One rank's next snapshot or share raises, its store slows down (or recovers), or its
        store fails the next few writes of checkpoint data (pieces, shard records, manifests)."""
        rank = self.ranks[self._pick(index)]
        if fault == "snapshot-raises":
            rank.fail_snapshot = True
        elif fault == "share-raises":
            rank.fail_share = True
        elif fault.startswith("store-fails-"):
            rank.store.failing_puts = int(fault.rsplit("-", 1)[1])
        else:
            rank.store.delay_s = SLOW_S[fault]

    @precondition(lambda self: bool(self.ring) and not self.finished and not self.stop_requested
                  and self.step >= 9)  # not before the run got anywhere
    @rule()
    def operator_stops(self) -> None:
        request_stop(self.memory)
        self.stop_requested = True

    @running
    @rule(join=st.booleans())
    def reset(self, join: bool) -> None:
        if self.finished:
            return
        survivors = [h for h in self.ring if not self.ranks[h].impl.run.leaving]
        if not survivors or len(survivors) + join > MAX_RANKS or (survivors == self.ring and not join):
            return  # nothing for Horovod to re-form
        self._form_ring(survivors + ([self._new_rank()] if join else []))
        event("reset")

    # ------------------------------------------------------------------ one step boundary

    def _master(self) -> TransientImpl:
        impls = self._impls()
        return impls[impls[0].run.master]

    def _stop_seen(self) -> None:
        """Let the master's background look at the store find the stop request, so that the
        next round shares it (the test waits for that look; the protocol never does)."""
        poller = self._master().stop_poller
        for _ in range(500):
            poller.polled.clear()
            if poller.requested:
                return
            assert poller.polled.wait(GROUP_TIMEOUT_S), "the master's stop poller never looked"
        raise AssertionError("the master's stop poller did not see the stop request")

    @running
    @rule(count=st.integers(1, 3))
    def step_boundaries(self, count: int) -> None:
        for _ in range(count):
            if not self.finished:
                self._step_boundary()

    def _step_boundary(self) -> None:
        """One step boundary on every rank, and what every rank must agree on after it."""
        if self.stop_requested:
            self._stop_seen()
        self.step += 1
        step = self.step
        new = [h for h in self.ring if h in self.deadlines and h not in self.handled]
        faulty = any(self.ranks[h].fault_armed for h in self.ring)
        ranks = [self.ranks[h] for h in self.ring]
        outcomes: list[StepOutcome] = self._timed(
            lambda r: ranks[r].impl.after_step(step, ranks[r].snapshot, lambda: {"step": step}, ranks[r].share()))

        for name in AGREED:
            values = {getattr(o, name) for o in outcomes}
            assert len(values) == 1, f"step {step}: the ranks disagree on {name}: {values}"
        [outcome] = {(o.emergency_step, o.committed, o.stop, o.departure_pending) for o in outcomes}
        emergency, committed, stopped, _ = outcome
        if new:
            assert emergency == step, f"step {step}: {new} got a notice and no emergency save started"
            assert all(o.departure_pending for o in outcomes)
            if not faulty:
                assert committed, f"step {step}: the emergency save failed with no fault armed"
            self.handled.update(new)
            event(f"emergency save {'committed' if committed else 'failed'}")
        else:
            assert emergency is None and not committed, f"step {step}: an emergency save with no new notice"
        assert [o.leaving for o in outcomes] == [h in self.handled for h in self.ring]
        if committed:
            assert step in [s for s, _ in self.shared.commits], f"step {step} committed, but has no marker"
        if self.stop_requested and not new:
            assert stopped, f"step {step}: the master saw the stop request, but the ring did not stop"
        elif not self.stop_requested:
            assert not stopped, f"step {step}: a stop nobody requested"
        if stopped:
            event("stopped")
            self._final_save(step)
        self._check_lease()
        self.one_committer_per_save_and_generations_grow()
        self.each_leaving_record_has_its_own_deadline_once()

    def _final_save(self, step: int) -> None:
        """What the framework layer does after a stop: every rank saves the step unless committed."""
        impls = self._impls()
        master = impls[0].run.master

        def final(r: int) -> bool:
            impls[r].end(step)  # lets an in-flight background save finish first
            if not impls[r].final_save_needed(step):
                return True
            return impls[r].save_now(step, STATE, {"step": step}, coordinator=master, deadline=None,
                                     kind="final")
        results = self._timed(final)
        assert len(set(results)) == 1, f"the ranks disagree on whether the final save committed: {results}"
        self.finished = True

    # ------------------------------------------------------------------ invariants

    def _check_lease(self) -> None:
        """The lease object names the elected master, not released."""
        master = self._master()
        record, _ = master.lease.read()
        assert record is not None and not record.released and record.holder == master.lease.holder, (
            f"the lease is {record}, but the elected master is {master.host} ({master.lease.holder})")

    def _commit_events(self) -> list[dict[str, Any]]:
        return [e for rank in self.ranks.values() for e in rank.impl.events.events if e["event"] == "commit"]

    @invariant()
    def one_committer_per_save_and_generations_grow(self) -> None:
        # the events first: a background commit's marker is created before its event is logged
        events = self._commit_events()
        commits = list(self.shared.commits)
        steps = [s for s, _ in commits]
        assert len(steps) == len(set(steps)), f"a step was committed twice: {commits}"
        generations = [g for _, g in commits]
        assert all(g is not None for g in generations), f"a commit without a lease generation: {commits}"
        assert generations == sorted(generations) and len(set(generations)) == len(generations), (
            f"a commit was fenced with an older lease generation than one before it: {commits}")
        markers = dict(commits)
        claimed: dict[int, int] = {}
        for commit in events:
            assert commit["step"] in markers, f"a commit event without a commit marker: {commit}"
            # every commit event, of a synchronous or a background save, names the generation its fence wrote
            generation, fenced = commit["lease_generation"], markers[commit["step"]]
            assert generation == fenced, (
                f"the commit event of step {commit['step']} ({commit['kind']}) names lease generation "
                f"{generation}, its commit marker {fenced}")
            claimed[commit["step"]] = claimed.get(commit["step"], 0) + 1
        assert all(n == 1 for n in claimed.values()), f"more than one rank claims a commit: {claimed}"

    @invariant()
    def each_leaving_record_has_its_own_deadline_once(self) -> None:
        published((self.ranks[host].impl for host in self.handled), GROUP_TIMEOUT_S)  # written in the background
        records = {r.host: r.deadline for r in read_leaving(self.memory)}
        assert set(records) == self.handled, f"leaving records of {sorted(records)}, leavers {sorted(self.handled)}"
        for host, deadline in records.items():
            assert deadline == self.deadlines[host], (
                f"{host}'s leaving record says {deadline}, its own notice {self.deadlines[host]}")
            writes = self.shared.leaving_puts[keys.leaving_key(host)]
            assert 1 <= writes <= self.record_writes_allowed(host), (
                f"{host}'s leaving record was written {writes} times")

    def record_writes_allowed(self, host: str) -> int:
        """A leaving record is written once (a protocol that plans a leave again may write it again)."""
        return 1

    def teardown(self) -> None:
        try:
            for host, rank in self.ranks.items():
                try:
                    rank.impl.manager.wait(timeout=GATHER_TIMEOUT_S + STEP_BOUND_S)
                except Exception:  # noqa: BLE001 - a failed background save is an outcome, checked below
                    pass
                assert not rank.impl.manager.save_in_flight, f"{host}'s background save outlived its gather timeout"
            if self.ring:
                self.one_committer_per_save_and_generations_grow()
                # once every background save is done, every marker has its one commit event
                claimed = sorted(e["step"] for e in self._commit_events())
                assert claimed == sorted(s for s, _ in self.shared.commits), (
                    f"commit events for {claimed}, markers {self.shared.commits}")
                assert CheckpointManager(self.memory, max_to_keep=None).all_steps() == sorted(claimed)
        finally:
            for rank in self.ranks.values():
                rank.impl.close()
                rank.impl.manager.close()


NoticeProtocol.TestCase.settings = settings(
    max_examples=75, stateful_step_count=40, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_notice_protocol_interleavings = NoticeProtocol.TestCase
