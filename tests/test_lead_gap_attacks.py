"""Attacks on the lead's wait for a step boundary across an epoch's end, third round: a gap between two
steps (an evaluation, timed by ``before_step``) holds no host check, so the lead covers the gap and the
step after it; one gap must not pin the notice rounds to every step. Real TransientImpl ranks on the
tests' collectives, fake clocks."""
from __future__ import annotations

import pytest
from test_protocol_agreement import make_ranks, step_all

from hvd_transient.core.interfaces import Clocks
from hvd_transient.watchers.base import Notice

pytestmark = pytest.mark.timeout(120)
T0 = 1_700_000_000.0


def ranks(leave, **cfg):
    now = {"t": T0}
    clocks = Clocks(monotonic=lambda: now["t"], wall=lambda: now["t"])
    group, impls, _ = make_ranks(check_every_steps=None, check_interval_s=1.0, clocks=clocks, leave=leave, **cfg)
    return now, group, impls


def warm_up(now, group, impls, step_s, gap_s, steps=20):
    """Two epochs with one timed epoch-end gap between them (Keras: before_step in on_epoch_begin)."""
    group.run(lambda r: impls[r].before_step())
    step = 0
    for epoch in range(2):
        if epoch:
            now["t"] += gap_s
            group.run(lambda r: impls[r].before_step())
        for _ in range(steps):
            step += 1
            now["t"] += step_s
            step_all(group, impls, step)
    return step


def worst_phase_departure(leave, step_s, gap_s, window_s=30.0, **cfg):
    """The epoch ends at the last step boundary before leave_at (the worst phase): returns
    (first host check at/after leave_at, deadline, leave_at)."""
    now, group, impls = ranks(leave, **cfg)
    step = warm_up(now, group, impls, step_s, gap_s)
    impls[2].watcher.notice = Notice("gce", "h2", now["t"], now["t"] + window_s, "preempted")
    deadline = now["t"] + window_s
    while True:
        step += 1
        now["t"] += step_s
        out = step_all(group, impls, step)
        if out[2].emergency_step is not None:
            leave_at = out[2].leave_at
            if leave_at is None:
                return now["t"], deadline, None
            break
    # train on to a step boundary 0.1 s before leave_at (one shorter step sets the phase)
    m = int((leave_at - 0.1 - now["t"]) // step_s)
    first = (leave_at - 0.1 - now["t"]) - m * step_s
    for d in ([first] if first > 1e-9 else []) + [step_s] * m:
        step += 1
        now["t"] += d
        step_all(group, impls, step)
    assert abs(now["t"] - (leave_at - 0.1)) < 1e-6
    now["t"] += gap_s  # the epoch ends here: its evaluation (no step, no host check)
    group.run(lambda r: impls[r].before_step())
    while True:
        step += 1
        now["t"] += step_s
        out = step_all(group, impls, step)
        if out[2].check_hosts and now["t"] >= leave_at:
            return now["t"], deadline, leave_at


@pytest.mark.parametrize("step_s,gap_s,lead_s,window_s", [(4.0, 12.0, 2.0, 30.0), (11.0, 30.0, None, 120.0)])
def test_the_lead_covers_the_gap_and_the_step_after_it(step_s, gap_s, lead_s, window_s):
    cfg = {} if lead_s is None else {"leave_lead_s": lead_s}
    at, deadline, leave_at = worst_phase_departure("near_deadline", step_s, gap_s, window_s, **cfg)
    at_n, deadline_n, _ = worst_phase_departure("at_notice", step_s, gap_s, window_s, **cfg)
    assert leave_at is not None, "a lead fits"
    allowance = 10.0 if lead_s is None else lead_s
    print(f"near_deadline: leave_at = deadline-{deadline - leave_at:.1f}, first host check after it at "
          f"deadline{at - deadline:+.1f} s (the lead keeps {allowance:.0f} s for the departure itself); "
          f"at_notice: deadline{at_n - deadline_n:+.1f} s")
    assert at < deadline, f"still in the ring at its deadline ({at - deadline:+.1f} s)"
    assert at <= deadline - allowance + 1e-6, (
        f"the host check that lets the VM go comes at deadline{at - deadline:+.1f} s: its departure "
        f"({allowance:.0f} s kept) ends past the deadline; at_notice's came at deadline{at_n - deadline_n:+.1f} s")


def rounds_over(impls, group, now, step, n, step_s):
    before = impls[0].notice_rounds
    for _ in range(n):
        step += 1
        now["t"] += step_s
        step_all(group, impls, step)
    return impls[0].notice_rounds - before, step


@pytest.mark.parametrize("gap_s", [0.0, 20.0])
def test_one_gap_outside_a_notice_does_not_pin_the_cadence(gap_s):
    now, group, impls = ranks("near_deadline")
    step = warm_up(now, group, impls, 0.2, gap_s)
    n, step = rounds_over(impls, group, now, step, 200, 0.2)
    print(f"gap {gap_s}: {n} rounds in 200 steps of 0.2 s")
    assert n <= 60, f"{n} rounds in 200 steps"


@pytest.mark.parametrize("gap_s", [0.0, 20.0])
def test_a_notice_whose_vm_never_goes_does_not_pin_the_cadence_for_the_rest_of_the_job(gap_s):
    """A VM under notice that is still in the ring long after its deadline (the departure went stale:
    periodic saves resume): the rest of the job must not pay a round per step for one earlier epoch end."""
    now, group, impls = ranks("at_notice")
    step = warm_up(now, group, impls, 0.2, gap_s)
    impls[2].watcher.notice = Notice("gce", "h2", now["t"], now["t"] + 30.0, "preempted")
    # it never leaves: 30 s window + 60 s grace + margin of training at 0.2 s/step
    for _ in range(int(120 / 0.2)):
        step += 1
        now["t"] += 0.2
        step_all(group, impls, step)
    assert not impls[0].run.departure_pending, "the departure went stale"
    n, step = rounds_over(impls, group, now, step, 200, 0.2)
    print(f"gap {gap_s}: {n} rounds in 200 steps of 0.2 s after the stale notice")
    assert n <= 60, f"{n} rounds in 200 steps (one round per step for the rest of the job)"


def first_epoch_departure(leave, epoch_steps, notice_at_step, step_s=0.2, eval_s=20.0, window_s=30.0):
    """A notice in the job's first epoch, at ``notice_at_step``; the epoch (``epoch_steps`` long, as a
    Keras fit says; None: not said) ends with an evaluation of ``eval_s`` that no epoch timed before.
    Returns (the first host check that lets the VM go, its deadline, its leave_at)."""
    now, group, impls = ranks(leave)
    for impl in impls:
        impl.run.epoch_steps = epoch_steps
    group.run(lambda r: impls[r].before_step())  # on_epoch_begin of the first epoch
    step = 0
    for _ in range(notice_at_step):
        step += 1
        now["t"] += step_s
        step_all(group, impls, step)
    impls[2].watcher.notice = Notice("gce", "h2", now["t"], now["t"] + window_s, "preempted")
    deadline = now["t"] + window_s
    leave_at = None
    while True:
        step += 1
        now["t"] += step_s
        out = step_all(group, impls, step)
        if out[2].emergency_step is not None:
            leave_at = out[2].leave_at
            break
    end = epoch_steps or 60
    while True:
        if step % end == 0:  # the epoch's end: its evaluation, then the next epoch begins
            now["t"] += eval_s
            group.run(lambda r: impls[r].before_step())
        step += 1
        now["t"] += step_s
        out = step_all(group, impls, step)
        if out[2].check_hosts and (leave_at is None or now["t"] >= leave_at):
            return now["t"], deadline, leave_at


def test_until_an_epochs_end_was_timed_a_leave_after_it_is_taken_at_once():
    """Never worse than at_notice: the first epoch's evaluation is not timed yet, so a VM whose leave_at
    would come after the epoch's end leaves at once, before the evaluation (with no epoch length said,
    the departure is only known to come after the deadline: the case the rule is for)."""
    at, deadline, leave_at = first_epoch_departure("near_deadline", epoch_steps=60, notice_at_step=50)
    assert leave_at is None and at < deadline - 20.0, (at - deadline, leave_at)
    blind, deadline_b, _ = first_epoch_departure("near_deadline", epoch_steps=None, notice_at_step=50)
    assert blind > deadline_b - 10.0  # without the epoch's length the lead cannot know of the evaluation


def test_an_epoch_whose_end_comes_after_the_leave_does_not_stop_the_training_through():
    at, deadline, leave_at = first_epoch_departure("near_deadline", epoch_steps=1000, notice_at_step=50)
    assert leave_at is not None and at < deadline - 5.0, (at - deadline, leave_at)
