"""What a preemption costs: plain Horovod elastic against the same job with hvd-transient.

The same elastic Keras training runs on a local cluster of 3 hosts (``LocalCluster``: real
``horovodrun`` over local host aliases, a GCE metadata emulator per host), twice per scenario:

* ``baseline``: ``bench/plain_elastic_worker.py``, the standard Horovod elastic Keras script
  (same model, data, learning rate, in-memory commit cadence). Nobody reacts to the notice,
  so when the window ends the worker is killed (SIGTERM): Horovod treats it as a failure,
  blacklists the host and rolls the survivors back to their last in-memory commit.
* ``ours``: ``examples/keras_elastic.py`` with the same notice: emergency checkpoint, master
  election if needed, the host published as leaving, discovery drops it, Horovod shrinks the
  ring without rolling back. The worker would still be killed at the deadline if it had not
  left by then.

Scenarios: the preempted host is a plain worker (``worker``) or the checkpoint master /
Horovod's rank 0 (``master``). Per preemption, from the event log every worker writes
(plus Horovod-internal timestamps from ``bench/_hvd_trace.py`` and the discovery calls):

* steps rolled back: the survivors' step before the reset minus the step after it;
* resume: from the worker leaving the ring to the survivors' next completed step (``first_step``
  on the new ring), with a breakdown into phases. The worker leaves the ring when the survivors
  raise HostsUpdatedInterrupt (ours: it trained with them until then) or when it is killed
  (baseline); this is the time no training happens, Spotnik's "ring repair";
* publication to resume (ours): from ``leave_published`` to that next step, which adds how long
  Horovod's driver took to notice the departure (discovery poll + notification) while the ring,
  the leaving worker included, kept training;
* notice to resume, and the time from ``horovodrun`` starting to global step T (the same T
  for every run; chosen from the first run's step rate unless ``--total-steps`` is given).

Runs alternate (ours, baseline) within each repeat so load drift on a shared machine hits
both alike. ``ours`` runs end with a stop request once step T is reached; ``baseline`` runs
are given a fixed number of epochs (T steps). Results: ``bench/results/preemption_cost.json``,
``.md`` and ``.png``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from common import (
    BenchError,
    Panel,
    command_line,
    csv_list,
    finish_report,
    install_interrupt_handlers,
    machine_info,
    machine_line,
    markdown_table,
    plot_panels,
    print_table,
    spread,
    spread_or_none,
    spread_summary,
    write_results,
)

log = logging.getLogger("preemption_cost")

# google-api-core warns about the Python version on import (gs:// stores): noise here.
warnings.filterwarnings("ignore", category=FutureWarning, module="google.api_core")

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
OURS_SCRIPT = REPO / "examples" / "keras_elastic.py"
BASELINE_SCRIPT = BENCH / "plain_elastic_worker.py"
TRACE = BENCH / "_hvd_trace.py"
DEFAULT_OUT = BENCH / "results" / "preemption_cost.json"

HOSTS = ("localhost", "127.0.0.1", "127.0.1")
VARIANTS = ("ours", "baseline")
SCENARIOS = ("worker", "master")
LABELS = {"ours": "hvd-transient", "baseline": "plain Horovod elastic"}
RESUME_GOAL_MS = 1000.0
DRIVER_DISCOVERY_SLEEP_S = 1.0  # horovod.runner.elastic.driver.DISCOVER_HOSTS_FREQUENCY_SECS
BASE_LR = 0.01
START_TIMEOUT_S = 600.0
RESUME_TIMEOUT_S = 300.0

Event = dict[str, Any]


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    model: str
    repeats: int
    window_s: float
    store: str
    steps_per_epoch: int
    warmup_steps: int
    total_steps: int | None
    batches_per_commit: int
    save_every: int
    step_seconds: float
    gloo_timeout_s: int
    scenarios: tuple[str, ...]
    variants: tuple[str, ...]


@dataclass(frozen=True)
class RunPlan:
    variant: str
    scenario: str
    repeat: int
    store: str
    workdir: Path
    total_steps: int | None  # None: decide from this run's step rate (the first run only)

    @property
    def name(self) -> str:
        return f"{self.variant}-{self.scenario}-{self.repeat}"


def worker_command(plan: RunPlan, cfg: Config, total_steps: int | None) -> tuple[str, ...]:
    """The training command of every worker, wrapped by the Horovod trace."""
    common = ["--model", cfg.model, "--steps-per-epoch", str(cfg.steps_per_epoch),
              "--batches-per-commit", str(cfg.batches_per_commit), "--step-seconds", str(cfg.step_seconds),
              "--base-lr", str(BASE_LR)]
    if plan.variant == "ours":
        # Runs until told to stop (at step T); it knows the cloud's notice window, as a user would set it.
        script = [str(OURS_SCRIPT), "--store", plan.store, "--epochs", "100000", "--save-every",
                  str(cfg.save_every), "--notice-window", str(cfg.window_s), *common]
    else:
        if total_steps is None:
            raise BenchError("the baseline needs a fixed number of steps: run an 'ours' run first or "
                             "give --total-steps")
        epochs = math.ceil(total_steps / cfg.steps_per_epoch)
        script = [str(BASELINE_SCRIPT), "--events-store", plan.store, "--epochs", str(epochs), *common]
    return (sys.executable, str(TRACE), "worker", str(plan.workdir / "trace"), *script)


def discovery_tap(workdir: Path) -> str:
    """``HVDT_CLI`` for LocalCluster's discovery script: the real CLI, each call recorded."""
    return f"{sys.executable} {TRACE} discover {workdir / 'discovery.jsonl'} hvd-transient"


# --------------------------------------------------------------------------- one run (I/O)


@dataclass
class RunRecord:
    """Everything one run produced; ``analyze`` turns it into numbers."""

    plan: RunPlan
    launched_at: float
    notice_at: float
    target: str
    master: str
    total_steps: int
    events: list[Event]
    trace: list[Event]
    discovery: list[dict[str, Any]]
    killed_at: float | None
    kill_error: str | None
    exit_code: int | None
    ended_at: float | None
    rate_before: float | None


def _read_jsonl(paths: Iterator[Path]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return sorted(out, key=lambda e: e.get("t", 0.0))


def step_rate(events: Sequence[Event], size: int, *, after: float = 0.0, before: float = math.inf) -> float | None:
    """Steps per second on a ring of ``size`` from one host's progress events in (after, before)."""
    by_host: dict[str, list[Event]] = {}
    for e in events:
        if e.get("event") == "progress" and e.get("size") == size and after < e["t"] < before:
            by_host.setdefault(e["host"], []).append(e)
    best = max(by_host.values(), key=len, default=[])
    if len(best) < 2 or best[-1]["t"] <= best[0]["t"]:
        return None
    return (best[-1]["step"] - best[0]["step"]) / (best[-1]["t"] - best[0]["t"])


def choose_total_steps(cfg: Config, rate: float) -> int:
    """A step T the baseline reaches only well after its kill and resume: warm-up, the window at the
    3-worker rate (x1.5 for noise) and 40 steps, rounded up to whole epochs."""
    steps = cfg.warmup_steps + math.ceil(1.5 * rate * cfg.window_s) + 40
    return math.ceil(steps / cfg.steps_per_epoch) * cfg.steps_per_epoch


def current_master(events: Sequence[Event], variant: str) -> str:
    """Checkpoint master (ours) / Horovod rank 0's host (baseline) on the latest ring."""
    rings = [e for e in events if e.get("event") == "ring"]
    if variant == "ours":
        return rings[-1]["master_host"]
    rank0 = [e for e in rings if e.get("rank") == 0]
    return rank0[-1]["host"]


def pick_target(scenario: str, master: str) -> str:
    return master if scenario == "master" else [h for h in HOSTS if h != master][-1]


def run_one(plan: RunPlan, cfg: Config) -> RunRecord:
    from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec

    plan.workdir.mkdir(parents=True, exist_ok=True)
    total = plan.total_steps
    spec = LocalClusterSpec(store=plan.store, hosts=HOSTS, command=worker_command(plan, cfg, total),
                            workdir=plan.workdir, gloo_timeout_s=cfg.gloo_timeout_s,
                            extra_env=(("HVDT_CLI", discovery_tap(plan.workdir)),))
    survivors_resumed = None
    with LocalCluster(spec) as cluster:
        cluster.wait_for_step(cfg.warmup_steps, START_TIMEOUT_S, size=3)
        events = cluster.events()
        rate = step_rate(events, 3)
        if total is None:
            if rate is None:
                raise BenchError(f"{plan.name}: no step rate before the preemption; give --total-steps")
            total = choose_total_steps(cfg, rate)
            log.info("step T = %d (%.1f steps/s on 3 workers)", total, rate)
        master = current_master(events, plan.variant)
        target = pick_target(plan.scenario, master)
        notice_at = cluster.preempt(target, window_s=cfg.window_s, kill_at_deadline=True)
        survivors = set(HOSTS) - {target}

        def resumed(ev: list[Event]) -> list[Event]:
            return [e for e in ev if e.get("event") == "first_step" and e.get("size") == 2
                    and e["host"] in survivors and e["t"] > notice_at]

        survivors_resumed = cluster.wait_for(resumed, RESUME_TIMEOUT_S + cfg.window_s, "the survivors to resume")
        if max(e["step"] for e in survivors_resumed) >= total:
            raise BenchError(f"{plan.name}: the survivors resumed at or after step T={total}; "
                             "raise --total-steps")
        cluster.wait_for_step(total, START_TIMEOUT_S)
        if plan.variant == "ours":
            cluster.request_stop()
        exit_code = cluster.wait(START_TIMEOUT_S)
        ended_at = time.time()
        snapshot = cluster.emulator.instance(target)
        events = cluster.events()
        launched_at = cluster.started_at
    return RunRecord(
        plan=plan, launched_at=launched_at, notice_at=notice_at, target=target, master=master,
        total_steps=total, events=events, trace=_read_jsonl((plan.workdir / "trace").glob("*.jsonl")),
        discovery=_read_jsonl(plan.workdir.glob("discovery.jsonl")),
        killed_at=snapshot.killed_at, kill_error=snapshot.kill_error, exit_code=exit_code, ended_at=ended_at,
        rate_before=rate)


def save_record(rec: RunRecord) -> Path:
    """The raw record beside the run's logs (kept with --keep), for re-analysis."""
    path = rec.plan.workdir / "record.json"
    path.write_text(json.dumps(asdict(rec), default=str))
    return path


def load_record(path: Path) -> RunRecord:
    raw = json.loads(Path(path).read_text())
    plan = raw.pop("plan")
    plan["workdir"] = Path(plan["workdir"])
    return RunRecord(plan=RunPlan(**plan), **raw)


# --------------------------------------------------------------------------- analysis (pure)


@dataclass(frozen=True)
class Measurement:
    variant: str
    scenario: str
    repeat: int
    target: str
    master: str
    steps_rolled_back: int
    step_before: int | None
    step_after: int | None
    resets: int
    resume_ms: float | None          # worker leaves the ring (interrupt / kill) -> survivors' next step
    publish_to_resume_ms: float | None  # ours: leave_published -> survivors' next step
    notice_to_resume_ms: float | None
    stall_ms: float | None           # ours: every rank blocked by the emergency checkpoint
    lost_s: float | None             # stall + resume + rolled-back steps at the survivors' step rate
    train_to_t_s: float | None       # first step of the run -> global step T
    total_steps: int
    exit_code: int | None
    job_s: float | None              # horovodrun start -> exit
    left_at_s: float | None          # notice -> leave_published / kill, seconds
    killed: bool                     # the worker was still there at the deadline and got SIGTERM
    rate_before: float | None
    rate_after: float | None
    marks: dict[str, float]          # seconds after the notice
    phases_ms: dict[str, float]      # resume broken down: phase -> ms (consecutive marks)
    error: str | None = None


#: resume phases, in order; each ends at the mark of the same name
OURS_MARKS = ("watcher", "agreed", "emergency_save", "left", "discovery", "notified", "interrupt",
              "rendezvous", "restart", "first_step")
BASELINE_MARKS = ("killed", "failure_detected", "rendezvous", "restart", "first_step")
PHASE_TEXT = {
    "watcher": "notice seen by the watcher",
    "agreed": "next step boundary: all ranks agree",
    "emergency_save": "emergency checkpoint committed",
    "left": "host published as leaving",
    "killed": "notice window ends: SIGTERM",
    "discovery": "discovery stops listing the host (1 s poll + script start-up; training goes on)",
    "notified": "driver notifies the coordinator",
    "interrupt": "survivors raise HostsUpdatedInterrupt: the worker leaves the ring",
    "failure_detected": "survivors see the failure (collective error)",
    "rendezvous": "hvd.shutdown + hvd.init: new ring (a rank stuck in a collective waits out the Gloo timeout)",
    "restart": "state sync + fit restarts (ring event)",
    "first_step": "first step on the new ring completes",
}


def _first(events: Sequence[Event], event: str, /, *, after: float, hosts: set[str] | None = None,
           **match: Any) -> Event | None:
    for e in events:
        if (e.get("event") == event and e["t"] >= after and (hosts is None or e.get("host") in hosts)
                and all(e.get(k) == v for k, v in match.items())):
            return e
    return None


def _latest_per_host(events: Sequence[Event], event: str, hosts: set[str], /, *, after: float,
                     **match: Any) -> float | None:
    """Time by which every host in ``hosts`` emitted its first ``event`` after ``after``."""
    times = []
    for host in hosts:
        e = _first(events, event, after=after, hosts={host}, **match)
        if e is None:
            return None
        times.append(e["t"])
    return max(times)


def resume_marks(rec: RunRecord) -> tuple[dict[str, float], float | None, float | None]:
    """Absolute times of each phase's end, the departure time (leave / kill) and the resume time."""
    survivors = set(HOSTS) - {rec.target}
    ev, tr, t0 = rec.events, rec.trace, rec.notice_at
    marks: dict[str, float] = {}
    if rec.plan.variant == "ours":
        notice = _first(ev, "notice", after=t0, hosts={rec.target})
        if notice is not None:
            marks["watcher"] = float(notice["detected_at"])
        agreed = _first(ev, "notice_agreed", after=t0)
        if agreed is not None:
            marks["agreed"] = agreed["t"]
        commit = _first(ev, "commit", after=t0, kind="emergency")
        if commit is not None:
            marks["emergency_save"] = commit["t"]
        leave = _first(ev, "leave_published", after=t0, hosts={rec.target})
        departed = leave["t"] if leave is not None else None
        if departed is not None:
            marks["left"] = departed
            # the first call that read the store after the publication (it may have started before)
            dropped = next((d for d in rec.discovery if d["end"] >= departed and rec.target not in d["hosts"]
                            and d.get("code") == 0), None)
            if dropped is not None:
                marks["discovery"] = dropped["end"]
            notified = _first(tr, "hosts_updated", after=departed)
            if notified is not None:
                marks["notified"] = notified["t"]
            interrupt = _latest_per_host(tr, "interrupt", survivors, after=departed)
            if interrupt is not None:
                marks["interrupt"] = interrupt
    else:
        departed = rec.killed_at
        if departed is not None:
            marks["killed"] = departed
            begin = _first(tr, "reset_begin", after=departed, hosts=survivors)
            if begin is not None:
                marks["failure_detected"] = begin["t"]
    after = departed if departed is not None else t0
    first = _latest_per_host(ev, "first_step", survivors, after=after, size=2)
    for name, kind, source in (("rendezvous", "reset_done", tr), ("restart", "ring", ev)):
        t = _latest_per_host(source, kind, survivors, after=after, **({"size": 2} if kind == "ring" else {}))
        if t is not None and (first is None or t <= first):
            marks[name] = t
    if first is not None:
        marks["first_step"] = first
    return marks, departed, first


def phases(marks: Mapping[str, float], order: Sequence[str], start: str) -> dict[str, float]:
    """Milliseconds of each phase from ``start`` on: the gap to the previous present mark."""
    out: dict[str, float] = {}
    names = list(order)
    prev = marks.get(start)
    if prev is None:
        return out
    for name in names[names.index(start) + 1:]:
        t = marks.get(name)
        if t is None:
            continue
        out[name] = max(0.0, (t - prev) * 1000.0)
        prev = max(prev, t)
    return out


def rollback(rec: RunRecord) -> tuple[int, int | None, int | None, int]:
    """Steps the survivors lost (most on any survivor), their step before and after the first reset,
    and how many resets they went through."""
    survivors = set(HOSTS) - {rec.target}
    resets = [e for e in rec.events if e.get("event") == "reset" and e["host"] in survivors
              and e["t"] >= rec.notice_at]
    lost: dict[str, int] = {}
    for e in resets:
        lost[e["host"]] = lost.get(e["host"], 0) + int(e.get("rolled_back", 0))
    first = resets[0] if resets else None
    per_host_resets = max((sum(1 for e in resets if e["host"] == h) for h in survivors), default=0)
    return (max(lost.values(), default=0), first.get("last_step") if first else None,
            first.get("step") if first else None, per_host_resets)


def analyze(rec: RunRecord) -> Measurement:
    marks_abs, departed, first = resume_marks(rec)
    order = OURS_MARKS if rec.plan.variant == "ours" else BASELINE_MARKS
    all_phases = phases({"notice": rec.notice_at, **marks_abs}, ("notice", *order), "notice")
    rolled, before, after, resets = rollback(rec)
    reached = [e["t"] for e in rec.events if e.get("event") in ("progress", "first_step", "train_end")
               and e.get("step", -1) >= rec.total_steps]
    began = [e["t"] for e in rec.events if e.get("event") == "first_step" and e["t"] < rec.notice_at]
    survivors = set(HOSTS) - {rec.target}
    rate_after = step_rate([e for e in rec.events if e["host"] in survivors], 2, after=first or math.inf)
    if rec.plan.variant == "ours":
        # Until the survivors' interrupt, training went on (with the leaving worker still in the ring).
        last_old = marks_abs.get("interrupt")
        stall = ((marks_abs["left"] - marks_abs["agreed"]) * 1000.0
                 if "left" in marks_abs and "agreed" in marks_abs else None)
    else:
        last_old, stall = departed, 0.0
    resume = (first - last_old) * 1000.0 if first is not None and last_old is not None else None
    lost = None
    if resume is not None and stall is not None:
        redo = rolled / rate_after if rolled and rate_after else 0.0
        lost = (stall + resume) / 1000.0 + redo
    return Measurement(
        variant=rec.plan.variant, scenario=rec.plan.scenario, repeat=rec.plan.repeat, target=rec.target,
        master=rec.master, steps_rolled_back=rolled, step_before=before, step_after=after, resets=resets,
        resume_ms=resume,
        publish_to_resume_ms=((first - departed) * 1000.0 if rec.plan.variant == "ours"
                              and first is not None and departed is not None else None),
        notice_to_resume_ms=(first - rec.notice_at) * 1000.0 if first is not None else None,
        stall_ms=stall, lost_s=lost,
        train_to_t_s=min(reached) - min(began) if reached and began else None,
        total_steps=rec.total_steps, exit_code=rec.exit_code,
        job_s=rec.ended_at - rec.launched_at if rec.ended_at else None,
        left_at_s=departed - rec.notice_at if departed is not None else None,
        killed=rec.killed_at is not None,
        rate_before=rec.rate_before,
        rate_after=rate_after,
        marks={k: v - rec.notice_at for k, v in marks_abs.items()},
        phases_ms=all_phases,
    )


def discovery_stats(records: Sequence[RunRecord]) -> dict[str, Any]:
    """How often Horovod's driver really ran discovery, and how long a call took in-process."""
    intervals, calls, overheads = [], [], []
    for rec in records:
        d = rec.discovery
        calls += [x["end"] - x["t"] for x in d]
        intervals += [b["t"] - a["t"] for a, b in zip(d, d[1:])]
        # between one call's end and the next call's first line: the driver's sleep, then bash,
        # the Python interpreter and the imports of the discovery command
        overheads += [b["t"] - a["end"] - DRIVER_DISCOVERY_SLEEP_S for a, b in zip(d, d[1:])]
    out: dict[str, Any] = {"driver_sleep_s": DRIVER_DISCOVERY_SLEEP_S}
    for key, values in (("interval_s", intervals), ("call_in_process_s", calls), ("start_up_s", overheads)):
        if values:
            out[key] = spread_summary(spread(values))
    return out


# --------------------------------------------------------------------------- summary & report


def summarize(ms: Sequence[Measurement], records: Sequence[RunRecord], cfg: Config) -> dict[str, Any]:
    ok = [m for m in ms if m.error is None]
    summary: dict[str, Any] = {"resume_goal_ms": RESUME_GOAL_MS, "scenarios": {}}
    for variant in VARIANTS:  # every key present; None for a variant that was not run
        mine = [m for m in ok if m.variant == variant]
        rolled = spread_or_none([m.steps_rolled_back for m in mine])
        resume = spread_or_none([m.resume_ms for m in mine])
        lost = spread_or_none([m.lost_s for m in mine])
        summary[f"{variant}_steps_rolled_back"] = rolled.median if rolled else None
        summary[f"{variant}_steps_rolled_back_max"] = rolled.max if rolled else None
        summary[f"{variant}_resume_ms_median"] = resume.median if resume else None
        summary[f"{variant}_resume_ms_max"] = resume.max if resume else None
        summary[f"{variant}_lost_s_median"] = lost.median if lost else None
        summary[f"{variant}_runs"] = {"ok": len(mine), "failed": sum(1 for m in ms if m.variant == variant and m.error)}
    for scenario in cfg.scenarios:
        entry: dict[str, Any] = {}
        for variant in cfg.variants:
            mine = [m for m in ok if m.variant == variant and m.scenario == scenario]
            if not mine:
                continue
            phase_names = list(dict.fromkeys(k for m in mine for k in m.phases_ms))
            entry[variant] = {
                "runs": len(mine),
                "steps_rolled_back": spread_summary(spread_or_none([m.steps_rolled_back for m in mine])),
                "resume_ms": spread_summary(spread_or_none([m.resume_ms for m in mine])),
                "notice_to_resume_ms": spread_summary(spread_or_none([m.notice_to_resume_ms for m in mine])),
                "publish_to_resume_ms": spread_summary(spread_or_none([m.publish_to_resume_ms for m in mine])),
                "stall_ms": spread_summary(spread_or_none([m.stall_ms for m in mine])),
                "lost_s": spread_summary(spread_or_none([m.lost_s for m in mine])),
                "train_to_t_s": spread_summary(spread_or_none([m.train_to_t_s for m in mine])),
                "job_s": spread_summary(spread_or_none([m.job_s for m in mine])),
                "left_after_notice_s": spread_summary(spread_or_none([m.left_at_s for m in mine])),
                "killed_at_deadline": sum(m.killed for m in mine),
                "phases_ms": {p: spread_summary(spread_or_none([m.phases_ms.get(p) for m in mine]))
                              for p in phase_names},
            }
        summary["scenarios"][scenario] = entry
    o, b = summary["ours_resume_ms_median"], summary["baseline_resume_ms_median"]
    summary["resume_speedup"] = b / o if o and b else None
    summary["ours_publish_to_resume_ms_median"] = publish_all.median if (publish_all := spread_or_none(
        [m.publish_to_resume_ms for m in ok if m.variant == "ours"])) else None
    ours = [m for m in ok if m.variant == "ours"]
    summary["goal_zero_rollback_met"] = bool(ours) and all(m.steps_rolled_back == 0 for m in ours)
    summary["goal_resume_under_1s_met"] = (summary.get("ours_resume_ms_median") or math.inf) <= RESUME_GOAL_MS
    summary["goal_resume_under_1s_every_run"] = bool(ours) and all(
        m.resume_ms is not None and m.resume_ms <= RESUME_GOAL_MS for m in ours)
    summary["total_steps"] = max((m.total_steps for m in ok), default=None)
    summary["discovery"] = discovery_stats(records)
    return summary


def _fmt_ms(s: Mapping[str, Any] | None) -> str:
    if not s:
        return "-"
    if s["n"] < 2:
        return f"{s['median']:,.0f}"
    return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"


def _fmt_s(s: Mapping[str, Any] | None) -> str:
    if not s:
        return "-"
    if s["n"] < 2:
        return f"{s['median']:.1f}"
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def _fmt_s2(s: Mapping[str, Any] | None) -> str:
    if not s:
        return "-"
    if s["n"] < 2:
        return f"{s['median']:.2f}"
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def _fmt_steps(s: Mapping[str, Any] | None) -> str:
    if not s:
        return "-"
    if s["n"] < 2 or s["min"] == s["max"]:
        return f"{s['median']:g}"
    return f"{s['median']:g} ({s['min']:g}-{s['max']:g})"


MAIN_COLUMNS = ("preempted", "variant", "runs", "steps rolled back", "resume ms (leaves ring -> next step)",
                "published -> next step ms", "time lost s", "notice -> next step ms", "s to step T", "job s")


def main_table(summary: Mapping[str, Any], cfg: Config) -> list[list[str]]:
    rows = []
    for scenario in cfg.scenarios:
        for variant in cfg.variants:
            e = summary["scenarios"].get(scenario, {}).get(variant)
            if e is None:
                continue
            who = "checkpoint master (rank 0)" if scenario == "master" else "worker (not rank 0)"
            rows.append([who, LABELS[variant], str(e["runs"]), _fmt_steps(e["steps_rolled_back"]),
                         _fmt_ms(e["resume_ms"]), _fmt_ms(e.get("publish_to_resume_ms")), _fmt_s2(e["lost_s"]),
                         _fmt_ms(e["notice_to_resume_ms"]), _fmt_s(e["train_to_t_s"]), _fmt_s(e["job_s"])])
    return rows


def phase_table(summary: Mapping[str, Any], cfg: Config) -> tuple[list[str], list[list[str]]]:
    cols = [(s, v) for s in cfg.scenarios for v in cfg.variants if summary["scenarios"].get(s, {}).get(v)]
    header = ["phase (ends when ...)", *(f"{LABELS[v]}, {s}" for s, v in cols)]
    rows = []
    for variant, order, start in (("ours", OURS_MARKS, "interrupt"), ("baseline", BASELINE_MARKS, "killed")):
        if variant not in cfg.variants:
            continue
        resume = order[order.index(start) + 1:]
        for name in order:
            tag = "" if name in resume else " [notice -> departure]"
            cells = []
            for s, v in cols:
                cells.append(_fmt_ms(summary["scenarios"][s][v]["phases_ms"].get(name)) if v == variant else "")
            rows.append([f"{PHASE_TEXT[name]}{tag}", *cells])
    return header, rows


def run_rows(ms: Sequence[Measurement]) -> tuple[list[str], list[list[str]]]:
    header = ["run", "preempted", "rolled back", "step before -> after", "resume ms", "published -> next ms", "lost s",
              "notice -> resume ms", "s to step T", "job s", "killed", "exit", "error"]
    rows = []
    for m in ms:
        rows.append([f"{m.variant} {m.scenario} #{m.repeat}", m.target, str(m.steps_rolled_back),
                     f"{m.step_before} -> {m.step_after}" if m.step_before is not None else "-",
                     f"{m.resume_ms:,.0f}" if m.resume_ms is not None else "-",
                     f"{m.publish_to_resume_ms:,.0f}" if m.publish_to_resume_ms is not None else "-",
                     f"{m.lost_s:.2f}" if m.lost_s is not None else "-",
                     f"{m.notice_to_resume_ms:,.0f}" if m.notice_to_resume_ms is not None else "-",
                     f"{m.train_to_t_s:.1f}" if m.train_to_t_s is not None else "-",
                     f"{m.job_s:.1f}" if m.job_s is not None else "-",
                     "yes" if m.killed else "no", str(m.exit_code), (m.error or "")[:80]])
    return header, rows


def make_plot(path: Path, summary: Mapping[str, Any], cfg: Config) -> Path | None:
    scen = tuple(s for s in cfg.scenarios if summary["scenarios"].get(s))
    cats = tuple("master" if s == "master" else "worker" for s in scen)

    def series(key: str, scale: float = 1.0) -> tuple[dict[str, list[float | None]], dict[str, list[Any]]]:
        vals: dict[str, list[float | None]] = {}
        errs: dict[str, list[Any]] = {}
        for v in cfg.variants:
            vs, es = [], []
            for s in scen:
                e = summary["scenarios"][s].get(v, {}).get(key)
                vs.append(e["median"] * scale if e else None)
                es.append((e["min"] * scale, e["max"] * scale) if e else None)
            vals[LABELS[v]], errs[LABELS[v]] = vs, es
        return vals, errs

    panels = []
    for key, title, ylabel, scale in (
            ("resume_ms", "resume: worker leaves the ring -> survivors' next step", "seconds", 1e-3),
            ("steps_rolled_back", "steps rolled back", "steps", 1.0),
            ("lost_s", "training time lost (stall + resume + redone steps)", "seconds", 1.0),
            ("train_to_t_s", f"first step -> step T={summary.get('total_steps')}", "seconds", 1.0)):
        vals, errs = series(key, scale)
        panels.append(Panel(title, ylabel, cats, vals, errs))
    # resume breakdown of ours (median ms per phase, per scenario)
    if "ours" in cfg.variants:
        resume = OURS_MARKS[OURS_MARKS.index("left") + 1:]  # publication -> next step
        vals = {f"ours, {s}": [(summary["scenarios"][s]["ours"]["phases_ms"].get(p) or {}).get("median")
                               for p in resume] for s in scen if summary["scenarios"][s].get("ours")}
        panels.append(Panel("hvd-transient resume breakdown (ms, median)", "ms", resume, vals))
    if "baseline" in cfg.variants:
        resume = BASELINE_MARKS[1:]
        vals = {f"baseline, {s}": [(summary["scenarios"][s]["baseline"]["phases_ms"].get(p) or {}).get("median")
                                   for p in resume] for s in scen if summary["scenarios"][s].get("baseline")}
        panels.append(Panel("plain Horovod resume breakdown (ms, median)", "ms", resume, vals))
    return plot_panels(path, panels, title=f"cost of a preemption ({cfg.model}, {cfg.window_s:g} s notice)")


# --------------------------------------------------------------------------- driver


@contextlib.contextmanager
def store_root(spec: str, tmp: Path) -> Iterator[str]:
    """Where the runs' stores go: ``local`` (a temporary directory), ``gcs`` (fake-gcs-server
    started here) or a URL (directory, file://, gs://bucket/prefix)."""
    if spec == "local":
        yield str(tmp / "stores")
    elif spec == "gcs":
        try:
            from ckpt_service.testing.gcs_emulator import gcs_emulator
        except ImportError as exc:
            raise BenchError(f"cannot start the GCS emulator ({exc}); install the dev extras") from exc
        with gcs_emulator() as emu:  # sets STORAGE_EMULATOR_HOST for the workers too
            yield f"gs://{emu.new_bucket('preemption-cost')}/runs"
    else:
        yield spec.rstrip("/")


def plans(cfg: Config, root: str, tmp: Path) -> Iterator[RunPlan]:
    for repeat in range(cfg.repeats):
        for scenario in cfg.scenarios:
            for variant in cfg.variants:  # ours first: the very first run can choose T
                name = f"{variant}-{scenario}-{repeat}"
                yield RunPlan(variant, scenario, repeat, f"{root}/{name}", tmp / name, None)


def run_all(cfg: Config, tmp: Path) -> tuple[list[Measurement], list[RunRecord], float]:
    started = time.perf_counter()
    measurements: list[Measurement] = []
    records: list[RunRecord] = []
    total = cfg.total_steps
    with store_root(cfg.store, tmp) as root:
        for plan in plans(cfg, root, tmp):
            plan = RunPlan(plan.variant, plan.scenario, plan.repeat, plan.store, plan.workdir, total)
            t0 = time.perf_counter()
            print(f"run {plan.name}: ...", file=sys.stderr, flush=True)
            try:
                rec = run_one(plan, cfg)
            except BenchError:
                raise
            except Exception as exc:  # a failed run is reported, the others still count
                log.error("run %s failed: %s", plan.name, exc)
                measurements.append(_failed(plan, total, exc))
                continue
            total = rec.total_steps
            save_record(rec)
            m = analyze(rec)
            measurements.append(m)
            records.append(rec)
            print(f"run {plan.name}: {m.target} preempted, rolled back {m.steps_rolled_back}, resume "
                  f"{m.resume_ms or float('nan'):,.0f} ms (from publication "
                  f"{m.publish_to_resume_ms or float('nan'):,.0f} ms), "
                  f"lost {m.lost_s or float('nan'):.2f} s, step T={total} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return measurements, records, time.perf_counter() - started


def _failed(plan: RunPlan, total: int | None, exc: Exception) -> Measurement:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return Measurement(variant=plan.variant, scenario=plan.scenario, repeat=plan.repeat, target="", master="",
                       steps_rolled_back=0, step_before=None, step_after=None, resets=0, resume_ms=None,
                       publish_to_resume_ms=None, notice_to_resume_ms=None, stall_ms=None, lost_s=None,
                       train_to_t_s=None,
                       total_steps=total or 0, exit_code=None,
                       job_s=None, left_at_s=None, killed=False, rate_before=None, rate_after=None, marks={},
                       phases_ms={}, error=text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="preemption_cost",
        description="Cost of one preemption (steps rolled back, time to resume, run time): plain Horovod "
                    "elastic, killed at the end of the notice window, against hvd-transient with the same "
                    "notice, on a local 3-host cluster.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("small_cnn", "resnet32"), default="small_cnn")
    p.add_argument("--repeats", type=int, default=3, help="runs per scenario and variant")
    p.add_argument("--window-s", type=float, default=10.0, help="notice window: the kill comes this long after it")
    p.add_argument("--store", default="local",
                   help="run stores: 'local' (temporary directory), 'gcs' (fake-gcs-server started here) or a "
                        "URL prefix (directory, file://, gs://bucket/prefix); each run gets its own prefix")
    p.add_argument("--steps-per-epoch", type=int, default=20,
                   help="Keras epoch length (after a reset Keras restarts the epoch: keep it short)")
    p.add_argument("--warmup-steps", type=int, default=30, help="steps on 3 workers before the notice")
    p.add_argument("--total-steps", type=int, default=None,
                   help="step T every run must reach (default: from the first run's step rate)")
    p.add_argument("--batches-per-commit", type=int, default=10, help="Horovod in-memory commit cadence (both)")
    p.add_argument("--save-every", type=int, default=100, help="hvd-transient periodic checkpoint interval")
    p.add_argument("--step-seconds", type=float, default=None,
                   help="extra time per step, like a GPU step (default 0.05 for small_cnn, 0 for resnet32)")
    p.add_argument("--gloo-timeout-seconds", type=int, default=10,
                   help="horovodrun --gloo-timeout-seconds (how long survivors may wait on a dead peer)")
    p.add_argument("--scenarios", type=csv_list(str, SCENARIOS), default=SCENARIOS)
    p.add_argument("--variants", type=csv_list(str, VARIANTS), default=VARIANTS)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (.md and .png beside it)")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--tmpdir", type=Path, default=None, help="parent of the temporary working directory")
    p.add_argument("--keep", action="store_true", help="keep the working directory (logs, traces, stores)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    install_interrupt_handlers()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    # hvd-transient's workers have normally left before their deadline: the emulator then reports a
    # SIGTERM it could not deliver, which is the expected outcome (rows record "killed")
    logging.getLogger("hvd_transient.testing.metadata_emulator.registry").setLevel(logging.ERROR)
    if args.repeats < 1 or args.window_s <= 0 or args.steps_per_epoch < 1 or args.warmup_steps < 10:
        print("preemption_cost: --repeats and --steps-per-epoch must be >= 1, --window-s > 0, "
              "--warmup-steps >= 10 (the step rate is measured over the warm-up)", file=sys.stderr)
        return 2
    step_seconds = args.step_seconds if args.step_seconds is not None else (0.05 if args.model == "small_cnn" else 0.0)
    cfg = Config(args.model, args.repeats, args.window_s, args.store, args.steps_per_epoch, args.warmup_steps,
                 args.total_steps, args.batches_per_commit, args.save_every, step_seconds,
                 args.gloo_timeout_seconds, tuple(args.scenarios), tuple(args.variants))
    if cfg.total_steps is None and "ours" not in cfg.variants:
        print("preemption_cost: with --variants baseline alone, give --total-steps", file=sys.stderr)
        return 2
    machine = machine_info()
    print(f"machine: {machine_line(machine)}, load {machine['load_average_at_start']}", file=sys.stderr, flush=True)
    if args.tmpdir is not None:
        args.tmpdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="preemption-cost-", dir=args.tmpdir))
    try:
        measurements, records, elapsed = run_all(cfg, tmp)
    except BenchError as exc:
        print(f"preemption_cost: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("preemption_cost: interrupted; clusters stopped, no results written", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"working directory kept: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if not any(m.error is None for m in measurements):
        print("preemption_cost: every run failed:\n" + "\n".join(m.error or "" for m in measurements), file=sys.stderr)
        return 1
    summary = summarize(measurements, records, cfg)
    summary["elapsed_s"] = elapsed
    table = main_table(summary, cfg)
    print()
    print_table(MAIN_COLUMNS, table, title=f"cost of a preemption ({machine_line(machine)})")
    ph_header, ph_rows = phase_table(summary, cfg)
    print_table(ph_header, ph_rows, title="where the time goes (ms after the previous phase; median (min-max))")
    run_header, runs = run_rows(measurements)
    notes = [
        "resume: from the worker leaving the ring (ours: the survivors' HostsUpdatedInterrupt, until which the "
        "leaving worker trained with them; baseline: the SIGTERM at the end of the notice window) to the latest "
        "survivor's first completed step on the new ring: the time no training happens",
        "published -> next step (ours): from leave_published to that step; adds Horovod's discovery poll and "
        "notification, during which the ring, the leaving worker included, keeps training",
        "steps rolled back: survivors' step before the reset minus the step after it (summed over resets)",
        "time lost: emergency-checkpoint stall (ours) + resume + rolled-back steps / survivors' step rate",
        f"s to step T: from the run's first step to global step T ({summary['total_steps']}); after the "
        "preemption both run on 2 workers, but ours drops the leaving worker a few seconds after the notice "
        "while the baseline keeps 3 workers until the kill; job s: horovodrun start to exit",
        "phases come from the event log, bench/_hvd_trace.py (Horovod internals) and the recorded discovery calls",
        "machine shared with other jobs: compare medians measured in the same run",
    ]
    params = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__} | {"total_steps_used": summary["total_steps"],
                                                                       "hosts": HOSTS}
    out = write_results(args.out, name="preemption_cost", summary=summary,
                        rows=[asdict(m) for m in measurements], params=params, notes=notes, machine=machine)
    markdown = (
        f"# preemption_cost results\n\nMachine: {machine_line(machine)}, load average at start "
        f"{machine['load_average_at_start']}  \nCommand: `{command_line()}`  \nRun time: {elapsed:.0f} s; "
        f"{cfg.model}, {cfg.window_s:g} s notice, step T = {summary['total_steps']}.\n\n"
        f"{markdown_table(MAIN_COLUMNS, table)}\n\n**Where the time goes** (ms from the previous phase's end, "
        f"median (min-max))\n\n{markdown_table(ph_header, ph_rows)}\n\n"
        f"Discovery: {json.dumps(summary['discovery'])}\n\n## Every run\n\n{markdown_table(run_header, runs)}\n")
    plot = (lambda png: make_plot(png, summary, cfg)) if args.plot else None
    return finish_report(out, markdown, plot, elapsed)


if __name__ == "__main__":
    sys.exit(main())
