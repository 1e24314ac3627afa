"""How hvd-transient's costs grow with the ring: 2, 4, 8 and 16 local workers.

Per ring size N a ``LocalCluster`` (real elastic ``horovodrun``, a local host alias and an emulated GCE VM
per worker, standby joins) trains small_cnn through :mod:`bench.scale_worker`, which times the callback's
step boundary and logs every store request: steady steps, a worker's notice (notice -> agreed -> emergency
checkpoint committed -> leave -> the survivors' next step), then a new VM joining through its standby. The
same notice runs again on the GCS emulator, up to its commit. A discovery call's CPU is timed at N hosts and
N leaving records. :mod:`hvd_transient.report.scaling` fits the figures and extrapolates.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import bench.common as bc
from hvd_transient.report.analysis import analyze
from hvd_transient.report.scaling import Fit, ScalingInputs, best_fit, first_limits, predict

log = logging.getLogger(__name__)

WORKER = bc.REPO / "bench" / "scale_worker.py"
#: spellings of 127.0.0.1 beyond the cluster's own aliases: each is one more local Horovod host
EXTRA_ALIASES = ("127.0.0.01", "127.0.0.001", "127.00.0.1", "127.000.0.1", "127.0.00.1", "127.0.000.1",
                 "127.00.00.1", "127.000.000.1", "0177.0.0.1", "0177.1", "0x7f.1", "0x7f.0.1", "0x7f.0.0.1")
START_TIMEOUT_S, STEP_TIMEOUT_S, SKIP_STEPS = 900.0, 600.0, 5
CKPT_PREFIXES = ("steps/", "commits/", "lease/")  # a commit's own requests: its step's objects, marker, lease
WRITES = ("put", "put_parts", "delete", "delete_if_generation")
EXTRAPOLATE = (64, 256, 1024)


@dataclass(frozen=True)
class Config:  # field names are the command line's
    sizes: tuple[int, ...]
    stores: tuple[str, ...]
    warmup_steps: int
    after_join_steps: int
    window_s: float
    discovery_calls: int
    discovery_sizes: tuple[int, ...]


def aliases(n: int) -> tuple[str, ...]:
    from hvd_transient.testing.local_cluster import HOST_ALIASES
    hosts = (*HOST_ALIASES, *EXTRA_ALIASES)
    if n > len(hosts):
        raise bc.BenchError(f"at most {len(hosts)} local host aliases, asked for {n}")
    return hosts[:n]


def pct(values: Sequence[float], q: int) -> float | None:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else \
        (values[0] if values else None)


def read_lines(out: Path) -> tuple[list[list[Any]], list[list[Any]]]:
    """The workers' step and request lines, each prefixed with its file's stem (host-pid)."""
    steps: list[list[Any]] = []
    reqs: list[list[Any]] = []
    for path in sorted(out.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            (steps if rec[0] == "step" else reqs).append([path.stem, *rec[1:]])
    return steps, reqs


def step_costs(steps: Sequence[list[Any]], n: int, until: float) -> dict[str, float | None]:
    """ms per step boundary on the ring of ``n`` before ``until``: plain steps and notice rounds, wall and CPU."""
    seen: dict[str, int] = {}
    plain_wall: list[float] = []
    plain_cpu: list[float] = []
    round_wall: list[float] = []
    round_cpu: list[float] = []
    for proc, t, _step, size, wall, cpu, is_round in steps:
        if size != n or t >= until:
            continue
        seen[proc] = seen.get(proc, 0) + 1
        if seen[proc] > SKIP_STEPS:  # a process's first steps trace functions
            (round_wall if is_round else plain_wall).append(wall * 1e3)
            (round_cpu if is_round else plain_cpu).append(cpu * 1e3)
    def med(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return {"step_ms": med(plain_wall), "step_ms_p99": pct(plain_wall, 99), "step_cpu_ms": med(plain_cpu),
            "step_cpu_ms_p99": pct(plain_cpu, 99), "round_ms": med(round_wall), "round_cpu_ms": med(round_cpu),
            "plain_steps": len(plain_wall), "rounds": len(round_wall)}


def requests(reqs: Sequence[list[Any]], since: float, until: float, ckpt_only: bool = False) -> dict[str, Any]:
    """Store calls of every process in [since, until]; ``ckpt_only``: on a checkpoint's objects, marker, lease."""
    mine = [r for r in reqs if since <= r[1] <= until and (not ckpt_only or r[3].startswith(CKPT_PREFIXES))]
    data = [r for r in mine if r[2] in WRITES and "/data/" in r[3]]
    writers = len({r[0] for r in data})
    return {"requests": len(mine), "writes": sum(r[2] in WRITES for r in mine), "data_writers": writers,
            "data_writes_per_writer": len(data) / writers if writers else 0.0}


def ms(later: float | None, earlier: float | None) -> float | None:
    return (later - earlier) * 1e3 if later is not None and earlier is not None else None


def run_ring(n: int, store: str, root: str, work: Path, cfg: Config) -> dict[str, Any]:
    """One job on N workers: steady steps, a worker's notice and departure, then (local) a standby join."""
    from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec
    hosts, spare = aliases(n + 1)[:n], aliases(n + 1)[n]
    out = work / "lines"
    command = (sys.executable, str(WORKER), "--store", f"{root}/ring-{n}", "--model", "small_cnn", "--epochs",
               "100000", "--steps-per-epoch", "100", "--save-every", "100000", "--batch-size", "16",
               "--notice-window", str(cfg.window_s), "--leave", "at_notice")
    spec = LocalClusterSpec(store=f"{root}/ring-{n}", hosts=hosts, command=command, workdir=work, max_np=n,
                            gloo_timeout_s=60, elastic_timeout_s=600, standby=True, notice_s=cfg.window_s,
                            extra_env=(("HVDT_SCALE_OUT", str(out)),))
    join = store == "local"
    with LocalCluster(spec) as cluster:
        cluster.wait_for_step(cfg.warmup_steps, START_TIMEOUT_S, size=n)
        master = analyze(cluster.events()).rings[-1].master_host
        target = [h for h in hosts if h != master][-1]
        notice_at = cluster.preempt(target, window_s=cfg.window_s, kill_at_deadline=True)
        if join:  # a new VM boots with the notice: its standby warms up (seconds) while the ring shrinks
            cluster.add_host(spare)
        survivors = [h for h in hosts if h != target]
        cluster.wait_for(lambda ev: [e for e in ev if e.get("event") == "first_step" and e["t"] > notice_at
                                     and e["host"] in survivors], STEP_TIMEOUT_S + cfg.window_s, "the survivors")
        if join:
            joined = cluster.wait_for(lambda ev: [e["step"] for e in ev if e.get("event") == "first_step"
                                                  and e["host"] == spare], STEP_TIMEOUT_S, f"{spare} to join")
            cluster.wait_for_step(max(joined) + cfg.after_join_steps, STEP_TIMEOUT_S, size=n)
            # a survivor's first step on the grown ring may still be on its way to the log (first_step is not
            # written at once): the stall is read once every survivor's is there
            cluster.wait_for(lambda ev: any(j.host == spare and j.stall_s is not None for j in analyze(ev).joins),
                             STEP_TIMEOUT_S, f"the survivors' first step with {spare}")
        events = cluster.events()
    run = analyze(events)
    p = run.preemption_of(target, after=notice_at)
    if p is None or p.resumed_at is None:
        raise bc.BenchError(f"N={n} {store}: no departure of {target} with the survivors resuming")
    steps, reqs = read_lines(out)
    last = [e["last_step_at"] for e in events if e.get("event") == "reset" and e.get("host") in survivors
            and p.departed_at < e["t"] <= p.resumed_at and e.get("last_step_at") is not None]
    j = next((j for j in run.joins if j.host == spare), None) if join else None
    if j is not None and (j.size != n or j.t < p.resumed_at):
        raise bc.BenchError(f"N={n}: {spare} joined before the survivors of {target}'s departure resumed")
    join_reset = min((e["t"] for e in events if e.get("event") == "reset" and e.get("host") in survivors
                      and j is not None and j.stalled_from is not None and j.stalled_from < e["t"] <= j.t),
                     default=None)
    notice = requests(reqs, notice_at, p.departed_at)
    commit = requests(reqs, p.agreed_at or notice_at, p.commit_at or p.departed_at, ckpt_only=True)
    return {"n": n, "store": store, **step_costs(steps, n, notice_at),
            "notice_to_agreed_ms": ms(p.agreed_at, p.notice_at), "agreed_to_committed_ms": ms(p.commit_at, p.agreed_at),
            "notice_to_committed_ms": ms(p.commit_at, p.notice_at),
            "departure_stall_ms": ms(p.resumed_at, max(last)) if last else None,
            "join_stall_ms": j.stall_s * 1e3 if j is not None and j.stall_s is not None else None,
            # where a stall goes: the survivors' last step -> their reset (Horovod: the interrupt, the driver's
            # rendezvous, hvd.init) -> the new ring (state sync, fit resumes, the plugin's allgather and lease)
            # -> their first step on it
            "departure_phases_ms": {"last_step_to_reset": ms(p.reset_at, max(last) if last else None),
                                    "reset_to_ring": ms(p.ring_at, p.reset_at),
                                    "ring_to_first_step": ms(p.resumed_at, p.ring_at)},
            "join_phases_ms": {"last_step_to_reset": ms(join_reset, j.stalled_from if j else None),
                               "reset_to_ring": ms(j.t if j else None, join_reset),
                               "ring_to_first_step": ms(j.resumed_at if j else None, j.t if j else None)},
            "notice_requests": notice["requests"], "notice_requests_per_rank": notice["requests"] / n,
            "commit_requests": commit["requests"], "commit_writes": commit["writes"],
            "commit_data_writers": commit["data_writers"], "data_writes_per_writer": commit["data_writes_per_writer"],
            "commit_requests_per_rank": commit["requests"] / n}


def discovery_cpu(n: int, root: str, work: Path, calls: int) -> dict[str, float]:
    """CPU of one ``hvd-transient discover`` (the process, and its host search alone) at N hosts and N records."""
    from ckpt_service.stores import open_store
    from hvd_transient.core.membership import publish_leaving
    from hvd_transient.discovery.cli import build_parser, find_hosts
    hosts, url = [f"vm-{i:04d}" for i in range(n)], f"{root}/discovery-{n}"
    state = work / f"hosts-{n}.json"
    state.write_text(json.dumps({"hosts": [{"host": h, "slots": 1} for h in hosts]}))
    store = open_store(url)
    for h in hosts:
        publish_leaving(store, h, deadline=time.time() + 3600)
    store.close()
    argv = ["discover", "--backend", "local", "--state-file", str(state), "--store", url]
    cli = str(Path(sys.executable).parent / "hvd-transient")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(calls):
        subprocess.run([cli, *argv], check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    args = build_parser().parse_args(argv[1:])
    cpu = time.process_time()
    for _ in range(calls):
        if find_hosts(args):
            raise bc.BenchError("discovery listed a host published as leaving")
    return {"discovery_cpu_ms": (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / calls * 1e3,
            "discovery_search_cpu_ms": (time.process_time() - cpu) / calls * 1e3}


def run_all(cfg: Config, tmp: Path) -> list[dict[str, Any]]:
    """A row per ring size and store, and one per discovery size and store (``"n"`` hosts, no ring)."""
    rows = []
    for store in cfg.stores:
        with bc.store_root(store, tmp, "scale") as root:
            for n in cfg.sizes:
                print(f"N={n} {store} ...", file=sys.stderr, flush=True)
                rows.append(run_ring(n, store, root, tmp / f"{store}-{n}", cfg) | {"load": load()})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            for n in sorted({*cfg.sizes, *cfg.discovery_sizes}):
                rows.append({"n": n, "store": store, "discovery_only": True,
                             **discovery_cpu(n, root, tmp, cfg.discovery_calls)})
    return rows


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def model(by: Mapping[tuple[int, str], Mapping[str, Any]], sizes: Sequence[int],
          discovery: Mapping[tuple[int, str], Mapping[str, Any]]) -> dict[str, Any]:
    """The commit-scaling model's inputs (fits: the GCS emulator's commit and discovery where run, else the local
    store's; the local rings' notice rounds) and its predictions."""
    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [(n, by[n, "local"][key]) for n in sizes if by.get((n, "local"), {}).get(key) is not None]
        return [n for n, _ in pts], [v * 1e-3 for _, v in pts]

    store = "gcs" if any(s == "gcs" for _, s in by) else "local"
    rows = [by[n, store] for n in sizes if (n, store) in by]
    # at scale each rank writes its share of a real model's state: the measured writes of one writer's piece
    # per rank, plus what the commit writes once (manifest, lease, marker)
    per_writer = max(r["data_writes_per_writer"] for r in rows)
    fixed = statistics.median(r["commit_writes"] - r["data_writes_per_writer"] * r["commit_data_writers"]
                              for r in rows)
    inp = ScalingInputs(writes_per_rank=per_writer, fixed_writes=fixed,
                        # on separate VMs every rank writes its share on its own cores, in parallel: the commit
                        # takes about what it takes on the smallest ring (here, N ranks share the machine's cores)
                        commit_s=Fit(rows[0]["agreed_to_committed_ms"] * 1e-3, 0.0, "linear"),
                        discovery_cpu_s=best_fit(*zip(*sorted((n, r["discovery_search_cpu_ms"] * 1e-3)
                                                              for (n, s), r in discovery.items() if s == store))),
                        round_s=best_fit(*series("round_cpu_ms")))
    preds = [predict(inp, n) for n in EXTRAPOLATE]
    return {"inputs": asdict(inp), "predictions": [asdict(p) | {"reached": p.reached} for p in preds],
            "first_limits": first_limits(inp), "store": store}


COLUMNS = (("plain step ms (median / p99)", ("step_ms", "step_ms_p99"), ".2f"),
           ("step CPU ms (median / p99)", ("step_cpu_ms", "step_cpu_ms_p99"), ".2f"),
           ("notice round ms (wall / CPU)", ("round_ms", "round_cpu_ms"), ".1f"),
           ("notice -> agreed -> committed ms, local", ("notice_to_agreed_ms", "notice_to_committed_ms"), ",.0f"),
           ("the same, GCS emulator", ("gcs:notice_to_agreed_ms", "gcs:notice_to_committed_ms"), ",.0f"),
           ("departure stall ms", ("departure_stall_ms",), ",.0f"),
           ("standby join stall ms", ("join_stall_ms",), ",.0f"),
           ("store requests per notice (per rank)", ("notice_requests", "notice_requests_per_rank"), ",.1f"),
           ("per commit (per rank)", ("commit_requests", "commit_requests_per_rank"), ",.1f"),
           ("discovery CPU ms per call (search alone)", ("discovery_cpu_ms", "discovery_search_cpu_ms"), ",.1f"))


def cell(by: Mapping[tuple[int, str], Mapping[str, Any]], n: int, keys: Sequence[str], spec: str) -> str:
    vals = []
    for key in keys:
        store, _, name = key.rpartition(":")
        v = by.get((n, store or "local"), {}).get(name)
        vals.append("-" if v is None else f"{v:{spec}}")
    return " / ".join(vals) if len(vals) < 3 else " ".join(vals)


def table(by: Mapping[tuple[int, str], Mapping[str, Any]], sizes: Sequence[int]) -> str:
    rows = [[n, *(cell(by, n, keys, spec) for _, keys, spec in COLUMNS)] for n in sizes]
    return bc.markdown_table(("N", *(c for c, _, _ in COLUMNS)), rows)


def growth(by: Mapping[tuple[int, str], Mapping[str, Any]], sizes: Sequence[int]) -> dict[str, float | None]:
    """Largest over smallest ring's figure, per per-rank figure (the goal: at most 1.5)."""
    keys = ("step_ms", "step_ms_p99", "step_cpu_ms", "round_ms", "round_cpu_ms", "notice_to_committed_ms",
            "departure_stall_ms", "join_stall_ms", "notice_requests_per_rank", "commit_requests_per_rank",
            "discovery_cpu_ms")
    lo, hi = by.get((min(sizes), "local"), {}), by.get((max(sizes), "local"), {})
    return {k: hi[k] / lo[k] if lo.get(k) and hi.get(k) is not None else None for k in keys}


def extrapolation(m: Mapping[str, Any]) -> str:
    rows = [[p["n"], f"{p['commit_writes']:,.0f}", f"{p['write_rate']:,.0f}", f"{p['commit_s']:.2f}",
             f"{p['discovery_s']:.2f}", f"{p['round_s'] * 1e3:.1f}", ", ".join(p["reached"]) or "none"]
            for p in m["predictions"]]
    firsts = "; ".join(f"{k}: N={v}" if v else f"{k}: beyond 65,536" for k, v in m["first_limits"].items())
    head = ("N", "writes per commit", "writes/s", "commit s", "discovery s (20 ms RTT)", "notice round ms",
            "limits reached")
    return f"{bc.markdown_table(head, rows)}\n\nFirst N reaching each limit: {firsts}\n"


def phase_table(by: Mapping[tuple[int, str], Mapping[str, Any]], sizes: Sequence[int]) -> str:
    names = ("last_step_to_reset", "reset_to_ring", "ring_to_first_step")

    def cells(r: Mapping[str, Any], key: str) -> list[str]:
        return ["-" if (v := r.get(key, {}).get(name)) is None else f"{v:,.0f}" for name in names]

    rows = [[n, *cells(by[n, "local"], "departure_phases_ms"), *cells(by[n, "local"], "join_phases_ms")]
            for n in sizes if (n, "local") in by]
    heads = ("last step -> reset", "reset -> ring", "ring -> first step")
    return bc.markdown_table(("N", *(f"departure: {h}" for h in heads), *(f"join: {h}" for h in heads)), rows)


def discovery_table(discovery: Mapping[tuple[int, str], Mapping[str, Any]]) -> str:
    stores = sorted({s for _, s in discovery})
    rows = [[n, *(f"{r['discovery_cpu_ms']:,.1f} / {r['discovery_search_cpu_ms']:,.1f}"
                  if (r := discovery.get((n, s))) else "-" for s in stores)] for n in sorted({n for n, _ in discovery})]
    return bc.markdown_table(("N hosts and leaving records", *(f"CPU ms per call, {s} (search alone)" for s in stores)),
                             rows)


def make_plot(path: Path, by: Mapping[tuple[int, str], Mapping[str, Any]], sizes: Sequence[int],
              discovery: Mapping[tuple[int, str], Mapping[str, Any]]) -> Path | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = (("per-step plugin cost, ms", ("step_ms", "step_ms_p99", "step_cpu_ms", "step_cpu_ms_p99")),
              ("notice round, ms", ("round_ms", "round_cpu_ms")),
              ("notice -> committed, ms",
               ("notice_to_agreed_ms", "notice_to_committed_ms", "gcs:notice_to_committed_ms")),
              ("stalls, ms", ("departure_stall_ms", "join_stall_ms")),
              ("store requests per rank", ("notice_requests_per_rank", "commit_requests_per_rank")),
              ("discovery CPU per call, ms (N hosts, N leaving records)",
               ("discovery_cpu_ms", "discovery_search_cpu_ms", "gcs:discovery_cpu_ms", "gcs:discovery_search_cpu_ms")))
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, keys) in zip(axes.flat, panels):
        source = discovery if title.startswith("discovery") else by
        ns = sorted({n for n, _ in source})
        for key in keys:
            store, _, name = key.rpartition(":")
            pts = [(n, v) for n in ns if (v := source.get((n, store or "local"), {}).get(name)) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=key if store else f"local:{key}")
        ax.set(title=title, xlabel="workers (N)", xscale="log", ylim=(0, None))
        ax.minorticks_off()
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"hvd-transient costs against ring size (local workers sharing {os.cpu_count()} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = bc.parser("scale", __doc__.splitlines()[0], keep=True)
    p.add_argument("--sizes", type=bc.csv_list(int), default=(2, 4, 8, 16), help="ring sizes (workers)")
    p.add_argument("--stores", type=bc.csv_list(str, ("local", "gcs")), default=("local", "gcs"),
                   help="local: the whole scenario; gcs (fake-gcs-server): up to the departure")
    p.add_argument("--warmup-steps", type=bc.positive_int, default=40, help="steps on the ring before the notice")
    p.add_argument("--after-join-steps", type=bc.positive_int, default=10, help="steps on the ring after the join")
    p.add_argument("--window-s", type=float, default=30.0, help="notice window")
    p.add_argument("--discovery-calls", type=bc.positive_int, default=10, help="discovery calls timed per size")
    p.add_argument("--from-json", type=Path, help="no run: the tables, model and plot of an earlier run's results")
    p.add_argument("--discovery-sizes", type=bc.csv_list(int), default=EXTRAPOLATE,
                   help="hosts and leaving records to time discovery at, besides the ring sizes (no ring)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = Config(**{f.name: getattr(args, f.name) for f in fields(Config)})
    most = len(aliases(len(EXTRA_ALIASES))) + len(EXTRA_ALIASES) - 1  # one alias stays spare for the join
    if max(cfg.sizes) > most or cfg.warmup_steps <= 2 * SKIP_STEPS:
        build_parser().error(f"--sizes: at most {most} workers; --warmup-steps: above {2 * SKIP_STEPS}")
    logging.getLogger("hvd_transient.testing.metadata_emulator.registry").setLevel(logging.ERROR)
    if args.from_json:
        earlier = json.loads(args.from_json.read_text())
        rows, elapsed, machine = earlier["rows"], earlier["summary"]["elapsed_s"], earlier["machine"]
        kept: dict[str, Any] = {f.name: (tuple(v) if isinstance(v := earlier["params"][f.name], list) else v)
                                for f in fields(Config)}
        cfg = Config(**kept)
    else:
        rows, elapsed, machine = bc.measured("scale", lambda tmp: run_all(cfg, tmp), args.tmpdir, args.keep)
    discovery = {(r["n"], r["store"]): r for r in rows if r.get("discovery_only")}
    by = {(r["n"], r["store"]): r | discovery[r["n"], r["store"]] for r in rows if not r.get("discovery_only")}
    sizes = sorted({n for n, _ in by})
    m = model(by, sizes, discovery)
    summary = {"growth_2_to_max": growth(by, sizes), "model": m, "load_during": [r["load"] for r in by.values()],
               "discovery": {f"{s}:{n}": r for (n, s), r in discovery.items()},
               "cores": machine["cores"]}
    markdown = (f"small_cnn, {cfg.window_s:g} s notice, {machine['cores']} cores.\n\n{table(by, sizes)}\n\n"
                f"**Where a stall goes** (ms, local store)\n\n{phase_table(by, sizes)}\n\n"
                f"**Discovery** (`hvd-transient discover`, N hosts, N leaving records)\n\n"
                f"{discovery_table(discovery)}\n\n"
                f"**Extrapolation** (`hvd_transient.report.scaling`, inputs from this run)\n\n{extrapolation(m)}")
    print(markdown, flush=True)
    params = asdict(cfg) | ({"measured_by": earlier["params"].get("measured_by", earlier["command"])}
                            if args.from_json else {})
    return bc.publish(args.out, name="scale", summary=summary, rows=rows, params=params, notes=NOTES,
                      machine=machine, elapsed=elapsed, markdown=markdown,
                      plot=(lambda png: make_plot(png, by, sizes, discovery)) if args.plot else None)


NOTES = ["one worker per local host alias (spellings of 127.0.0.1), each an emulated GCE VM; every worker shares "
         "the machine's cores", "step: TransientCallback.on_train_batch_end at steps without a notice round "
         "(wall and the thread's CPU); notice round: the same at steps with one",
         "departure stall: survivors' last step on the old ring -> their first on the new one; join stall: the "
         "same for a standby join", "requests: store calls of every process (event log included) from the notice "
         "to the departure; per commit: those on the checkpoint's objects, marker and lease, agreed -> committed",
         "discovery: `hvd-transient discover` at N hosts and N leaving records (process CPU; search alone: "
         "find_hosts in-process)"]

if __name__ == "__main__":
    sys.exit(main())
