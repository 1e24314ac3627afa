"""Public spot traces: reading the three formats, picking a window, mapping onto local VMs, the schedule."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_transient.testing import demo
from hvd_transient.testing.local_cluster import HOST_ALIASES
from hvd_transient.testing.schedule import Action, ScheduleError
from hvd_transient.testing.trace_formats import TraceError, detect_format, parse_trace, read_trace
from hvd_transient.testing.traces import TraceOptions, plan_trace

TRACES = Path(__file__).resolve().parent.parent / "bench" / "traces"
HOSTS = HOST_ALIASES

# 3 nodes at 0; node2 and node3 go at 600 s (a wave); node4 comes at 900 s; node1 goes at 1500 s
PARCAE = """0,add,node1
0,add,node2
0,add,node3
600000,add,node9
600000,remove,node2
600000,remove,node3
900000,add,node4
1500000,remove,node1
1800000,remove,node4
"""
BAMBOO = "0,8\n100,8\n100,4\n200,4\n200,8\n300,8\n300,6\n"
SKYPILOT = json.dumps({"metadata": {"gap_seconds": 60}, "data": [2, 2, 1, 1, 2, 2, 0, 2]})


def notices(plan):  # type: ignore[no-untyped-def]
    return [(a.target, a.at_s) for a in plan.actions if a.action == "notice"]


def joins(plan):  # type: ignore[no-untyped-def]
    return [(a.target, a.at_s) for a in plan.actions if a.action == "join"]


def test_formats_are_detected_and_parsed() -> None:
    assert detect_format(PARCAE) == "parcae"
    assert detect_format(BAMBOO) == "bamboo"
    assert detect_format(SKYPILOT) == "skypilot"
    events = parse_trace(PARCAE)
    assert [(e.t_s, e.kind, e.node) for e in events.events[:4]] == [
        (0.0, "add", "node1"), (0.0, "add", "node2"), (0.0, "add", "node3"), (600.0, "add", "node9")]
    assert events.peak == 4 and events.duration_s == 1800.0
    # a repeated time stamp is the step: the last line at a time wins, unchanged counts are dropped
    assert parse_trace(BAMBOO).levels == ((0.0, 8), (100.0, 4), (200.0, 8), (300.0, 6))
    assert parse_trace(SKYPILOT).levels == ((0.0, 2), (120.0, 1), (240.0, 2), (360.0, 0), (420.0, 2))
    assert parse_trace(PARCAE, "oobleck").format == "oobleck"


def test_event_trace_follows_k_nodes_with_waves_windows_and_boot() -> None:
    plan = plan_trace(parse_trace(PARCAE), TraceOptions(max_nodes=2, time_scale=10.0, window_s=30.0, boot_s=5.0),
                      HOSTS)
    # node1 and node2 are followed (the first two alive), node3 is ignored
    assert plan.hosts == HOSTS[:2]
    # node2 goes at 600 s = 60 s real: its notice comes 30 real seconds earlier; node3's removal is not played
    assert plan.waves[0].hosts == (HOSTS[1],) and plan.waves[0].at_s == 60.0
    # node9 is added at the wave's instant but a line before it, while both nodes are still followed: ignored;
    # node4 at 900 s = 90 s real takes the free name longest free: an alias never used, after a 5 s boot
    assert joins(plan) == [(HOSTS[2], 95.0)]
    # node1 at 1500 s, node4 at 1800 s (the window's end: not inside it)
    assert notices(plan) == [(HOSTS[1], 30.0), (HOSTS[0], 120.0)]
    assert plan.availability == ((0.0, 2), (60.0, 1), (90.0, 2), (150.0, 1))
    assert plan.duration_s == 180.0 and plan.available_at(100.0) == 2


def test_a_wave_shares_one_notice_and_window_start_and_length_pick_the_window() -> None:
    plan = plan_trace(parse_trace(PARCAE), TraceOptions(start_s=300.0, hours=1000 / 3600, max_nodes=3,
                                                        cloud="gce"), HOSTS)
    assert plan.options.notice_s == 30.0 and plan.duration_s == 1000.0
    # relative to the window's start at 300 s: the wave of node2 and node3 at 300 s, node1 at 1200 s (outside)
    assert [(w.hosts, w.at_s, w.notice_at_s) for w in plan.waves] == [((HOSTS[1], HOSTS[2]), 300.0, 270.0)]
    # node4 at 600 s fills a free slot (node9 came with the wave, first in the file, while 3 were followed)
    assert joins(plan) == [(HOSTS[3], 600.0)]
    aws = plan_trace(parse_trace(PARCAE), TraceOptions(start_s=300.0, hours=0.5, max_nodes=3, cloud="aws"), HOSTS)
    assert aws.waves[0].notice_at_s == 300.0 - 120.0


def test_count_traces_are_scaled_and_drop_the_longest_running_first() -> None:
    plan = plan_trace(parse_trace(BAMBOO), TraceOptions(max_nodes=4, window_s=10.0, hours=400 / 3600), HOSTS)
    assert plan.scale == 0.5  # peak 8 onto 4 VMs
    assert plan.hosts == HOSTS[:4]
    # 8 -> 4 at 100 s is 4 -> 2: the two oldest VMs get notices 10 s before
    assert plan.waves[0].hosts == HOSTS[:2] and plan.waves[0].notice_at_s == 90.0
    # 4 -> 8 at 200 s is 2 -> 4: never-used names first, then 6 at 300 s is 3: the oldest running goes
    assert sorted(joins(plan)) == sorted([(HOSTS[4], 200.0), (HOSTS[5], 200.0)])
    assert plan.waves[1].hosts == (HOSTS[2],)
    assert plan.availability == ((0.0, 4), (100.0, 2), (200.0, 4), (300.0, 3))
    small = plan_trace(parse_trace(SKYPILOT), TraceOptions(max_nodes=4, time_scale=2.0), HOSTS)
    assert small.scale == 1.0 and small.availability == ((0.0, 2), (60.0, 1), (120.0, 2), (180.0, 0), (210.0, 2))


def test_the_real_p3_excerpt_has_an_hour_with_at_least_five_preemptions() -> None:
    trace = read_trace(TRACES / "oobleck-p3-first-2h.csv")
    assert trace.format == "parcae" and trace.peak == 32
    plan = plan_trace(trace, TraceOptions(start_s=1800.0, hours=1.0, time_scale=6.0, max_nodes=4, cloud="aws",
                                          window_s=30.0), HOSTS)
    assert plan.duration_s == 600.0 and plan.preemptions >= 5
    assert any(len(w.hosts) > 1 for w in plan.waves)  # node1 and node2 go together at 3060 s
    assert all(1 <= n <= 4 for _, n in plan.availability)
    _check_consistent(plan)


@pytest.mark.parametrize("name", ["bamboo-g4dn-xlarge-us-east-1c-2020-11-20.csv",
                                  "skypilot-aws-v100-4node-us-east-2a-day2.json"])
def test_the_other_real_excerpts_are_read(name: str) -> None:
    trace = read_trace(TRACES / name)
    start = next(t for t, c in trace.levels if c > 0)
    plan = plan_trace(trace, TraceOptions(start_s=start, hours=4.0, time_scale=20.0, max_nodes=3), HOSTS)
    assert plan.preemptions >= 1
    _check_consistent(plan)


def _check_consistent(plan) -> None:  # type: ignore[no-untyped-def]
    """Each name alternates join/notice; a notice comes while its VM is up; a name is reused only after its
    previous VM stopped (notice + window); n(t) never exceeds --max-nodes."""
    up = {h: 0.0 for h in plan.hosts}
    stopped: dict[str, float] = {}
    window = plan.options.notice_s
    assert [a.at_s for a in plan.actions] == sorted(a.at_s for a in plan.actions)
    for a in plan.actions:
        if a.action == "join":
            assert a.target not in up, a
            assert a.at_s >= stopped.get(a.target, -1.0) + 1.0 - 1e-9, a
            up[a.target] = a.at_s
        else:
            assert a.target in up and a.at_s >= up.pop(a.target), a
            stopped[a.target] = a.at_s + window
    assert max(n for _, n in plan.availability) <= plan.options.max_nodes


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.booleans()), min_size=1, max_size=40),
       st.integers(1, 5), st.floats(0.5, 20.0), st.floats(0.0, 30.0))
def test_any_event_trace_plans_consistently(steps: list[tuple[int, bool]], k: int, scale: float, boot: float) -> None:
    lines, alive, t, n = ["0,add,n0"], ["n0"], 0, 1
    for gap, add in steps:
        t += gap * 1000
        if add or len(alive) == 1:
            alive.append(f"n{n}")
            lines.append(f"{t},add,n{n}")
            n += 1
        else:
            lines.append(f"{t},remove,{alive.pop(0)}")
    trace = parse_trace("\n".join(lines) + "\n")
    plan = plan_trace(trace, TraceOptions(max_nodes=k, time_scale=scale, window_s=10.0, boot_s=boot), HOSTS)
    _check_consistent(plan)
    assert all(isinstance(a, Action) and a.at_s is not None and a.at_s >= 0 for a in plan.actions)


@pytest.mark.parametrize("text, fmt, message", [
    ("0,add,a\n5x,add,b\n", None, r"trace:2: the time \(ms\) '5x' is not a number"),
    ("0,add,a\n10,remove,b\n", None, r"trace:2: b is removed but is not alive"),
    ("0,add,a\n10,add,a\n", None, r"trace:2: a is added again"),
    ("10,add,a\n0,add,b\n", None, r"trace:2: .* before the previous line"),
    ("0,add,a\n10,drop,a\n", "parcae", r"trace:2: expected 'add' or 'remove'"),
    ("0,4\n10,2,3\n", "bamboo", r"trace:2: expected 'seconds,available_instances'"),
    ("0,4\n10,2.5\n", None, r"trace:2: the instance count must be a whole number"),
    ("0,4\n10,-1\n", None, r"trace:2: the instance count must be a finite number >= 0"),
    ('{"metadata": {"gap_seconds": 0}, "data": [1]}', None, r"gap_seconds must be a number > 0"),
    ('{"metadata": {"gap_seconds": 60}, "data": [1, "x"]}', None, r"data\[1\] must be a whole number"),
    ('{"metadata": {"gap_seconds": 60},\n "data": [1,', "skypilot", r"trace:2: not valid JSON"),
    ("hello world\n", None, r"trace:1: cannot tell the trace's format"),
    ("\n\n", None, r"the trace is empty"),
    ("0,add,a\n", "nope", r"unknown trace format 'nope'"),
])
def test_malformed_traces_name_the_line(text: str, fmt: str | None, message: str) -> None:
    with pytest.raises(TraceError, match=message) as info:
        parse_trace(text, fmt)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ScheduleError)


def test_bad_windows_and_options_are_refused(tmp_path: Path) -> None:
    trace = parse_trace(PARCAE)
    with pytest.raises(TraceError, match="--max-nodes 7: only 6 local VMs"):
        plan_trace(trace, TraceOptions(max_nodes=7), HOSTS)
    with pytest.raises(TraceError, match="--trace-start 1 h is at or past the trace's end"):
        plan_trace(trace, TraceOptions(start_s=3600.0), HOSTS)
    with pytest.raises(TraceError, match="no node is available"):
        plan_trace(parse_trace("0,0\n100,2\n"), TraceOptions(), HOSTS)
    for bad in ({"time_scale": 0.0}, {"max_nodes": 0}, {"hours": -1.0}, {"start_s": -5.0}, {"cloud": "azure"},
                {"window_s": 0.0}):
        with pytest.raises(TraceError):
            TraceOptions(**bad)  # type: ignore[arg-type]
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "missing.csv")


def test_demo_refuses_a_malformed_trace_before_starting_anything(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("0,add,a\n10,remove,b\n")
    assert demo.main(["--trace", str(bad), "--workdir", str(tmp_path / "w")]) == 2
    assert "bad.csv:2: b is removed but is not alive" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
    good = tmp_path / "good.csv"
    good.write_text(PARCAE)
    assert demo.main(["--trace", str(good), "--schedule", str(bad), "--workdir", str(tmp_path / "w")]) == 2
    assert "--trace decides the preemptions" in capsys.readouterr().err
