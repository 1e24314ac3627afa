"""The report's rings read from the ``ring`` events' ring id and member hosts, and rebuilt by the old guess
(same step, size and master, each process once) where the events carry neither (older logs, the baseline).

Each log here is one the guess gets wrong (a clock that runs ahead, a member's lost event, a joiner whose
ring event comes first) while the ids get it right; the last ones have no ids, and the guess still holds.
"""
from __future__ import annotations

from typing import Any

import pytest
from test_report import T0, Log, whole_cluster_notice_log

from hvd_transient.report.analysis import analyze
from hvd_transient.report.run_analysis import FINISHED, KILLED, RunAnalysis


def ring(log: Log, t: float, step: int, hosts: list[str], master: str, ring_id: str,
         pids: dict[str, int] | None = None, *, at: dict[str, float] | None = None, lost: tuple[str, ...] = ()
         ) -> None:
    """Every rank's ``ring`` event of one start, as the plugin writes it (its id, the hosts in rank order).

    ``at``: host -> its event's time where not ``t + 0.001 * rank``; ``lost``: hosts whose event never
    reached the log.
    """
    for rank, host in enumerate(hosts):
        if host not in lost:
            log.add((at or {}).get(host, t + 0.001 * rank), "ring", host, (pids or {}).get(host), step=step,
                    rank=rank, size=len(hosts), master=hosts.index(master), master_host=master, ring=ring_id,
                    hosts=list(hosts))


def without_ids(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log as an older version wrote it: ``ring`` events without their ring id and hosts."""
    return [{k: v for k, v in e.items() if e["event"] != "ring" or k not in ("ring", "hosts")} for e in events]


def rings(a: RunAnalysis) -> list[tuple[float, int, int, tuple[str, ...], bool, tuple[str, ...]]]:
    return [(round(r.started_at - T0, 3), r.step, r.size, r.hosts, r.relaunch, r.joined) for r in a.rings]


def test_a_clock_running_ahead_puts_no_ring_event_in_the_wrong_ring() -> None:
    """C is killed; A and B shrink to a ring of 2 and D joins them at once. B's clock runs 0.5 s ahead: its
    event of the ring of 2 is logged after the ring of 3 began, and the guess makes rings of B alone."""
    log = Log()
    log.start(0.0, ["A", "B", "C"])
    ring(log, 0.1, 0, ["A", "B", "C"], "A", "r0")
    log.each(2.0, "first_step", ["A", "B", "C"], step=1, size=3)
    log.each(4.0, "progress", ["A", "B", "C"], step=20, size=3)    # C's last event: then kill -9
    log.each(10.0, "reset", ["A", "B"], step=15, rolled_back=5, last_step=20)
    ring(log, 10.1, 15, ["A", "B"], "A", "r1")
    log.add(10.3, "start", "D", step=15, rank=2, size=3, restored_step=None)
    log.each(10.4, "reset", ["A", "B"], step=15, rolled_back=0, last_step=15)
    ring(log, 10.5, 15, ["A", "B", "D"], "A", "r2")
    log.each(11.5, "first_step", ["A", "B", "D"], step=16, size=3)
    log.finish(20.0, 100, ["A", "B", "D"], "A")
    for e in log.events:
        if e["host"] == "B":
            e["t"] += 0.5

    a = analyze(log.events)
    assert rings(a) == [(0.1, 0, 3, ("A", "B", "C"), True, ()),
                        (10.1, 15, 2, ("A", "B"), False, ()),
                        (10.5, 15, 3, ("A", "B", "D"), False, ("D",))]
    assert [(j.host, j.t, j.size) for j in a.joins] == [("D", T0 + 10.5, 3)]
    assert {w.host: w.outcome for w in a.workers} == {"A": FINISHED, "B": FINISHED, "C": KILLED, "D": FINISHED}
    assert rings(analyze(without_ids(log.events))) != rings(a)   # the guess: B's late events make rings of their own


def replaced_member_log(*, lost_and_late: bool) -> Log:
    """Two rings of 3 at step 20: A, B, C, then A, B, D once C is killed (D at rank 2).

    ``lost_and_late``: C's event of its last ring never reached the log (killed right after), and D's ring
    event is logged before A's and B's; else every event is there, in rank order.
    """
    log = Log()
    log.start(0.0, ["A", "B", "C"])
    ring(log, 0.1, 0, ["A", "B", "C"], "A", "r0")
    log.each(2.0, "first_step", ["A", "B", "C"], step=1, size=3)
    log.each(4.0, "progress", ["A", "B", "C"], step=20, size=3)
    log.each(9.0, "reset", ["A", "B", "C"], step=20, rolled_back=0, last_step=20)
    ring(log, 9.1, 20, ["A", "B", "C"], "A", "r1", lost=("C",) if lost_and_late else ())
    log.each(10.0, "reset", ["A", "B"], step=20, rolled_back=0, last_step=20)
    log.add(10.2, "start", "D", step=20, rank=2, size=3, restored_step=None)
    ring(log, 10.5, 20, ["A", "B", "D"], "A", "r2",
         at={"D": 10.5, "A": 10.501, "B": 10.502} if lost_and_late else None)
    log.each(11.0, "first_step", ["A", "B", "D"], step=21, size=3)
    log.finish(20.0, 100, ["A", "B", "D"], "A")
    return log


def test_rings_of_one_size_and_step_on_other_hosts_are_told_apart_by_their_ids() -> None:
    """The guess would take D into C's ring (its event matches step, size and master, and C's is missing)."""
    events = replaced_member_log(lost_and_late=True).events
    a = analyze(events)
    assert rings(a) == [(0.1, 0, 3, ("A", "B", "C"), True, ()),
                        (9.1, 20, 3, ("A", "B", "C"), False, ()),      # C in it, though its event was lost
                        (10.5, 20, 3, ("A", "B", "D"), False, ("D",))]
    (j,) = a.joins
    assert (j.host, j.t) == ("D", T0 + 10.5)
    assert j.stall_s == pytest.approx(11.0 - 9.101)   # the survivors' ring events on C's ring -> first step
    (p,) = a.preemptions
    assert (p.host, p.notice, p.ring_at) == ("C", False, T0 + 10.5)
    assert p.resume_ms == pytest.approx(11000 - 9002, abs=1)   # C's last event (its reset) -> first step
    assert "ring of 3 at step 20, master A, members A, B, C" in {e.text.split(": ", 1)[1] for e in a.timeline
                                                                if e.kind == "ring"}
    guessed = analyze(without_ids(events))
    assert [r.hosts for r in guessed.rings] == [("A", "B", "C"), ("A", "B", "D"), ("A", "B")]
    assert [j.t for j in guessed.joins] == [T0 + 9.1]


def test_without_ring_ids_the_rings_are_still_rebuilt() -> None:
    """A log in order, with every event, read as an older version wrote it: the guess finds the same run."""
    events = replaced_member_log(lost_and_late=False).events
    guessed = analyze(without_ids(events))
    assert rings(guessed) == [(0.1, 0, 3, ("A", "B", "C"), True, ()),
                              (9.1, 20, 3, ("A", "B", "C"), False, ()),
                              (10.5, 20, 3, ("A", "B", "D"), False, ("D",))]
    assert [(j.host, j.t) for j in guessed.joins] == [("D", T0 + 10.5)]
    assert guessed == analyze(events)


def test_rings_with_and_without_ids_in_one_log_keep_their_order() -> None:
    """A run an older version started (no ids) and a newer one relaunched: the rings in start order."""
    log = whole_cluster_notice_log()
    new = {"A": 201, "B": 202}
    log.start(60.0, ["A", "B"], step=25, pids=new, restored=25)
    ring(log, 60.1, 25, ["A", "B"], "A", "r-new", new)
    log.each(66.0, "first_step", ["A", "B"], new, step=26, size=2)
    log.finish(80.0, 120, ["A", "B"], "A", pids=new)
    a = analyze(log.events)
    assert rings(a) == [(0.1, 0, 3, ("A", "B", "C"), True, ()), (60.1, 25, 2, ("A", "B"), True, ())]
    assert a.rings[0].ended_at == pytest.approx(T0 + 5.502)
    assert all(p.cold_restart for p in a.preemptions) and a.joins == ()
