"""The notice rounds of a new ring: its first round cannot time a step (the ring's first step pays its set-up
and is not timed), so it must not set the cadence from the time since the ring began. Where a frontend
begins the ring within the first step (the PyTorch loop did: 10 ms before that step's report), that time said
the steps took 10 ms, and the next round came 90 steps later: a notice that came meanwhile waited 10 s
for its round under 0.11 s steps (seen in an end-to-end run on a loaded machine). Real TransientImpl ranks
on the tests' collectives, fake clocks."""
from __future__ import annotations

import pytest
from test_protocol_agreement import make_ranks, step_all

from hvd_transient.core.interfaces import Clocks
from hvd_transient.watchers.base import Notice

pytestmark = pytest.mark.timeout(120)
T0 = 1_700_000_000.0


@pytest.mark.parametrize("first_step_s", [0.001, 0.01, 0.11, 3.0])
@pytest.mark.parametrize("notice_after_steps", [1, 2, 5, 30])
def test_a_notice_early_in_a_ring_is_agreed_within_the_check_interval(first_step_s, notice_after_steps):
    """Steps of 0.11 s (the first one's report ``first_step_s`` after the ring began): a notice after any of
    the ring's first steps is agreed within the check interval (1 s) and a step."""
    now = {"t": T0}
    clocks = Clocks(monotonic=lambda: now["t"], wall=lambda: now["t"])
    group, impls, _ = make_ranks(check_every_steps=None, check_interval_s=1.0, clocks=clocks, leave="at_notice",
                                 timed_job=False)
    step_s, step = 0.11, 0
    for n in range(notice_after_steps):
        step += 1
        now["t"] += first_step_s if step == 1 else step_s
        step_all(group, impls, step)
    noticed_at = now["t"]
    impls[2].watcher.notice = Notice("gce", "h2", noticed_at, noticed_at + 30.0, "preempted")
    while True:
        step += 1
        now["t"] += step_s
        out = step_all(group, impls, step)
        if out[2].emergency_step is not None:
            break
        assert now["t"] - noticed_at < 30.0, "the notice was never agreed"
    assert now["t"] - noticed_at <= 1.0 + step_s + 1e-9, (
        f"agreed {now['t'] - noticed_at:.2f} s after the notice (step {step})")
