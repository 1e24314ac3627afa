"""Third attack round on the host check (commit 4e8b7be): (1) rank 0 announces a removal that Horovod's driver
never told the ring of, counted from the round that found the VM's leaving record in the store
(core/transient.py ``_note_landed``/``_announce_lost_removals``, core/leave_plan.py ``lost_removals``); (2) lost
joins matched to a ring's members by instance id or name (frontend/lost_joins.py). Tests named ``test_held_...``
are attacks the code withstood; the others reproduce a violation of what the modules' docstrings, the commit and
docs/reliability.md promise, and fail on the code they attack."""
from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import test_protocol_agreement as tpa
from test_host_check_attacks_second_round import CountingUpdates, _step_until_reset, counting_ranks, horovod_state
from test_protocol_agreement import make_ranks, notice, step_all

from ckpt_service.errors import StoreUnavailableError
from ckpt_service.stores import MemoryStore
from ckpt_service.testing.delegating import DelegatingStore
from hvd_transient import store_keys as keys
from hvd_transient.core.interfaces import Clocks
from hvd_transient.core.leave_plan import LOST_REMOVAL_AFTER_S, MAX_REMOVAL_ANNOUNCES
from hvd_transient.discovery.ready import ReadyRecord
from hvd_transient.frontend.lost_joins import LostJoins, MemberSeen, RingSeen, lost_joins


class LeavingDown(DelegatingStore):
    """Puts of leaving records fail once ``down`` is set (the store unreachable for them)."""

    def __init__(self, inner: Any, *, down: bool = False) -> None:
        super().__init__(inner)
        self.down = down

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if self.down and key.startswith(keys.LEAVING_PREFIX):
            raise StoreUnavailableError("the store did not answer (injected)")
        return super().put(key, data, if_generation_match=if_generation_match)


def _wait_landed(impl: Any, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not impl._departure.record_landed:  # noqa: SLF001
        assert time.monotonic() < end, "the leaving record never landed"
        time.sleep(0.01)  # the background writer's put: a real thread


# ------------------------------------------------------------------ rule 1: lost removals (violations)

def test_a_wall_clock_ahead_on_another_rank_makes_the_second_announce_come_on_the_new_rings_first_step() -> None:
    """ATTACKS rule 1's "the second [announce] on a ring that ran 2 s" (leave_plan.lost_removals: "again only on
    a ring that ran ``after_s``"). ``now`` is the round's clock (the latest wall clock of the ranks) while
    ``ring_began_at`` is rank 0's own (``run.ring_began_wall``, not agreed): a rank whose clock runs 5 s ahead
    makes every new ring look 5 s old at its first round. After the first announce resets the ring with h2 still
    listed, the second and last announce fires at the new ring's first step (0.5 s in), before the driver had
    the time the rule gives it: both announces are spent within one reset."""
    t = {"wall": time.time()}
    group, impls, state, updates = counting_ranks(t, leave="at_notice")
    impls[1].clocks = Clocks(wall=lambda: t["wall"] + 5.0)  # rank 1's clock runs 5 s ahead of rank 0's
    impls[2].watcher.notice = notice(30.0, now=t["wall"])
    step_all(group, impls, 1)
    step, raised_at = _step_until_reset(group, impls, state, t, 1, t["wall"] + 30.0)
    assert raised_at is not None and updates.removals == 1
    state.on_reset()  # the ring re-forms with h2 still listed (discovery has not dropped it yet)
    group.run(lambda r: impls[r].begin(step))
    began = t["wall"]
    _, again_at = _step_until_reset(group, impls, state, t, step, began + 10.0)
    for impl in impls:
        impl.close()
    assert again_at is not None and updates.removals == MAX_REMOVAL_ANNOUNCES
    assert again_at - began > LOST_REMOVAL_AFTER_S, \
        f"the second announce came {again_at - began:.1f} s into the new ring, not after it ran 2 s"


# ------------------------------------------------------------------ rule 2: lost joins (violations)

def test_a_vm_that_joined_by_instance_id_whose_record_has_no_id_is_announced_lost_once_it_left() -> None:
    """ATTACKS rule 2's "a VM that joined is never announced as lost". ``_is`` falls back to names where either
    side lacks an instance id, but ``last_in_ring`` does not: a member that said its id is remembered under
    ``id:…`` only, and a record without an id (its standby could not read the metadata server, an older
    standby) is looked up under ``name:…`` only. w-3 became ready at T, joined the ring that began at T+4
    (saying id 111), and left; the next ring (T+8) is without it: its record is taken for a lost join."""
    began = 1_764_000_000.0
    lost = LostJoins(clock=lambda: began)
    record = ReadyRecord(host="w-3", ready_at=began - 8.0, instance_id=None)
    # the ring that took w-3 (every rank calls ring_began; rank 1 here, so no timer starts)
    ring_a = [MemberSeen(frozenset({"w-0"}), "100"), MemberSeen(frozenset({"w-3", "10.0.0.5"}), "111")]
    lost._clock = lambda: began - 4.0  # noqa: SLF001
    lost.ring_began(ring_a, rank=1, store=None)  # type: ignore[arg-type]
    lost._clock = lambda: began  # noqa: SLF001
    lost.ring_began([MemberSeen(frozenset({"w-0"}), "100")], rank=1, store=None)  # type: ignore[arg-type]
    ring_b = RingSeen((MemberSeen(frozenset({"w-0"}), "100"),), began)
    found = lost_joins([record], ring_b, last_in_ring=lost._last_in_ring, announced=())  # noqa: SLF001
    lost.close()
    assert found == [], "a VM that was in a ring since it became ready was announced as a lost join"


# ------------------------------------------------------------------ attacks that held

def test_held_a_vm_of_two_ranks_seeing_its_notice_at_different_rounds_has_one_writer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTACKS "the rank that writes the record reports it landed" with a VM of two ranks (h1: ranks 1 and 2)
    where rank 2 sees the notice a round before rank 1: the round spreads the notice to every rank of the VM,
    so rank 1 (the lowest) writes every version, also the re-plan's. With its leaving puts failing, no round
    finds the record landed and nothing is announced (a record that never lands causes no announce), even
    after a re-plan to "at once"."""
    monkeypatch.setattr(tpa, "HOSTS", ["h0", "h1", "h1"])
    mem = MemoryStore.named(uuid.uuid4().hex)
    t = {"wall": time.time(), "mono": 1000.0}
    t0 = t["wall"]
    group, impls, _ = make_ranks(stores=[mem, LeavingDown(mem, down=True), mem], leave="near_deadline",
                                 leave_lead_s=4.0, clocks=Clocks(wall=lambda: t["wall"], monotonic=lambda: t["mono"]))
    updates = CountingUpdates(state := horovod_state())
    impls[0].host_updates = updates
    impls[2].watcher.notice = notice(30.0, now=t0)
    step_all(group, impls, 1)
    impls[1].watcher.notice = notice(30.0, now=t0)
    step = 1
    for _ in range(2):
        step += 1
        t["wall"] += 0.5
        t["mono"] += 0.5
        step_all(group, impls, step)
    step += 1
    t["wall"] += 0.5
    t["mono"] += 28.0  # a slow step: h1 now leaves at once
    step_all(group, impls, step)
    assert "h1" not in impls[0].run.leave_at_of
    _, raised_at = _step_until_reset(group, impls, state, t, step, t0 + 20.0)
    for impl in impls:
        impl.close()
    assert raised_at is None and updates.removals == 0 and impls[0].run.landed_at_of == {}
    assert not impls[2]._departure.record_landed  # noqa: SLF001


@pytest.mark.parametrize("second_lands", [True, False])
def test_held_a_replan_to_at_once_after_the_record_landed_counts_from_the_new_version(second_lands: bool) -> None:
    """ATTACKS the replan: h2's record (leave_at) landed and a round dated it; a slow step re-plans h2 to leave at
    once. The landing is dropped on every rank; the announce comes only 2 s after a round found the new version
    (never where it does not land: the store down for leaving records after the first)."""
    mem = MemoryStore.named(uuid.uuid4().hex)
    flaky = LeavingDown(mem)
    t = {"wall": time.time(), "mono": 1000.0}
    t0 = t["wall"]
    group, impls, _ = make_ranks(stores=[mem, mem, flaky], leave="near_deadline", leave_lead_s=4.0,
                                 clocks=Clocks(wall=lambda: t["wall"], monotonic=lambda: t["mono"]))
    updates = CountingUpdates(horovod_state())
    impls[0].host_updates = updates
    impls[2].watcher.notice = notice(30.0, now=t0)
    step_all(group, impls, 1)
    _wait_landed(impls[2])
    step = 2
    t["wall"] += 0.5
    t["mono"] += 0.5
    step_all(group, impls, step)
    assert all("h2" in impl.run.landed_at_of for impl in impls)
    flaky.down = not second_lands
    step += 1
    t["wall"] += 0.5
    t["mono"] += 28.0
    step_all(group, impls, step)  # re-planned: at once
    replanned_at = t["wall"]
    assert all("h2" not in impl.run.landed_at_of for impl in impls)
    if second_lands:
        _wait_landed(impls[2])
    landed_seen: list[float] = []
    while t["wall"] < t0 + 20.0:
        step += 1
        t["wall"] += 0.5
        outcomes = step_all(group, impls, step)
        assert len({o.check_hosts for o in outcomes}) == 1
        if "h2" in impls[0].run.landed_at_of and not landed_seen:
            landed_seen.append(impls[0].run.landed_at_of["h2"])
        if updates.removals:
            break
    for impl in impls:
        impl.close()
    if second_lands:
        assert updates.removals == 1 and landed_seen and landed_seen[0] > replanned_at
        assert t["wall"] > landed_seen[0] + LOST_REMOVAL_AFTER_S
    else:
        assert updates.removals == 0 and not landed_seen


def test_held_rank_0_under_notice_announces_its_own_lost_removal_before_its_deadline() -> None:
    """ATTACKS "who announces" where rank 0 is itself the VM under notice (at_notice): rank 0 (Horovod's rank 0,
    whose host updates the check broadcasts) still announces its own removal; the ring resets well before
    the deadline, and every rank agreed at every step."""
    t = {"wall": time.time()}
    group, impls, _ = make_ranks(leave="at_notice", clocks=Clocks(wall=lambda: t["wall"]))
    updates = CountingUpdates(state := horovod_state())
    impls[0].host_updates = updates
    impls[0].watcher.notice = notice(30.0, now=t["wall"])
    t0 = t["wall"]
    step_all(group, impls, 1)
    _, raised_at = _step_until_reset(group, impls, state, t, 1, t0 + 30.0)
    for impl in impls:
        impl.close()
    assert raised_at is not None and raised_at < t0 + 6.0 and updates.removals == 1


def test_held_a_notice_at_the_round_that_finds_another_vms_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTACKS a notice (h3) agreed at the very round that first finds h2's record landed: ``_note_landed`` runs
    before the emergency, so h2's landing is kept; both VMs' removals are announced (once each), before their
    deadlines."""
    monkeypatch.setattr(tpa, "HOSTS", ["h0", "h1", "h2", "h3"])
    t = {"wall": time.time()}
    t0 = t["wall"]
    group, impls, _ = make_ranks(size=4, leave="at_notice", clocks=Clocks(wall=lambda: t["wall"]))
    updates = CountingUpdates(state := horovod_state())
    impls[0].host_updates = updates
    impls[2].watcher.notice = notice(30.0, now=t0)
    step_all(group, impls, 1)
    _wait_landed(impls[2])
    impls[3].watcher.notice = notice(30.0, now=t0)
    t["wall"] += 0.5
    step_all(group, impls, 2)  # h3's notice round, and the round that finds h2's record
    assert all(impl.run.landed_at_of.get("h2") == pytest.approx(t["wall"], abs=1e-3) for impl in impls)
    _wait_landed(impls[3])
    step, raised_at = _step_until_reset(group, impls, state, t, 2, t0 + 30.0)
    assert raised_at is not None and raised_at < t0 + 6.0
    if set(impls[0].run.removals_announced) != {"h2", "h3"}:  # h3's came due a step later: the next ring
        state.on_reset()
        group.run(lambda r: impls[r].begin(step))
        _, raised_at = _step_until_reset(group, impls, state, t, step, t0 + 30.0)
        assert raised_at is not None and raised_at < t0 + 8.0
    for impl in impls:
        impl.close()
    assert set(impls[0].run.removals_announced) == {"h2", "h3"}
    assert all(a.count == 1 for a in impls[0].run.removals_announced.values())


def test_held_a_really_missing_vm_is_announced_once_per_record() -> None:
    """ATTACKS rule 2's "a VM really missing is announced once per record per process": found on two rings in
    a row, taken once; a new record of the same VM (a new ready_at) is announced again, once."""
    began = 1_764_000_000.0
    clock = {"now": began}
    lost = LostJoins(clock=lambda: clock["now"])
    record = ReadyRecord(host="w-4", ready_at=began + 1.0, instance_id="444")
    for _ in range(2):
        lost.ring_began([MemberSeen(frozenset({"w-0"}), "100")], rank=1, store=None)  # type: ignore[arg-type]
        lost.look(lost._ring, [record])  # noqa: SLF001
        taken = lost.take()
        assert taken == ([record] if _ == 0 else [])
        clock["now"] += 1.0
    again = ReadyRecord(host="w-4", ready_at=clock["now"] + 1.0, instance_id="444")
    lost.ring_began([MemberSeen(frozenset({"w-0"}), "100")], rank=1, store=None)  # type: ignore[arg-type]
    lost.look(lost._ring, [record, again])  # noqa: SLF001
    assert lost.take() == [again] and lost.take() == []
    lost.close()
