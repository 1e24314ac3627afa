"""The run report reads damaged logs: an event whose fields are not of its kind's declared types is
skipped and counted, never a traceback.

Mutations of the real run log kept under tests/data/report_events (one field of one event at a
time, to a value of another type), and whole events made up of random fields, go through the
analysis, the text and JSON renderings and (a few) the plot.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_service.stores import LocalStore
from ckpt_service.stores.memory import MemoryStore
from hvd_transient.report import build, load_events
from hvd_transient.report.render import render_text, to_json
from hvd_transient.report.run_analysis import RunAnalysis
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import read_events, read_log
from hvd_transient.telemetry.parsing import UNNAMED_KIND, UNREADABLE_LINE, parse_log, understood

REAL_LOG = Path(__file__).resolve().parent / "data" / "report_events"
EVENTS: list[dict[str, Any]] = read_events(LocalStore(REAL_LOG))
HOSTS = sorted({e["host"] for e in EVENTS})
T_FIRST, T_LAST = EVENTS[0]["t"], EVENTS[-1]["t"]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: values no field of any kind may hold: each makes its event unreadable wherever it lands
NEVER_VALID = st.one_of(
    st.just(math.nan), st.just(math.inf), st.just(-math.inf),
    st.integers(min_value=2 ** 63, max_value=2 ** 200), st.integers(max_value=-2 ** 63, min_value=-2 ** 200),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.one_of(st.integers(), st.none(), st.floats()), min_size=1, max_size=3),
)
#: values of other types than most fields', some of them valid for a few
OTHER_TYPES = st.one_of(
    NEVER_VALID, st.none(), st.booleans(), st.text(max_size=6), st.lists(st.text(max_size=4), max_size=3),
    st.integers(max_value=-1, min_value=-2 ** 62), st.floats(allow_nan=False, allow_infinity=False),
    st.just(10 ** 18), st.just(-1e12),
)
DELETE = object()


def report(events: Any) -> RunAnalysis:
    """The whole text-and-JSON report of ``events``; fails the test on any exception."""
    analysis, cost = build(events, instance_type="icac19/K80")
    assert "events:" in render_text(analysis, cost)
    json.dumps(to_json(analysis, cost), allow_nan=False)  # a JSON report readers of strict JSON take
    return analysis


def fields_of(event: dict[str, Any]) -> list[str]:
    """What an event holds, and the optional fields its kind declares that it leaves out (older logs)."""
    declared = [f.name for f in dataclasses.fields(ev.KINDS[event["event"]])]
    return sorted(set(event) | set(declared))


def mutated(index: int, name: str, value: Any) -> list[dict[str, Any]]:
    events = [dict(e) for e in EVENTS]
    if value is DELETE:
        events[index].pop(name, None)
    else:
        events[index][name] = value
    return events


def test_the_real_log_reads_without_a_skip() -> None:
    analysis = report(EVENTS)
    assert analysis.event_count == len(EVENTS) and analysis.skipped_events == {}
    assert json.loads(json.dumps(to_json(analysis, None)))["skipped_event_count"] == 0


def test_every_declared_field_type_is_checked() -> None:
    """A field of a type the reader does not understand would be passed unchecked to the analysers."""
    for cls in ev.KINDS.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert understood(hints[f.name]), f"{cls.event}.{f.name}: {hints[f.name]}"


@pytest.mark.parametrize(("name", "value"), [
    ("t", "soon"), ("t", None), ("t", [1.0]), ("t", math.nan), ("t", 1e300), ("step", "12"), ("step", 1.5),
    ("step", None), ("hosts", "h0"), ("hosts", [1, 2]), ("seconds", "0.5"), ("seconds", math.inf),
    ("pid", math.nan), ("host", ["h"]), ("step", DELETE), ("t", DELETE), ("event", {"a": 1}),
])
def test_one_bad_field_skips_its_event_and_is_counted(name: str, value: Any) -> None:
    index = next(i for i, e in enumerate(EVENTS) if name in fields_of(e))
    kind = UNNAMED_KIND if name == "event" else EVENTS[index]["event"]
    analysis = report(mutated(index, name, value))
    assert analysis.skipped_events == {kind: 1} and analysis.event_count == len(EVENTS) - 1
    assert f"1 skipped as unreadable ({kind} 1)" in render_text(analysis, None)
    assert to_json(analysis, None)["skipped_events"] == {kind: 1}


@settings(FAST, max_examples=150)
@given(st.data())
def test_any_single_field_mutation_of_a_real_log(data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(EVENTS) - 1), label="event")
    name = data.draw(st.sampled_from(fields_of(EVENTS[index])), label="field")
    never_valid = data.draw(st.booleans())
    value = data.draw(NEVER_VALID if never_valid else st.one_of(OTHER_TYPES, st.just(DELETE)), label="value")
    analysis = report(mutated(index, name, value))
    assert analysis.event_count + analysis.skipped_count == len(EVENTS)
    if never_valid:
        kind = UNNAMED_KIND if name == "event" else EVENTS[index]["event"]
        assert analysis.skipped_events == {kind: 1}
    else:
        assert analysis.skipped_count <= 1


def _valid(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a declared type, of any size the reader takes: the analysers must cope with them."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*map(_valid, args))
    if origin is tuple:
        return st.lists(st.sampled_from(HOSTS) | st.text(max_size=4), max_size=4)
    return {int: st.integers(-2 ** 63 + 1, 2 ** 63 - 1) | st.integers(-3, 200), float: st.floats(
        allow_nan=False, allow_infinity=False) | st.floats(T_FIRST, T_LAST) | st.floats(-5, 300),
        bool: st.booleans(), str: st.sampled_from(HOSTS) | st.text(max_size=6), type(None): st.none()}[hint]


@st.composite
def random_event(draw: st.DrawFn) -> dict[str, Any]:
    """An event of a declared kind (or not) at a time of the real log (or not), its fields of their types
    or of others, some missing."""
    kind = draw(st.sampled_from(sorted(ev.KINDS)) | st.text(max_size=5))
    event: dict[str, Any] = {"t": draw(st.floats(T_FIRST, T_LAST) | OTHER_TYPES), "event": kind,
                             "host": draw(st.sampled_from(HOSTS) | OTHER_TYPES),
                             "pid": draw(st.sampled_from([e["pid"] for e in EVENTS]) | OTHER_TYPES)}
    cls = ev.KINDS.get(kind)
    if cls is not None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if draw(st.integers(0, 9)):  # mostly present
                event[f.name] = draw(_valid(hints[f.name]) if draw(st.integers(0, 3)) else OTHER_TYPES)
    return event


@FAST
@given(st.lists(random_event(), min_size=1, max_size=6))
def test_random_events_among_a_real_log(extra: list[dict[str, Any]]) -> None:
    analysis = report(EVENTS + extra)
    assert analysis.event_count + analysis.skipped_count == len(EVENTS) + len(extra)


@settings(max_examples=40, deadline=None)
@given(st.lists(random_event(), min_size=1, max_size=8))
def test_random_events_alone(events: list[dict[str, Any]]) -> None:
    parsed = parse_log(events)
    if not parsed.records:
        return  # nothing to report: the report says so (ReportError), tested below
    analysis = report(parsed)
    assert analysis.event_count + analysis.skipped_count == len(events)


def test_a_log_of_unreadable_events_only_is_a_report_error(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from hvd_transient.report import main

    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "h.1.jsonl").write_text('{"t": "x", "event": "progress"}\nnot json\n')
    assert main([str(tmp_path)]) == 2
    assert "none of the 2 events could be read" in capsys.readouterr().err


def test_unreadable_lines_are_counted_from_the_store() -> None:
    store = MemoryStore.named("fuzz-unreadable")
    store.put("events/h.1.000000.jsonl", b"".join(json.dumps(e).encode() + b"\n" for e in EVENTS[:20])
              + b"{broken\n[1, 2]\n" + json.dumps({**EVENTS[20], "step": "x"}).encode() + b"\n")
    parsed = read_log(store)
    assert len(parsed.records) == 20
    assert parsed.skipped == {UNREADABLE_LINE: 2, EVENTS[20]["event"]: 1}


@pytest.mark.parametrize(("index", "name", "value"), [(0, "t", 0.0), (len(EVENTS) - 1, "t", T_LAST + 1e9),
                                                      (5, "step", 2 ** 62)])
def test_the_plot_of_a_damaged_log(tmp_path: Path, index: int, name: str, value: Any) -> None:
    pytest.importorskip("matplotlib")
    from hvd_transient.report.plot import plot_run

    out = tmp_path / "run.png"
    plot_run(report(mutated(index, name, value)), out)
    assert out.stat().st_size > 0


def test_the_cli_reports_skipped_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hvd_transient.report import main

    (tmp_path / "events").mkdir()
    lines = [json.dumps(e) for e in EVENTS] + [json.dumps({**EVENTS[3], "t": "later"}), "{"]
    (tmp_path / "events" / "all.jsonl").write_text("\n".join(lines) + "\n")
    assert load_events(str(tmp_path)).skipped == {EVENTS[3]["event"]: 1, UNREADABLE_LINE: 1}
    out_json = tmp_path / "report.json"
    assert main([str(tmp_path), "--json", str(out_json)]) == 0
    assert f"2 skipped as unreadable ({UNREADABLE_LINE} 1, {EVENTS[3]['event']} 1)" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["skipped_event_count"] == 2
