"""Public spot-preemption traces turned into a local cluster's schedule (pure but for :func:`load_plan`'s read).

The trace files are read by :mod:`hvd_transient.testing.trace_formats` (Parcae/Oobleck, Bamboo,
SkyPilot), whose names this module re-exports.

:func:`plan_trace` maps a window of a trace (``start_s``, ``hours``) onto at most ``max_nodes`` local VMs:

* **Event traces follow K nodes' own lifetimes.** The first ``max_nodes`` nodes alive at the window's
  start (in the trace's order) are the starting VMs; a VM whose node the trace removes is preempted at
  that time; when the trace adds a node while fewer than ``max_nodes`` are followed, a free VM follows
  it from then on. Nodes beyond the K followed are ignored, so every preemption played is one a real
  node went through, with its real lifetime.
* **Count traces are scaled.** A count c becomes ``round(c * max_nodes / peak)`` VMs, ``peak`` the
  trace's largest count (no scaling when ``peak <= max_nodes``); a drop preempts that many VMs, the
  longest-running first, a rise boots that many.

Times: a trace second at ``t`` plays at ``(t - start_s) / time_scale`` seconds after the first step.
A removal is when the node was gone, so its notice comes the cloud's window (GCE 30 s, AWS 120 s)
**earlier, in real seconds**: compression does not shorten the window, so a compressed run gives the
protocol ``time_scale`` times more trace time to act than the cloud would (and a removal in the first
window gets its notice at the start). Several removals at the same trace instant are one correlated
wave: their notices share one time. An addition is a VM that becomes available at its trace time and
joins (through a standby) ``boot_s`` real seconds later; n(t), the VMs available for the ideal, counts
it from its trace time, so boot time is lost time. A VM name is reused only after its previous VM
stopped (the name free longest is taken).
"""
from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass
from typing import Sequence

from hvd_transient.testing.schedule import Action
from hvd_transient.testing.trace_formats import (
    FORMATS,
    NodeEvent,
    Trace,
    TraceError,
    detect_format,
    parse_trace,
    read_trace,
)

log = logging.getLogger(__name__)

#: the cloud's preemption notice, seconds (GCE Spot / preemptible, AWS Spot interruption notice)
NOTICE_WINDOWS_S = {"gce": 30.0, "aws": 120.0}
#: a reused VM name joins at least this long after its previous VM stopped (its window's end)
REUSE_GAP_S = 1.0
HOUR_S = 3600.0


@dataclass(frozen=True)
class TraceOptions:
    """How a trace window is played (the command line's ``--trace-*`` options)."""

    start_s: float = 0.0           # --trace-start (hours on the command line)
    hours: float | None = None     # --trace-hours; None: to the trace's end
    time_scale: float = 1.0        # --time-scale: trace seconds per real second
    max_nodes: int = 4             # --max-nodes
    cloud: str = "gce"             # whose notice window a removal gets
    window_s: float | None = None  # the notice window (real seconds); default the cloud's
    boot_s: float = 0.0            # an added VM joins this long after it became available (real seconds)

    def __post_init__(self) -> None:
        if self.cloud not in NOTICE_WINDOWS_S:
            raise TraceError(f"unknown cloud {self.cloud!r}; use one of {', '.join(NOTICE_WINDOWS_S)}")
        for name, option in (("start_s", "--trace-start"), ("boot_s", "--boot-seconds")):
            if not getattr(self, name) >= 0:
                raise TraceError(f"{option} must be >= 0, not {getattr(self, name)!r}")
        if self.hours is not None and not self.hours > 0:
            raise TraceError(f"--trace-hours must be > 0, not {self.hours!r}")
        if not self.time_scale > 0:
            raise TraceError(f"--time-scale must be > 0, not {self.time_scale!r}")
        if self.max_nodes < 1:
            raise TraceError(f"--max-nodes must be at least 1, not {self.max_nodes!r}")
        if self.window_s is not None and not self.window_s > 0:
            raise TraceError(f"the notice window must be > 0 s, not {self.window_s!r}")

    @property
    def notice_s(self) -> float:
        return NOTICE_WINDOWS_S[self.cloud] if self.window_s is None else self.window_s


@dataclass(frozen=True)
class Wave:
    """Removals at one trace instant: their notices share one time."""

    at_s: float                 # real seconds: when the VMs are gone
    notice_at_s: float          # real seconds: when their notices come
    hosts: tuple[str, ...]
    trace_t_s: float


@dataclass(frozen=True)
class TracePlan:
    """A trace window as the local cluster plays it; every time in real seconds after the first step."""

    trace: str                                   # the file's name
    format: str
    options: TraceOptions
    hosts: tuple[str, ...]                       # the VMs the job starts on
    actions: tuple[Action, ...]                  # notices (at ``at_s``) and joins, by host name
    availability: tuple[tuple[float, int], ...]  # n(t): (from real second, VMs available); starts at 0.0
    duration_s: float                            # the window, in real seconds
    waves: tuple[Wave, ...]
    scale: float = 1.0                           # count traces: local VMs per trace instance

    @property
    def preemptions(self) -> int:
        return sum(len(w.hosts) for w in self.waves)

    def available_at(self, t: float) -> int:
        n = self.availability[0][1]
        for at, count in self.availability:
            if at > t:
                break
            n = count
        return n

    def describe(self) -> str:
        o = self.options
        hours = self.duration_s * o.time_scale / HOUR_S
        return (f"{self.trace} ({self.format}), {o.start_s / HOUR_S:g} h + {hours:g} h at x{o.time_scale:g} "
                f"= {self.duration_s:.0f} s, {len(self.hosts)} VMs at the start, "
                f"{self.preemptions} preemptions in {len(self.waves)} waves, {o.notice_s:g} s notices ({o.cloud})")


# ----------------------------------------------------------------------------------------------- planning

class _Hosts:
    """VM names: a name is reused only once its VM stopped, the one free longest first."""

    def __init__(self, names: Sequence[str], used: int) -> None:
        self.free: dict[str, float] = {h: -math.inf for h in names[used:]}

    def take(self, at: float) -> tuple[str, float]:
        host = min(self.free, key=lambda h: self.free[h])
        freed = self.free.pop(host)
        return host, max(at, freed + REUSE_GAP_S)

    def release(self, host: str, at: float) -> None:
        self.free[host] = at


def plan_trace(trace: Trace, options: TraceOptions, hosts: Sequence[str]) -> TracePlan:
    """The schedule, the starting VMs and n(t) of ``options``' window of ``trace`` on ``hosts`` (names)."""
    if options.max_nodes > len(hosts):
        raise TraceError(f"--max-nodes {options.max_nodes}: only {len(hosts)} local VMs exist ({', '.join(hosts)})")
    end = trace.duration_s if options.hours is None else options.start_s + options.hours * HOUR_S
    if options.start_s >= trace.duration_s:
        raise TraceError(f"--trace-start {options.start_s / HOUR_S:g} h is at or past the trace's end "
                         f"({trace.duration_s / HOUR_S:.2f} h)")
    return _Planner(trace, options, tuple(hosts), end).plan()


class _Planner:
    """One pass over the window: joins, removals (grouped into waves) and n(t)."""

    def __init__(self, trace: Trace, options: TraceOptions, hosts: tuple[str, ...], end: float) -> None:
        self.trace, self.options, self.hosts, self.end = trace, options, hosts, end
        self.actions: list[Action] = []
        self.deltas: list[tuple[float, int]] = []
        self.waves: dict[float, Wave] = {}
        self.joined_at: dict[str, float] = {}
        self.pool: _Hosts | None = None

    def real(self, t_s: float) -> float:
        return round((t_s - self.options.start_s) / self.options.time_scale, 3)

    def start(self, count: int) -> list[str]:
        running = list(self.hosts[:count])
        self.joined_at = {h: 0.0 for h in running}
        self.pool = _Hosts(self.hosts, count)
        return running

    def add(self, t_s: float) -> str:
        assert self.pool is not None
        at = self.real(t_s)
        host, join_at = self.pool.take(at + self.options.boot_s)
        join_at = round(join_at, 3)
        self.joined_at[host] = join_at
        self.actions.append(Action("join", host, at_s=join_at))
        self.deltas.append((at, +1))
        return host

    def remove(self, host: str, t_s: float) -> None:
        assert self.pool is not None
        at, joined = self.real(t_s), self.joined_at.pop(host)
        self.deltas.append((at, -1))
        if at <= joined:  # gone before it finished booting: it never joins
            self.actions.remove(Action("join", host, at_s=joined))
            self.pool.release(host, joined)
            return
        # the notice comes a window before the VM is gone, once the VM is there
        notice = round(max(0.0, at - self.options.notice_s, joined), 3)
        self.pool.release(host, notice + self.options.notice_s)  # the local VM stops when its window ends
        self.actions.append(Action("notice", host, at_s=notice))
        wave = self.waves.get(t_s)
        self.waves[t_s] = Wave(at, min(notice, wave.notice_at_s) if wave else notice,
                               (*wave.hosts, host) if wave else (host,), t_s)

    def in_window(self, t_s: float) -> bool:
        return self.options.start_s < t_s < self.end

    def plan(self) -> TracePlan:
        trace, k = self.trace, self.options.max_nodes
        scale = 1.0
        if trace.is_events:
            alive: list[str] = []
            for e in trace.events:
                if e.t_s > self.options.start_s:
                    break
                alive.append(e.node) if e.kind == "add" else alive.remove(e.node)
            followed = dict(zip(alive[:k], self.start(min(k, len(alive)))))
            n0 = len(followed)
            for e in trace.events:
                if not self.in_window(e.t_s):
                    continue
                if e.kind == "add" and len(followed) < k:
                    followed[e.node] = self.add(e.t_s)
                elif e.kind == "remove" and e.node in followed:
                    self.remove(followed.pop(e.node), e.t_s)
        else:
            scale = min(1.0, k / trace.peak) if trace.peak else 1.0

            def local(count: int) -> int:
                return min(k, int(math.floor(count * scale + 0.5)))

            first = next((c for t, c in reversed(trace.levels) if t <= self.options.start_s), trace.levels[0][1])
            running = self.start(local(first))  # oldest first: the longest-running VM is preempted first
            n0 = len(running)
            for t_s, count in trace.levels:
                if not self.in_window(t_s):
                    continue
                while len(running) < local(count):
                    running.append(self.add(t_s))
                while len(running) > local(count):
                    self.remove(running.pop(0), t_s)
        return _finish(trace, self.options, self.hosts[:n0], self.actions, self.deltas, self.real(self.end),
                       tuple(self.waves[t] for t in sorted(self.waves)), scale)


def _finish(trace: Trace, options: TraceOptions, start_hosts: tuple[str, ...], actions: list[Action],
            deltas: list[tuple[float, int]], duration_s: float, waves: tuple[Wave, ...], scale: float) -> TracePlan:
    if not start_hosts:
        raise TraceError(f"{trace.source}: no node is available at --trace-start {options.start_s / HOUR_S:g} h; "
                         "the job needs at least one VM to start on: pick a later start")
    n = len(start_hosts)
    availability: list[tuple[float, int]] = [(0.0, n)]
    for at, d in sorted(deltas, key=lambda x: x[0]):
        n += d
        if availability[-1][0] == at:
            availability[-1] = (at, n)
        else:
            availability.append((at, n))
    ordered = sorted(actions, key=lambda a: (a.at_s or 0.0, a.action != "join", a.target))  # a VM is up first
    return TracePlan(trace.source, trace.format, options, start_hosts, tuple(ordered), tuple(availability),
                     duration_s, waves, scale)


# ----------------------------------------------------------------------------------------------- command line

def add_trace_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, required: bool = False,
                        scale: float = 6.0) -> None:
    """``--trace FILE`` and the options that pick and shape its window (``demo`` and ``bench goodput``)."""
    p.add_argument("--trace", required=required, metavar="FILE",
                   help="a public spot trace (Parcae/Oobleck CSV, Bamboo CSV or SkyPilot JSON) to play")
    p.add_argument("--trace-format", choices=FORMATS, help="the trace's format (default: detected)")
    p.add_argument("--trace-start", type=float, default=0.0, metavar="HOURS", help="the window starts this far in")
    p.add_argument("--trace-hours", type=float, default=1.0, metavar="HOURS", help="the window's length")
    p.add_argument("--time-scale", type=float, default=scale,
                   help="trace seconds per real second (6: an hour plays in 10 minutes); notice windows stay real")
    p.add_argument("--max-nodes", type=int, default=4,
                   help="at most this many local VMs: event traces follow that many nodes, count traces are scaled")
    p.add_argument("--cloud", choices=sorted(NOTICE_WINDOWS_S), default="gce",
                   help="whose notice a removal gets (gce 30 s, aws 120 s; --window overrides)")
    p.add_argument("--boot-seconds", type=float, default=0.0,
                   help="an added VM joins this many real seconds after the trace makes it available")


def trace_options(args: argparse.Namespace, window_s: float | None = None) -> TraceOptions:
    """The :class:`TraceOptions` of :func:`add_trace_arguments`' options (hours become seconds)."""
    return TraceOptions(start_s=args.trace_start * HOUR_S, hours=args.trace_hours, time_scale=args.time_scale,
                        max_nodes=args.max_nodes, cloud=args.cloud, window_s=window_s, boot_s=args.boot_seconds)


def load_plan(args: argparse.Namespace, hosts: Sequence[str], window_s: float | None = None) -> TracePlan:
    return plan_trace(read_trace(args.trace, args.trace_format), trace_options(args, window_s), hosts)


__all__ = ["FORMATS", "NOTICE_WINDOWS_S", "NodeEvent", "Trace", "TraceError", "TraceOptions", "TracePlan", "Wave",
           "add_trace_arguments", "detect_format", "load_plan", "parse_trace", "plan_trace", "read_trace",
           "trace_options"]
