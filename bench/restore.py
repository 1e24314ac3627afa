"""Cold restart from the store: read throughput (:mod:`bench.ckpt_io`'s restore, N writers -> M readers),
and ``examples/keras_elastic.py`` relaunched on 2 workers after a checkpoint by 3 and the loss of the
cluster: ``horovodrun`` start -> first step by the job's events (start, ring, first_step), against a fresh start.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import bench.common as bc
from bench import ckpt_io

log = logging.getLogger(__name__)

EXAMPLE = bc.REPO / "examples" / "keras_elastic.py"
WRITER_HOSTS = ("localhost", "127.0.0.1", "127.0.1")
RESTART_HOSTS = ("localhost", "127.0.0.1")
LAUNCH_TIMEOUT_S = 600.0
NEVER = 10**9  # --save-every / --epochs that a run never reaches
#: (event, what ends there, short name): the job's events every launch passes, in order
LAUNCH_PHASES = (
    ("start", "processes up, imports, hvd.init, model, checkpoint restore (rank 0), state set-up", "start-up"),
    ("ring", "state sync (broadcast from rank 0) + fit starts", "sync"),
    ("first_step", "first step (tracing) completes", "1st step"),
)

Event = dict[str, Any]


@dataclass(frozen=True)
class RestartConfig:  # field names are the command line's
    model: str
    restart_repeats: int
    store: str
    steps_per_epoch: int
    batch_size: int


@dataclass(frozen=True)
class Launch:
    """One launch on the relaunch hosts, measured from horovodrun's start (seconds)."""

    kind: str  # cold_restart | fresh_start
    repeat: int
    first_step_s: float  # horovodrun start -> first completed step (latest rank)
    marks: dict[str, float]  # LAUNCH_PHASES' marks present
    restored_step: int | None


def launch_marks(events: Sequence[Event], launched_at: float, hosts: Sequence[str]) -> dict[str, float]:
    """Seconds after launch by which every rank had logged each of LAUNCH_PHASES' events."""
    marks: dict[str, float] = {}
    for name, _, _ in LAUNCH_PHASES:
        firsts = [min((e["t"] for e in events if e.get("event") == name and e.get("host") == host
                       and e["t"] >= launched_at), default=None) for host in hosts]
        if None not in firsts:
            marks[name] = max(firsts) - launched_at  # type: ignore[type-var]
    return marks


def summarize(rows: Sequence[ckpt_io.Row], cfg: ckpt_io.Config | None, launches: Sequence[Launch],
              checkpoint: Mapping[str, Any] | None) -> dict[str, Any]:
    summary: dict[str, Any] = {"units": "MB = 10**6 bytes; medians over repeats"}
    if cfg is not None and rows:
        largest = bc.size_label(max(cfg.sizes_mb))
        by_size = ckpt_io.summarize(rows, cfg)["restore_mb_per_s"]
        best = {store: max(by_size[store][largest].items(), key=lambda kv: kv[1]) for store in by_size}
        summary.update(restore_size=largest, restore_mb_per_s_by_size=by_size,
                       restore_mb_per_s={store: rate for store, (_, rate) in best.items()},
                       restore_best_combination={store: combo for store, (combo, _) in best.items()})
    if not launches:
        return summary
    order = ("launch", *(name for name, _, _ in LAUNCH_PHASES))
    for kind in ("cold_restart", "fresh_start"):
        if found := [x for x in launches if x.kind == kind]:
            s = bc.spread([x.first_step_s for x in found])
            phases = [bc.phases({"launch": 0.0, **x.marks}, order) for x in found]
            summary.update({f"{kind}_s": s.median, f"{kind}_s_spread": bc.spread_summary(s), f"{kind}_phases_s": {
                name: bc.spread_summary(bc.spread_or_none([p.get(name) for p in phases]))
                for name, _, _ in LAUNCH_PHASES if any(name in p for p in phases)}})
    cold, fresh = summary.get("cold_restart_s"), summary.get("fresh_start_s")
    if cold and fresh:
        summary["cold_minus_fresh_s"] = cold - fresh  # launch noise on a shared machine: either sign
    summary["checkpoint"] = dict(checkpoint or {})
    return summary


def launch_table(summary: Mapping[str, Any]) -> str:
    cold, fresh = summary.get("cold_restart_phases_s", {}), summary.get("fresh_start_phases_s", {})
    body = [[text, bc.fmt_summary(cold.get(name), ".2f"), bc.fmt_summary(fresh.get(name), ".2f")]
            for name, text, _ in LAUNCH_PHASES if name in cold or name in fresh]
    body.append(["**horovodrun start -> first step**", bc.fmt_summary(summary.get("cold_restart_s_spread"), ".1f"),
                 bc.fmt_summary(summary.get("fresh_start_s_spread"), ".1f")])
    header = ["phase (seconds; ends when ...)", "cold restart (restore)", "fresh start (no checkpoint)"]
    return bc.markdown_table(header, body)


def make_plot(path: Path, rows: Sequence[ckpt_io.Row], cfg: ckpt_io.Config | None,
              summary: Mapping[str, Any]) -> Path | None:
    panels = []
    if cfg is not None and rows:
        combos = [(w, r) for w in cfg.writers for r in cfg.readers]
        for store in cfg.stores:
            found = {size: [x.mb_per_s if (x := ckpt_io.find(rows, store=store, size=size, op="restore", writers=w,
                                                              readers=r)) else None for w, r in combos]
                     for size in map(bc.size_label, cfg.sizes_mb)}
            panels.append(bc.Panel(f"restore from {ckpt_io.STORE_NAMES[store]}: N writers -> M readers (MB/s)", "MB/s",
                                   [f"{w}->{r}" for w, r in combos], found))
    if summary.get("cold_restart_phases_s") or summary.get("fresh_start_phases_s"):
        medians = {label: [(summary.get(f"{kind}_phases_s", {}).get(name) or {}).get("median")
                           for name, _, _ in LAUNCH_PHASES]
                   for kind, label in (("cold_restart", "cold restart"), ("fresh_start", "fresh start"))}
        panels.append(bc.Panel("launch -> first step, by phase (s, median)", "seconds",
                               tuple(short for _, _, short in LAUNCH_PHASES), medians))
    return bc.plot_panels(path, panels, title="cold restart from the store", columns=2) if panels else None


def example_command(store: str, rc: RestartConfig, *, save_every: int) -> tuple[str, ...]:
    return (sys.executable, str(EXAMPLE), "--store", store,
            "--model", rc.model, "--epochs", str(NEVER), "--steps-per-epoch", str(rc.steps_per_epoch),
            "--batch-size", str(rc.batch_size), "--save-every", str(save_every), "--batches-per-commit", "10")


def _cluster(store: str, hosts: Sequence[str], command: tuple[str, ...], workdir: Path) -> Any:
    from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec
    return LocalCluster(LocalClusterSpec(store=store, hosts=tuple(hosts), command=command, workdir=workdir))


def write_checkpoint(store: str, rc: RestartConfig, workdir: Path) -> dict[str, Any]:
    """Train on 3 workers until a periodic checkpoint of all 3 commits, then lose the whole cluster."""
    from ckpt_service.manager import CheckpointManager
    from hvd_transient.testing.local_cluster import of
    cmd = example_command(store, rc, save_every=2 * rc.steps_per_epoch)
    with _cluster(store, WRITER_HOSTS, cmd, workdir) as c:
        c.wait_for(lambda ev: of(ev, "commit", kind="periodic", size=3), LAUNCH_TIMEOUT_S,
                   "a checkpoint written by 3 workers")
        c.stop()
    with CheckpointManager(store, max_to_keep=None) as mgr:
        step = mgr.latest_step()
        manifest = mgr.manifest(step) if step is not None else None
    if manifest is None or manifest.world_size != 3:
        raise bc.BenchError(f"{store} has no committed checkpoint written by the 3 workers")
    return {"step": step, "writers": 3, "bytes": manifest.nbytes, "tensors": len(manifest.tensors)}


def measure_launch(kind: str, repeat: int, store: str, rc: RestartConfig, workdir: Path,
                   checkpoint_step: int | None) -> Launch:
    def first_steps(events: list[Event]) -> list[Event]:
        hits = [e for e in events if e.get("event") == "first_step" and e.get("size") == len(RESTART_HOSTS)
                and e["t"] >= c.started_at]
        return hits if len({e["host"] for e in hits}) == len(RESTART_HOSTS) else []

    with _cluster(store, RESTART_HOSTS, example_command(store, rc, save_every=NEVER), workdir) as c:
        c.wait_for(first_steps, LAUNCH_TIMEOUT_S, f"the first step ({kind})")
        launched_at, events = c.started_at, c.events()
        c.stop()
    restored = next((e["restored_step"] for e in events if e.get("event") == "start" and e["t"] >= launched_at
                     and e.get("restored_step") is not None), None)
    if restored != checkpoint_step:
        raise bc.BenchError(f"the {kind} restored step {restored}, expected {checkpoint_step}")
    marks = launch_marks(events, launched_at, RESTART_HOSTS)
    return Launch(kind, repeat, marks["first_step"], marks, restored)


def cold_restart(rc: RestartConfig, tmp: Path) -> tuple[list[Launch], dict[str, Any]]:
    launches: list[Launch] = []
    with bc.store_root(rc.store, tmp, "restore") as root:
        checkpoint = write_checkpoint(store := f"{root}/checkpointed", rc, tmp / "writer")
        print(f"checkpoint: step {checkpoint['step']}, {checkpoint['bytes'] / 1e6:.2f} MB", file=sys.stderr, flush=True)
        for repeat in range(rc.restart_repeats):
            for kind in ("cold_restart", "fresh_start"):  # alternating: load drift hits both alike
                target, expected = (store, checkpoint["step"]) if kind == "cold_restart" else (
                    f"{root}/fresh-{repeat}", None)
                launches.append(launch := measure_launch(kind, repeat, target, rc, tmp / f"{kind}-{repeat}", expected))
                print(f"  {kind:12} #{repeat}: first step {launch.first_step_s:.1f} s after launch",
                      file=sys.stderr, flush=True)
    return launches, checkpoint


def main(argv: Sequence[str] | None = None) -> int:
    p = ckpt_io.state_parser("restore", __doc__, sizes=(100.0, 1000.0), keep=True)
    p.add_argument("--store", default="local", help="cold-restart stores: local, gcs (emulator) or a URL")
    p.add_argument("--model", choices=("small_cnn", "resnet32"), default="small_cnn", help="cold-restart model")
    p.add_argument("--restart-repeats", type=bc.positive_int, default=3, help="cold restarts and fresh starts each")
    p.add_argument("--steps-per-epoch", type=bc.positive_int, default=20)
    p.add_argument("--batch-size", type=bc.positive_int, default=32)
    p.add_argument("--skip-throughput", action="store_true", help="only the cold-restart part")
    p.add_argument("--skip-restart", action="store_true", help="only the read-throughput part")
    args = p.parse_args(argv)
    if args.skip_throughput and args.skip_restart:
        p.error("nothing to do (both parts skipped)")
    cfg = None if args.skip_throughput else ckpt_io.config(args, async_stall=False, save_repeats=1)
    rc = None if args.skip_restart else RestartConfig(**{f.name: getattr(args, f.name) for f in fields(RestartConfig)})

    def both(tmp: Path) -> tuple[list[ckpt_io.Row], list[Launch], dict[str, Any] | None]:
        rows = ckpt_io.run(cfg, tmp) if cfg else []
        launches, checkpoint = cold_restart(rc, tmp) if rc else ([], None)
        return rows, launches, checkpoint

    (rows, launches, checkpoint), elapsed, machine = bc.measured("restore", both, args.tmpdir, args.keep)
    summary = summarize(rows, cfg, launches, checkpoint)
    markdown = []
    if cfg is not None:
        markdown.append("**Read throughput** (MB/s, median (min-max); N writers -> M reader processes, each "
                        f"reading its share, checked bit-exact)\n\n{ckpt_io.restore_table(rows, cfg)}\n")
        print(markdown[-1], flush=True)
    if rc is not None:
        markdown.append(f"**Cold restart** ({rc.model}, checkpoint of {(checkpoint or {}).get('bytes', 0) / 1e6:.2f} "
                        f"MB written by 3 workers, relaunched on 2; seconds, median (min-max))\n\n"
                        f"{launch_table(summary)}\n")
        print(markdown[-1], flush=True)
    notes = ["read throughput: each writer count saves once, each reader count restores it, from a barrier to the "
             "last reader done; local reads are cold",
             "cold restart: horovodrun start to the latest rank's first completed step, from a checkpoint written by "
             "3 workers of examples/keras_elastic.py whose cluster was then killed; fresh start: an empty store"]
    params = {"throughput": None if cfg is None else asdict(cfg), "restart": None if rc is None else asdict(rc),
              "writer_hosts": WRITER_HOSTS, "restart_hosts": RESTART_HOSTS}
    rows_out = [{"part": "throughput", **r.as_dict()} for r in rows] + [{"part": "restart", **asdict(x)}
                                                                        for x in launches]
    return bc.publish(args.out, name="restore", summary=summary, rows=rows_out, params=params, notes=notes,
                      machine=machine, elapsed=elapsed, markdown="\n".join(markdown),
                      plot=(lambda png: make_plot(png, rows, cfg, summary)) if args.plot else None)


if __name__ == "__main__":
    sys.exit(main())
