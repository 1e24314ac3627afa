"""Training throughput and per-save stall with periodic checkpoints, ours against Horovod's recipe.

ResNet-32 (CIFAR-10 shapes, synthetic data) trains under a real ``horovodrun -np 2``
(Gloo, loopback, a static job) and, side by side in ONE job, runs these configurations
(see ``bench/overhead_worker.py`` for exactly what each calls):

* ``none``: no checkpointing;
* ``save_weights``: the baseline Horovod's docs recommend: rank 0 alone saves synchronously
  with ``model.save_weights`` (TensorFlow checkpoint format) every K steps;
* ``tf_checkpoint`` (optional): rank 0 alone, ``tf.train.Checkpoint(model, optimizer).write``;
* ``ours_sync``: hvd-transient, every rank writes its share (``TransientImpl.save_now``:
  ``CheckpointManager.save``, records gathered by Horovod collectives, rank 0 commits);
* ``ours_async``: hvd-transient's periodic ``save_async`` exactly as ``TransientCallback``
  runs it (the caller pays only the snapshot; persisting runs on a background thread).

Both ``ours`` configurations also run the per-step notice collective of ``TransientCallback``.
Each configuration trains in *windows* of K steps (K = the save interval) whose first step
saves, interleaved round by round with the others, so every window holds one save and
its after-effects, and slow phases of a shared machine hit every configuration alike.

Measured per configuration and interval: steps/s (median over windows), overhead against
``none`` (paired with the ``none`` window of the same round), the per-save stall (the time
the step loop is blocked in the checkpoint call at a save step, minus that call's median
at other steps; slowest rank; for the async configuration the save's own blocked time as
``TransientImpl`` reports it), and, as references, ``np.copy`` of the whole state timed by
the no-checkpoint windows at their save steps (the stall's reference: same point of the
loop, same load), and, after the run on an idle loop, the same copy and reading every
variable into host memory on rank 0.

Results: ``bench/results/ckpt_overhead.json`` (+ ``.md``, ``.png``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from common import (
    BenchError,
    Panel,
    Spread,
    command_line,
    csv_list,
    finish_report,
    install_interrupt_handlers,
    machine_info,
    machine_line,
    markdown_table,
    plot_panels,
    positive_int,
    positive_seconds,
    print_table,
    spread,
    write_results,
)

log = logging.getLogger("ckpt_overhead")

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "overhead_worker.py"
DEFAULT_OUT = REPO / "bench" / "results" / "ckpt_overhead.json"
#: local host aliases, one Horovod slot each (see hvd_transient.testing.local_cluster.HOST_ALIASES)
HOST_ALIASES = ("localhost", "127.0.0.1", "127.0.1", "127.1", "2130706433", "0x7f000001")

CONFIGS = ("none", "save_weights", "tf_checkpoint", "ours_sync", "ours_async")
DEFAULT_CONFIGS = ("none", "save_weights", "ours_sync", "ours_async")
LABELS = {
    "none": "no checkpoint",
    "save_weights": "rank 0 model.save_weights (Horovod docs)",
    "tf_checkpoint": "rank 0 tf.train.Checkpoint.write",
    "ours_sync": "hvd-transient sync sharded",
    "ours_async": "hvd-transient async (TransientCallback)",
}
#: steps of the untimed warm-up window each checkpointing configuration gets (its first save)
WARMUP_WINDOW_STEPS = 3
GOAL_OVERHEAD_PCT = 1.0
GOAL_STALL_VS_MEMCPY = 2.0


# --------------------------------------------------------------------------- the plan (pure)


@dataclass(frozen=True)
class Window:
    config: str
    interval: int
    steps: int
    index: int          # round number; -1 for the warm-up window
    start_step: int     # the configuration's own step count at the window's first step


def windows_per_interval(steps: int, interval: int) -> int:
    """Measured windows for one configuration and interval: ``steps`` in whole intervals, at least one."""
    return max(1, round(steps / interval))


def plan_windows(configs: Sequence[str], intervals: Sequence[int], steps: int) -> list[Window]:
    """Warm-up windows first, then rounds; in each round every configuration runs one window per interval.

    The configuration order rotates from round to round, and a configuration's step count
    starts every window at a multiple of its interval, so the window's first step saves.
    """
    plan = [Window(c, k, min(WARMUP_WINDOW_STEPS, k), -1, k)
            for k in intervals for c in configs if c != "none"]
    counts = {k: windows_per_interval(steps, k) for k in intervals}
    for r in range(max(counts.values())):
        order = list(configs[r % len(configs):]) + list(configs[:r % len(configs)])
        for k in intervals:
            if r < counts[k]:
                plan += [Window(c, k, k, r, k * (r + 2)) for c in order]
    return plan


# --------------------------------------------------------------------------- analysis (pure)


@dataclass(frozen=True)
class WindowResult:
    """One window as both ranks saw it."""

    config: str
    interval: int
    index: int
    window_s: float                        # rank 0's wall time, barrier to barrier
    step_s: tuple[float, ...]              # rank 0: training step + checkpoint call, per step
    hook_s: tuple[tuple[float, ...], ...]  # per rank: time in the checkpoint call, per step
    save_steps: tuple[int, ...]
    finish_s: float                        # waiting for the background save after the last step (max rank)
    cpu_s: tuple[float, ...] = ()          # per rank: process CPU time (all threads) in the window
    persisted_at: int | None = None        # rank 0: step index by which its background save had finished
    manager_blocked_s: float | None = None  # CheckpointManager's own stall figure (async: the snapshot), max rank
    round_steps: tuple[int, ...] = ()      # steps whose call ran the notice collective (the same on every rank)
    own_stalls_s: tuple[float, ...] = ()   # async: per save, the slowest rank's own blocked time (async_save event)
    copies_s: tuple[float, ...] = ()       # none: per timed step, the slowest rank's np.copy of the state

    @property
    def steps(self) -> int:
        return len(self.step_s)

    def median_step_s(self) -> float:
        others = [s for i, s in enumerate(self.step_s) if i not in self.save_steps]
        return statistics.median(others or self.step_s)

    def stalls_s(self) -> list[float]:
        """Per save: the slowest rank's time in the checkpoint call beyond its median call at other steps.

        The save step's call also runs the notice collective, so it is compared with the other
        steps that ran one (all of them with ``--check-every 1``): the stall is the save's own cost.
        """
        out = []
        for i in self.save_steps:
            per_rank = []
            for hooks in self.hook_s:
                others = [h for j, h in enumerate(hooks) if j not in self.save_steps]
                alike = [h for j, h in enumerate(hooks) if j not in self.save_steps
                         and (j in self.round_steps) == (i in self.round_steps)]
                ref = alike or others
                per_rank.append(hooks[i] - (statistics.median(ref) if ref else 0.0))
            out.append(max(per_rank))
        return out

    def notice_rounds_between_saves(self) -> int:
        """Notice collectives this window ran at steps that did not save."""
        return sum(1 for j in self.round_steps if j not in self.save_steps)

    def median_plain_hook_s(self) -> float:
        """Rank 0's time in the checkpoint call at steps that neither save nor run the collective."""
        plain = [h for j, h in enumerate(self.hook_s[0]) if j not in self.save_steps and j not in self.round_steps]
        return statistics.median(plain) if plain else 0.0

    def median_hook_s(self) -> float:
        """Rank 0's time in the checkpoint call at steps that do not save (the per-step protocol)."""
        others = [h for j, h in enumerate(self.hook_s[0]) if j not in self.save_steps]
        return statistics.median(others) if others else 0.0

    def in_call_fraction(self) -> float:
        """Share of the window rank 0 spent inside checkpoint calls or waiting for a background save.

        An upper bound on what the calls cost: a collective in the call also absorbs waiting for
        a slower rank, which would otherwise happen in the next training step's allreduce.
        """
        return (sum(self.hook_s[0]) + self.finish_s) / self.window_s


def merge_ranks(rank_docs: Sequence[Mapping[str, Any]]) -> list[WindowResult]:
    """Join the ranks' window records (same order on every rank) into WindowResults; warm-ups dropped."""
    docs = sorted(rank_docs, key=lambda d: d["rank"])
    if not docs or docs[0]["rank"] != 0:
        raise BenchError("rank 0's results are missing")
    counts = {len(d["windows"]) for d in docs}
    if len(counts) != 1:
        raise BenchError(f"the ranks recorded different numbers of windows: {sorted(counts)}")
    out = []
    for per_rank in zip(*(d["windows"] for d in docs)):
        w0 = per_rank[0]
        if w0["index"] < 0:
            continue
        blocked = [w["snapshot_or_save_s"] for w in per_rank if "snapshot_or_save_s" in w]
        out.append(WindowResult(
            config=w0["config"], interval=w0["interval"], index=w0["index"], window_s=w0["window_s"],
            step_s=tuple(t + h for t, h in zip(w0["train_s"], w0["hook_s"])),
            hook_s=tuple(tuple(w["hook_s"]) for w in per_rank), save_steps=tuple(w0["save_steps"]),
            finish_s=max(w["finish_s"] for w in per_rank), persisted_at=w0.get("persisted_at"),
            cpu_s=tuple(w.get("cpu_s", 0.0) for w in per_rank),
            manager_blocked_s=max(blocked) if blocked else None,
            round_steps=tuple(w0.get("round_steps", ())),
            own_stalls_s=tuple(slowest_rank(per_rank, "own_stall_s")),
            copies_s=tuple(slowest_rank(per_rank, "copy_s"))))
    return out


#: What summarize() takes from every rank's end-of-run samples (the slowest rank per sample): its key -> the worker's.
SLOWEST_RANK_SAMPLES = {"background_cpu_s": "background_cpu_samples", "idle_stall_s": "idle_stall_samples",
                        "idle_copy_s": "idle_copy_samples", "paired_stall_s": "paired_stall_samples",
                        "paired_copy_s": "paired_copy_samples"}


def slowest_rank(per_rank: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    """Per sample of ``key`` (the ranks take theirs in step, e.g. one per save), the largest over the ranks."""
    return [max(per_sample) for per_sample in zip(*(d.get(key, ()) for d in per_rank))]


@dataclass(frozen=True)
class ConfigStats:
    config: str
    interval: int
    windows: int
    steps_per_s: Spread
    overhead_pct: Spread | None     # window time against the `none` window of the same round - 1
    cpu_overhead_pct: Spread | None  # CPU time (all ranks, all threads) against the same `none` window - 1
    cpu_ms_per_step: Spread         # all ranks together, per window
    in_call_pct: Spread             # share of the window inside checkpoint calls (rank 0)
    median_step_ms: float
    per_step_call_ms: float         # checkpoint call at steps that do not save
    plain_call_ms: float            # checkpoint call at steps that neither save nor run the notice collective
    stall_ms: Spread | None         # per save, slowest rank: time in the call beyond a usual call
    own_stall_ms: Spread | None     # ours_async: per save, slowest rank: the save's own blocked time
    snapshot_ms: float | None       # CheckpointManager.last_stats.stall_s (ours_async: the snapshot copy)
    finish_ms: float                # background save still running at the window's end
    persisted_within_steps: float | None  # ours_async: steps until the background save had finished
    notice_rounds_per_window: float | None = None  # ours: notice collectives at non-save steps, median
    copy_ms: Spread | None = None   # none: per save step, slowest rank: np.copy of the state in the loop

    @property
    def save_stall_ms(self) -> Spread | None:
        """The stall per save: the save's own blocked time where reported (async), else the call's excess."""
        return self.own_stall_ms if self.own_stall_ms is not None else self.stall_ms

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("steps_per_s", "overhead_pct", "cpu_overhead_pct", "cpu_ms_per_step", "in_call_pct",
                    "stall_ms", "own_stall_ms", "copy_ms"):
            value = getattr(self, key)
            d[key] = value.as_dict() if value is not None else None
        d["label"] = LABELS.get(self.config, self.config)
        return d


def config_stats(results: Sequence[WindowResult]) -> list[ConfigStats]:
    by_key: dict[tuple[str, int], list[WindowResult]] = {}
    for w in results:
        by_key.setdefault((w.config, w.interval), []).append(w)
    none = {(w.interval, w.index): w for w in results if w.config == "none"}
    out = []
    for (config, interval), windows in by_key.items():
        refs = [(w, none[(interval, w.index)]) for w in windows if config != "none" and (interval, w.index) in none]
        paired = [(w.window_s / ref.window_s - 1) * 100 for w, ref in refs]
        cpu_paired = [(sum(w.cpu_s) / sum(ref.cpu_s) - 1) * 100 for w, ref in refs if sum(ref.cpu_s) > 0]
        stalls = [s * 1000 for w in windows for s in w.stalls_s()]
        snapshots = [w.manager_blocked_s * 1000 for w in windows if w.manager_blocked_s is not None]
        persisted = [w.persisted_at + 1 for w in windows if w.persisted_at is not None]
        out.append(ConfigStats(
            config=config, interval=interval, windows=len(windows),
            steps_per_s=spread([w.steps / w.window_s for w in windows]),
            overhead_pct=spread(paired) if paired else None,
            cpu_overhead_pct=spread(cpu_paired) if cpu_paired else None,
            cpu_ms_per_step=spread([sum(w.cpu_s) / w.steps * 1000 for w in windows]),
            in_call_pct=spread([w.in_call_fraction() * 100 for w in windows]),
            median_step_ms=statistics.median(w.median_step_s() * 1000 for w in windows),
            per_step_call_ms=statistics.median(w.median_hook_s() * 1000 for w in windows),
            plain_call_ms=statistics.median(w.median_plain_hook_s() * 1000 for w in windows),
            stall_ms=spread(stalls) if stalls else None,
            own_stall_ms=spread(own) if (own := [s * 1000 for w in windows for s in w.own_stalls_s]) else None,
            snapshot_ms=statistics.median(snapshots) if snapshots and config == "ours_async" else None,
            finish_ms=statistics.median(w.finish_s * 1000 for w in windows),
            persisted_within_steps=statistics.median(persisted) if persisted and config == "ours_async" else None,
            notice_rounds_per_window=(statistics.median(w.notice_rounds_between_saves() for w in windows)
                                      if config.startswith("ours") else None),
            copy_ms=spread(copies) if (copies := [s * 1000 for w in windows for s in w.copies_s]) else None))
    order = {c: i for i, c in enumerate(CONFIGS)}
    return sorted(out, key=lambda s: (s.interval, order.get(s.config, 99)))


def goal_interval(intervals: Sequence[int]) -> int:
    """The interval the goal is stated for (200 steps), else the longest one measured."""
    return 200 if 200 in intervals else max(intervals)


def throughput_noise_pct(stats: Sequence[ConfigStats]) -> float | None:
    """How much identical windows without checkpointing varied: their steps/s range, % of the median.

    The whole range, not half of it: a paired comparison can land anywhere within it.
    """
    rates = [x for s in stats if s.config == "none" for x in s.steps_per_s.samples]
    if len(rates) < 2:
        return None
    return (max(rates) - min(rates)) / statistics.median(rates) * 100


def cpu_noise_pct(stats: Sequence[ConfigStats]) -> float | None:
    """The range of the `none` windows' CPU time per step, % of its median."""
    cpu = [x for s in stats if s.config == "none" for x in s.cpu_ms_per_step.samples]
    if len(cpu) < 2 or statistics.median(cpu) <= 0:
        return None
    return (max(cpu) - min(cpu)) / statistics.median(cpu) * 100


def goal_verdict(value: float | None, noise: float | None, limit: float) -> bool | None:
    """True/False when the measurement can tell; None when the noise is as large as the limit itself."""
    if value is None:
        return None
    if noise is not None and noise >= limit:
        return False if value - noise > limit else None
    return value <= limit


def _stall_and_copy(stalls: Sequence[float] | None, copies: Sequence[float] | None, *, saves: str, stall: str,
                    copy: str, ratio: str) -> dict[str, Any]:
    """Summary fields of a set of stall and copy timings (seconds): count, medians in ms, their ratio."""
    if not stalls or not copies:
        return {}
    stall_ms, copy_ms = statistics.median(stalls) * 1000, statistics.median(copies) * 1000
    return {saves: len(stalls), stall: stall_ms, copy: copy_ms, ratio: stall_ms / copy_ms if copy_ms > 0 else None}


def summarize(stats: Sequence[ConfigStats], copies: Mapping[str, Any], intervals: Sequence[int]) -> dict[str, Any]:
    find = {(s.config, s.interval): s for s in stats}
    memcpy_idle_ms = copies["memcpy_s"] * 1000
    # The stall's reference: the same copy at the same point of the loop (the no-checkpoint windows'
    # save steps, slowest rank), so that the load on the machine is the same for both.
    in_loop = [x for s in stats if s.config == "none" and s.copy_ms is not None for x in s.copy_ms.samples]
    memcpy_ms = statistics.median(in_loop) if in_loop else memcpy_idle_ms
    host_read_ms = copies["host_read_s"] * 1000
    at = goal_interval(intervals)

    def med(value: Spread | None) -> float | None:
        return value.median if value is not None else None

    def by_interval(config: str, attr: str) -> dict[str, float | None]:
        return {str(k): med(getattr(find[(config, k)], attr)) if (config, k) in find else None for k in intervals}

    summary: dict[str, Any] = {
        "goal_interval": at,
        "memcpy_ms": memcpy_ms,
        "memcpy_measured": "in_loop" if in_loop else "idle",
        "memcpy_in_loop_samples": len(in_loop),
        "memcpy_idle_ms": memcpy_idle_ms,
        "host_read_ms": host_read_ms,
        "notice_collective_ms": copies["notice_collective_s"] * 1000 if "notice_collective_s" in copies else None,
        "throughput_noise_pct": throughput_noise_pct(stats),
        "cpu_noise_pct": cpu_noise_pct(stats),
        "state_bytes": copies["state_bytes"],
        "state_tensors": copies["tensors"],
        "steps_per_s": {c: {str(k): find[(c, k)].steps_per_s.median for k in intervals if (c, k) in find}
                        for c in dict.fromkeys(s.config for s in stats)},
    }
    for config, prefix in (("ours_async", "async"), ("ours_sync", "sync"), ("save_weights", "baseline"),
                           ("tf_checkpoint", "tf_checkpoint")):
        if (config, at) not in find:
            continue
        s = find[(config, at)]
        summary[f"{prefix}_overhead_pct"] = med(s.overhead_pct)
        summary[f"{prefix}_overhead_range_pct"] = [s.overhead_pct.min, s.overhead_pct.max] if s.overhead_pct else None
        summary[f"{prefix}_cpu_overhead_pct"] = med(s.cpu_overhead_pct)
        summary[f"{prefix}_in_call_pct"] = med(s.in_call_pct)
        # A save's stall does not depend on the interval: the median over every save is the steadier figure.
        all_stalls = [x for k in intervals if (config, k) in find and find[(config, k)].save_stall_ms
                      for x in find[(config, k)].save_stall_ms.samples]
        summary[f"{prefix}_stall_ms"] = statistics.median(all_stalls) if all_stalls else None
        in_call = [x for k in intervals if (config, k) in find and find[(config, k)].stall_ms
                   for x in find[(config, k)].stall_ms.samples]
        summary[f"{prefix}_call_stall_ms"] = statistics.median(in_call) if in_call else None
        summary[f"{prefix}_saves"] = len(all_stalls)
        summary[f"{prefix}_per_step_call_ms"] = s.per_step_call_ms
        summary[f"{prefix}_plain_call_ms"] = s.plain_call_ms
        summary[f"{prefix}_median_step_ms"] = s.median_step_ms
        summary[f"{prefix}_overhead_pct_by_interval"] = by_interval(config, "overhead_pct")
        summary[f"{prefix}_cpu_overhead_pct_by_interval"] = by_interval(config, "cpu_overhead_pct")
        summary[f"{prefix}_in_call_pct_by_interval"] = by_interval(config, "in_call_pct")
        summary[f"{prefix}_stall_ms_by_interval"] = by_interval(config, "save_stall_ms")
    if "none" in {s.config for s in stats} and ("none", at) in find:
        summary["none_median_step_ms"] = find[("none", at)].median_step_ms
    if summary.get("async_stall_ms") is not None:
        stall = summary["async_stall_ms"]
        summary["async_snapshot_ms"] = find[("ours_async", at)].snapshot_ms
        summary["async_stall_vs_memcpy"] = stall / memcpy_ms if memcpy_ms > 0 else None
        summary["async_stall_vs_memcpy_idle"] = stall / memcpy_idle_ms if memcpy_idle_ms > 0 else None
        summary["async_stall_vs_host_read"] = stall / host_read_ms if host_read_ms > 0 else None
        overhead = summary["async_overhead_pct"]
        collective = summary["notice_collective_ms"]
        if collective is not None and ("none", at) in find:
            # The loop's blocked time per interval if no rank waited for another: one save stall and
            # the notice collectives of the other steps, over the interval's time without checkpointing.
            # the rounds the run really made (adaptive cadence or every --check-every steps)
            rounds = find[("ours_async", at)].notice_rounds_per_window
            summary["async_notice_rounds_per_interval"] = rounds
            interval_ms = at * find[("none", at)].median_step_ms
            # the other steps' own call (reading the step, the cadence bookkeeping), rank 0's median
            plain = max(0.0, at - 1 - rounds) * summary["async_plain_call_ms"]
            summary["async_blocking_estimate_pct"] = (stall + rounds * collective + plain) / interval_ms * 100
            # the stall and the copy, each right after a collective, no training going on
            summary.update(_stall_and_copy(copies.get("idle_stall_s"), copies.get("idle_copy_s"),
                                           saves="async_idle_saves", stall="async_stall_idle_ms",
                                           copy="memcpy_after_collective_ms", ratio="async_stall_idle_vs_memcpy_idle"))
            # saves and copies alternating step by step while training goes on
            summary.update(_stall_and_copy(copies.get("paired_stall_s"), copies.get("paired_copy_s"),
                                           saves="async_paired_saves", stall="async_stall_paired_ms",
                                           copy="memcpy_paired_ms", ratio="async_stall_paired_vs_memcpy"))
            background = copies.get("background_cpu_s") or []
            if background:
                # Upper bound of the contention: every CPU-ms of the background write taken from training.
                summary["async_background_cpu_ms"] = statistics.median(background) * 1000
                summary["async_blocking_with_background_pct"] = (
                    (stall + rounds * collective + plain + summary["async_background_cpu_ms"]) / interval_ms * 100)
        summary["goal"] = {
            "overhead_pct_max": GOAL_OVERHEAD_PCT, "stall_vs_memcpy_max": GOAL_STALL_VS_MEMCPY,
            # None: the machine's noise is larger than the goal, so the measurement cannot decide
            "overhead_met": goal_verdict(overhead, summary["throughput_noise_pct"], GOAL_OVERHEAD_PCT),
            "cpu_overhead_met": goal_verdict(summary["async_cpu_overhead_pct"], summary["cpu_noise_pct"],
                                             GOAL_OVERHEAD_PCT),
            "blocking_estimate_met": (summary["async_blocking_estimate_pct"] <= GOAL_OVERHEAD_PCT
                                      if "async_blocking_estimate_pct" in summary else None),
            "blocking_with_background_met": (summary["async_blocking_with_background_pct"] <= GOAL_OVERHEAD_PCT
                                             if "async_blocking_with_background_pct" in summary else None),
            "stall_met": stall <= GOAL_STALL_VS_MEMCPY * memcpy_ms,
            "stall_paired_met": (summary["async_stall_paired_vs_memcpy"] <= GOAL_STALL_VS_MEMCPY
                                 if "async_stall_paired_vs_memcpy" in summary else None),
        }
    return summary


# --------------------------------------------------------------------------- tables and plot


def _pct(s: Spread | None, signed: bool = True) -> str:
    if s is None:
        return "-"
    f = "{:+.1f}%" if signed else "{:.1f}%"
    if s.n < 2:
        return f.format(s.median)
    return f"{f.format(s.median)} ({f.format(s.min)}..{f.format(s.max)})"


def _ms(s: Spread | None) -> str:
    if s is None:
        return "-"
    return f"{s.median:,.1f}" if s.n < 2 else f"{s.median:,.1f} ({s.min:,.1f}-{s.max:,.1f})"


TABLE_COLUMNS = ("checkpointing", "every", "windows", "steps/s", "overhead vs none", "CPU overhead vs none",
                 "time in ckpt calls",
                 "median step ms", "per-step call ms", "stall ms per save", "in-call excess ms", "stall / step",
                 "of which snapshot ms")


def table_rows(stats: Sequence[ConfigStats]) -> list[list[str]]:
    rows = []
    for s in stats:
        r = s.steps_per_s
        rate = f"{r.median:.2f}" if r.n < 2 else f"{r.median:.2f} ({r.min:.2f}-{r.max:.2f})"
        stall = s.save_stall_ms
        ratio = f"{stall.median / s.median_step_ms:.2f}" if stall else "-"
        rows.append([LABELS.get(s.config, s.config), str(s.interval), str(s.windows), rate,
                     _pct(s.overhead_pct), _pct(s.cpu_overhead_pct),
                     _pct(s.in_call_pct, signed=False) if s.config != "none" else "-",
                     f"{s.median_step_ms:.0f}", f"{s.per_step_call_ms:.2f}" if s.config != "none" else "-",
                     _ms(stall), _ms(s.stall_ms) if s.own_stall_ms is not None else "-", ratio,
                     f"{s.snapshot_ms:.1f}" if s.snapshot_ms is not None else "-"])
    return rows


def goal_text(summary: Mapping[str, Any]) -> str:
    if "goal" not in summary:
        return "goal not evaluated (ours_async was not run)"
    g, at = summary["goal"], summary["goal_interval"]
    overhead, in_call = summary["async_overhead_pct"], summary["async_in_call_pct"]
    stall, memcpy, read = summary["async_stall_ms"], summary["memcpy_ms"], summary["host_read_ms"]
    def verdict(met: bool | None, noise: float | None, what: str) -> str:
        if met is None:
            return f"cannot be decided here: {what} of identical windows varied over {noise or 0:.1f}%"
        return "met" if met else "NOT met"

    cpu = summary["async_cpu_overhead_pct"]
    text = (f"goal check (async, every {at} steps): throughput overhead {overhead:+.2f}% (goal <= "
            f"{GOAL_OVERHEAD_PCT:g}%: {verdict(g['overhead_met'], summary['throughput_noise_pct'], 'steps/s')}); "
            f"CPU-time overhead {cpu:+.2f}% ({verdict(g['cpu_overhead_met'], summary['cpu_noise_pct'], 'CPU time')}); "
            f"time inside checkpoint calls {in_call:.2f}% (an upper bound: it includes waiting for the slower rank)")
    if "async_blocking_estimate_pct" in summary:
        text += (f"; blocked-time estimate {summary['async_blocking_estimate_pct']:.2f}% (one stall + "
                 f"{summary['async_notice_rounds_per_interval']} notice collectives of "
                 f"{summary['notice_collective_ms']:.2f} ms + the other steps' calls of "
                 f"{summary['async_plain_call_ms']:.2f} ms, over {at} steps "
                 f"without checkpointing; {'within' if g['blocking_estimate_met'] else 'above'} "
                 f"{GOAL_OVERHEAD_PCT:g}%, background contention not included)")
    if "async_blocking_with_background_pct" in summary:
        text += (f"; with the background write's CPU time ({summary['async_background_cpu_ms']:.1f} ms per save, "
                 f"slowest rank) counted as lost training time, an upper bound of its contention: "
                 f"{summary['async_blocking_with_background_pct']:.2f}% "
                 f"({'within' if g['blocking_with_background_met'] else 'above'} {GOAL_OVERHEAD_PCT:g}%)")
    where = ("in the no-checkpoint windows, at the save step and every tenth of the interval, slowest rank"
             if summary.get("memcpy_measured") == "in_loop" else "after the run, rank 0")
    idle = summary.get("memcpy_idle_ms")
    return text + (f"; stall {stall:.1f} ms (median of {summary['async_saves']} saves, slowest rank) vs np.copy of "
                   f"the state {memcpy:.2f} ms ({where}) = {stall / memcpy:.1f}x "
                   f"(goal <= {GOAL_STALL_VS_MEMCPY:g}x: {'met' if g['stall_met'] else 'NOT met'})"
                   + (f"; against the same copy on the idle loop after the run ({idle:.2f} ms, rank 0): "
                      f"{stall / idle:.1f}x" if idle and summary.get("memcpy_measured") == "in_loop" else "")
                   + (f"; {summary['async_paired_saves']} saves alternating step by step with as many copies while "
                      f"training goes on (slowest rank): stall {summary['async_stall_paired_ms']:.2f} ms vs np.copy "
                      f"{summary['memcpy_paired_ms']:.2f} ms = {summary['async_stall_paired_vs_memcpy']:.1f}x "
                      f"({'met' if g['stall_paired_met'] else 'NOT met'})"
                      if summary.get("async_stall_paired_vs_memcpy") else "")
                   + (f"; with no training going on, each right after a collective (slowest rank): stall "
                      f"{summary['async_stall_idle_ms']:.2f} ms vs np.copy "
                      f"{summary['memcpy_after_collective_ms']:.2f} ms = "
                      f"{summary['async_stall_idle_vs_memcpy_idle']:.1f}x"
                      if summary.get("async_stall_idle_vs_memcpy_idle") else "")
                   + f"; reading the variables into host memory alone takes {read:.1f} ms")


def make_plot(path: Path, stats: Sequence[ConfigStats], summary: Mapping[str, Any],
              intervals: Sequence[int]) -> Path | None:
    configs = list(dict.fromkeys(s.config for s in stats))
    cats = tuple(f"every {k}" for k in intervals)
    find = {(s.config, s.interval): s for s in stats}

    def series(attr: str, configs_: Sequence[str]) -> tuple[dict[str, list[float | None]], dict[str, list[Any]]]:
        vals: dict[str, list[float | None]] = {}
        errs: dict[str, list[Any]] = {}
        for c in configs_:
            got = [getattr(find[(c, k)], attr) if (c, k) in find else None for k in intervals]
            vals[LABELS[c]] = [g.median if g is not None else None for g in got]
            errs[LABELS[c]] = [(g.min, g.max) if g is not None else None for g in got]
        return vals, errs

    saving = [c for c in configs if c != "none"]
    rate_vals, rate_errs = series("steps_per_s", configs)
    over_vals, over_errs = series("overhead_pct", saving)
    call_vals, call_errs = series("in_call_pct", saving)
    cpu_vals, cpu_errs = series("cpu_overhead_pct", saving)
    stall_vals, stall_errs = series("save_stall_ms", saving)
    copy_vals, copy_errs = series("copy_ms", ["none"])
    if any(v is not None for v in copy_vals[LABELS["none"]]):
        stall_vals["np.copy of the state in the loop"] = copy_vals[LABELS["none"]]
        stall_errs["np.copy of the state in the loop"] = copy_errs[LABELS["none"]]
    else:
        stall_vals["np.copy of the state (1 rank)"] = [summary["memcpy_ms"]] * len(intervals)
    stall_vals["read variables to host (1 rank)"] = [summary["host_read_ms"]] * len(intervals)
    panels = [
        Panel("training throughput (steps/s)", "steps/s", cats, rate_vals, rate_errs),
        Panel("throughput overhead vs no checkpoint (%, paired windows)", "%", cats, over_vals, over_errs),
        Panel("CPU-time overhead vs no checkpoint (%, all ranks and threads)", "%", cats, cpu_vals, cpu_errs),
        Panel("time inside checkpoint calls (% of the window, rank 0)", "%", cats, call_vals, call_errs),
        Panel("stall per save (ms, slowest rank, log)", "ms", cats, stall_vals, stall_errs, log_y=True),
    ]
    return plot_panels(path, panels, title="checkpoint overhead during training (Horovod, 2 ranks)", columns=3)


# --------------------------------------------------------------------------- running horovodrun


def join_url(base: str, name: str) -> str:
    if "://" in base:
        return base.rstrip("/") + "/" + name
    return str(Path(base) / name)


def _worker_env(np_: int, notice_file: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    threads = str(max(1, (os.cpu_count() or 1) // np_))
    env = dict(os.environ)
    env.update({
        "PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', '')}",
        # the user's own --model module is importable from where the command was started
        "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p),
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "TF_NUM_INTRAOP_THREADS": threads,  # the ranks share the machine's cores
        "TF_NUM_INTEROP_THREADS": "1",
        "OMP_NUM_THREADS": threads,
        # the notice watcher of TransientCallback: a local notice file that never appears
        "HVDT_WATCHER": "local",
        "HVDT_NOTICE_FILE": str(notice_file),
        "NO_GCE_CHECK": "true",
    })
    return env


_PROGRESS = re.compile(r"^\[0\]<stderr>:(\[\d+/\d+\].*)$")


def run_horovod(plan: Mapping[str, Any], np_: int, work: Path, timeout_s: float) -> list[dict[str, Any]]:
    plan_path, out_dir, log_path = work / "plan.json", work / "ranks", work / "horovodrun.log"
    plan_path.write_text(json.dumps(plan, indent=1))
    hosts = ",".join(f"{h}:1" for h in HOST_ALIASES[:np_])
    cmd = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(np_), "-H", hosts, "--gloo",
           "--network-interfaces", "lo", sys.executable, str(WORKER), "--plan", str(plan_path),
           "--out", str(out_dir)]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=_worker_env(np_, work / "no-notice"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                            cwd=work, text=True, errors="replace")
    timed_out = threading.Event()

    def kill_group() -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def on_timeout() -> None:
        timed_out.set()
        kill_group()

    timer = threading.Timer(timeout_s, on_timeout)
    timer.daemon = True
    timer.start()
    try:
        with open(log_path, "w") as log_file:
            assert proc.stdout is not None
            for line in proc.stdout:
                log_file.write(line)
                match = _PROGRESS.match(line.rstrip("\n"))
                if match:
                    print("  " + match.group(1), file=sys.stderr, flush=True)
        code = proc.wait()
    except BaseException:
        kill_group()
        proc.wait()
        raise
    finally:
        timer.cancel()
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
    if timed_out.is_set():
        raise BenchError(f"horovodrun did not finish within {timeout_s:.0f} s (--timeout); log tail:\n{tail}")
    if code != 0:
        raise BenchError(f"horovodrun exited with {code}; log tail:\n{tail}")
    docs = []
    for rank in range(np_):
        path = out_dir / f"rank-{rank}.json"
        if not path.exists():
            raise BenchError(f"rank {rank} wrote no results ({path}); log tail:\n{tail}")
        docs.append(json.loads(path.read_text()))
    return docs


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckpt_overhead",
        description="Training throughput and per-save stall under Horovod: no checkpoint, rank-0 "
                    "model.save_weights (Horovod's recipe), hvd-transient sync sharded and async saves.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default="resnet32",
                       help="resnet32 | small_cnn | package.module:function | path/to/file.py:function "
                            "(a function returning a Keras model, compiled or not; modules are imported "
                            "from the current directory and PYTHONPATH)")
    model.add_argument("--saved-model", type=Path, help="a saved Keras model (tf.keras.models.load_model)")
    p.add_argument("--store", help="where hvd-transient writes (directory, file://, gs://bucket/prefix); "
                                   "default: a temporary directory. A run-specific prefix under it is removed "
                                   "at the end unless --keep")
    p.add_argument("--steps", type=positive_int, default=200,
                   help="measured steps per configuration and interval (whole intervals, at least one)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="per-rank batch size")
    p.add_argument("--intervals", type=csv_list(int), default=(50, 200), help="save every K steps")
    p.add_argument("--np", dest="np_", type=positive_int, default=2, help="Horovod ranks (local host aliases)")
    p.add_argument("--configs", type=csv_list(str, CONFIGS), default=DEFAULT_CONFIGS,
                   help="configurations to run (none is always run)")
    p.add_argument("--check-every", type=positive_int, default=None,
                   help="TransientCallback check_every_steps: the notice collective runs every N steps "
                        "(default: adaptive, about once per --check-interval seconds, as TransientCallback)")
    p.add_argument("--check-interval", type=positive_seconds, default=1.0,
                   help="TransientCallback check_interval_s for the adaptive notice cadence")
    p.add_argument("--warmup-steps", type=int, default=20, help="untimed steps at the start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before horovodrun is killed")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (.md and .png beside it)")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--markdown", action="store_true", help="also print the markdown table")
    p.add_argument("--tmpdir", type=Path, help="parent of the temporary work directory (removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and the horovodrun log")
    return p


def _model_spec(args: argparse.Namespace) -> dict[str, str]:
    if args.saved_model is not None:
        path = args.saved_model.expanduser().resolve()
        if not path.exists():
            raise BenchError(f"--saved-model {args.saved_model}: no such file or directory")
        return {"kind": "saved", "value": str(path)}
    if args.model in ("resnet32", "small_cnn"):
        return {"kind": "builtin", "value": args.model}
    module, _, func = args.model.rpartition(":")
    if not module or not func:
        raise BenchError(f"--model {args.model!r}: use resnet32, small_cnn, module:function or file.py:function")
    if module.endswith(".py"):
        path = Path(module).expanduser().resolve()
        if not path.is_file():
            raise BenchError(f"--model {args.model!r}: no such file {path}")
        return {"kind": "function", "value": f"{path}:{func}"}
    return {"kind": "function", "value": args.model}


def _remove_store(url: str) -> None:
    if "://" not in url or url.startswith("file://"):
        shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)
        return
    from ckpt_service.stores import open_store

    try:
        store = open_store(url)
        store.delete_prefix("")
        store.close()
    except Exception as exc:  # clean-up must not hide the results
        print(f"ckpt_overhead: could not remove {url}: {exc}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    install_interrupt_handlers()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    if args.np_ > len(HOST_ALIASES):
        print(f"ckpt_overhead: --np at most {len(HOST_ALIASES)} on one machine", file=sys.stderr)
        return 2
    if args.store and args.store.startswith("memory://"):
        print("ckpt_overhead: memory:// stores live in one process; use a directory or gs://", file=sys.stderr)
        return 2
    configs = ("none", *[c for c in args.configs if c != "none"])
    try:
        model = _model_spec(args)
    except BenchError as exc:
        print(f"ckpt_overhead: {exc}", file=sys.stderr)
        return 2
    if args.tmpdir is not None:
        args.tmpdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckpt-overhead-", dir=args.tmpdir))
    store_base = join_url(args.store, f"ckpt-overhead-{uuid.uuid4().hex[:8]}") if args.store else str(work / "store")
    windows = plan_windows(configs, args.intervals, args.steps)
    plan = {
        "model": model, "batch_size": args.batch_size, "warmup_steps": args.warmup_steps, "seed": args.seed,
        "check_every_steps": args.check_every, "check_interval_s": args.check_interval,
        "windows": [asdict(w) for w in windows], "baseline_dir": str(work / "baseline"),
        "stores": {f"{c}-{k}": join_url(store_base, f"{c}-{k}") for c in configs for k in args.intervals},
    }
    machine = machine_info()
    print(f"machine: {machine_line(machine)}", file=sys.stderr, flush=True)
    measured = sum(w.steps for w in windows if w.index >= 0)
    print(f"{len(windows)} windows, {measured} measured steps on {args.np_} ranks", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        docs = run_horovod(plan, args.np_, work, args.timeout)
    except BenchError as exc:
        print(f"ckpt_overhead: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ckpt_overhead: interrupted; no results written", file=sys.stderr)
        return 130
    finally:
        if not args.keep:
            if args.store:
                _remove_store(store_base)
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept: {work} and {store_base}", file=sys.stderr)
    elapsed = time.perf_counter() - started
    stats = config_stats(merge_ranks(docs))
    rank0 = docs[0]
    slowest = {key: slowest_rank(docs, samples) for key, samples in SLOWEST_RANK_SAMPLES.items()}
    summary = summarize(stats, {**rank0, **slowest}, args.intervals)
    summary["elapsed_s"] = elapsed
    table = table_rows(stats)
    title = (f"checkpoint overhead: {rank0['model_name']} ({rank0['params']:,} parameters, state "
             f"{rank0['state_bytes'] / 1e6:.1f} MB in {rank0['tensors']} tensors), batch {args.batch_size}, "
             f"{args.np_} ranks")
    print()
    print_table(TABLE_COLUMNS, table, title=title)
    goal = goal_text(summary)
    references = (f"np.copy of the state in the no-checkpoint windows: {summary['memcpy_ms']:.2f} ms "
                  f"(slowest rank, median of {summary['memcpy_in_loop_samples']}); after the run, on an idle loop: "
                  f"np.copy of the state {summary['memcpy_idle_ms']:.2f} ms, reading every variable into host memory "
                  f"{summary['host_read_ms']:.2f} ms, the notice allreduce alone "
                  f"{summary['notice_collective_ms']:.2f} ms (rank 0, medians of {len(rank0['memcpy_samples'])})")
    print("\n" + references)
    print(goal)
    md_table = markdown_table(TABLE_COLUMNS, table)
    if args.markdown:
        print()
        print(md_table)
    notes = [
        "each window is K steps (K = the save interval) whose first step saves; windows of all configurations "
        "are interleaved round by round; warm-up windows (each configuration's first save) are not counted",
        "overhead vs none: window time / the `none` window of the same round and interval - 1 (median over "
        "rounds; the range shows how noisy the machine was)",
        "time in ckpt calls: share of the window rank 0 spent inside the checkpoint call or waiting for a "
        "background save at the window end; an upper bound for the calls (a collective also absorbs waiting "
        "for the slower rank), blind to background work slowing the training steps",
        "stall: slowest rank's time in the checkpoint call at the save step minus its median call at other steps",
        "ours_* also run TransientCallback's per-step notice collective (per-step call ms); its cost alone, "
        "ranks arriving together, is the notice_collective_ms reference",
        "CPU overhead vs none: process CPU time of every rank (all threads: training, Horovod, background "
        "saves) in the window against the paired `none` window - 1; much less disturbed by other work on a "
        "shared machine than wall time, but blind to time spent waiting (fsync, network)",
        "throughput_noise_pct / cpu_noise_pct: the range of the `none` windows' steps/s / CPU time per step, % of "
        "their median; when it is "
        "at least the 1% goal, the throughput verdict is left undecided (null) unless the overhead exceeds the "
        "goal by more than the noise",
        "*_stall_ms: median over every save of the configuration, all intervals (the stall does not depend on "
        "the interval); *_stall_ms_by_interval: per interval. For the async configuration it is the save's own "
        "blocked time as TransientImpl reports it (async_save event, slowest rank): it leaves out the wait for "
        "the other rank in the notice collective that the save step also runs; async_call_stall_ms is the time "
        "in the call beyond a usual check step (an upper bound that includes that wait)",
        "async_blocking_estimate_pct: (async stall + the notice collectives the run made at the other K - 1 "
        "steps (adaptive: about one per --check-interval s; or every --check-every steps) x notice_collective_ms "
        "+ the remaining steps x async_plain_call_ms, the call at a step that neither saves nor runs the "
        "collective (reading the optimizer's step, the cadence bookkeeping; rank 0, median)) / (K x median step "
        "without checkpointing): the loop's blocked time if no rank waited for another; background "
        "contention is not included",
        "memcpy_ms, the stall's reference: np.copy of every state array, timed by the no-checkpoint windows at "
        "the step where the others save and at every tenth of the interval after it (slowest rank, median of "
        "all), i.e. under the same load as the stall (the other rank training on the same cores; about 15 ms "
        "of copies per window, under 0.1% of it); memcpy_idle_ms is the same copy after the run with "
        "no training going on (rank 0), and async_stall_vs_memcpy_idle the ratio against it",
        f"async_stall_idle_ms: the stall of the {summary.get('async_idle_saves')} saves of async_background_cpu_ms "
        "(slowest rank, median), with no training going on; "
        "memcpy_after_collective_ms: np.copy of the state timed the same way (right after a collective, slowest "
        "rank) before each of them; async_stall_idle_vs_memcpy_idle their ratio: the mechanism's own cost, "
        "without the other rank's training competing for the cores",
        f"async_stall_paired_ms / memcpy_paired_ms: after the windows, {summary.get('async_paired_saves')} "
        "training steps each followed by a collective and an async save, alternating with as many followed by a "
        "collective and np.copy of the state (slowest rank, medians; a save's background write is waited for "
        "before the next step, outside the timings): the stall and its reference under the same training load, "
        "with more samples than the windows' saves; goal.stall_paired_met: their ratio <= 2",
        f"async_background_cpu_ms: after the windows, every rank makes {summary.get('async_idle_saves')} async saves "
        "at once with training paused; the process CPU time from the save call's return to the background "
        "write's end (writing, checksums, gather, commit; minus the idle process's CPU rate), slowest rank, median. "
        "async_blocking_with_background_pct adds it to the blocked-time estimate: on cores that training "
        "keeps busy every CPU-ms of it can displace a ms of training, so it is an upper bound of the contention",
        "model.save_weights / tf.train.Checkpoint do not fsync; the hvd-transient local store fsyncs every object",
        "a background save still running at the end of a window is waited for and counted in that window",
    ]
    params = {"model": model, "batch_size": args.batch_size, "intervals": args.intervals, "steps": args.steps,
              "np": args.np_, "configs": configs, "warmup_steps": args.warmup_steps,
              "check_every_steps": args.check_every, "check_interval_s": args.check_interval,
              "store": args.store or "temporary directory", "seed": args.seed,
              "tf_intra_op_threads": max(1, (os.cpu_count() or 1) // args.np_)}
    rows = [s.as_dict() for s in stats]
    rows += [{"config": "reference", "label": "np.copy of every state array, idle loop after the run (rank 0)",
              "ms": spread([x * 1000 for x in rank0["memcpy_samples"]]).as_dict()},
             {"config": "reference", "label": "read every variable into host memory (rank 0)",
              "ms": spread([x * 1000 for x in rank0["host_read_samples"]]).as_dict()},
             {"config": "reference", "label": "notice allreduce alone, ranks arriving together (rank 0)",
              "ms": spread([x * 1000 for x in rank0["notice_collective_samples"]]).as_dict()}]
    params["model_info"] = {k: rank0[k] for k in ("model_name", "params", "state_bytes", "tensors", "loss")}
    out = write_results(args.out, name="ckpt_overhead", summary=summary, rows=rows, params=params, notes=notes,
                        machine=machine)
    markdown = (f"# ckpt_overhead results\n\nMachine: {machine_line(machine)}  \nCommand: `{command_line()}`  \n"
                f"Run time: {elapsed:.0f} s.\n\n{title}\n\n{md_table}\n\n"
                f"{references}.\n\n{goal}\n")
    plot = (lambda png: make_plot(png, stats, summary, args.intervals)) if args.plot else None
    return finish_report(out, markdown, plot, elapsed)


if __name__ == "__main__":
    sys.exit(main())
