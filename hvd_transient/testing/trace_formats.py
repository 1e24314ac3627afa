"""Public spot-preemption trace files and their readers (pure but for reading a file).

Formats, detected from the file's content or named (``--trace-format``):

* ``parcae`` / ``oobleck``: ``ms,add|remove,nodeId`` lines, one per node event (Parcae NSDI'24
  ``liveput/traces/p3trace.csv``, Oobleck SOSP'23 ``tools/simulator/traces/``);
* ``bamboo``: ``seconds,available_instances`` lines, a step function (Bamboo NSDI'23 ``doc/data/``);
  a repeated time stamp is the step, its last line wins;
* ``skypilot``: JSON ``{"metadata": {"gap_seconds": N}, "data": [count, ...]}`` (SkyPilot spot-traces,
  NSDI'24 *Can't Be Late*), one count every ``gap_seconds``.

A file is read into a :class:`Trace`; :mod:`hvd_transient.testing.traces` maps a window of it onto
a local cluster's schedule.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from hvd_transient.testing.schedule import ScheduleError

FORMATS = ("parcae", "oobleck", "bamboo", "skypilot")
EVENT_FORMATS = frozenset({"parcae", "oobleck"})


class TraceError(ScheduleError):
    """A trace file or a trace option is malformed; the message names the line or the option."""


@dataclass(frozen=True)
class NodeEvent:
    """One line of an event trace: node ``node`` was added or removed ``t_s`` seconds into the trace."""

    t_s: float
    kind: str  # "add" | "remove"
    node: str
    line: int


@dataclass(frozen=True)
class Trace:
    """A parsed trace: node events (event formats) or a step function of counts (count formats)."""

    format: str
    source: str
    events: tuple[NodeEvent, ...] = ()
    levels: tuple[tuple[float, int], ...] = ()  # (t_s, instances available from t_s on), t_s increasing
    end_s: float | None = None  # where the trace ends, if not at its last time stamp (SkyPilot: the last gap's end)

    @property
    def is_events(self) -> bool:
        return self.format in EVENT_FORMATS

    @property
    def duration_s(self) -> float:
        if self.end_s is not None:
            return self.end_s
        times = [e.t_s for e in self.events] or [t for t, _ in self.levels]
        return max(times, default=0.0)

    @property
    def peak(self) -> int:
        """The most nodes available at once."""
        if not self.is_events:
            return max((c for _, c in self.levels), default=0)
        alive, peak = 0, 0
        for e in self.events:
            alive += 1 if e.kind == "add" else -1
            peak = max(peak, alive)
        return peak


def detect_format(text: str, source: str = "trace") -> str:
    """``skypilot`` for a JSON object, ``parcae`` for ``ms,add|remove,node`` lines, ``bamboo`` for pairs."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        return "skypilot"
    for number, row in _rows(text):
        if len(row) == 3 and row[1].strip().lower() in ("add", "remove"):
            return "parcae"
        if len(row) == 2:
            return "bamboo"
        raise TraceError(f"{source}:{number}: cannot tell the trace's format from {','.join(row)!r}; expected "
                         "'ms,add|remove,node' (Parcae/Oobleck), 'seconds,instances' (Bamboo) or SkyPilot JSON; "
                         "or name it with --trace-format")
    raise TraceError(f"{source}: the trace is empty")


def read_trace(path: str | Path, fmt: str | None = None) -> Trace:
    """Read a trace file; ``fmt`` one of :data:`FORMATS`, or None to detect it."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    return parse_trace(text, fmt, source=path.name)


def parse_trace(text: str, fmt: str | None = None, *, source: str = "trace") -> Trace:
    if fmt is not None and fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; use one of {', '.join(FORMATS)}")
    fmt = fmt or detect_format(text, source)
    if fmt in EVENT_FORMATS:
        return Trace(fmt, source, events=_parse_events(text, source))
    if fmt == "bamboo":
        return Trace(fmt, source, levels=_parse_bamboo(text, source))
    levels, end_s = _parse_skypilot(text, source)
    return Trace(fmt, source, levels=levels, end_s=end_s)


def _rows(text: str) -> Iterable[tuple[int, list[str]]]:
    """Non-blank, non-comment CSV rows with their 1-based line numbers."""
    for number, line in enumerate(io.StringIO(text), start=1):
        if line.strip() and not line.lstrip().startswith("#"):
            yield number, next(csv.reader([line]))


def _number(text: str, what: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{where}: {what} {text.strip()!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: {what} must be a finite number >= 0, not {text.strip()!r}")
    return value


def _parse_events(text: str, source: str) -> tuple[NodeEvent, ...]:
    events: list[NodeEvent] = []
    alive: set[str] = set()
    for number, row in _rows(text):
        where = f"{source}:{number}"
        if len(row) != 3:
            raise TraceError(f"{where}: expected 'ms,add|remove,nodeId', got {','.join(row)!r}")
        t_s = _number(row[0], "the time (ms)", where) / 1000.0
        kind, node = row[1].strip().lower(), row[2].strip()
        if kind not in ("add", "remove") or not node:
            raise TraceError(f"{where}: expected 'add' or 'remove' and a node id, got {','.join(row)!r}")
        if events and t_s < events[-1].t_s:
            raise TraceError(f"{where}: time {row[0].strip()} ms is before the previous line's; the lines must be "
                             "in time order")
        if kind == "add" and node in alive:
            raise TraceError(f"{where}: {node} is added again while alive")
        if kind == "remove" and node not in alive:
            raise TraceError(f"{where}: {node} is removed but is not alive (never added, or removed already)")
        (alive.add if kind == "add" else alive.discard)(node)
        events.append(NodeEvent(t_s, kind, node, number))
    if not events:
        raise TraceError(f"{source}: the trace has no events")
    return tuple(events)


def _parse_bamboo(text: str, source: str) -> tuple[tuple[float, int], ...]:
    levels: dict[float, int] = {}
    last = -1.0
    for number, row in _rows(text):
        where = f"{source}:{number}"
        if len(row) != 2:
            raise TraceError(f"{where}: expected 'seconds,available_instances', got {','.join(row)!r}")
        t_s = _number(row[0], "the time (s)", where)
        count = _number(row[1], "the instance count", where)
        if count != int(count):
            raise TraceError(f"{where}: the instance count must be a whole number, not {row[1].strip()!r}")
        if t_s < last:
            raise TraceError(f"{where}: time {row[0].strip()} s is before the previous line's; the lines must be "
                             "in time order")
        levels[t_s], last = int(count), t_s
    if not levels:
        raise TraceError(f"{source}: the trace has no lines")
    return _steps(sorted(levels.items()))


def _parse_skypilot(text: str, source: str) -> tuple[tuple[tuple[float, int], ...], float]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{source}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list) or not isinstance(doc.get("metadata"), dict):
        raise TraceError(f'{source}: expected {{"metadata": {{"gap_seconds": N}}, "data": [count, ...]}}')
    gap = doc["metadata"].get("gap_seconds")
    if not isinstance(gap, (int, float)) or isinstance(gap, bool) or not gap > 0:
        raise TraceError(f"{source}: metadata.gap_seconds must be a number > 0, not {gap!r}")
    data = doc["data"]
    if not data:
        raise TraceError(f"{source}: data is empty")
    for i, count in enumerate(data):
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise TraceError(f"{source}: data[{i}] must be a whole number >= 0, not {count!r}")
    return _steps([(i * float(gap), int(c)) for i, c in enumerate(data)]), len(data) * float(gap)


def _steps(points: Sequence[tuple[float, int]]) -> tuple[tuple[float, int], ...]:
    """Only the points where the count changes (the first always)."""
    out: list[tuple[float, int]] = []
    for t, c in points:
        if not out or out[-1][1] != c:
            out.append((t, c))
    return tuple(out)


__all__ = ["EVENT_FORMATS", "FORMATS", "NodeEvent", "Trace", "TraceError", "detect_format", "parse_trace",
           "read_trace"]
