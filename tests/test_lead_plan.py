"""When a VM under notice leaves (``core/leave_plan.py``), as a property: with the default
(``leave="near_deadline"``) every VM under notice either leaves, at a step boundary and with its departure
done, before its deadline, or leaves at once, exactly as ``at_notice`` does; and it never does worse than
``at_notice``.

:func:`simulate` plays one notice on a timeline the way the protocol and Horovod take it: the ranks agree at
a notice round (a step boundary, once the watcher has seen the notice); the emergency save holds that
boundary; the leaving record lands; discovery drops the host at its ``leave_at`` (or at once); Horovod's
driver learns it some time later; the VM leaves at the first step boundary with a host check after that
(every step at the notice, or once the latest round found the VM due; else at the rounds only); the ring's
reset then takes its time. The VM is stopped at its deadline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hvd_transient.core.config import TransientConfig
from hvd_transient.core.election import NoticeRound, steps_until_next_check
from hvd_transient.core.leave_plan import LeavePlan, departure_stale, departures_due, plan_for_round, plan_leave

HOSTS = ("h0", "h1", "h2")
NEAR = TransientConfig(store="memory://x", leave="near_deadline")
AT_NOTICE = TransientConfig(store="memory://x", leave="at_notice")


@dataclass(frozen=True)
class World:
    """One notice, in seconds from the step boundary before it (time 0)."""

    step_s: float        # every step takes this long (the slowest the job timed, too)
    phase_s: float       # the notice comes this long after a step boundary (< step_s)
    seen_after_s: float  # the watcher sees it this long after it came
    window_s: float      # the cloud stops the VM this long after the notice
    dated_early_s: float  # the watcher's deadline is this much earlier than the true one (never later)
    rounds_offset: int   # the step boundary (of the cadence's cycle) that has the next round
    save_s: float        # the emergency save holds the agreed boundary this long
    write_s: float       # the leaving record lands this long after the agreement
    notified_s: float    # Horovod's driver learns of the host's drop this long after it
    reset_s: float       # the ring's reset, from the VM's last step to its end in the ring
    departure_s: float | None  # the slowest departure this job timed before (None: none yet)

    @property
    def noticed_at(self) -> float:
        return self.phase_s

    @property
    def deadline(self) -> float:
        return self.noticed_at + self.window_s

    @property
    def dated_deadline(self) -> float:
        return self.deadline - self.dated_early_s

    def every(self, config: TransientConfig) -> int:
        """Steps between two rounds at this step time (the adaptive cadence, or the fixed one)."""
        if config.check_every_steps:
            return config.check_every_steps
        return steps_until_next_check(self.step_s * 10, 10, config.check_interval_s, config.max_check_every_steps,
                                      slowest_step_s=self.step_s, ring_slowest_step_s=self.step_s)


@dataclass(frozen=True)
class Outcome:
    plan: LeavePlan
    agreed_at: float
    gone_at: float  # the VM is out of the ring (its reset done)
    deadline: float

    @property
    def graceful(self) -> bool:
        return self.gone_at <= self.deadline


def agreement(world: World, config: TransientConfig) -> float:
    """The first round at or after the watcher saw the notice: rounds are every ``every`` steps."""
    every = world.every(config)
    seen = world.noticed_at + world.seen_after_s
    i = math.ceil(seen / world.step_s - 1e-9)
    while (i - world.rounds_offset) % every:
        i += 1
    return i * world.step_s


def simulate(world: World, config: TransientConfig) -> Outcome:
    agreed = agreement(world, config)
    round_ = NoticeRound(leaving=(2,), deadline=world.dated_deadline, vm_deadlines=(None, None, world.dated_deadline),
                         step_s=world.step_s, departure_s=world.departure_s, at=agreed)
    plan = plan_for_round(config, list(HOSTS), round_, world.dated_deadline, agreed)
    every = world.every(config)
    dropped = agreed + world.write_s if plan.leave_at is None else max(plan.leave_at, agreed + world.write_s)
    notified = dropped + world.notified_s
    due_from: float | None = agreed if plan.at_once else None  # rounds found it due from here on
    j = 0
    while True:  # boundaries after the save: the agreed one (held by the save), then one per step
        boundary = agreed + world.save_s + j * world.step_s
        is_round = j % every == 0
        if is_round and due_from is None and plan.leave_at is not None and boundary >= plan.leave_at:
            due_from = boundary  # this round's clock is past leave_at: every step is checked from here
        checked = j == 0 or is_round or due_from is not None  # the emergency's own boundary checks too
        if checked and boundary >= notified:
            return Outcome(plan, agreed, boundary + world.reset_s, world.deadline)
        j += 1


def worlds() -> st.SearchStrategy[World]:
    @st.composite
    def build(draw: st.DrawFn) -> World:
        step = draw(st.floats(0.01, 20.0))
        departure = draw(st.none() | st.floats(0.0, 8.0))
        allowance = NEAR.departure_allowance_s(departure)
        # the assumption the lead rests on: leaving takes no longer than the job's measure of it allows
        leaving = draw(st.floats(0.0, 1.0)) * allowance
        notified = draw(st.floats(0.0, 1.0)) * leaving
        return World(step_s=step, phase_s=draw(st.floats(0.0, 1.0)) * step * 0.999,
                     seen_after_s=draw(st.floats(0.0, 2.0)), window_s=draw(st.floats(1.0, 150.0)),
                     dated_early_s=draw(st.floats(0.0, 20.0)), rounds_offset=draw(st.integers(0, 1000)),
                     save_s=draw(st.floats(0.0, 30.0)), write_s=draw(st.floats(0.0, 30.0)),
                     notified_s=notified, reset_s=leaving - notified, departure_s=departure)
    return build()


@settings(max_examples=1500, deadline=None)
@given(worlds())
def test_near_deadline_leaves_before_the_deadline_or_at_once(world: World) -> None:
    """Where the emergency save and the leaving record are done by ``leave_at`` (else see the next test), a VM
    that trains on is out of the ring before its deadline; one that cannot, leaves at once."""
    near = simulate(world, NEAR)
    if near.plan.at_once:
        assert near.gone_at == simulate(world, AT_NOTICE).gone_at  # the same timeline as at_notice
        return
    assert near.plan.leave_at is not None
    assume(world.save_s <= near.plan.leave_at - near.agreed_at and world.write_s <= near.plan.leave_at - near.agreed_at)
    assert near.graceful, (near, world)


@settings(max_examples=1500, deadline=None)
@given(worlds())
def test_near_deadline_never_does_worse_than_at_notice(world: World) -> None:
    """Whatever the save and the record's write took (the save ends by its own deadline, the notice's less
    ``leave_margin_s``): where leaving at the notice is graceful, so is the default."""
    agreed = agreement(world, NEAR)
    assume(agreed + world.save_s <= max(agreed, world.dated_deadline - NEAR.leave_margin_s))
    if simulate(world, AT_NOTICE).graceful:
        assert simulate(world, NEAR).graceful, world


def test_the_measured_case_slow_steps_in_a_short_window() -> None:
    """15 s steps, a 30 s window, the notice 12.5 s after a step boundary: a 10 s lead let the VM start a step
    its deadline cut short. The lead now covers the step (25 s), so it leaves at the next boundary."""
    world = World(step_s=15.0, phase_s=12.5, seen_after_s=0.2, window_s=30.0, dated_early_s=0.0, rounds_offset=0,
                  save_s=0.3, write_s=0.1, notified_s=1.0, reset_s=1.0, departure_s=None)
    near = simulate(world, NEAR)
    assert near.plan.lead_s == 25.0 and near.plan.leave_at == pytest.approx(world.deadline - 25.0)
    assert near.graceful and near.gone_at == pytest.approx(simulate(world, AT_NOTICE).gone_at)
    # with 3 s steps it trains on for most of the window, and still leaves in time
    world3 = World(**{**world.__dict__, "step_s": 3.0, "phase_s": 2.5})
    near3 = simulate(world3, NEAR)
    assert not near3.plan.at_once and near3.graceful and near3.gone_at > world3.deadline - 20.0


def test_the_plan_leaves_at_once_when_the_lead_does_not_fit_or_the_deadline_is_past() -> None:
    hosts, leaving = list(HOSTS), {"h2"}
    fits = plan_leave(NEAR, hosts, leaving, 130.0, 100.0, step_s=1.0, departure_s=None)
    assert fits.leave_at == pytest.approx(119.0) and fits.lead_s == 11.0 and not fits.at_once
    assert plan_leave(NEAR, hosts, leaving, 110.0, 100.0, step_s=1.0, departure_s=None).at_once
    assert plan_leave(NEAR, hosts, leaving, 90.0, 100.0, step_s=1.0, departure_s=None).at_once  # already past
    assert plan_leave(NEAR, hosts, leaving, 130.0, 100.0, step_s=25.0, departure_s=None).at_once  # slow steps
    assert plan_leave(AT_NOTICE, hosts, leaving, 500.0, 100.0, step_s=1.0, departure_s=None).at_once
    assert plan_leave(NEAR, hosts, set(hosts), 500.0, 100.0, step_s=1.0, departure_s=None).at_once  # whole ring


def test_a_departure_is_due_at_once_or_past_its_leave_at_and_every_rank_agrees() -> None:
    """The rounds' shared clock decides: a departure at once, or past its ``leave_at``, is looked for at every
    step; one before its ``leave_at`` at the rounds only."""
    hosts = list(HOSTS)
    ahead = NoticeRound(leaving=(2,), deadline=200.0, vm_deadlines=(None, None, 200.0), step_s=0.1, at=100.0)
    assert not departures_due(NEAR, hosts, ahead, 30.0)
    assert departures_due(NEAR, hosts, NoticeRound(**{**ahead.__dict__, "at": 190.0}), 30.0)  # past leave_at
    assert departures_due(AT_NOTICE, hosts, ahead, 30.0)
    assert not departures_due(NEAR, hosts, NoticeRound(leaving=(), deadline=None, at=100.0), 30.0)


def test_a_departure_that_cannot_happen_is_stale_after_its_deadline_and_grace() -> None:
    pending = NoticeRound(leaving=(2,), deadline=100.0, vm_deadlines=(None, None, 100.0), at=150.0)
    assert not departure_stale(pending)
    assert departure_stale(NoticeRound(**{**pending.__dict__, "at": 161.0}))
    assert departure_stale(NoticeRound(leaving=(), deadline=None, at=150.0))  # nobody under notice any more
