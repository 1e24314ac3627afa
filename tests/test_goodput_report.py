"""Whole-run goodput (hvd_transient.report.goodput) on hand-made event logs, where the right answers are known."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_report import PNG_MAGIC, T0, Log, preempted_worker_log

from hvd_transient.report.analysis import analyze
from hvd_transient.report.goodput import (
    CHECKPOINT_STALLS,
    OFF_PACE,
    SLOWER_STEADY,
    SLOWER_UNDER_NOTICE,
    LoadSample,
    Segment,
    capacity_gap,
    cost_per_m_samples,
    final_step,
    goodput,
    ideal_samples,
    lineage,
    load_summary,
    lost_phases,
    on_demand_cost_per_m_samples,
    pace_losses,
    plot_goodput_timeline,
    ratio_by_size,
    ring_paces,
    ring_size_at,
    save_stalls,
    step_time_ratio,
    useful_samples,
    vm_seconds,
)

RATES = {1: 100.0, 2: 180.0, 3: 240.0}


def test_ideal_is_the_integral_of_the_calibrated_rate_over_n_of_t() -> None:
    availability = ((0.0, 3), (10.0, 2), (25.0, 0), (30.0, 1))
    # 10 s at 240 + 15 s at 180 + 5 s at nothing + 10 s at 100, the window ending at 40 s
    assert ideal_samples(availability, RATES, 40.0) == pytest.approx(2400 + 2700 + 0 + 1000)
    assert ideal_samples(availability, RATES, 20.0) == pytest.approx(2400 + 1800)  # cut at the window's end
    assert vm_seconds(availability, 40.0) == pytest.approx(30 + 30 + 0 + 10)
    with pytest.raises(ValueError, match="no calibrated rate for a ring of 4"):
        ideal_samples(((0.0, 4),), RATES, 10.0)


def test_lineage_drops_rolled_back_and_rerun_steps() -> None:
    # ring of 3 from 0; a rollback to 15 on 2 (steps 15.. of the first ring are lost); a restore of an older
    # checkpoint at 10 on 1 cuts the second ring entirely and the first at 10
    assert lineage([(0, 3)], 50) == (Segment(0, 50, 3),)
    assert lineage([(0, 3), (15, 2)], 40) == (Segment(0, 15, 3), Segment(15, 40, 2))
    assert lineage([(0, 3), (15, 2), (10, 1)], 30) == (Segment(0, 10, 3), Segment(10, 30, 1))
    assert lineage([(0, 3), (20, 2)], 12) == (Segment(0, 12, 3),)  # the final model is older than ring 2


def test_useful_samples_of_a_run_with_a_clean_leave_and_one_with_a_rollback() -> None:
    run = analyze(preempted_worker_log().events)  # 3 workers to step 30, 2 to step 100
    assert final_step(run) == 100
    assert useful_samples(run, 32, 100) == (30 * 3 + 70 * 2) * 32
    log = Log()
    log.start(0.0, ["A", "B", "C"])
    log.ring(0.1, 0, ["A", "B", "C"], "A")
    log.each(2.0, "first_step", ["A", "B", "C"], step=1, size=3)
    log.each(4.0, "progress", ["A", "B", "C"], step=20, size=3)
    log.each(15.0, "reset", ["A", "B"], step=15, rolled_back=7, last_step=22)
    log.ring(15.1, 15, ["A", "B"], "A")
    log.each(15.6, "first_step", ["A", "B"], step=16, size=2)
    log.each(20.0, "progress", ["A", "B"], step=40, size=2)
    rolled = analyze(log.events)
    assert final_step(rolled, until=T0 + 16.0) == 20  # not the later progress
    assert final_step(rolled, until=T0 + 30.0) == 40
    assert useful_samples(rolled, 10, 40) == (15 * 3 + 25 * 2) * 10  # steps 15-22 on 3 workers do not count
    g = goodput("horovod_elastic", rolled, t0=T0 + 2.0, duration_s=20.0, availability=((0.0, 3), (10.0, 2)),
                rates={2: 20.0, 3: 30.0}, batch_size=10, final=40)
    assert g.ideal_samples == pytest.approx(10 * 30 + 10 * 20)
    assert g.goodput == pytest.approx(950 / 500)  # a broken calibration shows as goodput > 1
    assert g.steps_rolled_back == 7 and g.preemptions_seen == 1
    assert g.steps_redone == 22 - 15  # the survivors reset from step 22 (their last progress event said 20)


def test_lost_time_phases_add_up_to_the_loss() -> None:
    run = analyze(preempted_worker_log().events)
    # ideal: 3 workers for 5.5 s then 2 for 14.5 s, at 1 step/s per worker-batch of 1 sample
    g = goodput("ours", run, t0=T0, duration_s=20.0, availability=((0.0, 3), (5.5, 2)),
                rates={2: 2 * 5.0, 3: 3 * 5.0}, batch_size=1, final=100)
    assert g.useful_samples == 30 * 3 + 70 * 2
    assert g.steps_rolled_back == 0 and g.steps_redone == 0
    assert g.lost_phases_s["preemptions (departure -> next step)"] == pytest.approx(3.0, abs=0.01)
    lost = (g.ideal_samples - g.useful_samples) / (g.ideal_samples / 20.0)
    assert sum(g.lost_phases_s.values()) == pytest.approx(max(lost, 0.0), abs=0.01)  # the remainder is signed


def test_a_runs_goodput_carries_the_driver_messages_rank_0_announced() -> None:
    log = preempted_worker_log()
    log.add(8.0, "host_update_announced", "A", None, change="removal", hosts=["C"])
    g = goodput("ours", analyze(log.events), t0=T0, duration_s=20.0, availability=((0.0, 3), (5.5, 2)),
                rates={2: 2 * 5.0, 3: 3 * 5.0}, batch_size=1, final=100)
    assert g.host_updates_announced == {"removal": 1}
    plain = goodput("ours", analyze(preempted_worker_log().events), t0=T0, duration_s=20.0,
                    availability=((0.0, 3), (5.5, 2)), rates={2: 2 * 5.0, 3: 3 * 5.0}, batch_size=1, final=100)
    assert plain.host_updates_announced == {}


def test_costs_per_million_useful_samples() -> None:
    # 2 VMs for an hour at 1 $/h spot: 2 $ for 1M useful samples; on demand a ring of 3 does 240/s at 3 $/h each
    assert cost_per_m_samples(1_000_000, ((0.0, 2),), 3600.0, 1.0) == pytest.approx(2.0)
    assert cost_per_m_samples(0, ((0.0, 2),), 3600.0, 1.0) is None
    assert on_demand_cost_per_m_samples(RATES, 3.0) == pytest.approx(3 * 3.0 / 3600 / 240 * 1e6)


def test_timeline_plot_shows_availability_ring_size_steps_and_the_lost_time(tmp_path: Path) -> None:
    run = analyze(preempted_worker_log().events)
    path = tmp_path / "goodput.png"
    phases = {"preemptions (departure -> next step)": 3.0, "other": 1.5}
    top, bottom = plot_goodput_timeline(path, run, t0=T0, duration_s=20.0, availability=((0.0, 3), (5.5, 2)),
                                        title="ours", phases=phases)
    assert path.read_bytes()[:8] == PNG_MAGIC
    lines = {line.get_label(): line for line in top.get_lines()}
    avail = lines["VMs available (trace)"]
    assert list(avail.get_xdata()) == [0.0, 5.5, 20.0] and list(avail.get_ydata()) == [3, 2, 2]
    ring = lines["ring size"]
    assert max(ring.get_ydata()) == 3 and 2 in list(ring.get_ydata())
    assert ring.get_xdata()[0] == pytest.approx(0.1, abs=0.01)  # the first ring started 0.1 s in
    # the preemption's lost span: C leaves at 5.5 s, the survivors' next step at 8.5 s
    (span,) = [p for p in top.patches if p.get_alpha() == 0.25]
    assert span.get_x() == pytest.approx(5.5, abs=0.01)
    assert span.get_x() + span.get_width() == pytest.approx(8.5, abs=0.01)
    steps_axis = [ax for ax in top.figure.axes if ax not in (top, bottom)][0]
    assert list(steps_axis.get_lines()[0].get_ydata()) == [1, 10, 30, 31, 60, 100]  # every step point seen
    assert [b.get_width() for b in bottom.patches] == [3.0, 1.5]
    assert [t.get_text() for t in bottom.get_yticklabels()] == list(phases)


def test_a_ring_smaller_than_the_vms_available_is_split_by_cause() -> None:
    run = analyze(preempted_worker_log().events)  # C leaves at 5.5 s (notice at 5.0), the ring of 2 steps at 8.5 s
    assert [ring_size_at(run, T0 + t) for t in (0.05, 1.0, 8.0, 9.0, 20.1, 25.0)] == [0, 3, 3, 2, 2, 0]
    # C's VM is gone at 10 s (its notice window: 5-10 s); a new VM is up from 14 s but never joins
    availability = ((0.0, 3), (10.0, 2), (14.0, 3))
    rates = {2: 10.0, 3: 15.0}
    excluded = [(T0 + 5.5, T0 + 8.5)]  # the preemption's own span is counted by its event
    in_window, elsewhere = capacity_gap(run, t0=T0, duration_s=20.0, availability=availability, rates=rates,
                                        notice_windows=[(5.0, 10.0)], excluded=excluded)
    assert in_window == pytest.approx((15 - 10) * 1.5)   # 8.5-10 s: C could have trained to its VM's end
    assert elsewhere == pytest.approx((15 - 10) * 6.0)   # 14-20 s: a VM up and not in the ring
    g = goodput("ours", run, t0=T0, duration_s=20.0, availability=availability, rates=rates, batch_size=1,
                final=100, notice_windows=[(5.0, 10.0)])
    mean = g.ideal_samples / 20.0
    assert g.lost_phases_s["left before the VM was gone (notice window unused)"] == pytest.approx(7.5 / mean)
    assert g.lost_phases_s["VMs up but not in the ring (boot, joining, fixed ring)"] == pytest.approx(30.0 / mean)


def test_a_wave_and_a_multi_host_join_count_their_span_once() -> None:
    log = Log()
    log.start(0.0, ["A", "B", "C"])
    log.ring(0.1, 0, ["A", "B", "C"], "A")
    log.each(2.0, "first_step", ["A", "B", "C"], step=1, size=3)
    log.each(4.0, "progress", ["A", "B", "C"], step=20, size=3)  # B and C's last events: killed together
    log.each(10.0, "reset", ["A"], step=15, rolled_back=7, last_step=22)
    log.ring(10.1, 15, ["A"], "A")
    log.each(11.0, "first_step", ["A"], step=16, size=1)
    log.each(15.0, "progress", ["A"], step=40, size=1)
    log.each(20.0, "progress", ["A"], step=60, size=1)
    run = analyze(log.events)
    assert len(run.preemptions) == 2
    phases = lost_phases(run, T0, T0 + 30.0, 100.0)
    assert phases["preemptions (departure -> next step)"] == pytest.approx(7.0, abs=0.01)  # 4.0 -> 11.0, once
    rate = run.ring_at(T0 + 11.0).steps_per_s  # type: ignore[union-attr]
    assert rate and phases["rolled-back steps"] == pytest.approx(7 / rate)  # once, though two VMs left


def paced_log() -> Log:
    """A ring of A and B at 10 steps/s from step 1 to 90, but for a periodic save that stalls it 1 s at step 55."""
    log = Log()
    log.start(0.0, ["A", "B"])
    log.ring(0.05, 0, ["A", "B"], "A")
    log.each(0.1, "first_step", ["A", "B"], step=1, size=2)
    for step in range(10, 100, 10):
        t = step / 10 + (1.0 if step > 50 else 0.0)
        log.each(t, "progress", ["A", "B"], step=step, size=2)
    log.add(6.5, "async_save", "A", step=55, stall_ms=1000.0, size=2)
    log.add(6.5, "async_save", "B", step=55, stall_ms=400.0, size=2)  # the ring waits for its slowest rank
    return log


def test_a_rings_steady_pace_against_the_calibration_names_the_slower_steps_and_the_checkpoint_stall() -> None:
    log = paced_log()
    run = analyze(log.events)
    rates = {2: 2 * 4 * 12.5}  # the calibration: 12.5 steps/s of 2 x 4 samples; the run steps at 10
    (pace,) = ring_paces(run, t0=T0, duration_s=10.0, rates=rates, batch_size=4, warmup_steps=10)
    assert pace.size == 2 and pace.steps_per_s == pytest.approx(10.0, rel=0.01)  # the stall's interval is no median
    assert pace.ratio == pytest.approx(1.25, rel=0.01) and pace.steady_s == pytest.approx(9.0, abs=0.01)
    assert step_time_ratio([pace]) == pace.ratio and ratio_by_size([pace]) == {2: pace.ratio}
    assert step_time_ratio([]) is None
    stalls = save_stalls(log.events)
    assert stalls == [(pytest.approx(T0 + 6.5), 1.0)]
    own = {2: 2 * 4 * 10.0}
    lost = pace_losses(run, t0=T0, duration_s=10.0, rates=own, batch_size=4, excluded=[], notice_spans=[],
                       stalls=stalls)
    assert lost[CHECKPOINT_STALLS] == pytest.approx(80.0, rel=0.01)  # 1 s of the ring's 80 samples/s
    assert lost[OFF_PACE] == pytest.approx(0.0, abs=1.0) and lost[SLOWER_UNDER_NOTICE] == 0.0
    notice = pace_losses(run, t0=T0, duration_s=10.0, rates=own, batch_size=4, excluded=[],
                         notice_spans=[(T0 + 5.0, T0 + 7.0)])  # no save events: the stall is the notice's
    assert notice[SLOWER_UNDER_NOTICE] == pytest.approx(80.0, rel=0.01) and notice[CHECKPOINT_STALLS] == 0.0
    g = goodput("ours", run, t0=T0, duration_s=10.0, availability=((0.0, 2),), rates=rates, batch_size=4,
                stalls=stalls, warmup_steps=10)
    assert g.step_time_ratio == pytest.approx(1.25, rel=0.01)
    assert g.goodput_own_pace == pytest.approx(g.goodput * 1.25)
    phases = g.lost_phases_s
    assert phases[SLOWER_STEADY] == pytest.approx(10.0 * g.goodput * 0.25, rel=0.01)
    assert phases[CHECKPOINT_STALLS] == pytest.approx(1.0, rel=0.01)  # seconds of the window
    assert sum(phases.values()) == pytest.approx(10.0 * (1 - g.goodput), abs=0.01)


def test_load_summary_tells_the_machines_load_from_the_benchmarks_own() -> None:
    samples = [LoadSample(0.0, 3.0, 2.0, 1.5), LoadSample(5.0, 5.0, 2.0, 1.0), LoadSample(10.0, 4.0, 1.5, 1.6)]
    summary = load_summary(samples)
    assert summary is not None and summary.samples == 3
    assert (summary.load_1m, summary.load_1m_max, summary.busy_cores) == (4.0, 5.0, 2.0)
    assert summary.others_cores == pytest.approx(0.5)  # 0.5, 1.0 and (never below zero) 0.0
    assert load_summary([]) is None
