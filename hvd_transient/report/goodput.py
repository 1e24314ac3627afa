"""Whole-run goodput on a trace: useful samples against what the available VMs could have trained (pure).

* **Ideal** = the integral of r(n(t)) dt over the trace's window: n(t) the VMs the trace makes available
  (:attr:`hvd_transient.testing.traces.TracePlan.availability`), r(k) the steady samples per second of a ring of k
  measured on the same machine (a calibration: a small box does not scale linearly). r(0) = 0.
* **Useful samples** are those in the final model: each ring trained from its start step on, with its
  size; a ring that starts at an earlier step (a rollback, a restore of an older checkpoint) cuts every
  segment after that step off the lineage, so rolled-back and re-run work is not counted. Steps are
  counted up to the final model's step (:func:`final_step`).
* **Goodput** = useful / ideal. **Lost time** is where the rest went, in seconds of the window (samples lost
  over the window's mean ideal rate), from the run's events: preemptions (departure -> the survivors' next
  step), joins (the survivors' stall), relaunches (the cluster was down until the first step of a new
  launch), rolled-back steps (at the ring's rate); outside those spans, a ring smaller than the VMs
  available, split into the rest of a notice window the leaving VM did not train through and VMs up but
  not (yet) in the ring (boot, standby, a fixed ring after a relaunch). The rest is split too: steady steps
  slower than the calibration's (the machine's load, or a per-step cost: the variant's **step-time ratio**);
  checkpoint stalls (the save events' blocked seconds); steps slower than the ring's steady pace under a
  notice (notice rounds, host checks) and elsewhere (warm-up after a ring change); and what none of these
  explains.
* **Same machine state.** A loaded machine slows every step of the run it lands on. Each ring's **steady
  pace** is the median rate of its progress intervals after ``warmup_steps`` (outside preemption, join and
  notice spans); its step time over the calibration's for the same size is its step-time ratio
  (:func:`ring_paces`), and the variant's ratio is their median weighted by seconds. **Goodput at its own
  pace** uses an ideal of r(k) / that ratio: every variant is judged against the machine it ran on, and
  its losses are those of its protocol; the ratio says what the machine (or a per-step cost) took.
* **Cost** per million useful samples: the VMs the trace had running are paid at spot prices whatever the
  job did with them; on demand, the same samples come from a ring of the largest size at its full rate.
"""
from __future__ import annotations

import logging
import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from hvd_transient.report.records import of as _of
from hvd_transient.report.run_analysis import ProgressPoint, RunAnalysis
from hvd_transient.report.saves import BLOCKING_SAVE_KINDS
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.parsing import parse_log

log = logging.getLogger(__name__)

Availability = Sequence[tuple[float, int]]


@dataclass(frozen=True)
class Segment:
    """Steps [start, end) of the final model's lineage, trained by a ring of ``size``."""

    start: int
    end: int
    size: int


def ideal_samples(availability: Availability, rates: Mapping[int, float], duration_s: float) -> float:
    """The integral of r(n(t)) over [0, duration_s]; ``availability`` is n(t) as (from second, n) steps."""
    total = 0.0
    for i, (at, n) in enumerate(availability):
        until = availability[i + 1][0] if i + 1 < len(availability) else duration_s
        span = max(0.0, min(until, duration_s) - max(at, 0.0))
        if n > 0 and span > 0:
            if n not in rates:
                raise ValueError(f"no calibrated rate for a ring of {n}; calibrated: {sorted(rates)}")
            total += rates[n] * span
    return total


def vm_seconds(availability: Availability, duration_s: float) -> float:
    """The integral of n(t): what the trace's VMs cost in VM-seconds over the window."""
    return ideal_samples(availability, {n: float(n) for _, n in availability}, duration_s)


def lineage(rings: Sequence[tuple[int, int]], final: int) -> tuple[Segment, ...]:
    """The final model's segments from ``(start step, size)`` of each ring in start order, up to ``final``."""
    segments: list[Segment] = []
    for start, size in rings:
        while segments and segments[-1].start >= start:
            segments.pop()  # rolled back past this whole segment
        if segments and segments[-1].end > start:
            segments[-1] = Segment(segments[-1].start, start, segments[-1].size)
        segments.append(Segment(start, 1 << 62, size))
    out = []
    for s in segments:
        end = min(s.end, final)
        if end > s.start:
            out.append(Segment(s.start, end, s.size))
    return tuple(out)


def final_step(run: RunAnalysis, until: float | None = None) -> int:
    """The final model's step: ``train_end`` of a finished run, else the last step seen by ``until``."""
    if run.completed and run.final_step is not None and until is None:
        return run.final_step
    steps = [p.step for p in run.progress if until is None or p.t <= until]
    steps += [r.step for r in run.rings if until is None or r.started_at <= until]
    return max(steps, default=0)


def useful_samples(run: RunAnalysis, batch_size: int, final: int) -> int:
    """Samples in the final model: each lineage step trained ``size x batch_size`` samples."""
    segs = lineage([(r.step, r.size) for r in sorted(run.rings, key=lambda r: r.started_at)], final)
    return sum((s.end - s.start) * s.size * batch_size for s in segs)


def ring_size_at(run: RunAnalysis, t: float) -> int:
    """The size of the ring training at ``t`` (epoch seconds); 0 while none is."""
    current = None
    for ring in run.rings:
        if ring.started_at > t:
            break
        current = ring
    return current.size if current is not None and t < current.ended_at else 0


def capacity_gap(run: RunAnalysis, *, t0: float, duration_s: float, availability: Availability,
                 rates: Mapping[int, float], notice_windows: Sequence[tuple[float, float]],
                 excluded: Sequence[tuple[float, float]], step_s: float = 0.25) -> tuple[float, float]:
    """Samples lost to a ring smaller than n(t), outside the ``excluded`` spans (epoch seconds): (inside a
    notice window, i.e. ``notice_windows`` (from, to) seconds of the window; elsewhere)."""
    in_window = elsewhere = 0.0
    avail = list(availability)
    for i in range(int(duration_s / step_s)):
        rel = (i + 0.5) * step_s
        t = t0 + rel
        if any(a <= t < b for a, b in excluded):
            continue
        n = next((c for at, c in reversed(avail) if at <= rel), avail[0][1])
        size = min(ring_size_at(run, t), n)
        gap = (rates.get(n, 0.0) - rates.get(size, 0.0)) * step_s if size < n else 0.0
        if any(a <= rel < b for a, b in notice_windows):
            in_window += gap
        else:
            elsewhere += gap
    return in_window, elsewhere


def steps_redone(run: RunAnalysis, until: float) -> int:
    """Steps trained and then thrown away (a rollback, a restore of an older checkpoint), up to ``until``: for
    each ring, the highest step it reached (its progress, or the survivors' resets) beyond the step the next
    ring started from."""
    rings = sorted(run.rings, key=lambda r: r.started_at)
    total = 0
    for ring, following in zip(rings, rings[1:]):
        if following.started_at > until:
            break
        reached = max([ring.step] + [p.step for p in run.progress if ring.started_at <= p.t < following.started_at])
        reset = max((p.steps_rolled_back for p in run.preemptions
                     if p.resumed_at is not None and run.ring_at(p.resumed_at) == following), default=0)
        total += max(reached - following.step, reset, 0)
    return total


#: the lost-time phases that are not spans of events (see the module's docstring)
SLOWER_STEADY = "steady steps slower than calibration (machine load, per-step cost)"
CHECKPOINT_STALLS = "checkpoint stalls (save events)"
SLOWER_UNDER_NOTICE = "steps slower under a notice (notice rounds, host checks)"
OFF_PACE = "steps off the ring's steady pace (warm-up after a change)"
REMAINDER = "remainder (not attributed)"


def lost_phases(run: RunAnalysis, t0: float, t_end: float, lost_s: float, *,
                gaps_s: tuple[float, float] = (0.0, 0.0), pace_s: Mapping[str, float] | None = None
                ) -> dict[str, float]:
    """Seconds of the window lost to each cause (see the module's docstring); ``lost_s`` the total,
    ``gaps_s`` the :func:`capacity_gap` in seconds, ``pace_s`` the losses to a slower pace by name
    (:func:`pace_losses`); what none of them names is the signed remainder."""
    inside = [p for p in run.preemptions if t0 <= p.departed_at <= t_end]
    # a wave's departures, and several VMs joining one ring, share one span: each second counts once
    preempt = _union_s([(p.departed_at, min(p.resumed_at, t_end)) for p in inside
                        if p.resumed_at is not None and not p.cold_restart])
    joins = _union_s([(j.stalled_from, min(j.resumed_at, t_end)) for j in run.joins if t0 <= j.t <= t_end
                      and j.stalled_from is not None and j.resumed_at is not None])
    relaunch = _union_s(_relaunch_spans(run, t0, t_end))
    redone: dict[float, int] = {}  # one rollback per resumption, however many left in it
    for p in inside:
        if p.resumed_at is not None and p.steps_rolled_back:
            redone[p.resumed_at] = max(redone.get(p.resumed_at, 0), p.steps_rolled_back)
    rolled = 0.0
    for resumed_at, steps in redone.items():
        after = run.ring_at(resumed_at)
        if after is not None and after.steps_per_s:
            rolled += steps / after.steps_per_s
    named = {"preemptions (departure -> next step)": preempt, "joins (survivors' stall)": joins,
             "relaunches (down -> first step)": relaunch, "rolled-back steps": rolled,
             "left before the VM was gone (notice window unused)": gaps_s[0],
             "VMs up but not in the ring (boot, joining, fixed ring)": gaps_s[1], **(pace_s or {})}
    return {**named, REMAINDER: lost_s - sum(named.values())}


# ------------------------------------------------------------------------------- pace: the same machine state

@dataclass(frozen=True)
class RingPace:
    """One ring's steady pace: the median rate of its progress intervals after its warm-up."""

    at_s: float              # the ring's start, seconds into the window
    size: int
    steady_s: float          # seconds of progress intervals measured
    steps_per_s: float       # their median rate
    ratio: float | None      # its step time over the calibration's for its size (> 1: slower); None: uncalibrated


def _intervals(run: RunAnalysis, t0: float, t_end: float, skip: Sequence[tuple[float, float]]
               ) -> list[tuple[ProgressPoint, ProgressPoint, int]]:
    """Consecutive progress points of one ring (and its size) inside the window, clear of the ``skip`` spans."""
    points = [p for p in run.progress if t0 <= p.t <= t_end]
    out = []
    for p, q in zip(points, points[1:]):
        if p.size is None or p.size != q.size or q.step <= p.step or q.t <= p.t:
            continue
        ring = run.ring_at(p.t)
        if ring is None or ring is not run.ring_at(q.t) or ring.size != p.size:
            continue
        if not any(a < q.t and p.t < b for a, b in skip):
            out.append((p, q, ring.size))
    return out


def ring_paces(run: RunAnalysis, *, t0: float, duration_s: float, rates: Mapping[int, float], batch_size: int,
               warmup_steps: int = 20, skip: Sequence[tuple[float, float]] = (), min_intervals: int = 3
               ) -> tuple[RingPace, ...]:
    """Each ring's steady pace: progress intervals from ``warmup_steps`` after its start step, clear of
    ``skip`` (epoch-second spans: preemptions, joins, notices), at least ``min_intervals`` of them."""
    by_ring: dict[float, list[tuple[float, float]]] = {}
    sizes: dict[float, int] = {}
    for p, q, size in _intervals(run, t0, t0 + duration_s, skip):
        ring = run.ring_at(p.t)
        if ring is None or p.step < ring.step + warmup_steps:
            continue
        by_ring.setdefault(ring.started_at, []).append((q.t - p.t, (q.step - p.step) / (q.t - p.t)))
        sizes[ring.started_at] = size
    paces = []
    for start, spans in sorted(by_ring.items()):
        if len(spans) < min_intervals:
            continue
        size, steps_per_s = sizes[start], statistics.median(r for _, r in spans)
        calibrated = rates.get(size)
        ratio = calibrated / (size * batch_size) / steps_per_s if calibrated and steps_per_s > 0 else None
        paces.append(RingPace(round(start - t0, 3), size, sum(s for s, _ in spans), steps_per_s, ratio))
    return tuple(paces)


def step_time_ratio(paces: Iterable[RingPace]) -> float | None:
    """The rings' step-time ratios' median, weighted by their steady seconds; None when none was measured."""
    weighted = sorted((p.ratio, p.steady_s) for p in paces if p.ratio is not None and p.steady_s > 0)
    total = sum(w for _, w in weighted)
    reach = 0.0
    for ratio, w in weighted:
        reach += w
        if reach >= total / 2:
            return ratio
    return None


def ratio_by_size(paces: Iterable[RingPace]) -> dict[int, float]:
    """Ring size -> the step-time ratio of its rings (weighted median), largest size first."""
    by: dict[int, list[RingPace]] = {}
    for p in paces:
        by.setdefault(p.size, []).append(p)
    out = {k: step_time_ratio(v) for k, v in sorted(by.items(), reverse=True)}
    return {k: r for k, r in out.items() if r is not None}


def save_stalls(events: Iterable[Any]) -> list[tuple[float, float]]:
    """(when, seconds) training waited for each checkpoint, from a run's save events: an async save's stall,
    a blocking save's seconds; the longest any rank waited (a ring steps at its slowest rank's pace)."""
    records = parse_log(events).records
    worst: dict[tuple[str, int, str], tuple[float, float]] = {}

    def note(run_key: str, step: int, kind: str, t: float, seconds: float) -> None:
        k = (run_key, step, kind)
        if seconds > worst.get(k, (t, -1.0))[1]:
            worst[k] = (t, seconds)

    for a in _of(records, ev.AsyncSave):
        note("async", a.body.step, a.body.kind or "periodic", a.t, a.body.stall_ms / 1e3)
    for e in _of(records, ev.SaveEnd):
        if e.body.kind in BLOCKING_SAVE_KINDS:
            note("blocking", e.body.step, e.body.kind, e.t, e.body.seconds)
    return sorted(worst.values())


def pace_losses(run: RunAnalysis, *, t0: float, duration_s: float, rates: Mapping[int, float], batch_size: int,
                excluded: Sequence[tuple[float, float]], notice_spans: Sequence[tuple[float, float]],
                stalls: Sequence[tuple[float, float]] = ()) -> dict[str, float]:
    """Samples each ring trained below ``rates`` (its expected pace) over its progress intervals clear of
    ``excluded``: a checkpoint stall (``stalls``, :func:`save_stalls`) costs its seconds at the ring's rate;
    the rest of an interval's shortfall counts under a notice (``notice_spans``) or elsewhere. Signed:
    steps faster than the pace give back."""
    out = {CHECKPOINT_STALLS: 0.0, SLOWER_UNDER_NOTICE: 0.0, OFF_PACE: 0.0}
    for p, q, size in _intervals(run, t0, t0 + duration_s, excluded):
        rate = rates.get(size)
        if not rate:
            continue
        dt = q.t - p.t
        stalled = min(dt, sum(s for t, s in stalls if p.t < t <= q.t))
        shortfall = rate * dt - (q.step - p.step) * size * batch_size - rate * stalled
        mid = (p.t + q.t) / 2
        out[CHECKPOINT_STALLS] += rate * stalled
        out[SLOWER_UNDER_NOTICE if any(a <= mid < b for a, b in notice_spans) else OFF_PACE] += shortfall
    return out


def _notice_spans(run: RunAnalysis, t0: float, t_end: float) -> list[tuple[float, float]]:
    """Notice -> departure of each VM that left with notice in the window (epoch seconds)."""
    return [(p.notice_at, p.departed_at) for p in run.preemptions
            if p.notice and p.notice_at is not None and t0 <= p.departed_at <= t_end]


def _union_s(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by the union of (from, to) spans."""
    total, reach = 0.0, -float("inf")
    for a, b in sorted(spans):
        if b > max(a, reach):
            total += b - max(a, reach)
            reach = b
    return total


def _relaunch_spans(run: RunAnalysis, t0: float, t_end: float) -> list[tuple[float, float]]:
    """From the end of the ring before each relaunch to the relaunched ring's first step (epoch seconds)."""
    spans = []
    for prev, ring in zip(run.rings, run.rings[1:]):
        if ring.relaunch and t0 <= ring.started_at <= t_end:
            first = next((p.t for p in run.progress if p.t >= ring.started_at), ring.started_at)
            spans.append((min(prev.ended_at, first), min(first, t_end)))
    return spans


def _excluded_spans(run: RunAnalysis, t0: float, t_end: float) -> list[tuple[float, float]]:
    """The spans :func:`lost_phases` counts by event: preemptions, join stalls, relaunches (epoch seconds)."""
    spans = [(p.departed_at, p.resumed_at) for p in run.preemptions
             if p.resumed_at is not None and t0 <= p.departed_at <= t_end and not p.cold_restart]
    spans += [(j.stalled_from, j.resumed_at) for j in run.joins
              if j.stalled_from is not None and j.resumed_at is not None and t0 <= j.t <= t_end]
    return spans + _relaunch_spans(run, t0, t_end)


@dataclass(frozen=True)
class Goodput:
    variant: str
    useful_samples: int
    ideal_samples: float
    final_step: int
    steps_rolled_back: int  # the most any resumption rolled back (survivors' resets)
    preemptions_seen: int
    lost_phases_s: Mapping[str, float] = field(default_factory=dict)
    steps_redone: int = 0  # every step trained twice, relaunches included (:func:`steps_redone`)
    #: each departure's lead before its VM's deadline, in order (near_deadline; None: it left at once)
    leave_leads_s: tuple[float | None, ...] = ()
    ring_paces: tuple[RingPace, ...] = ()
    #: the run's steady step time over the calibration's (:func:`step_time_ratio`); None: not measured
    step_time_ratio: float | None = None
    #: VMs rank 0 announced to its host check because Horovod's driver lost its message, by change
    host_updates_announced: Mapping[str, int] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        """Against the calibration's r(k)."""
        return self.useful_samples / self.ideal_samples if self.ideal_samples > 0 else 0.0

    @property
    def goodput_own_pace(self) -> float:
        """Against r(k) at the run's own steady pace: the same machine state (the calibration's without a ratio)."""
        return self.goodput * (self.step_time_ratio or 1.0)


def goodput(variant: str, run: RunAnalysis, *, t0: float, duration_s: float, availability: Availability,
            rates: Mapping[int, float], batch_size: int, final: int | None = None,
            notice_windows: Sequence[tuple[float, float]] = (), stalls: Sequence[tuple[float, float]] = (),
            warmup_steps: int = 20) -> Goodput:
    """The figures of one variant's run whose window started at ``t0`` (epoch seconds); ``notice_windows``:
    (notice, VM gone) in seconds of the window, for the lost-time split; ``stalls``: :func:`save_stalls`."""
    t_end = t0 + duration_s
    ideal = ideal_samples(availability, rates, duration_s)
    step = final_step(run) if final is None else final
    useful = useful_samples(run, batch_size, step)
    mean_rate = ideal / duration_s if duration_s > 0 else 0.0
    lost = (ideal - useful) / mean_rate if mean_rate > 0 else 0.0
    inside = [p for p in run.preemptions if t0 <= p.departed_at <= t_end]
    excluded = _excluded_spans(run, t0, t_end)
    in_window, elsewhere = capacity_gap(run, t0=t0, duration_s=duration_s, availability=availability, rates=rates,
                                        notice_windows=notice_windows, excluded=excluded)
    gaps = (in_window / mean_rate, elsewhere / mean_rate) if mean_rate > 0 else (0.0, 0.0)
    notices = _notice_spans(run, t0, t_end)
    paces = ring_paces(run, t0=t0, duration_s=duration_s, rates=rates, batch_size=batch_size,
                       warmup_steps=warmup_steps, skip=[*excluded, *notices])
    ratio = step_time_ratio(paces)
    pace_s: dict[str, float] = {}
    if mean_rate > 0:
        own = {k: r / (ratio or 1.0) for k, r in rates.items()}  # the run's own pace
        own_mean = mean_rate / (ratio or 1.0)
        samples = pace_losses(run, t0=t0, duration_s=duration_s, rates=own, batch_size=batch_size,
                              excluded=excluded, notice_spans=notices, stalls=stalls)
        # the time trained, at the ratio's slower steps: the calibration's loss less the loss at its own pace
        pace_s[SLOWER_STEADY] = duration_s * useful / ideal * ((ratio or 1.0) - 1.0)
        pace_s |= {k: v / own_mean for k, v in samples.items()}
    return Goodput(variant, useful, ideal, step, max((p.steps_rolled_back for p in inside), default=0),
                   len(inside), lost_phases(run, t0, t_end, max(0.0, lost), gaps_s=gaps, pace_s=pace_s),
                   steps_redone(run, t_end), tuple(p.leave_lead_s for p in inside), paces, ratio,
                   dict(run.host_updates_announced))


@dataclass(frozen=True)
class LoadSample:
    """The machine over one sampling interval: the 1-minute load average at its end, and the cores busy in it
    (``/proc/stat``): all of them, and those of the benchmark's own processes."""

    t: float
    load_1m: float
    busy_cores: float
    own_cores: float


@dataclass(frozen=True)
class LoadSummary:
    """Medians of a variant's :class:`LoadSample` s: what the machine gave it."""

    samples: int
    load_1m: float
    load_1m_max: float
    busy_cores: float
    others_cores: float  # cores busy with processes not the benchmark's: the machine's own load


def load_summary(samples: Sequence[LoadSample]) -> LoadSummary | None:
    if not samples:
        return None
    med = statistics.median
    return LoadSummary(len(samples), med(s.load_1m for s in samples), max(s.load_1m for s in samples),
                       med(s.busy_cores for s in samples),
                       med(max(0.0, s.busy_cores - s.own_cores) for s in samples))


def cost_per_m_samples(useful: int, availability: Availability, duration_s: float,
                       spot_per_hour: float) -> float | None:
    """Spot dollars per million useful samples: the trace's VM-hours at spot prices over the samples."""
    if useful <= 0:
        return None
    return vm_seconds(availability, duration_s) / 3600.0 * spot_per_hour / useful * 1e6


def on_demand_cost_per_m_samples(rates: Mapping[int, float], on_demand_per_hour: float) -> float | None:
    """The same work on demand: the largest calibrated ring at its full rate, never preempted."""
    if not rates:
        return None
    k = max(rates)
    return k * on_demand_per_hour / 3600.0 / rates[k] * 1e6 if rates[k] > 0 else None


def plot_goodput_timeline(path: str | os.PathLike[str], run: RunAnalysis, *, t0: float, duration_s: float,
                          availability: Availability, title: str, phases: Mapping[str, float] | None = None) -> Any:
    """One variant's window: VMs available and ring size (left axis), the step reached (right axis), each
    preemption's and relaunch's lost span shaded; a bar of the lost-time phases underneath. Returns the figure's
    axes (top, bottom) before saving, for tests to inspect."""
    from hvd_transient.report.plot import _pyplot

    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), gridspec_kw={"height_ratios": [3, 1]})
    xs = [at for at, _ in availability] + [duration_s]
    ys = [n for _, n in availability] + [availability[-1][1]]
    top.step(xs, ys, where="post", label="VMs available (trace)", color="#8d8d8d", linewidth=3, alpha=0.6)
    rx: list[float] = []
    ry: list[int] = []
    for i, ring in enumerate(run.rings):
        start = ring.started_at - t0
        end = (run.rings[i + 1].started_at if i + 1 < len(run.rings) else ring.ended_at) - t0
        rx += [max(start, 0.0), max(min(ring.ended_at - t0, end), 0.0)]
        ry += [ring.size, ring.size]
        if ring.ended_at < (run.rings[i + 1].started_at if i + 1 < len(run.rings) else ring.ended_at):
            rx.append(ring.ended_at - t0)
            ry.append(0)
    top.plot(rx, ry, drawstyle="steps-post", label="ring size", color="#2166ac")
    for p in run.preemptions:
        if p.resumed_at is not None and t0 <= p.departed_at <= t0 + duration_s:
            top.axvspan(p.departed_at - t0, p.resumed_at - t0, color="#d1495b", alpha=0.25)
    top.set(xlim=(0, duration_s), ylabel="VMs / ring size", title=title)
    top.set_ylim(0, max(ys + ry + [1]) + 0.5)
    steps = top.twinx()
    pts = [(p.t - t0, p.step) for p in run.progress if 0 <= p.t - t0 <= duration_s]
    if pts:
        steps.plot([x for x, _ in pts], [s for _, s in pts], ".", markersize=2, color="#4c9f70", label="step")
    steps.set_ylabel("step")
    top.legend(loc="upper left", fontsize=7)
    names = list(phases or {})
    bottom.barh(names, [float((phases or {})[n]) for n in names], color="#e6a23c")
    bottom.set_xlabel("seconds of the window lost")
    bottom.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return top, bottom


__all__ = ["CHECKPOINT_STALLS", "Goodput", "LoadSample", "LoadSummary", "OFF_PACE", "REMAINDER", "RingPace",
           "SLOWER_STEADY", "SLOWER_UNDER_NOTICE", "Segment", "capacity_gap", "cost_per_m_samples", "final_step",
           "goodput", "ideal_samples", "lineage", "load_summary", "lost_phases", "on_demand_cost_per_m_samples",
           "pace_losses", "plot_goodput_timeline", "ratio_by_size", "ring_paces", "ring_size_at", "save_stalls",
           "step_time_ratio", "steps_redone", "useful_samples", "vm_seconds"]
