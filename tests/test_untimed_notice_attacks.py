"""Attacks on the rule "a notice agreed before any rank timed a step of the job leaves at once" (the notice round's
``NoticeRound.step_timed``, from ``RunState.step_timed``, set in ``TransientImpl.after_step``; ``plan_for_round`` in
``core/leave_plan.py``), and on ``RunState.start_ring`` clearing every member's step times at each new ring.

The promises under attack (docs/reliability.md, "A notice waits for the next check"): a VM under notice is let go by
its host check before its deadline less the departure lead, never later than ``leave="at_notice"`` would; where no
rank timed a step the leave is exactly ``at_notice``'s; every rank computes the same decisions and the same
``next_check_step``; a leave is never moved later. Real ``TransientImpl`` ranks on the tests' in-process collectives
(``Ring`` of tests/test_first_round_cadence_attacks.py), fake clocks.

How a VM is let go here: discovery drops it ``drop_after_s`` after the round that agreed its notice (its record
landed and Horovod's driver polled; at its ``leave_at`` if that is later), from then on rank 0 holds a host update
(``HostUpdates.pending``, as Horovod's driver tells rank 0), and the VM goes at the first step whose outcome runs
the host check (``StepOutcome.check_hosts``). ``drop_after_s=0`` is the model of ``_fresh_notice_departure``.

``test_fixed_*`` reproduced a violation, now fixed (the comment above each says how it was found and what changed);
``test_held_*`` are attacks the rules withstood."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
from test_first_round_cadence_attacks import INTERVAL, Ring
from test_protocol_agreement import events

from hvd_transient.core.config import TransientConfig
from hvd_transient.core.election import decode_notice, encode_notice
from hvd_transient.core.leave_plan import plan_for_round

pytestmark = [pytest.mark.timeout(120), pytest.mark.timed]  # bounds wall-clock times
LEAD_S = 10.0  # the departure's share of the lead until a departure is timed (DEFAULT_LEAVE_LEAD_S)


class Updates:
    """Horovod's host updates as rank 0 sees them: pending from ``at`` (None: never)."""

    def __init__(self, ring: Ring, rank: int) -> None:
        self.ring, self.rank, self.at = ring, rank, None
        self.announced: list[Any] = []

    def pending(self) -> bool:
        return self.rank == 0 and self.at is not None and self.ring.now["t"] >= self.at

    def announce_removal(self, hosts: Any) -> None:
        self.announced.append(list(hosts))


@dataclass
class Departure:
    noticed: float
    deadline: float
    agreed_step: int = -1
    agreed_at: float = 0.0
    leave_at: float | None = None  # as planned at the notice's round
    let_go_at: float = 0.0
    checks: list[tuple[int, bool]] = field(default_factory=list)  # (step, check_hosts) from the notice's round on
    ring: Any = None

    @property
    def after_notice(self) -> float:
        return self.let_go_at - self.noticed


def depart(leave: str, step_s: float, *, window_s: float = 30.0, drop_after_s: float = 0.0,
           prelude: Callable[[Ring], None] | None = None, first_dt: float = 0.01, by: int = 1,
           between: Callable[[Ring, Departure], None] | None = None, then_s: float | None = None,
           keep: bool = False, **cfg: Any) -> Departure:
    """Ring h0-h2 (``cfg`` for ``Ring``); ``prelude(ring)`` trains before the notice; h2 gets a notice; steps of
    ``step_s`` (the first one ``first_dt``: a ring's first step, reported 10 ms after its begin as the PyTorch loop
    does, where the next step is a ring's first) until it is agreed; ``between(ring, d)`` right after that; then
    steps of ``then_s`` (default ``step_s``) until h2 is let go (see the module docstring)."""
    ring = Ring(leave=leave, **cfg)
    for r, impl in enumerate(ring.impls):
        impl.host_updates = Updates(ring, r)
    try:
        if prelude is not None:
            prelude(ring)
        noticed = ring.give_notice(2, window_s)
        d = Departure(noticed, noticed + window_s, ring=ring)
        dt = first_dt if ring.impls[0].run.begun_at_step == ring.step else step_s
        while True:
            out = ring.do_step(dt, by=by)
            dt = step_s
            if out[2].emergency_step is not None:
                break
            assert ring.now["t"] < d.deadline, "the notice was never agreed"
        d.agreed_step, d.agreed_at, d.leave_at = ring.step, ring.now["t"], out[2].leave_at
        stale = between is not None  # out is then the notice round's outcome, steps ago: not a check to count
        if between is not None:
            between(ring, d)
        while True:
            leave_at = ring.impls[0].run.leave_at_of.get("h2")
            dropped = max(d.agreed_at + drop_after_s, leave_at if leave_at is not None else -np.inf)
            for r, impl in enumerate(ring.impls):
                if not isinstance(impl.host_updates, Updates):  # a newcomer
                    impl.host_updates = Updates(ring, r)
                impl.host_updates.at = dropped
            if not stale:
                d.checks.append((ring.step, out[2].check_hosts))
            if not stale and out[2].check_hosts and ring.now["t"] >= dropped:
                d.let_go_at = ring.now["t"]
                return d
            assert ring.now["t"] < d.deadline + 120, "h2 was never let go"
            out, stale = ring.do_step(step_s if then_s is None else then_s, by=by), False
    finally:
        if not keep:
            ring.close()


def timed_steps(n: int, step_s: float, *, by: int = 1) -> Callable[[Ring], None]:
    """A prelude: the ring's first step (10 ms after its begin), then ``n`` steps of ``step_s``."""
    def run(ring: Ring) -> None:
        ring.do_step(0.01, by=by)
        for _ in range(n):
            ring.do_step(step_s, by=by)
    return run


# ------------------------------------------------------------------ the vector

@pytest.mark.parametrize("ranks", [
    [(False, 0.0), (False, 0.0), (False, 0.0)],
    [(True, 0.0), (False, 0.0), (False, 0.0)],      # one rank timed steps of 0 s (a fake clock)
    [(False, 0.0), (False, 0.0), (True, 2.5)],      # only the newcomer timed (rank 2)
    [(True, 2.5), (True, 7.25), (False, 0.0)],      # old members timed, a newcomer did not
    [(True, 1e-7), (True, 0.0), (True, 3e4)],       # sub-us and very long steps
])
def test_held_decode_says_some_rank_timed_and_the_slowest_timed_step_on_every_rank(ranks):
    size = len(ranks)
    vecs = [encode_notice(r, size, None, job_step_s=s, step_timed=t) for r, (t, s) in enumerate(ranks)]
    # every rank sums the same vectors (in whatever order the transport adds them): the sums are whole us
    decoded = {decode_notice(np.sum(vecs[k:] + vecs[:k], axis=0), size) for k in range(size)}
    assert len(decoded) == 1
    round_ = decoded.pop()
    assert round_.step_timed == any(t for t, _ in ranks)
    assert round_.step_s == pytest.approx(max([round(s * 1e6) / 1e6 for t, s in ranks if t] or [0.0]), abs=1e-12)


def test_held_a_round_with_no_step_timed_plans_at_once_whatever_else_it_carries():
    """``plan_for_round`` leaves at once where no step was timed, even with a departure, a gap and a step_s
    (the cadence's fallback) that would fit; with a step timed, the same round plans a leave_at."""
    cfg = TransientConfig(store="memory://x", leave="near_deadline")
    base = decode_notice(sum(encode_notice(r, 3, 1000.0 if r == 2 else None, job_step_s=0.0, departure_s=2.0,
                                           gap_s=1.0, wall=100.0, step_timed=False) for r in range(3)), 3)
    assert not base.step_timed
    assert plan_for_round(cfg, ["h0", "h1", "h2"], base, 1000.0, 100.0).at_once
    timed = decode_notice(sum(encode_notice(r, 3, 1000.0 if r == 2 else None, job_step_s=0.0, departure_s=2.0,
                                            gap_s=1.0, wall=100.0, step_timed=r == 0) for r in range(3)), 3)
    assert timed.step_timed and plan_for_round(cfg, ["h0", "h1", "h2"], timed, 1000.0, 100.0).leave_at is not None


# ------------------------------------------------------------------ no step timed: exactly leave="at_notice"

UNTIMED = {  # scenarios whose notice is agreed at a round where no rank of the job timed a step
    "fresh": dict(),
    "fresh-spe2": dict(by=2),
    "relaunch-at-9": dict(begin_step=9),
    "relaunch-every-10": dict(begin_step=9, check_every_steps=10),
    "fresh-saves-every-1": dict(save_every_steps=1),
}


@pytest.mark.parametrize("step_s", [0.5, 25.0, 31.0])
@pytest.mark.parametrize("scenario", list(UNTIMED))
def test_held_a_notice_before_any_timed_step_is_agreed_and_planned_as_at_notice(scenario, step_s):
    """The round that agrees the notice, its plan (at once), its due time, and the let-go where discovery drops
    the VM at once: the same with ``near_deadline`` as with ``at_notice``, on every rank."""
    got = {leave: depart(leave, step_s, keep=True, **UNTIMED[scenario]) for leave in ("at_notice", "near_deadline")}
    try:
        naive, near = got["at_notice"], got["near_deadline"]
        assert (near.agreed_step, near.agreed_at - near.noticed) == (naive.agreed_step, naive.agreed_at - naive.noticed)
        assert near.leave_at is None
        for impl in near.ring.impls:
            assert "h2" not in impl.run.leave_at_of
            assert impl.run.due_at_of["h2"] == pytest.approx(near.agreed_at)
        assert near.after_notice <= naive.after_notice + 1e-9
    finally:
        for d in got.values():
            d.ring.close()


@pytest.mark.parametrize("step_s", [0.0, 0.5, 3.0])
def test_held_steps_of_zero_seconds_count_as_timed(step_s):
    """A ring's second step is timed even at 0 s (a fake clock): a notice agreed after it is planned from it (a
    leave_at, lead = max(step, interval) + 10 s, on every rank), and h2 is let go by its deadline less the
    departure's lead (steps of 0.5 s after the notice's round, so the clock moves)."""
    d = depart("near_deadline", step_s, window_s=60.0, prelude=timed_steps(1, step_s), then_s=0.5, keep=True)
    try:
        assert all(i.run.step_timed for i in d.ring.impls)
        assert d.leave_at == pytest.approx(d.deadline - max(step_s, INTERVAL) - LEAD_S)
        assert d.let_go_at <= d.deadline - LEAD_S + 1e-6
    finally:
        d.ring.close()


@pytest.mark.parametrize("step_s", [0.5, 3.0, 12.0, 18.0])
def test_held_a_notice_at_the_round_after_the_first_timed_step_leaves_within_its_lead(step_s):
    d = depart("near_deadline", step_s, prelude=timed_steps(1, step_s))
    assert d.let_go_at <= d.deadline - LEAD_S + 1e-6


def _only_rank_1_times_its_first_execution(ring: Ring) -> None:
    """Keras ``steps_per_execution=2`` where only rank 1 ran on_epoch_begin (before_step) before the first
    execution: rank 1 alone times it (2 s)."""
    ring.impls[1].before_step()
    ring.do_step(2.0, by=2)
    assert [i.run.step_timed for i in ring.impls] == [False, True, False]


def test_held_one_rank_alone_timed_a_step_and_every_rank_plans_alike():
    d = depart("near_deadline", 0.4, by=2, prelude=_only_rank_1_times_its_first_execution, window_s=60.0, keep=True)
    try:
        impls = d.ring.impls
        assert d.leave_at == pytest.approx(d.deadline - 2.0 - LEAD_S)  # from rank 1's 2 s execution
        assert len({(i.run.leave_at_of.get("h2"), i.run.due_at_of.get("h2"), i.run.next_check_step)
                    for i in impls}) == 1
    finally:
        d.ring.close()


# ------------------------------------------------------------------ at once, then a step is timed


# Found, then fixed (NoticeRounds.agree: a departure is also due where RunState.departure_due_by says so, from the
# agreed due_at_of): a VM that leaves at once because no step was timed (h2's record says: drop it now; leave_at_of
# has no entry) loses the host check at every step as soon as a later round finds a step timed. departures_due
# (core/leave_plan.py), which decides NoticeRounds.departures_due and so TransientImpl._departures_wait, does not look
# at what was planned (run.leave_at_of / due_at_of) but plans every leave again from the current round: at the round
# after the untimed one, step_timed is True, plan_for_round finds deadline - lead in the future, so no departure is
# "due", _departures_wait() is True, and check_hosts is False except at rounds. Discovery drops h2 at once (its record
# has no leave_at), but the ring runs the host check only at its next round (adaptive: up to max(step,
# check_interval_s) later; check_every_steps=10: ten steps later), where at_notice runs it at every step. Measured:
# fixed cadence, 1 s steps, record landing 12 s after the notice: at_notice lets h2 go at 12 s, near_deadline at 20 s
# (the checks at every step stop at step 20); adaptive, 0.5 s steps, drop 0.9 s after: at_notice at 1.01 s,
# near_deadline at 1.51 s. Before this change the same VM was planned a leave_at (wrongly), so the at-once path that
# the rule adds is what drops the per-step check. Fix: departures_due should count as due a handled VM of the ring
# with no leave_at in run.leave_at_of (it was told to leave at once), or one whose leave_at has passed, i.e. decide
# from the agreed plan (leave_at_of/due_at_of, kept alike on every rank and learnt by newcomers in start_ring), not
# from a fresh plan_for_round.
@pytest.mark.parametrize(("step_s", "drop_after_s", "cfg"), [
    (0.5, 0.9, dict()),
    (1.0, 12.0, dict(check_every_steps=10, begin_step=9)),
    (1.0, 15.0, dict(check_every_steps=10, begin_step=9)),
], ids=["adaptive", "every-10-drop-12s", "every-10-drop-15s"])
def test_fixed_an_at_once_leave_loses_its_per_step_host_check_once_a_step_is_timed(step_s, drop_after_s, cfg):
    naive = depart("at_notice", step_s, window_s=60.0, drop_after_s=drop_after_s, **cfg)
    near = depart("near_deadline", step_s, window_s=60.0, drop_after_s=drop_after_s, **cfg)
    assert near.leave_at is None  # at once: no step was timed at the notice's round
    assert all(check for _, check in naive.checks)
    assert near.after_notice <= naive.after_notice + 1e-9, (
        f"let go {near.after_notice:.2f} s after the notice, at_notice {naive.after_notice:.2f} s; host checks "
        f"{[s for s, c in near.checks if c]} of steps {near.checks[0][0]}-{near.checks[-1][0]}")


# Found, then fixed (NoticeRounds.ring_began: a ring begins with a departure due where RunState.departure_due_by says
# so at ring_began_wall; and as above) (across a reset; the first part is not this change's, the second is the
# mechanism above): h2 leaves at once, and the ring resets (same members: a failure, a join) one step later, before h2
# is gone. (a) The new ring starts with no departure due (NoticeRounds.departures_due holds only for the ring whose
# round found it due, _due_in_ring), so until its first round _departures_wait() is True and no step runs the host
# check; with check_every_steps=10 that round is 9 steps away. This holds for any at-once leave under near_deadline,
# here one whose lead (10 x 1 s + 10 s) does not fit in a 15 s window: the new ring's round at step 30 finds it due
# again, but h2, dropped by discovery 3 s after the notice's round, is let go at step 30, 20 s after the notice and
# past its 15 s deadline, where at_notice (_departures_wait() is False whatever the ring) lets it go at 13 s. (b)
# Where h2 left at once because no step was timed, that round (step 20) has steps timed, plans h2 a leave_at in
# departures_due, and the per-step check never comes back (let go at step 30 at the round's host update, at_notice at
# 13 s). Fix: (a) a new ring should start with departures_due True for a handled VM of the ring that leaves at once
# (agreed: run.leave_at_of has no entry for it, start_ring merges what members say), or whose leave_at has passed at
# the ring's start (ring_began_wall, agreed); (b) as above.
@pytest.mark.parametrize(("window_s", "drop_after_s", "cfg"), [
    (60.0, 13.0, dict(begin_step=9)),                   # at once: no step timed at the notice's round
    (15.0, 3.0, dict(prelude=timed_steps(9, 1.0))),     # at once: the lead (20 s) does not fit in the window
], ids=["untimed", "lead-does-not-fit"])
def test_fixed_an_at_once_leave_loses_its_per_step_host_check_after_a_reset(window_s, drop_after_s, cfg):
    def reset_a_step_later(ring: Ring, d: Departure) -> None:
        ring.do_step(1.0)
        ring.reset()

    got = {leave: depart(leave, 1.0, window_s=window_s, drop_after_s=drop_after_s, check_every_steps=10,
                         between=reset_a_step_later, **cfg) for leave in ("at_notice", "near_deadline")}
    assert got["near_deadline"].leave_at is None
    assert got["near_deadline"].after_notice <= got["at_notice"].after_notice + 1e-9, (
        f"near_deadline {got['near_deadline'].after_notice:.2f} s, at_notice {got['at_notice'].after_notice:.2f} s "
        f"(deadline {window_s:.0f} s); host checks {[s for s, c in got['near_deadline'].checks if c]} of steps "
        f"{got['near_deadline'].checks[0][0]}-{got['near_deadline'].checks[-1][0]}")


def test_held_an_at_once_leave_is_never_moved_to_a_later_leave_at():
    """The rounds after the untimed one, which plan h2 a leave_at in departures_due, move nothing: no rank records
    a leave_at for h2, its due time stays the notice's round, its record is not written again."""
    def train_on(ring: Ring, d: Departure) -> None:
        for _ in range(25):
            ring.do_step(1.0)
        for impl in ring.impls:
            assert "h2" not in impl.run.leave_at_of
            assert impl.run.due_at_of["h2"] == pytest.approx(d.agreed_at)
        assert not events(ring.impls[2], "leave_moved")

    depart("near_deadline", 1.0, window_s=120.0, drop_after_s=60.0, between=train_on)


@pytest.mark.parametrize("then_s", [0.1, 5.0, 8.0])
def test_held_a_planned_leave_is_replanned_earlier_never_later(then_s):
    """h2's leave is planned from 5 s steps (120 s window); then steps of ``then_s``: faster ones leave it where it
    was, slower ones move it earlier (the same on every rank), and it is let go by its deadline less the lead."""
    seen: list[set[float | None]] = []

    def watch(ring: Ring, d: Departure) -> None:
        for _ in range(6):
            ring.do_step(then_s)
            seen.append({i.run.leave_at_of.get("h2") for i in ring.impls})

    d = depart("near_deadline", 5.0, window_s=120.0, prelude=timed_steps(3, 5.0), between=watch, then_s=then_s)
    assert d.leave_at == pytest.approx(d.deadline - 5.0 - LEAD_S)
    assert all(len(s) == 1 for s in seen)
    moved = [s.pop() for s in seen]
    assert all(m is not None and m <= d.leave_at + 1e-9 for m in moved)
    assert (moved[-1] < d.leave_at - 0.5) == (then_s > 5.0)
    assert d.let_go_at <= d.deadline - LEAD_S + 1e-6


# ------------------------------------------------------------------ steps timed, then their times dropped


# Found, then fixed (RunState.job_slowest_step_s: each timed step's time is kept for the job at once, not only when a
# round takes it): check_every_steps=10; the ring's steps 2-9 are timed (3 s each: RunState.step_timed turns True on
# every rank), but no round ran since the ring's first step, so their times are only in run.slowest_step_s; a reset
# (same members, no rollback or a rollback to 5) calls RunState.start_ring, which clears slowest_step_s on every rank
# (the rule that keeps next_check_step alike) while step_timed stays True. The round at step 10 (the new ring's first
# step, untimed) then carries step_timed=True and a job step_s of 0 (NoticeRounds._job_slowest_step_s never saw a
# step). plan_for_round plans from step_s=0: lead = 10 x 0 + 10 s, leave_at = deadline - 10 s; the next round, and so
# the next host check, is 10 steps (30 s) later. h2 is let go at its deadline (3 s steps) or after it (5 s: 50 s after
# the notice, 20 s late), where at_notice lets it go at the notice's round (10 ms). This is the violation the rule was
# to fix (test_fixed_check_every_steps_relaunch_* in test_first_round_cadence_attacks.py), reached through "timed"
# steps whose time no round ever heard. Fix: let step_timed say that a step TIME reached the rounds: fold
# run.slowest_step_s into NoticeRounds._job_slowest_step_s before start_ring clears it (begin()), or set the flag only
# where agree() folds a timed step's time into _job_slowest_step_s.
@pytest.mark.parametrize("how", ["reset", "join"])
@pytest.mark.parametrize("step_s", [3.0, 5.0])
def test_fixed_steps_timed_before_a_reset_with_no_round_leave_no_step_time_and_h2_misses_its_deadline(step_s, how):
    def prelude(ring: Ring) -> None:
        timed_steps(8, step_s)(ring)  # steps 1-9, no round (check_every_steps=10)
        assert ring.rounds == [] and all(i.run.step_timed for i in ring.impls)
        if how == "reset":
            ring.reset()
        else:  # a standby h3 joins at step 9: the ring re-forms with it
            ring.reform([*ring.impls, ring.newcomer("h3")])

    naive = depart("at_notice", step_s, prelude=prelude, check_every_steps=10)
    near = depart("near_deadline", step_s, prelude=prelude, check_every_steps=10)
    assert naive.after_notice < 0.1
    assert near.let_go_at <= near.deadline - LEAD_S + 1e-6, (
        f"let go {near.after_notice:.2f} s after the notice (deadline {near.deadline - near.noticed:.0f} s, "
        f"leave_at {None if near.leave_at is None else round(near.leave_at - near.noticed, 2)}, at_notice "
        f"{naive.after_notice:.2f} s)")


@pytest.mark.parametrize("prelude_kind", ["no-reset", "save-round-at-5", "adaptive-reset"])
def test_held_steps_timed_before_a_notice_reach_a_round_before_a_reset_clears_them(prelude_kind):
    """Controls for the violation above: without the reset the round at step 10 hears steps 2-10; a periodic
    save's round at step 5 hears steps 2-5 (as slow as the later ones); with the adaptive cadence, a ring's first
    timed step always has a round (the next round after an untimed one is at the next step)."""
    step_s = 5.0
    cfg: dict[str, Any] = dict(check_every_steps=10)
    if prelude_kind == "no-reset":
        prelude = timed_steps(8, step_s)
    elif prelude_kind == "save-round-at-5":
        cfg["save_every_steps"] = 5

        def prelude(ring: Ring) -> None:
            timed_steps(8, step_s)(ring)
            for impl in ring.impls:
                impl.manager.wait(timeout=30)
            ring.reset()
    else:
        cfg = {}

        def prelude(ring: Ring) -> None:
            timed_steps(8, step_s)(ring)
            ring.reset()
    d = depart("near_deadline", step_s, window_s=120.0, prelude=prelude, **cfg)
    assert d.leave_at is not None  # planned from a step time the rounds heard (5 s), not at once
    assert d.let_go_at <= d.deadline - LEAD_S + 1e-6


# ------------------------------------------------------------------ newcomers and the cadence (start_ring)


def _newcomer_joins(spe: int, slow_s: float) -> Ring:
    """Ring h0-h2 timed (one slow execution of ``slow_s``), reports of ``spe`` steps; then h3 joins."""
    ring = Ring()
    ring.do_step(0.01, by=spe)
    ring.do_step(0.1 * spe, by=spe)
    ring.do_step(slow_s, by=spe)
    ring.to_a_round(0.1 * spe, by=spe)
    ring.reform([*ring.impls, ring.newcomer("h3")], timeout_s=2.0)
    return ring


@pytest.mark.parametrize("spe", [1, 2, 3])
@pytest.mark.parametrize("phase", [0, 1, 2, 7])
def test_held_after_a_newcomer_joins_a_notice_is_agreed_within_the_interval_and_a_step(spe, phase):
    """Ranks agree on next_check_step after every step (Ring.check_agreement), and the newcomer's notice (h3: no
    step timed by it, the old members did) is agreed within the interval and a report of ``spe`` steps."""
    ring = _newcomer_joins(spe, 3.0)
    try:
        assert not ring.impls[3].run.step_timed and all(i.run.step_timed for i in ring.impls[:3])
        for k in range(phase):
            ring.do_step(0.01 if k == 0 else 0.1 * spe, by=spe)
        ring.give_notice(3)
        waited, _ = ring.until_agreed(3, 0.1 * spe, by=spe)
        assert waited <= INTERVAL + 0.1 * spe + 0.01 + 1e-9
    finally:
        ring.close()


@pytest.mark.parametrize("spe", [1, 2])
def test_held_a_vm_training_on_and_a_newcomer_agree_on_its_leave_and_the_cadence(spe):
    """h2 trains on to its leave_at (120 s window) when h3 joins; the ring then slows down (steps six times the
    slowest timed): every rank, the newcomer too, holds the same leave_at, moves it earlier at the same round, and
    sets the same next round; the leave is never moved later."""
    ring = Ring(leave="near_deadline")
    try:
        ring.do_step(0.01, by=spe)
        for _ in range(4):
            ring.do_step(0.5 * spe, by=spe)
        ring.give_notice(2, 120.0)
        ring.until_agreed(2, 0.5 * spe, by=spe)
        first = ring.impls[0].run.leave_at_of["h2"]
        ring.reform([*ring.impls, ring.newcomer("h3")], timeout_s=2.0)
        seen = []
        for k in range(15):
            ring.do_step(0.01 if k == 0 else 3.0 * spe, by=spe)
            at = {i.run.leave_at_of.get("h2") for i in ring.impls}
            assert len(at) == 1, f"the ranks disagree on h2's leave_at at step {ring.step}: {at}"
            seen.append(at.pop())
        assert all(a is not None and b is not None and b <= a for a, b in zip([first, *seen], seen))
        assert seen[-1] < first  # steps grew slower: moved earlier
    finally:
        ring.close()


def test_held_a_ring_reformed_before_any_step_was_timed_leaves_a_newcomers_notice_at_once():
    """A fresh ring resets at its first step and re-forms with h3 before any step is timed: h3's notice at the new
    ring's first round leaves at once on every rank (no rank timed a step), as at_notice would."""
    for leave in ("near_deadline", "at_notice"):
        ring = Ring(leave=leave)
        try:
            ring.do_step(0.01)
            ring.reform([*ring.impls, ring.newcomer("h3")], timeout_s=2.0)
            ring.give_notice(3)
            _, out = ring.until_agreed(3, 0.01)
            assert out.leave_at is None and ring.step == 2
            assert all("h3" not in i.run.leave_at_of for i in ring.impls)
        finally:
            ring.close()
