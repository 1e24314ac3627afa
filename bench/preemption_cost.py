"""What a preemption, and a join, costs: plain Horovod elastic against the same job with hvd-transient.

The same Keras training on a ``LocalCluster`` (real ``horovodrun``, a GCE metadata emulator per host) as
``baseline`` (``bench/plain_elastic_worker.py``: killed when the notice window ends, Horovod rolls back)
and ``ours`` (``examples/keras_elastic.py``: emergency checkpoint, election, a clean leave), when a worker
or the checkpoint master / rank 0 of 3 is preempted, or a host joins a ring of 2 (ours: through a standby
worker). ``--framework torch``: the same with PyTorch (``examples/torch_elastic.py`` against
``bench/plain_torch_elastic_worker.py``, ``TorchState`` and ``ElasticSampler``). Figures and phases come
from :func:`hvd_transient.report.analysis.analyze`; runs alternate.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import bench.common as bc
from hvd_transient.report.analysis import analyze

log = logging.getLogger(__name__)

HOSTS = ("localhost", "127.0.0.1", "127.0.1")
VARIANTS, SCENARIOS = ("ours", "baseline"), ("worker", "master", "join")
LABELS = {"ours": "hvd-transient", "baseline": "plain Horovod elastic"}
RESUME_GOAL_MS = 1000.0
RESUME_MARGIN_STEPS = 40  # step T comes at least this many steps after the survivors' resume
BASE_LR, START_TIMEOUT_S, RESUME_TIMEOUT_S = 0.01, 600.0, 300.0
#: phases of a departure, in order, each ending at its mark: Preemption.marks plus the notice given
#: (``given``) and the survivors' last step on the old ring (``last_step``, from their resets)
MARKS = ("given", "notice", "agreed", "committed", "left", "last_step", "reset", "ring", "first_step")
PHASES = {"notice": "notice seen by the watcher", "agreed": "all ranks agree on the step",
          "committed": "emergency checkpoint committed", "left": "host published as leaving / killed at the deadline",
          "last_step": "survivors' last step on the old ring", "reset": "survivors reset (rendezvous, rollback)",
          "ring": "training restarts on the new ring", "first_step": "first step on the new ring completes"}

Event = dict[str, Any]


@dataclass(frozen=True)
class Config:  # field names are the command line's
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
    gloo_timeout_seconds: int
    scenarios: tuple[str, ...]
    variants: tuple[str, ...]
    framework: str = "keras"


@dataclass(frozen=True)
class RunPlan:
    variant: str
    scenario: str
    repeat: int
    store: str
    workdir: Path
    total_steps: int | None  # None: decide from this run's step rate (the first run only)


def worker_command(plan: RunPlan, cfg: Config) -> tuple[str, ...]:
    """The training command of every worker."""
    scripts = bc.SCRIPTS[cfg.framework]
    shared = ["--model", cfg.model, "--steps-per-epoch", str(cfg.steps_per_epoch), "--batches-per-commit",
              str(cfg.batches_per_commit), "--step-seconds", str(cfg.step_seconds), "--base-lr", str(BASE_LR),
              *scripts.args]
    if plan.variant == "ours":  # runs until told to stop; knows the cloud's notice window, as a user would
        script = [str(scripts.ours), "--store", plan.store, "--epochs", "100000", "--save-every", str(cfg.save_every),
                  "--notice-window", str(cfg.window_s), "--leave", "at_notice", *shared]  # the leave itself
    elif plan.scenario != "join" and plan.total_steps is None:
        raise bc.BenchError("the baseline needs a fixed number of steps: run 'ours' first or give --total-steps")
    else:  # a join run is stopped once the bigger ring trained
        epochs = 100000 if plan.scenario == "join" else math.ceil((plan.total_steps or 0) / cfg.steps_per_epoch)
        script = [str(scripts.baseline), "--events-store", plan.store, "--epochs", str(epochs), *shared]
    return (sys.executable, *script)


@dataclass
class RunRecord:
    """Everything one run produced; :func:`measure` turns it into numbers."""

    plan: RunPlan
    launched_at: float
    notice_at: float                # the notice (join: the new host appearing)
    target: str                     # the preempted (join: the joining) host
    master: str
    total_steps: int
    events: list[Event]
    killed_at: float | None = None
    exit_code: int | None = None
    ended_at: float | None = None
    ready_at: float | None = None   # join, ours: the new VM's standby published itself ready


class LateResume(Exception):
    """The survivors resumed at or after the step T an earlier run chose: this run cannot be compared."""


def whole_epochs(steps: float, cfg: Config) -> int:
    return math.ceil(steps / cfg.steps_per_epoch) * cfg.steps_per_epoch


def step_at(events: Sequence[Event], when: float, rate: float) -> float:
    """The job's step at ``when``: the latest step its log reported by then, carried on at ``rate``.

    The bench reads the log late (through a slow store, by seconds: each of its reads lists and reads
    every segment), so the job is past the warm-up when the notice comes, by as much as that lag.
    """
    t, step = max((e["t"], e["step"]) for e in events if e.get("event") in ("progress", "first_step")
                  and e["t"] <= when)
    return float(step) + max(0.0, when - float(t)) * rate


def choose_total_steps(cfg: Config, rate: float, notice_step: float) -> int:
    """Step T, from the plan: well after the survivors' resume, in whole epochs.

    The ring, the target included, trains on after the notice until the target leaves: at once
    (``at_notice``), at its ``leave_at`` (the deadline less the lead), or at the deadline at the latest,
    where the emulator kills it (the baseline's case). So the survivors resume by about ``notice_step`` +
    one window at the 3-worker rate; half a window and ``RESUME_MARGIN_STEPS`` more cover the reset
    and a changing rate.
    """
    return whole_epochs(notice_step + math.ceil(1.5 * rate * cfg.window_s) + RESUME_MARGIN_STEPS, cfg)


def settle_total_steps(total: int, resumed_step: int, cfg: Config, *, chosen_here: bool) -> int:
    """Step T once the survivors resumed at ``resumed_step``: a T this run chose is moved past the resume
    (the run goes on until then, so the defaults always finish); a fixed one must already be past it."""
    if resumed_step < total:
        return total
    if chosen_here:
        return whole_epochs(resumed_step + RESUME_MARGIN_STEPS, cfg)
    if cfg.total_steps is not None:
        raise bc.BenchError(f"the survivors resumed at or after step T={total}; raise --total-steps")
    raise LateResume(f"the survivors resumed at step {resumed_step}, at or after step T={total} of the first run")


def pick_target(scenario: str, master: str) -> str:
    return master if scenario == "master" else [h for h in HOSTS if h != master][-1]


def first_steps(hosts: Sequence[str], size: int, after: float) -> Callable[[list[Event]], list[Event]]:
    return lambda ev: [e for e in ev if e.get("event") == "first_step" and e["size"] == size
                       and e["host"] in hosts and e["t"] > after]


def run_one(plan: RunPlan, cfg: Config) -> RunRecord:
    from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec
    plan.workdir.mkdir(parents=True, exist_ok=True)
    hosts = HOSTS[:2] if plan.scenario == "join" else HOSTS
    standby = plan.scenario == "join" and plan.variant == "ours"  # new VMs start a pre-warmed worker
    spec = LocalClusterSpec(store=plan.store, hosts=hosts, command=worker_command(plan, cfg), workdir=plan.workdir,
                            gloo_timeout_s=cfg.gloo_timeout_seconds, standby=standby)
    ready_at = None
    with LocalCluster(spec) as cluster:
        cluster.wait_for_step(cfg.warmup_steps, START_TIMEOUT_S, size=len(hosts))
        before = cluster.events()
        ring = analyze(before).rings[-1]
        master = ring.master_host  # checkpoint master / Horovod's rank 0
        total, killed_at, exit_code = plan.total_steps, None, None
        if plan.scenario == "join":
            target, notice_at = HOSTS[2], time.time()
            cluster.add_host(target)
            bigger = cluster.wait_for(first_steps(hosts, 3, notice_at), RESUME_TIMEOUT_S, "the ring of 3")
            cluster.wait_for_step(max(e["step"] for e in bigger) + 10, START_TIMEOUT_S, size=3)
            if standby:  # when the new VM's standby worker published itself ready
                from hvd_transient.discovery.ready import read_ready
                ready_at = next((r.ready_at for r in read_ready(cluster.store) if r.host == target), None)
        else:
            chosen_here, rate = total is None, ring.steps_per_s
            if chosen_here and rate is None:
                raise bc.BenchError(f"{plan.store}: no step rate before the preemption; give --total-steps")
            target = pick_target(plan.scenario, master)
            notice_at = cluster.preempt(target, window_s=cfg.window_s, kill_at_deadline=True)
            if total is None:
                assert rate is not None  # checked above
                notice_step = step_at(before, notice_at, rate)
                total = choose_total_steps(cfg, rate, notice_step)
                log.info("step T = %d (notice at about step %.0f, %.1f steps/s on 3 workers)", total, notice_step,
                         rate)
            survivors = tuple(h for h in HOSTS if h != target)
            resumed = cluster.wait_for(first_steps(survivors, 2, notice_at), RESUME_TIMEOUT_S + cfg.window_s,
                                       "the survivors to resume")
            total = settle_total_steps(total, max(e["step"] for e in resumed), cfg, chosen_here=chosen_here)
            cluster.wait_for_step(total, START_TIMEOUT_S)
            if plan.variant == "ours":
                cluster.request_stop()
            exit_code = cluster.wait(START_TIMEOUT_S)
            killed_at = cluster.emulator.instance(target).killed_at
        events = cluster.events()
    return RunRecord(plan, cluster.started_at, notice_at, target, master, total or 0, events, killed_at,
                     exit_code, time.time(), ready_at)


@dataclass(frozen=True)
class Measurement:
    variant: str
    scenario: str
    repeat: int
    target: str
    master: str = ""
    steps_rolled_back: int = 0
    step_before: int | None = None            # the survivors' first reset: from this step ...
    step_after: int | None = None             # ... to this one
    resets: int = 0
    resume_ms: float | None = None            # worker leaves the ring (survivors' last step / kill) -> next step
    publish_to_resume_ms: float | None = None  # ours: leave_published -> survivors' next step
    notice_to_resume_ms: float | None = None
    stall_ms: float | None = None             # ours: every rank waited for the emergency checkpoint
    lost_s: float | None = None               # stall + resume + rolled-back steps at the survivors' step rate
    train_to_t_s: float | None = None         # first step of the run -> global step T
    join_stall_s: float | None = None         # survivors' last step -> their first on the bigger ring
    join_s: float | None = None               # the new VM appears -> the ring with it starts
    standby_ready_s: float | None = None      # the new VM appears -> its standby is ready (ours)
    total_steps: int = 0
    exit_code: int | None = None
    job_s: float | None = None                # horovodrun start -> exit
    killed: bool = False                      # the worker was still there at the deadline and got SIGTERM
    marks: dict[str, float] = field(default_factory=dict)      # seconds after the notice
    phases_ms: dict[str, float] = field(default_factory=dict)  # phase -> ms since the previous mark
    error: str | None = None


def measure(rec: RunRecord) -> Measurement:
    """RunAnalysis's figures for the target's departure (or join), and its phases."""
    run = analyze(rec.events, kills={rec.target: rec.killed_at} if rec.killed_at is not None else None)
    base = Measurement(rec.plan.variant, rec.plan.scenario, rec.plan.repeat, rec.target, rec.master,
                       total_steps=rec.total_steps, exit_code=rec.exit_code, killed=rec.killed_at is not None,
                       job_s=rec.ended_at - rec.launched_at if rec.ended_at and rec.exit_code is not None else None)
    if rec.plan.scenario == "join":
        j = next((j for j in run.joins if j.host == rec.target and j.t >= rec.notice_at), None)
        if j is None:
            return replace(base, error=f"{rec.target} never joined a running ring")
        return replace(base, join_stall_s=j.stall_s, steps_rolled_back=j.steps_rolled_back, join_s=j.t - rec.notice_at,
                       standby_ready_s=rec.ready_at - rec.notice_at if rec.ready_at is not None else None)
    p = run.preemption_of(rec.target, after=rec.notice_at)
    if p is None:
        return replace(base, error=f"no departure of {rec.target} after the notice")
    ours, survivors = rec.plan.variant == "ours", [h for h in HOSTS if h != rec.target]
    marks = {"given": rec.notice_at, **p.marks}
    first = p.resumed_at
    if ours and first is not None:  # the ring, leaving worker included, trained until Horovod interrupted it
        last = [e["last_step_at"] for e in rec.events if e.get("event") == "reset" and e.get("host") in survivors
                and p.departed_at < e["t"] <= first and e.get("last_step_at") is not None]
        marks |= {"last_step": max(last)} if last else {}  # the last survivor's last step on the old ring
    rate_after = ring.steps_per_s if first is not None and (ring := run.ring_at(first)) is not None else None
    last_old = marks.get("last_step") if ours else p.departed_at
    resume = (first - last_old) * 1000.0 if first is not None and last_old is not None else None
    stall = p.agreed_to_left_ms if ours else 0.0
    redo = p.steps_rolled_back / rate_after if p.steps_rolled_back and rate_after else 0.0
    reached = next((q.t for q in run.progress if q.step >= rec.total_steps), None)
    return replace(
        base, steps_rolled_back=p.steps_rolled_back, step_before=p.last_step_before_reset,
        step_after=p.step_after_reset, resets=p.survivor_resets, resume_ms=resume,
        publish_to_resume_ms=p.resume_ms if ours else None,
        notice_to_resume_ms=(first - rec.notice_at) * 1000.0 if first is not None else None, stall_ms=stall,
        lost_s=(stall + resume) / 1000.0 + redo if resume is not None and stall is not None else None,
        train_to_t_s=reached - run.progress[0].t if reached is not None else None,
        marks={k: v - rec.notice_at for k, v in marks.items()},
        phases_ms=bc.phases(marks, MARKS, 1000.0))


PER_RUN = ("steps_rolled_back", "resume_ms", "notice_to_resume_ms", "publish_to_resume_ms", "stall_ms", "lost_s",
           "train_to_t_s", "job_s", "join_stall_s", "join_s", "standby_ready_s")


def summarize(ms: Sequence[Measurement], cfg: Config) -> dict[str, Any]:
    ok = [m for m in ms if m.error is None]

    def of(v: str, key: str, stat: str = "median", join: bool = False) -> float | None:
        s = bc.spread_or_none([getattr(m, key) for m in ok if m.variant == v and (m.scenario == "join") == join])
        return getattr(s, stat) if s else None

    summary: dict[str, Any] = {"framework": cfg.framework, "resume_goal_ms": RESUME_GOAL_MS,
                               "scenarios": {s: {} for s in cfg.scenarios}}
    for v in VARIANTS:  # every key present; None for what was not run
        summary |= {f"{v}_steps_rolled_back": of(v, "steps_rolled_back"),
                    f"{v}_steps_rolled_back_max": of(v, "steps_rolled_back", "max"),
                    f"{v}_resume_ms_median": of(v, "resume_ms"), f"{v}_resume_ms_max": of(v, "resume_ms", "max"),
                    f"{v}_lost_s_median": of(v, "lost_s"), f"{v}_join_stall_s": of(v, "join_stall_s", join=True),
                    f"{v}_runs": {"ok": sum(m.variant == v for m in ok),
                                  "failed": sum(1 for m in ms if m.variant == v and m.error)}}
        for s in cfg.scenarios:
            if mine := [m for m in ok if m.variant == v and m.scenario == s]:
                names = dict.fromkeys(k for m in mine for k in m.phases_ms)
                summary["scenarios"][s][v] = {
                    "runs": len(mine), "killed_at_deadline": sum(m.killed for m in mine),
                    **{k: bc.spread_summary(bc.spread_or_none([getattr(m, k) for m in mine])) for k in PER_RUN},
                    "phases_ms": {n: bc.spread_summary(bc.spread_or_none([m.phases_ms.get(n) for m in mine]))
                                  for n in names}}
    o, b = summary["ours_resume_ms_median"], summary["baseline_resume_ms_median"]
    ours = [m for m in ok if m.variant == "ours" and m.scenario != "join"]
    return summary | {
        "resume_speedup": b / o if o and b else None,
        "ours_publish_to_resume_ms_median": of("ours", "publish_to_resume_ms"),
        "goal_zero_rollback_met": bool(ours) and all(m.steps_rolled_back == 0 for m in ours),
        "goal_resume_under_1s_met": (o if o is not None else math.inf) <= RESUME_GOAL_MS,
        "goal_resume_under_1s_every_run": bool(ours) and all((m.resume_ms or math.inf) <= RESUME_GOAL_MS for m in ours),
        "total_steps": max((m.total_steps for m in ok if m.total_steps), default=None)}


#: (column, per-run measure, number format) of the main table
MAIN_COLUMNS = (("steps rolled back", "steps_rolled_back", "g"),
                ("resume ms (leaves ring -> next step)", "resume_ms", ",.0f"),
                ("published -> next step ms", "publish_to_resume_ms", ",.0f"), ("time lost s", "lost_s", ".2f"),
                ("notice -> next step ms", "notice_to_resume_ms", ",.0f"), ("s to step T", "train_to_t_s", ".1f"),
                ("join stall s (survivors' last -> next step)", "join_stall_s", ".2f"),
                ("join s (VM appears -> ring with it)", "join_s", ".1f"))
WHO = {"master": "checkpoint master (rank 0) preempted", "worker": "worker (not rank 0) preempted",
       "join": "a host joins a ring of 2"}


def main_table(summary: Mapping[str, Any], cfg: Config) -> str:
    rows = [[WHO[s], LABELS[v], str(e["runs"]), *(bc.fmt_summary(e[key], spec) for _, key, spec in MAIN_COLUMNS)]
            for s in cfg.scenarios for v in cfg.variants if (e := summary["scenarios"][s].get(v))]
    return bc.markdown_table(("scenario", "variant", "runs", *(c for c, _, _ in MAIN_COLUMNS)), rows)


def phase_table(summary: Mapping[str, Any], cfg: Config) -> str:
    """Where the time goes, in markdown ("" without a departure)."""
    cols = [(s, v) for s in cfg.scenarios if s != "join" for v in cfg.variants if summary["scenarios"][s].get(v)]
    rows = [[text, *(bc.fmt_summary(summary["scenarios"][s][v]["phases_ms"].get(name)) for s, v in cols)]
            for name, text in PHASES.items() if any(name in summary["scenarios"][s][v]["phases_ms"] for s, v in cols)]
    return (f"**Where the time goes** (ms from the previous phase's end, median (min-max))\n\n"
            f"{bc.markdown_table(['phase (ends when ...)', *(f'{LABELS[v]}, {s}' for s, v in cols)], rows)}\n"
            if rows else "")


def make_plot(path: Path, summary: Mapping[str, Any], cfg: Config) -> Path | None:
    panels = []
    for key, title, unit, scale in (("resume_ms", "resume: leaves the ring -> survivors' next step", "s", 1e-3),
                                    ("steps_rolled_back", "steps rolled back", "steps", 1.0),
                                    ("lost_s", "training time lost (stall + resume + redone steps)", "s", 1.0),
                                    ("join_stall_s", "join: survivors' stall", "s", 1.0)):
        scen = tuple(s for s in cfg.scenarios if (s == "join") == (key == "join_stall_s") and summary["scenarios"][s])
        cells = {LABELS[v]: [summary["scenarios"][s].get(v, {}).get(key) for s in scen] for v in cfg.variants}
        if scen:
            panels.append(bc.Panel(title, unit, scen, {k: [bc.Spread(c["median"] * scale, c["min"] * scale,
                                                                      c["max"] * scale, c["n"]) if c else None
                                                            for c in cs] for k, cs in cells.items()}))
    return bc.plot_panels(path, panels, title=f"cost of a preemption and a join ({bc.SCRIPTS[cfg.framework].label} "
                                              f"{cfg.model}, {cfg.window_s:g} s)")


def run_all(cfg: Config, tmp: Path) -> list[Measurement]:
    measurements: list[Measurement] = []
    total = cfg.total_steps
    with bc.store_root(cfg.store, tmp, "preemption-cost") as root:
        for repeat in range(cfg.repeats):
            for scenario in cfg.scenarios:
                for variant in cfg.variants:  # ours first: the very first run can choose T
                    name = f"{variant}-{scenario}-{repeat}"
                    plan = RunPlan(variant, scenario, repeat, f"{root}/{name}", tmp / name, total)
                    print(f"run {name} ...", file=sys.stderr, flush=True)
                    try:
                        rec = run_one(plan, cfg)
                    except bc.BenchError:
                        raise
                    except Exception as exc:  # a failed run is reported, the others still count
                        log.error("run %s failed: %s", name, exc)
                        measurements.append(Measurement(variant, scenario, repeat, "", total_steps=total or 0,
                                                        error=f"{type(exc).__name__}: {exc}".splitlines()[0]))
                        continue
                    total = rec.total_steps or total
                    measurements.append(m := measure(rec))
                    print(f"run {name}: {m.target}, rolled back {m.steps_rolled_back}, resume {m.resume_ms or 0:,.0f} "
                          f"ms, join stall {m.join_stall_s or 0:.2f} s, {m.error or 'ok'}", file=sys.stderr, flush=True)
    return measurements


def build_parser() -> argparse.ArgumentParser:
    p = bc.parser("preemption_cost", __doc__.splitlines()[0], keep=True, frameworks=True)
    bc.add_model_argument(p)
    p.add_argument("--repeats", type=bc.positive_int, default=3, help="runs per scenario and variant")
    p.add_argument("--window-s", type=float, default=10.0, help="notice window: the kill comes this long after it")
    p.add_argument("--store", default="local", help="run stores: 'local', 'gcs' (fake-gcs-server) or a URL prefix")
    p.add_argument("--steps-per-epoch", type=bc.positive_int, default=20, help="short: a reset restarts the epoch")
    p.add_argument("--warmup-steps", type=int, default=30, help="steps on the first ring before the notice / join")
    p.add_argument("--total-steps", type=int, default=None, help="step T (default: from the first run's step rate)")
    p.add_argument("--batches-per-commit", type=int, default=10, help="Horovod in-memory commit cadence (both)")
    p.add_argument("--save-every", type=int, default=100, help="hvd-transient periodic checkpoint interval")
    p.add_argument("--step-seconds", type=float,
                   help="extra time per step (default 0.05 for small_cnn and resnet8, else 0)")
    p.add_argument("--gloo-timeout-seconds", type=int, default=10, help="how long survivors wait on a dead peer")
    p.add_argument("--scenarios", type=bc.csv_list(str, SCENARIOS), default=SCENARIOS)
    p.add_argument("--variants", type=bc.csv_list(str, VARIANTS), default=VARIANTS)
    return p


NOTES = [
    "figures and phases from hvd_transient.report.analysis (as `hvd-transient report` shows them)",
    "resume: the worker leaves the ring (ours: the survivors' last step before their reset; baseline: the SIGTERM) "
    "-> the first survivor's first step on the new ring; time lost: stall + resume + redone steps",
    "join: ours boots a standby worker on the new VM, listed once ready; stall: the survivors' last step -> their "
    "first step on the ring of 3"]


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    bc.check_model(p, args)
    args.out = bc.results_path(args, "preemption_cost")
    if args.step_seconds is None:
        args.step_seconds = 0.05 if args.model in bc.SMALL_MODELS else 0.0
    cfg = Config(**{f.name: getattr(args, f.name) for f in fields(Config)})
    if cfg.window_s <= 0 or cfg.warmup_steps < 10:  # the step rate is measured over the warm-up
        p.error("--window-s must be > 0 and --warmup-steps >= 10")
    if cfg.total_steps is None and "ours" not in cfg.variants and set(cfg.scenarios) != {"join"}:
        p.error("with --variants baseline alone, give --total-steps")
    # our workers have normally left before their deadline: the emulator's undeliverable SIGTERM is expected
    logging.getLogger("hvd_transient.testing.metadata_emulator.registry").setLevel(logging.ERROR)
    measurements, elapsed, machine = bc.measured("preemption_cost", lambda tmp: run_all(cfg, tmp), args.tmpdir,
                                                 args.keep)
    if not any(m.error is None for m in measurements):
        print("preemption_cost: every run failed:\n" + "\n".join(m.error or "" for m in measurements), file=sys.stderr)
        return 1
    summary = summarize(measurements, cfg)
    markdown = (f"{bc.SCRIPTS[cfg.framework].describe()}, {cfg.model}, {cfg.window_s:g} s notice, "
                f"step T = {summary['total_steps']}.\n\n"
                f"{main_table(summary, cfg)}\n\n{phase_table(summary, cfg)}")
    print(markdown, flush=True)
    return bc.publish(args.out, name="preemption_cost", summary=summary, rows=[asdict(m) for m in measurements],
                      params=asdict(cfg) | {"total_steps_used": summary["total_steps"], "hosts": HOSTS},
                      notes=NOTES, machine=machine, elapsed=elapsed, markdown=markdown,
                      plot=(lambda png: make_plot(png, summary, cfg)) if args.plot else None)


if __name__ == "__main__":
    sys.exit(main())
