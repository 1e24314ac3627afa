"""`hvd-transient report`: the analysis of event logs, the CLI, the JSON and the plot.

Unit tests build event lists by hand (one scenario each); the CLI tests write
event files through the real EventLog into a local store; one test reads the
log of a real run kept under tests/data/report_events; the last one makes a real
run with LocalCluster and checks the report of its preemption.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from ckpt_service.stores import LocalStore, ObjectStore, open_store
from hvd_transient.gcp.pricing import load_price_table
from hvd_transient.report import main
from hvd_transient.report.analysis import analyze
from hvd_transient.report.costs import DEFAULT_INSTANCE_TYPE, estimate_costs
from hvd_transient.report.render import render_text, to_json
from hvd_transient.report.run_analysis import FINISHED, KILLED, LOST, PREEMPTED, NoEventsError
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import EventLog

T0 = 1_800_000_000.0
PIDS = {"A": 101, "B": 102, "C": 103, "D": 104}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REAL_LOG = Path(__file__).resolve().parent / "data" / "report_events"


class Log:
    """A hand-written event log; times are seconds after T0."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def add(self, t: float, event: str, host: str, pid: int | None = None, /, **fields: Any) -> None:
        self.events.append({"t": T0 + t, "event": event, "host": host, "pid": pid or PIDS[host], **fields})

    def each(self, t: float, event: str, hosts: list[str], pids: dict[str, int] | None = None, /,
             **fields: Any) -> None:
        for i, host in enumerate(hosts):
            self.add(t + 0.001 * i, event, host, (pids or {}).get(host), **fields)

    def ring(self, t: float, step: int, hosts: list[str], master: str, pids: dict[str, int] | None = None,
             base_lr: float = 0.01) -> None:
        for rank, host in enumerate(hosts):
            self.add(t + 0.001 * rank, "ring", host, (pids or {}).get(host), step=step, rank=rank,
                     size=len(hosts), master=hosts.index(master), master_host=master)
            self.add(t + 0.01 + 0.001 * rank, "lr", host, (pids or {}).get(host), lr=base_lr * len(hosts),
                     size=len(hosts), mode="linear")

    def start(self, t: float, hosts: list[str], step: int = 0, pids: dict[str, int] | None = None,
              restored: int | None = None) -> None:
        for rank, host in enumerate(hosts):
            self.add(t + 0.001 * rank, "start", host, (pids or {}).get(host), step=step, rank=rank,
                     size=len(hosts), restored_step=restored if rank == 0 else None)

    def notice(self, t: float, host: str, window: float = 30.0) -> None:
        self.add(t, "notice", host, source="gce", reason="preempted", detected_at=T0 + t,
                 deadline=T0 + t + window)

    def finish(self, t: float, step: int, hosts: list[str], master: str, pids: dict[str, int] | None = None) -> None:
        self.each(t, "train_end", hosts, pids, step=step)
        self.each(t + 0.1, "save_end", hosts, pids, step=step, kind="final", seconds=0.5, bytes=2000)
        self.add(t + 0.2, "commit", master, (pids or {}).get(master), step=step, kind="final", size=len(hosts))
        self.each(t + 0.3, "weights", hosts, pids, step=step, crc=42, size=len(hosts))


def preempted_worker_log() -> Log:
    """A (master), B, C; C gets a notice at step 25 and leaves; A and B finish at step 100."""
    log = Log()
    log.start(0.0, ["A", "B", "C"])
    log.ring(0.1, 0, ["A", "B", "C"], "A")
    log.each(2.0, "first_step", ["A", "B", "C"], step=1, size=3)
    log.each(3.0, "progress", ["A", "B", "C"], step=10, size=3)
    log.each(4.0, "async_save", ["A", "B", "C"], step=20, stall_ms=5.0, size=3)
    log.add(4.5, "commit", "A", step=20, kind="periodic", size=3)
    log.notice(5.0, "C")
    log.each(5.1, "notice_agreed", ["A", "B", "C"], step=25, leaving=["C"], deadline=T0 + 30.0, size=3)
    log.each(5.2, "save_start", ["A", "B", "C"], step=25, kind="emergency", size=3)
    log.each(5.3, "save_end", ["A", "B", "C"], step=25, kind="emergency", seconds=0.2, bytes=1000)
    log.add(5.4, "commit", "A", step=25, kind="emergency", size=3)
    log.add(5.5, "leave_published", "C", step=25, deadline=T0 + 35.0)
    log.each(8.0, "reset", ["A", "B"], step=30, rolled_back=0, last_step=30)
    log.ring(8.1, 30, ["A", "B"], "A")
    log.each(8.5, "first_step", ["A", "B"], step=31, size=2)
    log.each(12.0, "progress", ["A", "B"], step=60, size=2)
    log.finish(20.0, 100, ["A", "B"], "A")
    return log


# ----------------------------------------------------------------------------- analysis


def test_worker_preempted_with_notice() -> None:
    a = analyze(preempted_worker_log().events)
    (p,) = a.preemptions
    assert (p.host, p.was_master, p.notice, p.agreed_step) == ("C", False, True, 25)
    assert p.checkpoint_committed and p.deadline_met and p.new_master is None
    assert p.steps_rolled_back == 0
    assert p.resume_ms == pytest.approx(3000.0, abs=1)       # leave_published 5.5 -> first_step 8.5
    assert p.notice_to_commit_ms == pytest.approx(400.0, abs=1)
    assert p.reset_to_first_step_ms == pytest.approx(500.0, abs=1)
    assert not p.cold_restart
    outcomes = {w.host: w.outcome for w in a.workers}
    assert outcomes == {"A": FINISHED, "B": FINISHED, "C": PREEMPTED}
    assert [r.size for r in a.rings] == [3, 2] and a.rings[0].relaunch and not a.rings[1].relaunch
    assert a.rings[1].hosts == ("A", "B")
    assert [c.lr for c in a.lr_changes] == pytest.approx([0.03, 0.02])
    assert [(c.kind, c.step) for c in a.commits] == [("periodic", 20), ("emergency", 25), ("final", 100)]
    assert a.completed and a.ended_by == "end of training" and a.final_step == 100
    assert a.wall_s == pytest.approx(20.302, abs=1e-3)          # first start -> last weights
    assert a.joins == ()
    # A: 5 ms async stall + 0.2 s emergency + 0.5 s final save; C never saved a final checkpoint
    assert a.checkpoint_stall_s == pytest.approx(0.705)
    assert a.stall_s_by_worker["C (103)"] == pytest.approx(0.205)
    assert a.bytes_written == 3 * 1000 + 2 * 2000
    assert a.weights_consistent is True and a.last_committed_step == 100
    assert p.marks == pytest.approx({"notice": T0 + 5.0, "agreed": T0 + 5.1, "committed": T0 + 5.4,
                                     "left": T0 + 5.5, "reset": T0 + 8.0, "ring": T0 + 8.1,
                                     "first_step": T0 + 8.5})
    assert list(p.marks) == ["notice", "agreed", "committed", "left", "reset", "ring", "first_step"]
    assert p.agreed_to_left_ms == pytest.approx(400.0, abs=1)  # the emergency checkpoint held every rank
    assert (p.survivor_resets, p.last_step_before_reset, p.step_after_reset) == (1, 30, 30)


def test_master_preempted_with_election() -> None:
    log = Log()
    log.start(0.0, ["A", "B", "C"])
    log.ring(0.1, 0, ["A", "B", "C"], "A")
    log.each(2.0, "first_step", ["A", "B", "C"], step=1, size=3)
    log.notice(5.0, "A")
    log.each(5.1, "notice_agreed", ["A", "B", "C"], step=25, leaving=["A"], deadline=T0 + 6.0, size=3)
    log.each(5.2, "election", ["A", "B", "C"], step=25, old_master=0, new_master=1, old_master_host="A",
             new_master_host="B")
    log.add(7.0, "commit", "B", step=25, kind="emergency", size=3)   # after the 6 s deadline
    log.add(7.1, "leave_published", "A", step=25, deadline=T0 + 35.0)
    log.each(9.0, "reset", ["B", "C"], step=33, rolled_back=0, last_step=33)
    log.ring(9.1, 33, ["B", "C"], "B")
    log.each(9.6, "first_step", ["B", "C"], step=34, size=2)
    log.finish(15.0, 80, ["B", "C"], "B")
    a = analyze(log.events)
    (p,) = a.preemptions
    assert p.host == "A" and p.was_master and p.new_master == "B"
    assert p.checkpoint_committed and p.deadline_met is False
    assert p.notice_to_commit_ms == pytest.approx(2000.0, abs=1)
    assert p.resume_ms == pytest.approx(2500.0, abs=1)
    assert [r.master_host for r in a.rings] == ["A", "B"]
    assert a.completed and a.final_step == 80


def test_kill_without_notice_rolls_back() -> None:
    log = Log()
    log.start(0.0, ["A", "B", "C"])
    log.ring(0.1, 0, ["A", "B", "C"], "A")
    log.each(2.0, "first_step", ["A", "B", "C"], step=1, size=3)
    log.each(4.0, "progress", ["A", "B", "C"], step=20, size=3)    # C's last event: then kill -9
    log.each(15.0, "reset", ["A", "B"], step=15, rolled_back=7, last_step=22)
    log.ring(15.1, 15, ["A", "B"], "A")
    log.each(15.6, "first_step", ["A", "B"], step=16, size=2)
    log.finish(30.0, 60, ["A", "B"], "A")
    a = analyze(log.events)
    (p,) = a.preemptions
    assert (p.host, p.notice, p.was_master, p.checkpoint_committed) == ("C", False, False, False)
    assert p.steps_rolled_back == 7 and p.step == 20 and p.agreed_step is None
    assert p.resume_ms == pytest.approx(11600.0, abs=5)   # C progress 4.0 -> first_step 15.6
    assert p.notice_to_commit_ms is None and p.deadline_met is None
    assert {w.host: w.outcome for w in a.workers}["C"] == KILLED
    assert any(e.kind == "vanished" and e.host == "C" for e in a.timeline)
    assert a.completed
    assert p.agreed_to_left_ms is None and list(p.marks) == ["left", "reset", "ring", "first_step"]

    # whoever killed it knows when: the departure, and the resume, count from then
    (known,) = analyze(log.events, kills={"C": T0 + 10.0}).preemptions
    assert known.departed_at == T0 + 10.0 and known.resume_ms == pytest.approx(5600.0, abs=5)
    assert known.steps_rolled_back == 7


def test_rings_of_ranks_that_only_know_their_own_host() -> None:
    """The plain-Horovod baseline names the master host on rank 0 only: one ring, not two."""
    log = Log()
    log.start(0.0, ["A", "B"])
    log.ring(0.1, 0, ["A", "B"], "A")
    for e in log.events:
        if e["event"] == "ring" and e["rank"] != 0:
            e["master_host"] = None
    log.each(2.0, "first_step", ["A", "B"], step=1, size=2)
    a = analyze(log.events)
    assert [(r.size, r.master_host, r.hosts) for r in a.rings] == [(2, "A", ("A", "B"))]


def test_kill_before_the_first_step_waits_for_the_next_ring() -> None:
    """A worker that dies before the ring's first step: the old ring's first step is not a resume."""
    log = Log()
    log.start(0.0, ["A", "B", "C"])
    log.ring(0.1, 0, ["A", "B", "C"], "A")                       # C's last event: its lr at 0.112
    log.each(2.0, "first_step", ["A", "B"], step=1, size=3)
    log.each(12.0, "reset", ["A", "B"], step=0, rolled_back=1, last_step=1)
    log.ring(12.1, 0, ["A", "B"], "A")
    log.each(12.5, "first_step", ["A", "B"], step=1, size=2)
    (p,) = analyze(log.events).preemptions
    assert p.host == "C" and p.steps_rolled_back == 1
    assert p.resume_ms == pytest.approx(12500 - 112, abs=1)


def test_join_is_not_a_relaunch() -> None:
    log = Log()
    log.start(0.0, ["A", "B"])
    log.ring(0.1, 0, ["A", "B"], "A")
    log.each(2.0, "first_step", ["A", "B"], step=1, size=2)
    log.add(10.0, "start", "D", step=50, rank=2, size=3, restored_step=None)
    log.each(10.5, "reset", ["A", "B"], step=50, rolled_back=0, last_step=50)
    log.ring(11.0, 50, ["A", "B", "D"], "A")
    log.each(12.0, "first_step", ["A", "B", "D"], step=51, size=3)
    log.finish(20.0, 90, ["A", "B", "D"], "A")
    a = analyze(log.events)
    (j,) = a.joins
    assert (j.host, j.pid, j.step, j.size) == ("D", 104, 50, 3)
    assert a.rings[1].joined == ("D",) and not a.rings[1].relaunch
    assert a.preemptions == ()
    assert all(w.outcome == FINISHED for w in a.workers)
    assert [c.lr for c in a.lr_changes] == pytest.approx([0.02, 0.03])


def test_join_stall_of_the_survivors() -> None:
    """From the survivors' last step before their reset to their first step on the bigger ring."""
    log = Log()
    log.start(0.0, ["A", "B"])
    log.ring(0.1, 0, ["A", "B"], "A")
    log.each(2.0, "first_step", ["A", "B"], step=1, size=2)
    log.each(6.0, "progress", ["A", "B"], step=40, size=2)
    log.each(7.0, "progress", ["A", "B"], step=50, size=2)       # the last step before the ring changes
    log.add(9.0, "start", "D", step=52, rank=2, size=3, restored_step=None)
    log.each(9.5, "reset", ["A", "B"], step=52, rolled_back=0, last_step=52)
    log.ring(10.0, 52, ["A", "B", "D"], "A")
    log.each(12.5, "first_step", ["D", "A", "B"], step=53, size=3)  # the joiner traced its step first
    log.each(14.0, "progress", ["A", "B", "D"], step=60, size=3)
    log.finish(20.0, 90, ["A", "B", "D"], "A")
    a = analyze(log.events)
    (j,) = a.joins
    assert j.stalled_from == pytest.approx(T0 + 7.001) and j.resumed_at == pytest.approx(T0 + 12.501)
    assert j.stall_s == pytest.approx(5.5) and j.steps_rolled_back == 0
    ring_line = next(e.text for e in a.timeline if e.text.startswith("join D"))
    assert ring_line.endswith("survivors stalled 5.50 s")
    assert "joins: 1 (survivors stalled 5.50 s)" in render_text(a, None)
    assert to_json(a, None)["joins"][0]["stall_s"] == pytest.approx(5.5)


def test_join_stall_starts_at_the_survivors_last_completed_step() -> None:
    """Resets that say when their last step completed give the stall exactly, not the last progress event."""
    log = Log()
    log.start(0.0, ["A", "B"])
    log.ring(0.1, 0, ["A", "B"], "A")
    log.each(2.0, "first_step", ["A", "B"], step=1, size=2)
    log.each(7.0, "progress", ["A", "B"], step=50, size=2)
    log.add(9.0, "start", "D", step=56, rank=2, size=3, restored_step=None)
    log.add(9.5, "reset", "A", step=56, rolled_back=0, last_step=56, last_step_at=T0 + 9.2)
    log.add(9.5, "reset", "B", step=56, rolled_back=0, last_step=56, last_step_at=T0 + 9.3)
    log.ring(10.0, 56, ["A", "B", "D"], "A")
    log.each(10.4, "first_step", ["A", "B", "D"], step=57, size=3)
    (j,) = analyze(log.events).joins
    assert j.stalled_from == pytest.approx(T0 + 9.3) and j.stall_s == pytest.approx(10.401 - 9.3, abs=0.01)


def test_join_before_any_step_on_the_old_ring_stalls_from_its_start() -> None:
    log = Log()
    log.start(0.0, ["A", "B"])
    log.ring(0.1, 0, ["A", "B"], "A")
    log.each(3.0, "reset", ["A", "B"], step=0, rolled_back=0, last_step=0)
    log.ring(4.0, 0, ["A", "B", "D"], "A", pids={"D": 104})
    log.each(6.0, "first_step", ["A", "B", "D"], step=1, size=3)
    (j,) = analyze(log.events).joins
    assert j.stall_s == pytest.approx(6.0 - 0.101)          # from B's ring event on the first ring


def whole_cluster_notice_log() -> Log:
    """Every worker gets a notice; the emergency checkpoint commits; then the log stops."""
    log = Log()
    log.start(0.0, ["A", "B", "C"])
    log.ring(0.1, 0, ["A", "B", "C"], "A")
    log.each(2.0, "first_step", ["A", "B", "C"], step=1, size=3)
    for host in ("A", "B", "C"):
        log.notice(5.0, host)
    log.each(5.1, "notice_agreed", ["A", "B", "C"], step=25, leaving=["A", "B", "C"], deadline=T0 + 30.0, size=3)
    log.add(5.4, "commit", "A", step=25, kind="emergency", size=3)
    log.each(5.5, "leave_published", ["A", "B", "C"], step=25, deadline=T0 + 35.0)
    return log


def test_whole_cluster_loss_with_notice() -> None:
    a = analyze(whole_cluster_notice_log().events)
    assert [p.host for p in a.preemptions] == ["A", "B", "C"]
    assert all(p.notice and p.checkpoint_committed and p.agreed_step == 25 for p in a.preemptions)
    assert [p.was_master for p in a.preemptions] == [True, False, False]
    assert all(p.resume_ms is None and p.steps_rolled_back == 0 for p in a.preemptions)
    assert not a.completed and a.ended_by == "incomplete"
    assert a.final_step == 25 and a.last_committed_step == 25
    assert a.wall_s == pytest.approx(5.502, abs=1e-3)


def test_whole_cluster_loss_then_cold_restart_on_fewer_workers() -> None:
    log = whole_cluster_notice_log()
    new = {"A": 201, "B": 202}
    log.start(60.0, ["A", "B"], step=25, pids=new, restored=25)
    log.add(60.05, "restore", "A", 201, step=25, writers=3, bytes=10_000)
    log.ring(60.1, 25, ["A", "B"], "A", pids=new)
    log.each(66.0, "first_step", ["A", "B"], new, step=26, size=2)
    log.finish(80.0, 120, ["A", "B"], "A", pids=new)
    a = analyze(log.events)
    assert len(a.workers) == 5
    assert [r.relaunch for r in a.rings] == [True, True]
    assert a.joins == ()                                  # a relaunch is not a join
    assert all(p.cold_restart for p in a.preemptions)
    assert [p.resume_ms for p in a.preemptions] == pytest.approx([60500.0] * 3, abs=5)
    assert a.completed and a.final_step == 120
    assert {w.pid: w.restored_step for w in a.workers if w.pid in (201, 202)} == {201: 25, 202: None}
    assert a.rings[0].ended_at == pytest.approx(T0 + 5.502)   # no ring ran until the relaunch


def test_static_job_stopped_by_a_notice() -> None:
    """Without elastic mode a notice checkpoints and stops every rank at the agreed step."""
    log = Log()
    log.start(0.0, ["A", "B"])
    log.ring(0.1, 0, ["A", "B"], "A")
    log.each(2.0, "first_step", ["A", "B"], step=1, size=2)
    log.notice(5.0, "B")
    log.each(5.1, "notice_agreed", ["A", "B"], step=25, leaving=["B"], deadline=T0 + 30.0, size=2)
    log.add(5.4, "commit", "A", step=25, kind="emergency", size=2)
    log.add(5.5, "leave_published", "B", step=25, deadline=T0 + 35.0)
    log.each(5.6, "train_end", ["A", "B"], step=25)
    log.each(5.7, "weights", ["A", "B"], step=25, crc=1, size=2)
    a = analyze(log.events)
    assert a.completed and a.ended_by == "notice (stopped for a relaunch)" and a.final_step == 25
    (p,) = a.preemptions
    assert p.host == "B" and p.checkpoint_committed and p.resume_ms is None


def test_whole_cluster_killed_without_notice_is_lost_not_preempted() -> None:
    log = Log()
    log.start(0.0, ["A", "B"])
    log.ring(0.1, 0, ["A", "B"], "A")
    log.each(2.0, "first_step", ["A", "B"], step=1, size=2)
    log.each(3.0, "progress", ["A", "B"], step=10, size=2)
    a = analyze(log.events)
    assert {w.outcome for w in a.workers} == {LOST}
    assert a.preemptions == () and not a.completed and a.final_step == 10


def test_empty_log_is_an_error() -> None:
    with pytest.raises(NoEventsError):
        analyze([])


def test_cost_comparison_per_second_billing(tmp_path: Path) -> None:
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"currency": "USD", "instance_types": {
        "test/gpu": {"on_demand_per_hour": 3.6, "spot_per_hour": 0.36, "min_billed_seconds": 0}}}))
    a = analyze(preempted_worker_log().events)
    cost = estimate_costs(a, load_price_table(prices), "test/gpu")
    seconds = [w.seconds for w in a.workers]
    assert cost.transient_usd == pytest.approx(sum(math.ceil(s) for s in seconds) * 0.36 / 3600)
    assert cost.on_demand_usd == pytest.approx(sum(math.ceil(s) for s in seconds) * 3.6 / 3600)
    assert cost.single_seconds == pytest.approx(sum(seconds))
    assert cost.single_on_demand_usd == pytest.approx(math.ceil(sum(seconds)) * 3.6 / 3600)
    with_driver = estimate_costs(a, load_price_table(prices), "test/gpu", driver_instance_type="test/gpu")
    assert with_driver.transient_usd == pytest.approx(cost.transient_usd + math.ceil(a.wall_s) * 3.6 / 3600)
    assert with_driver.single_on_demand_usd == cost.single_on_demand_usd


def test_default_instance_type_is_priced() -> None:
    cost = estimate_costs(analyze(preempted_worker_log().events), load_price_table(None))
    assert cost.instance_type == DEFAULT_INSTANCE_TYPE
    assert 0 < cost.transient_usd < cost.on_demand_usd


def test_text_report_sections() -> None:
    a = analyze(preempted_worker_log().events)
    text = render_text(a, estimate_costs(a, load_price_table(None)))
    for section in ("== timeline", "== workers ==", "== preemptions ==", "== summary ==", "== cost =="):
        assert section in text
    assert "notice agreed at step 25: leaving C" in text
    assert text.count("notice agreed") == 1            # written by every rank, shown once
    assert "assumption: single on-demand VM time" in text


def test_json_document_is_serialisable_with_and_without_costs() -> None:
    a = analyze(preempted_worker_log().events)
    bare = json.loads(json.dumps(to_json(a, None)))
    assert bare["cost_transient_usd"] is None and bare["instance_type"] is None
    assert bare["preemptions"][0]["t_s"] == pytest.approx(5.5) and bare["wall_s"] == pytest.approx(a.wall_s)
    assert [r["size"] for r in bare["rings"]] == [3, 2]
    priced = to_json(a, estimate_costs(a, load_price_table(None), "icac19/K80"))
    assert priced["instance_type"] == "icac19/K80" and priced["cost"]["assumption"].startswith("single")


# ----------------------------------------------------------------------------- real run log


def test_real_run_log_fixture() -> None:
    """Worker notice, join, master notice with election, kill -9, operator stop (a real run)."""
    from hvd_transient.telemetry.events import read_events, read_records

    a = analyze(read_records(LocalStore(REAL_LOG)))
    assert a == analyze(read_events(LocalStore(REAL_LOG)))   # typed records or the logged dicts
    assert [r.size for r in a.rings] == [3, 2, 3, 2, 1]
    worker, master, killed = a.preemptions
    assert (worker.host, worker.notice, worker.was_master, worker.checkpoint_committed) == \
        ("localhost", True, False, True)
    assert worker.steps_rolled_back == 0 and (worker.resume_ms or 0) > 0 and worker.deadline_met
    assert (master.host, master.was_master, master.new_master) == ("127.0.0.1", True, "127.0.1")
    assert master.checkpoint_committed and master.steps_rolled_back == 0
    assert (killed.host, killed.notice, killed.checkpoint_committed) == ("127.1", False, False)
    assert killed.steps_rolled_back > 0
    assert [j.host for j in a.joins] == ["127.1"]
    (join,) = a.joins
    # the survivors' progress at step 60 (12.9 s) -> their first step on the ring of 3 (18.58 s)
    assert join.stall_s == pytest.approx(5.69, abs=0.01) and join.steps_rolled_back == 0
    assert a.completed and a.ended_by == "stop request" and a.weights_consistent
    assert {w.host: w.outcome for w in a.workers} == {
        "localhost": PREEMPTED, "127.0.0.1": PREEMPTED, "127.1": KILLED, "127.0.1": FINISHED}


# ----------------------------------------------------------------------------- CLI


def write_log_through_eventlog(store: ObjectStore) -> None:
    """A worker-preemption run, written by the real EventLog (one log per host, real times)."""
    logs = {h: EventLog(store, h, min_flush_interval_s=0.0) for h in ("localhost", "127.0.0.1", "127.0.1")}
    hosts = list(logs)
    for rank, h in enumerate(hosts):
        logs[h].emit(ev.Start(step=0, rank=rank, size=3, restored_step=None))
    for rank, h in enumerate(hosts):
        logs[h].emit(ev.Ring(step=0, rank=rank, size=3, master=0, master_host="localhost"))
    for h in hosts:
        logs[h].emit(ev.FirstStep(step=1, size=3))
    for h in hosts:
        logs[h].emit(ev.AsyncSave(step=5, stall_ms=3.0, size=3))
    logs["localhost"].emit(ev.Commit(step=5, kind="periodic", size=3))
    notice = logs["127.0.1"].emit(ev.Notice(source="gce", reason="preempted", detected_at=None, deadline=None))
    for h in hosts:
        logs[h].emit(ev.NoticeAgreed(step=8, leaving=("127.0.1",), deadline=notice.t + 25, size=3))
    for h in hosts:
        logs[h].emit(ev.SaveEnd(step=8, kind="emergency", seconds=0.01, bytes=100))
    logs["localhost"].emit(ev.Commit(step=8, kind="emergency", size=3))
    logs["127.0.1"].emit(ev.LeavePublished(step=8, deadline=None))
    for h in hosts[:2]:
        logs[h].emit(ev.Reset(step=12, rolled_back=0, last_step=12))
    for rank, h in enumerate(hosts[:2]):
        logs[h].emit(ev.Ring(step=12, rank=rank, size=2, master=0, master_host="localhost"))
    for h in hosts[:2]:
        logs[h].emit(ev.FirstStep(step=13, size=2))
    for h in hosts[:2]:
        logs[h].emit(ev.TrainEnd(step=30))
    logs["localhost"].emit(ev.Commit(step=30, kind="final", size=2))
    for rank, h in enumerate(hosts[:2]):
        logs[h].emit(ev.Weights(step=30, crc=7, size=2, rank=rank))
    for log in logs.values():
        log.flush()


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    write_log_through_eventlog(LocalStore(store))
    out_json, out_png = tmp_path / "report.json", tmp_path / "report.png"
    assert main([str(store), "--json", str(out_json), "--plot", str(out_png), "--instance-type", "icac19/K80"]) == 0
    stdout = capsys.readouterr().out
    assert "== preemptions ==" in stdout and "127.0.1" in stdout

    doc = json.loads(out_json.read_text())
    for key in ("completed", "final_step", "wall_s", "preemptions", "joins", "commits", "checkpoint_stall_s",
                "bytes_written", "cost_transient_usd", "cost_on_demand_usd", "cost_single_on_demand_usd",
                "instance_type"):
        assert key in doc, key
    assert doc["completed"] is True and doc["final_step"] == 30 and doc["instance_type"] == "icac19/K80"
    (p,) = doc["preemptions"]
    for key in ("host", "was_master", "notice", "steps_rolled_back", "resume_ms", "checkpoint_committed"):
        assert key in p, key
    assert p["host"] == "127.0.1" and p["notice"] is True and p["checkpoint_committed"] is True
    assert p["was_master"] is False and p["steps_rolled_back"] == 0 and p["resume_ms"] > 0
    assert [c["kind"] for c in doc["commits"]] == ["periodic", "emergency", "final"]
    assert doc["bytes_written"] == 300
    assert 0 < doc["cost_transient_usd"] < doc["cost_on_demand_usd"]

    png = out_png.read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_the_plot_shows_a_bar_per_worker_a_marker_per_event_and_the_ring_size(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from hvd_transient.report.plot import _ring_size_series, run_figure
    from hvd_transient.telemetry.events import read_events

    store = LocalStore(tmp_path / "store")
    write_log_through_eventlog(store)
    a = analyze(read_events(store))
    fig = run_figure(a)
    try:
        def shown(gid: str) -> int:
            return sum(1 for ax in fig.axes for artist in ax.get_children() if artist.get_gid() == gid)

        assert shown("worker") == len(a.workers) == 3
        assert shown("notice") == sum(w.notice_at is not None for w in a.workers) == 1
        assert shown("departure") == len(a.preemptions) == 1
        assert shown("join") == len(a.joins)
        for kind in ("periodic", "emergency", "final"):
            assert shown(f"commit:{kind}") == sum(c.kind == kind for c in a.commits) == 1
        (ring,) = [line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == "ring_size"]
        assert list(ring.get_ydata()) == _ring_size_series(a)[1]
        assert max(ring.get_ydata()) == 3 and 2 in list(ring.get_ydata())  # the ring shrank at the leave
    finally:
        plt.close(fig)


def test_cli_reads_a_gcs_store(tmp_path: Path, gcs_emulator_session: Any,
                               capsys: pytest.CaptureFixture[str]) -> None:
    """The real google-cloud-storage client against fake-gcs-server."""
    url = f"gs://{gcs_emulator_session.new_bucket('report')}/run1"
    write_log_through_eventlog(open_store(url))
    out = tmp_path / "r.json"
    assert main([url, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["completed"] and [p["host"] for p in doc["preemptions"]] == ["127.0.1"]
    empty = f"gs://{gcs_emulator_session.new_bucket('report')}/nothing"
    assert main([empty]) == 2
    assert f"no event log under {empty}" in capsys.readouterr().err


def test_cli_through_the_console_dispatcher(capsys: pytest.CaptureFixture[str]) -> None:
    from hvd_transient.cli import main as cli_main

    assert cli_main(["report", str(REAL_LOG)]) == 0
    assert "master moved 127.0.0.1 -> 127.0.1" in capsys.readouterr().out


def test_cli_without_events_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 2
    assert f"no event log under {empty}: is this the --store of a run?" in capsys.readouterr().err
    missing = tmp_path / "no-such-run"
    assert main([str(missing)]) == 2
    assert "no event log under" in capsys.readouterr().err
    assert not missing.exists(), "the report must not create a directory for a mistyped URL"


def test_cli_unknown_instance_type_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(REAL_LOG), "--instance-type", "no-such-vm"]) == 2
    assert "no price for instance type 'no-such-vm'" in capsys.readouterr().err


def test_cli_prices_file_overrides(tmp_path: Path) -> None:
    prices = tmp_path / "p.json"
    prices.write_text(json.dumps({"instance_types": {
        "my/vm": {"on_demand_per_hour": 1.0, "spot_per_hour": 0.5, "min_billed_seconds": 0}}}))
    out = tmp_path / "r.json"
    assert main([str(REAL_LOG), "--prices", str(prices), "--instance-type", "my/vm", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["cost_transient_usd"] == pytest.approx(doc["cost_on_demand_usd"] / 2, rel=0.05)


def test_bytes_written_counts_periodic_commits_and_synchronous_shares() -> None:
    from hvd_transient.report.analysis import analyze

    events = [
        {"t": 0.0, "event": "start", "host": "a", "pid": 1, "step": 0, "rank": 0, "size": 1},
        {"t": 0.1, "event": "ring", "host": "a", "pid": 1, "step": 0, "rank": 0, "size": 1,
         "master": 0, "master_host": "a"},
        {"t": 1.0, "event": "commit", "host": "a", "pid": 1, "step": 50, "kind": "periodic", "size": 1,
         "bytes": 1000},
        {"t": 2.0, "event": "save_end", "host": "a", "pid": 1, "step": 60, "kind": "final", "seconds": 0.1,
         "bytes": 300},
        {"t": 2.1, "event": "train_end", "host": "a", "pid": 1, "step": 60},
    ]
    assert analyze(events).bytes_written == 1300


# ----------------------------------------------------------------------------- the keeper


KEEPER = "driver"


def kept_through_a_wave_log() -> Log:
    """The keeper launches the job on A, B, C; a wave takes all three (emergency checkpoint at 25);
    the keeper ends the job, A's zone is out of capacity: B is started again, D created in zb; the
    relaunch restores step 25 and finishes at 120. The keeper's last cost comes after the end."""
    log = whole_cluster_notice_log()
    k = {"pid": 900}

    def keeper(t: float, event: str, **fields: Any) -> None:
        log.add(t, event, KEEPER, k["pid"], **fields)

    keeper(-10.0, "keeper_start", cluster="exp", workers=3, zones=["za", "zb"], instance_type="n1-standard-8",
           spot_per_hour=0.5, on_demand_per_hour=1.5, on_demand_after_s=None, max_cost_per_hour=None,
           max_total_cost=None, interval_s=30.0)
    keeper(-9.0, "keeper_job", phase="start", attempt=1, workers=["A", "B", "C"])
    keeper(36.0, "keeper_job", phase="exit", attempt=1, workers=[], exit_code=137, reason="no_workers", seconds=45.0)
    keeper(36.1, "keeper_stockout", name="A", zone="za", provisioning="spot", operation="start",
           code="ZONE_RESOURCE_POOL_EXHAUSTED", kind="stockout", failures=1, retry_in_s=60.0)
    keeper(36.2, "keeper_refill", name="B", zone="zb", provisioning="spot", operation="start", reason="restart",
           was="TERMINATED", avoided_zones=[])
    keeper(40.0, "keeper_refill", name="D", zone="zb", provisioning="spot", operation="create", reason="recreate",
           avoided_zones=["za"])
    keeper(40.5, "keeper_job", phase="relaunch", attempt=2, workers=["B", "D"], waited_s=4.5)
    new = {"B": 202, "D": 204}
    log.start(60.0, ["B", "D"], step=25, pids=new, restored=25)
    log.ring(60.1, 25, ["B", "D"], "B", pids=new)
    log.each(66.0, "first_step", ["B", "D"], new, step=26, size=2)
    log.finish(80.0, 120, ["B", "D"], "B", pids=new)
    keeper(82.0, "keeper_job", phase="exit", attempt=2, workers=[], exit_code=0, seconds=41.5)
    keeper(90.0, "keeper_cost", spent=0.25, spent_spot=0.25, spent_on_demand=0.0, on_demand_premium=0.0,
           rate_per_hour=1.0, spot_running=2, on_demand_running=0, wanted=3)
    return log


def test_keeper_section_from_its_events() -> None:
    log = kept_through_a_wave_log()
    a = analyze(log.events)
    k = a.keeper
    assert k is not None and (k.cluster, k.wanted, k.zones) == ("exp", 3, ("za", "zb"))
    assert (k.refills, k.restarts, k.creates, k.failovers, k.on_demand_refills) == (2, 1, 1, 1, 0)
    assert k.refills_by_zone == {"zb": 2} and k.stockouts_by_zone == {"za": 1} and k.quota_errors == 0
    assert (k.spent, k.on_demand_premium, k.fallbacks) == (0.25, 0.0, 0)
    assert k.relaunches == 1 and not k.gave_up
    first, second = k.jobs
    assert (first.attempt, first.exit_code, first.reason, first.resumed_step) == (1, 137, "no_workers", 1)
    assert (second.relaunch, second.workers, second.waited_s, second.exit_code) == (True, ("B", "D"), 4.5, 0)
    assert (second.restored_step, second.resumed_step) == (25, 26)
    assert second.launch_to_step_s == pytest.approx(66.0 - 40.5)
    assert second.outage_s == pytest.approx(66.0 - 5.102)  # from the last rank's agreed notice (the wave)

    # the keeper is no worker and stretches no time: the run is what it was without it
    bare = analyze([e for e in log.events if e["host"] != KEEPER])
    assert bare.keeper is None
    assert KEEPER not in {w.host for w in a.workers} and len(a.workers) == len(bare.workers) == 5
    assert (a.started_at, a.ended_at, a.wall_s) == (bare.started_at, bare.ended_at, bare.wall_s)
    assert a.ended_at == pytest.approx(T0 + 80.301)
    assert a.preemptions == bare.preemptions and a.rings == bare.rings


def test_keeper_section_in_the_text_and_json_reports() -> None:
    a = analyze(kept_through_a_wave_log().events)
    text = render_text(a, estimate_costs(a, load_price_table(None)))
    keeper = text.split("== keeper ==\n", 1)[1]
    assert "refills:              2 (1 started again, 1 created; 1 after a zone failover; 0 on demand)" in keeper
    assert "stock-outs:           za 1" in keeper and "job:                  2 launch(es), 1 relaunch(es)" in keeper
    assert "spend (workers):      $0.2500" in keeper and "keeper (no worker left)" in keeper
    assert "keeper: job relaunched (attempt 2) on B, D, 4.5 s after the previous attempt ended" in text
    assert "keeper: D created, spot in zb (failover: za backed off)" in text
    assert "keeper: job attempt 1 exited with status 137; ended by the keeper: no worker was left" in text
    doc = json.loads(json.dumps(to_json(a, None)))
    assert doc["keeper"]["relaunches"] == 1 and doc["keeper"]["stockouts_by_zone"] == {"za": 1}
    assert doc["keeper"]["jobs"][1] | {"launched_s": 0, "resumed_s": 0} == {
        "attempt": 2, "launched_s": 0, "workers": ["B", "D"], "relaunch": True, "waited_s": 4.5,
        "ended_s": pytest.approx(82.0), "exit_code": 0, "reason": None, "restored_step": 25, "resumed_s": 0,
        "resumed_step": 26, "launch_to_step_s": pytest.approx(25.5), "outage_s": pytest.approx(60.898)}
    assert to_json(analyze(preempted_worker_log().events), None)["keeper"] is None


def test_a_log_of_the_keeper_alone_is_reported() -> None:
    log = Log()
    log.add(0.0, "keeper_refill", KEEPER, 900, name="w0", zone="za", provisioning="spot", operation="create",
            reason="recreate", avoided_zones=[])
    log.add(5.0, "keeper_cost", KEEPER, 900, spent=0.01, spent_spot=0.01, spent_on_demand=0.0,
            on_demand_premium=0.0, rate_per_hour=0.5, spot_running=1, on_demand_running=0, wanted=1)
    a = analyze(log.events)
    assert a.workers == () and not a.completed and a.wall_s == pytest.approx(5.0)
    assert a.keeper is not None and a.keeper.refills == 1 and a.keeper.jobs == ()
    assert "== keeper ==" in render_text(a, None)


def test_plot_marks_the_keeper(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from hvd_transient.report.plot import plot_run

    out = tmp_path / "kept.png"
    plot_run(analyze(kept_through_a_wave_log().events), out)
    assert out.read_bytes().startswith(PNG_MAGIC)
