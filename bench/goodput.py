"""Whole-run goodput on a public spot trace: hvd-transient against plain Horovod elastic and checkpoint-restart.

A window of the trace (:mod:`hvd_transient.testing.traces`) is played on a ``LocalCluster`` (real ``horovodrun``, a
metadata emulator per host) three times, each from its first training step for the window's length:

* ``ours``: ``examples/keras_elastic.py``; removals are notices with the cloud's window, additions join
  through a standby; at the window's end the job is asked to stop;
* ``horovod_elastic``: ``bench/plain_elastic_worker.py`` (no plugin): nobody watches the notice, the worker is
  killed when its window ends, Horovod rolls back to its last in-memory commit; ``--blacklist-cooldown-range``
  lets a host name that failed come back when the trace adds a VM under it; the job is killed at the end;
* ``restart``: checkpoint-restart, as managed spot jobs do by default: ``keras_elastic.py`` with its notice
  watcher off and periodic checkpoints; any VM's loss ends the job, which is launched again at once on the VMs
  available then (a VM the trace adds is used from the next launch on) and restores the latest checkpoint.

``--framework torch``: the same with PyTorch, ``examples/torch_elastic.py`` for ``ours`` and ``restart``, and
``bench/plain_torch_elastic_worker.py`` (``TorchState``, ``ElasticSampler``) for ``horovod_elastic`` and the
calibration.

A calibration first measures r(k), the steady samples/s of a ring of k (plain Horovod, same model and machine)
for every k the window needs. Goodput, ideal, lost-time phases, each ring's step time against the calibration and
the goodput at a run's own steady pace (the machine state it ran on) come from
:mod:`hvd_transient.report.goodput`; this module drives the runs, samples the machine's load during each
(:class:`LoadSampler`) and prints.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Sequence

import bench.common as bc
from hvd_transient.core.transient import DEFAULT_LEAVE_LEAD_S, LEAVE_MODES
from hvd_transient.report.analysis import analyze
from hvd_transient.report.goodput import (
    Goodput,
    LoadSample,
    LoadSummary,
    cost_per_m_samples,
    final_step,
    goodput,
    load_summary,
    on_demand_cost_per_m_samples,
    plot_goodput_timeline,
    ratio_by_size,
    save_stalls,
)
from hvd_transient.testing.local_cluster import HOST_ALIASES, ClusterError, LocalCluster, LocalClusterSpec
from hvd_transient.testing.traces import TracePlan, add_trace_arguments, load_plan

log = logging.getLogger(__name__)

VARIANTS = ("ours", "horovod_elastic", "restart")
LABELS = {"ours": "hvd-transient", "horovod_elastic": "plain Horovod elastic", "restart": "checkpoint-restart"}
SUMMARY_KEY = {"ours": "ours_goodput", "horovod_elastic": "horovod_elastic_goodput", "restart": "restart_goodput"}
BASE_LR, START_TIMEOUT_S, FOREVER_EPOCHS = 0.01, 600.0, 100000
POLL_S = 0.2
DEFAULT_TRACE = bc.REPO / "bench" / "traces" / "oobleck-p3-first-2h.csv"
#: more names of the loopback address (inet_aton's octal and short forms): 8 followed nodes and their
#: replacements take up to 14 hosts
MORE_ALIASES = ("127.0.0.01", "0177.0.0.1", "0x7f.1", "127.00.0.1", "0x7f.0.0.1", "127.0.0.001", "0177.1", "0x7f.0.1")
HOSTS = HOST_ALIASES + tuple(a for a in MORE_ALIASES if a not in HOST_ALIASES)
LOAD_EVERY_S = 5.0
CALIBRATION_LAUNCHES = 3


@dataclass(frozen=True)
class Config:  # field names are the command line's
    model: str
    batch_size: int
    steps_per_epoch: int
    save_every: int
    restart_save_every: int
    batches_per_commit: int
    step_seconds: float
    calibration_s: float
    warmup_steps: int
    gloo_timeout_seconds: int
    cooldown: tuple[int, int]
    variants: tuple[str, ...]
    instance_type: str | None
    leave: str = "near_deadline"
    leave_lead: float | None = None  # None: the product's measured lead
    framework: str = "keras"


def worker_command(variant: str, store: str, cfg: Config, window_s: float) -> tuple[str, ...]:
    scripts = bc.SCRIPTS[cfg.framework]
    shared = ["--model", cfg.model, "--steps-per-epoch", str(cfg.steps_per_epoch), "--batch-size",
              str(cfg.batch_size), "--batches-per-commit", str(cfg.batches_per_commit), "--step-seconds",
              str(cfg.step_seconds), "--base-lr", str(BASE_LR), "--epochs", str(FOREVER_EPOCHS), *scripts.args]
    if variant == "horovod_elastic":
        return (sys.executable, str(scripts.baseline), "--events-store", store, *shared)
    every = cfg.restart_save_every if variant == "restart" else cfg.save_every
    lead = ("--leave-lead", f"{cfg.leave_lead:g}") if cfg.leave_lead is not None else ()
    return (sys.executable, str(scripts.ours), "--store", store, "--save-every", str(every),
            "--notice-window", f"{window_s:g}", "--leave", cfg.leave, *lead, *shared)


def _spec(variant: str, store: str, hosts: Sequence[str], workdir: Path, cfg: Config, plan: TracePlan
          ) -> LocalClusterSpec:
    window = plan.options.notice_s
    common: dict[str, Any] = dict(store=store, hosts=tuple(hosts), workdir=workdir, max_np=len(HOSTS),
                                  instances=HOSTS, notice_s=window, gloo_timeout_s=cfg.gloo_timeout_seconds,
                                  command=worker_command(variant, store, cfg, window))
    if variant == "ours":
        return LocalClusterSpec(**common, standby=True)
    if variant == "horovod_elastic":
        lo, hi = cfg.cooldown
        return LocalClusterSpec(**common, horovodrun_args=("--blacklist-cooldown-range", str(lo), str(hi)))
    # restart: a fixed ring of the VMs up at launch, nobody listens for notices
    return LocalClusterSpec(**common | {"max_np": len(hosts)}, min_np=len(hosts),
                            extra_env=(("HVDT_WATCHER", "local"),))


def _first_step(cluster: LocalCluster, after: float = 0.0) -> float:
    def seen(events: list[dict[str, Any]]) -> float | None:
        ts = [e["t"] for e in events if e.get("event") == "first_step" and e["t"] >= after]
        return min(ts) if ts else None
    return float(cluster.wait_for(seen, START_TIMEOUT_S, "the first training step"))


def _sleep_until(cluster: LocalCluster, t: float) -> None:
    while time.time() < t:
        if cluster.process is not None and cluster.process.poll() is not None:
            raise ClusterError(f"horovodrun exited ({cluster.process.returncode}) during the window; log tail:\n"
                               f"{cluster.log_tail()}")
        time.sleep(min(POLL_S, max(0.0, t - time.time())))


# -------------------------------------------------------------------------------------------- machine load

def _proc_cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


def _own_ticks() -> dict[int, int]:
    """pid -> utime + stime jiffies of this process and its descendants (workers, standbys, horovodrun)."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, ticks)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                text = fh.read()
        except OSError:
            continue  # it exited
        rest = text[text.rindex(")") + 2:].split()
        stats[int(entry.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    own, todo = {}, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in stats:
            own[pid] = stats[pid][1]
        todo += children.get(pid, [])
    return own


class LoadSampler:
    """While open, every ``every_s``: the load average and the cores busy, all and the benchmark's own
    (``/proc``), so that a variant's figures come with the machine they ran on."""

    def __init__(self, every_s: float = LOAD_EVERY_S) -> None:
        self.every_s = every_s
        self.samples: list[LoadSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def summary(self) -> LoadSummary | None:
        return load_summary(self.samples)

    def _run(self) -> None:
        cores = os.cpu_count() or 1
        try:
            busy, total = _proc_cpu_ticks()
            own = _own_ticks()
            while not self._stop.wait(self.every_s):
                busy2, total2 = _proc_cpu_ticks()
                own2 = _own_ticks()
                if total2 <= total:
                    continue
                span = (total2 - total) / cores  # jiffies per core in the interval
                own_ticks = sum(t - own.get(pid, 0) for pid, t in own2.items())
                self.samples.append(LoadSample(time.time(), os.getloadavg()[0], (busy2 - busy) / span,
                                               max(0.0, own_ticks / span)))
                busy, total, own = busy2, total2, own2
        except OSError as exc:  # no /proc: no load figures, the run goes on
            log.warning("load sampling stopped: %s", exc)


# ---------------------------------------------------------------------------------------------- calibration

def calibrate(cfg: Config, plan: TracePlan, root: str, tmp: Path) -> dict[int, float]:
    """r(k), samples/s of a plain Horovod ring of k, for each k > 0 the window's n(t) takes: one launch on the
    largest ring, measured, then one host killed at a time (each size measured after its own warm-up). Gloo can
    abort every survivor of a kill (a larger ring on a loaded machine does): the job is then launched afresh on
    the size it was going to, at most ``CALIBRATION_LAUNCHES`` times."""
    sizes = sorted({n for _, n in plan.availability if n > 0}, reverse=True)
    rates: dict[int, float] = {}
    for launch in range(1, CALIBRATION_LAUNCHES + 1):
        todo = [k for k in sizes if k not in rates]
        if not todo:
            break
        spec = _spec("horovod_elastic", f"{root}/calibrate-{launch}", HOSTS[:todo[0]], tmp / f"calibrate-{launch}",
                     cfg, plan)
        try:
            with LocalCluster(spec) as cluster:
                size = todo[0]
                for k in todo:
                    while size > k:  # shrink: the last host goes at once (a kill; Horovod resets the survivors)
                        cluster.preempt(HOSTS[size - 1], window_s=0.1)
                        size -= 1
                    rates[k] = _measure_ring(cluster, k, cfg)
        except ClusterError as exc:
            if launch == CALIBRATION_LAUNCHES:
                raise bc.BenchError(f"the calibration's plain Horovod job died {launch} times; the last: "
                                    f"{str(exc).splitlines()[0]}") from exc
            log.warning("calibration: plain Horovod's job died (%s); launching it afresh on a ring of %d",
                        str(exc).splitlines()[0], max(k for k in sizes if k not in rates))
    return dict(sorted(rates.items()))


def _measure_ring(cluster: LocalCluster, k: int, cfg: Config) -> float:
    """Samples/s of the cluster's ring of ``k``, over ``calibration_s`` after its warm-up."""
    print(f"calibrating a ring of {k} ...", file=sys.stderr, flush=True)
    since = time.time()
    first = cluster.wait_for(lambda ev: [e["step"] for e in ev if e.get("event") == "first_step"
                                         and e["size"] == k and e["t"] >= since - 1.0], START_TIMEOUT_S,
                             f"a ring of {k}")
    cluster.wait_for_step(max(first) + cfg.warmup_steps, START_TIMEOUT_S, size=k)
    begin = time.time()
    _sleep_until(cluster, begin + cfg.calibration_s)  # the measurement itself: a fixed span of steady training
    points = [p for p in analyze(cluster.events()).progress if p.t >= begin and p.size == k]
    if len(points) < 2 or points[-1].t <= points[0].t:
        raise bc.BenchError(f"a ring of {k} made too little progress in {cfg.calibration_s:g} s to "
                            "measure; raise --calibration-s")
    steps_per_s = (points[-1].step - points[0].step) / (points[-1].t - points[0].t)
    rate = steps_per_s * k * cfg.batch_size
    print(f"r({k}) = {rate:,.1f} samples/s ({steps_per_s:.2f} steps/s)", file=sys.stderr, flush=True)
    return rate


# ------------------------------------------------------------------------------------------------- variants

@dataclass
class Played:
    variant: str
    t0: float
    events: list[dict[str, Any]]
    launches: int = 1


def play_elastic(variant: str, cfg: Config, plan: TracePlan, store: str, workdir: Path) -> Played:
    """ours / horovod_elastic: one job for the whole window, the trace's notices and joins played into it."""
    spec = _spec(variant, store, plan.hosts, workdir, cfg, plan)
    with LocalCluster(spec) as cluster:
        t0 = _first_step(cluster)
        pending = list(plan.actions)
        while pending:
            action = pending[0]
            _sleep_until(cluster, t0 + (action.at_s or 0.0))
            if action.action == "join":
                cluster.add_host(action.target)
            elif action.target in cluster.worker_pids():
                cluster.preempt(action.target, window_s=plan.options.notice_s)
            elif time.time() < t0 + (action.at_s or 0.0) + plan.options.notice_s:
                time.sleep(POLL_S)  # its worker is not up yet (a join in progress): the notice waits for it
                continue
            else:  # no worker came up on it during its window: the VM is gone all the same
                log.warning("%s: no worker on %s during its window; the VM goes without one", variant,
                            action.target)
                cluster.vm_gone(action.target)
            pending.pop(0)
        _sleep_until(cluster, t0 + plan.duration_s)
        if variant == "ours":
            cluster.request_stop()
            cluster.wait(START_TIMEOUT_S)
        else:
            cluster.stop()  # plain Horovod keeps its model in memory: the end of the window ends it
        return Played(variant, t0, cluster.events())


def play_restart(cfg: Config, plan: TracePlan, store: str, workdir: Path) -> Played:
    """Checkpoint-restart: each VM loss ends the job; it is relaunched on the VMs up then, from its checkpoint."""
    window = plan.options.notice_s
    # (seconds into the window, +1 a VM is up | -1 it is gone, host): a VM is gone when its notice window ends
    changes = sorted(((a.at_s or 0.0) + (window if a.action == "notice" else 0.0), 1 if a.action == "join" else -1,
                      a.target) for a in plan.actions)
    up = list(plan.hosts)
    events: list[dict[str, Any]] = []
    t0: float | None = None
    launches = 0
    while True:
        if not up:  # nothing to run on: wait for the next VM, if it comes within the window
            if not changes or t0 is None or changes[0][0] >= plan.duration_s:
                break
            at, d, host = changes.pop(0)
            time.sleep(max(0.0, t0 + at - time.time()))
            (up.append if d > 0 else up.remove)(host)
            continue
        launches += 1
        spec = _spec("restart", store, up, workdir / f"launch-{launches}", cfg, plan)
        with LocalCluster(spec) as cluster:
            if t0 is None:
                t0 = _first_step(cluster)
            end = t0 + plan.duration_s
            lost = False
            while changes and changes[0][0] + t0 < end:
                at, d, host = changes[0]
                _sleep_until(cluster, t0 + at)
                changes.pop(0)
                if d > 0:
                    up.append(host)  # used from the next launch on
                elif host in up:
                    up.remove(host)
                    lost = True
                    # the rest of a correlated wave goes with it
                    while changes and changes[0][0] == at and changes[0][1] < 0:
                        gone = changes.pop(0)[2]
                        if gone in up:
                            up.remove(gone)
                    break
            if not lost:
                _sleep_until(cluster, end)
            cluster.stop()  # the VM's loss (or the window's end) ends the job
            events = cluster.events()
        if not lost:
            break
    if t0 is None:
        raise bc.BenchError("checkpoint-restart never trained: no VM was up at the window's start")
    return Played("restart", t0, events, launches)


# ------------------------------------------------------------------------------------------------- the bench

def measure(played: Played, plan: TracePlan, rates: dict[int, float], cfg: Config) -> Goodput:
    run = analyze(played.events)
    return goodput(played.variant, run, t0=played.t0, duration_s=plan.duration_s, availability=plan.availability,
                   rates=rates, batch_size=cfg.batch_size, final=final_step(run, until=played.t0 + plan.duration_s),
                   notice_windows=[(w.notice_at_s, w.at_s) for w in plan.waves], stalls=save_stalls(played.events),
                   warmup_steps=cfg.warmup_steps)


def run_all(cfg: Config, plan: TracePlan, tmp: Path, plot_to: Path | None) -> dict[str, Any]:
    """Calibrate, then play each variant; ``plot_to``: the results JSON, its plots ``<stem>-<variant>.png``."""
    with bc.store_root("local", tmp, "goodput") as root:
        with LoadSampler() as sampler:
            rates = calibrate(cfg, plan, root, tmp)
        load: dict[str, LoadSummary | None] = {"calibration": sampler.summary()}
        results: dict[str, Goodput] = {}
        launches: dict[str, int] = {}
        errors: dict[str, str] = {}
        for variant in cfg.variants:
            print(f"run {variant} ...", file=sys.stderr, flush=True)
            store, workdir = f"{root}/{variant}", tmp / variant
            try:
                with LoadSampler() as sampler:
                    played = (play_restart(cfg, plan, store, workdir) if variant == "restart"
                              else play_elastic(variant, cfg, plan, store, workdir))
            except bc.BenchError:
                raise
            except Exception as exc:  # a failed variant is reported, the others still count
                log.error("run %s failed: %s", variant, exc)
                errors[variant] = _why(exc)
                load[variant] = sampler.summary()
                continue
            results[variant] = g = measure(played, plan, rates, cfg)
            launches[variant] = played.launches
            load[variant] = sampler.summary()
            print(f"run {variant}: goodput {g.goodput_own_pace:.3f} at its own pace, {g.goodput:.3f} against the "
                  f"calibration (step time x{g.step_time_ratio or float('nan'):.2f}), {g.useful_samples:,} samples, "
                  f"final step {g.final_step}, rolled back {g.steps_rolled_back}, load {_load_text(load[variant])}",
                  file=sys.stderr, flush=True)
            if plot_to is not None:
                plot_to.parent.mkdir(parents=True, exist_ok=True)
                plot_goodput_timeline(plot_to.with_name(f"{plot_to.stem}-{variant}.png"), analyze(played.events),
                                      t0=played.t0, duration_s=plan.duration_s, availability=plan.availability,
                                      title=f"{LABELS[variant]} ({bc.SCRIPTS[cfg.framework].label}): goodput "
                                            f"{g.goodput_own_pace:.2f} at its own pace ({g.goodput:.2f} against "
                                            f"the calibration) on {plan.trace}",
                                      phases=g.lost_phases_s)
    return {"rates": rates, "results": results, "launches": launches, "errors": errors, "load": load}


def _why(exc: Exception) -> str:
    """A failed run in one line: the error's first line, and the job's own last word on why (gloo's abort,
    Horovod's driver giving up) where its log tail has one."""
    lines = f"{type(exc).__name__}: {exc}".splitlines()
    said = [ln.split(">:", 1)[-1].strip() for ln in lines[1:] if "what():" in ln or "failure count" in ln]
    return lines[0].removesuffix("; log tail:") + (f" ({said[-1]})" if said else "")


def _load_text(load: LoadSummary | None) -> str:
    if load is None:
        return "-"
    return f"{load.load_1m:.1f} (max {load.load_1m_max:.1f}), other processes {load.others_cores:.2f} cores"


def summarize(out: dict[str, Any], plan: TracePlan, cfg: Config) -> dict[str, Any]:
    from hvd_transient.gcp.pricing import load_price_table
    from hvd_transient.report.costs import DEFAULT_INSTANCE_TYPE

    price = load_price_table().price(cfg.instance_type or DEFAULT_INSTANCE_TYPE)
    results: dict[str, Goodput] = out["results"]
    spot = {v: cost_per_m_samples(g.useful_samples, plan.availability, plan.duration_s, price.spot_per_hour)
            for v, g in results.items()}
    summary: dict[str, Any] = {SUMMARY_KEY[v]: (results[v].goodput_own_pace if v in results else None)
                               for v in VARIANTS}
    summary |= {f"{v}_goodput_vs_calibration": (results[v].goodput if v in results else None) for v in VARIANTS}
    summary |= {f"{v}_step_time_ratio": (results[v].step_time_ratio if v in results else None) for v in VARIANTS}
    first = next(iter(results), None)
    return summary | {
        "framework": cfg.framework, "trace": plan.describe(),
        "ideal_samples": next(iter(results.values())).ideal_samples if results else None,
        "calibration_samples_per_s": {str(k): r for k, r in out["rates"].items()},
        "cost_per_m_samples_spot": spot.get("ours", spot.get(first) if first else None),
        "cost_per_m_samples_spot_by_variant": spot,
        "cost_per_m_samples_on_demand": on_demand_cost_per_m_samples(out["rates"], price.on_demand_per_hour),
        "instance_type": price.name,
        "ours_steps_rolled_back": results["ours"].steps_rolled_back if "ours" in results else None,
        "ours_leave": cfg.leave, "ours_leave_lead_s": cfg.leave_lead,  # None: measured by the product
        "ours_leave_leads_s": list(results["ours"].leave_leads_s) if "ours" in results else None,
        "ours_host_updates_announced": dict(results["ours"].host_updates_announced) if "ours" in results else None,
        "preemptions": plan.preemptions, "waves": len(plan.waves), "launches": out["launches"],
        "errors": out["errors"], "load": {k: asdict(v) if v else None for k, v in out.get("load", {}).items()},
        "step_time_ratio_by_size": {v: {str(k): r for k, r in ratio_by_size(g.ring_paces).items()}
                                    for v, g in results.items()}}


def table(out: dict[str, Any], summary: dict[str, Any]) -> str:
    rows: list[list[Any]] = []
    loads: dict[str, LoadSummary | None] = out.get("load", {})
    for v in (v for v in VARIANTS if v in out["results"] or v in out["errors"]):
        if v not in out["results"]:  # it ran and failed: the table says so, with why
            rows.append([LABELS[v], "failed", *["-"] * 11, out["errors"][v]])
            continue
        g = out["results"][v]
        lost = "; ".join(f"{k} {s:.0f} s" for k, s in g.lost_phases_s.items() if abs(s) >= 0.5)
        cost = summary["cost_per_m_samples_spot_by_variant"].get(v)
        by_size = ", ".join(f"{k}: {r:.2f}" for k, r in ratio_by_size(g.ring_paces).items())
        load = loads.get(v)
        rows.append([LABELS[v], f"{g.goodput_own_pace:.3f}", f"{g.goodput:.3f}",
                     f"{g.step_time_ratio:.2f}" if g.step_time_ratio else "-", by_size or "-",
                     f"{load.load_1m:.1f} ({load.load_1m_max:.1f})" if load else "-",
                     f"{load.others_cores:.2f}" if load else "-", f"{g.useful_samples:,}", g.final_step,
                     g.steps_rolled_back, g.steps_redone, out["launches"][v], f"{cost:.3f}" if cost else "-",
                     lost or "-"])
    od = summary["cost_per_m_samples_on_demand"]
    cal = loads.get("calibration")
    ideal = summary.get("ideal_samples")
    return (bc.markdown_table(("variant", "goodput at its own pace", "goodput against the calibration",
                               "step time / calibration", "by ring size", "load 1 min (max)",
                               "other processes' cores", "useful samples", "final step", "steps rolled back (max)",
                               "steps trained twice", "launches", "spot $ / M samples", "lost time"), rows)
            + f"\n\nSame work on demand: {od:.3f} $ / M samples ({summary['instance_type']}). r(k) samples/s: "
            + ", ".join(f"{k}: {r:,.1f}" for k, r in out["rates"].items())
            + (f" (ideal {ideal:,.0f} samples)" if ideal else "")
            + (f"; the calibration's load: {_load_text(cal)}" if cal else "") + _leads(summary) + "\n")


def _leads(summary: dict[str, Any]) -> str:
    leads = summary.get("ours_leave_leads_s")
    if not leads:
        return ""
    said = ", ".join("at once" if s is None else f"{s:.1f}" for s in leads)
    announced = summary.get("ours_host_updates_announced") or {}
    lost = ("; Horovod's driver lost its message of " + ", ".join(f"{n} {change}(s)" for change, n in
                                                                   announced.items())
            + ", which rank 0 announced" if announced else "")
    return f". hvd-transient left its VMs this many seconds before their deadlines, in order: {said}{lost}"


def build_parser() -> argparse.ArgumentParser:
    p = bc.parser("goodput", __doc__.splitlines()[0], keep=True, frameworks=True)
    add_trace_arguments(p)
    # by default: the checked-in hour of Oobleck's p3 trace with 6 preemptions for 4 nodes, in 10 minutes
    p.set_defaults(trace=str(DEFAULT_TRACE), trace_start=0.5)
    p.add_argument("--window", type=float, help="notice window in real seconds (default: the --cloud's)")
    bc.add_model_argument(p)
    p.add_argument("--batch-size", type=bc.positive_int, default=32)
    p.add_argument("--steps-per-epoch", type=bc.positive_int, default=100)
    # each variant at its own best: ours needs periodic saves only against losses without notice, so it saves
    # about once a minute here; checkpoint-restart rolls back to its latest save at every preemption
    p.add_argument("--save-every", type=bc.positive_int, default=1000,
                   help="ours: periodic checkpoint interval, steps (about a minute of a ring of 4 here)")
    p.add_argument("--restart-save-every", type=bc.positive_int, default=100,
                   help="checkpoint-restart: periodic checkpoint interval, steps (its rollback at each preemption)")
    p.add_argument("--batches-per-commit", type=bc.positive_int, default=10, help="Horovod in-memory commits")
    p.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step")
    p.add_argument("--calibration-s", type=float, default=30.0, help="seconds of steady training per ring size")
    p.add_argument("--warmup-steps", type=int, default=20, help="steps before a calibration measures")
    p.add_argument("--gloo-timeout-seconds", type=int, default=10, help="how long survivors wait on a dead peer")
    p.add_argument("--cooldown", type=int, nargs=2, default=(1, 2), metavar=("MIN", "MAX"),
                   help="plain Horovod's --blacklist-cooldown-range: a failed host name may come back")
    p.add_argument("--variants", type=bc.csv_list(str, VARIANTS), default=VARIANTS)
    p.add_argument("--instance-type", help="price-table entry for the costs")
    p.add_argument("--leave", choices=LEAVE_MODES, default="near_deadline",
                   help="ours: a worker under notice trains on until --leave-lead seconds before its deadline "
                        "(near_deadline, the product's default) or leaves after its emergency checkpoint (at_notice)")
    p.add_argument("--leave-lead", type=float, default=None,
                   help="ours, with --leave near_deadline: seconds before the deadline that a worker leaves "
                        f"(default: the product's, measured: {DEFAULT_LEAVE_LEAD_S:g} s until a departure was timed)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    bc.check_model(p, args)
    args.cooldown = tuple(args.cooldown)
    args.out = bc.results_path(args, "goodput")
    cfg = Config(**{f.name: getattr(args, f.name) for f in fields(Config)})
    if cfg.calibration_s <= 0 or cfg.warmup_steps < 1:
        p.error("--calibration-s must be > 0 and --warmup-steps >= 1")
    if cfg.leave_lead is not None and not cfg.leave_lead >= 0:
        p.error(f"--leave-lead must be zero or more seconds, not {cfg.leave_lead}")
    plan = load_plan(args, HOSTS, window_s=args.window)  # a TraceError names the line or option
    print(f"trace: {plan.describe()}", file=sys.stderr, flush=True)
    # our workers have normally left before their deadline: the emulator's undeliverable SIGTERM is expected
    logging.getLogger("hvd_transient.testing.metadata_emulator.registry").setLevel(logging.ERROR)
    plot_to = args.out if args.plot else None
    out, elapsed, machine = bc.measured("goodput", lambda tmp: run_all(cfg, plan, tmp, plot_to), args.tmpdir,
                                        args.keep)
    if not out["results"]:
        print("goodput: every variant failed:\n" + "\n".join(out["errors"].values()), file=sys.stderr)
        return 1
    summary = summarize(out, plan, cfg)
    markdown = (f"{bc.SCRIPTS[cfg.framework].describe()}, {cfg.model}. Trace: {summary['trace']}.\n\n"
                f"{table(out, summary)}")
    print(markdown, flush=True)
    rows = [asdict(g) | {"goodput": g.goodput, "goodput_own_pace": g.goodput_own_pace,
                         "load": asdict(load) if (load := out["load"].get(v)) else None}
            for v, g in out["results"].items()]
    return bc.publish(args.out, name="goodput", summary=summary, rows=rows,
                      params=asdict(cfg) | {"trace": args.trace, "options": asdict(plan.options),
                                            "hosts": plan.hosts, "availability": plan.availability,
                                            "actions": [a.describe() for a in plan.actions]},
                      notes=["goodput = samples in the final model / ideal; ideal = integral of r(n(t)) dt, r "
                             "calibrated on plain Horovod rings in the same run",
                             "goodput at its own pace: the ideal at the variant's steady step time (its rings' "
                             "median progress rate after warm-up, weighted median of their step-time ratios "
                             "against the calibration): every variant judged on the machine state it ran on",
                             "load: medians of 5 s samples during each variant's run; other processes' cores = "
                             "cores busy (/proc/stat) less those of this benchmark's processes",
                             f"plots: {args.out.stem}-<variant>.png beside the results"],
                      machine=machine, elapsed=elapsed, markdown=markdown, plot=None)


if __name__ == "__main__":
    sys.exit(main())
