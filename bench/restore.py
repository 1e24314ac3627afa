"""Cold restart from the store: checkpoint read throughput, and the start-up of a restored job.

Two parts:

* **read throughput** (``--stores local,gcs``): a float32 state of each ``--sizes-mb`` is saved
  once by N writer processes (1, 2, 4) and read back by M reader processes (1, 2, 4), each
  restoring its share with ``partition=(rank, M)``, checked bit-exact; on a local directory
  and on fake-gcs-server through the real google-cloud-storage client. This reuses
  ``bench/ckpt_io.py`` (its worker pool, shared-memory state and restore measurement);
  ``ckpt_io`` itself compares save and restore against ``np.savez``/``np.load``.
* **cold restart** (``--store``): a checkpoint written by 3 workers (``examples/keras_elastic.py``
  on ``LocalCluster``, the whole cluster then lost), relaunched on 2 workers: time from
  ``horovodrun`` starting to the first completed training step, against a fresh start of the
  same job with an empty store. Each launch is broken down (``bench/_hvd_trace.py --startup``):
  worker processes up, ``hvd.init``, the checkpoint restore on rank 0, the first step.

Results: ``bench/results/restore.json``, ``.md`` and ``.png``. Units: 1 MB = 10**6 bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import ckpt_io
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
    spread_summary,
    write_results,
)

log = logging.getLogger("restore")

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
EXAMPLE = REPO / "examples" / "keras_elastic.py"
TRACE = BENCH / "_hvd_trace.py"
DEFAULT_OUT = BENCH / "results" / "restore.json"
WRITER_HOSTS = ("localhost", "127.0.0.1", "127.0.1")
RESTART_HOSTS = ("localhost", "127.0.0.1")
LAUNCH_TIMEOUT_S = 600.0
NEVER = 10**9  # --save-every / --epochs that a run never reaches

Event = dict[str, Any]


# --------------------------------------------------------------------------- part 1: read throughput


class RestoreBench(ckpt_io.Bench):
    """``ckpt_io``'s measurement, narrowed to what a cold restart does: each writer count saves
    once (untimed for the summary), then every reader count restores it ``repeats`` times."""

    def _memcpy(self, label: str, nbytes: int, repeats: int) -> None:
        pass  # not a restore

    def _store(self, store: str, label: str, nbytes: int, repeats: int) -> None:
        from ckpt_service.manager import CheckpointManager

        url = self.url(store, label)
        parent = CheckpointManager(url, max_to_keep=None)
        try:
            self.pool.run("warmup", url=url)
            for writers in self.cfg.writers:
                step = self._saves(url, store, label, nbytes, 1, writers, parent)
                for readers in self.cfg.readers:
                    self._restores(url, store, label, nbytes, repeats, writers, readers, step)
                parent.delete(step)
        finally:
            if not self.pool.broken:
                self.pool.run("forget", url=url)
                if store == "gcs":
                    parent.store.delete_prefix("")  # frees the emulator's memory
            parent.close()
            if store == "local":
                shutil.rmtree(url, ignore_errors=True)


def read_throughput(cfg: ckpt_io.Config, tmp: Path) -> list[ckpt_io.Row]:
    with ckpt_io._maybe_emulator("gcs" in cfg.stores) as emu:  # noqa: SLF001 - the shared start-up
        pool = ckpt_io.WorkerPool(max(max(cfg.writers), max(cfg.readers)))
        try:
            pool.run("configure", io_threads=cfg.io_threads)
            bench = RestoreBench(cfg, pool, tmp, emu)
            for size_mb in cfg.sizes_mb:
                bench.run_size(size_mb)
            return bench.rows
        finally:
            pool.close()


def restore_rows(rows: Sequence[ckpt_io.Row]) -> list[ckpt_io.Row]:
    return [r for r in rows if r.op == "restore"]


def best_restore(rows: Sequence[ckpt_io.Row], store: str, size: str) -> ckpt_io.Row | None:
    found = [r for r in restore_rows(rows) if r.store == store and r.size == size]
    return max(found, key=lambda r: r.mb_per_s.median, default=None)


# --------------------------------------------------------------------------- part 2: cold restart


@dataclass(frozen=True)
class RestartConfig:
    model: str
    repeats: int
    store: str
    steps_per_epoch: int
    batch_size: int


@dataclass(frozen=True)
class Launch:
    """One launch on the relaunch hosts, measured from horovodrun's start (seconds)."""

    kind: str                        # cold_restart | fresh_start
    repeat: int
    first_step_s: float              # horovodrun start -> first completed step (latest rank)
    marks: dict[str, float]          # exec, init_done, restore_begin, restore_end, start, ring, first_step
    restored_step: int | None
    checkpoint_step: int | None


def example_command(store: str, rc: RestartConfig, trace_dir: Path, *, save_every: int) -> tuple[str, ...]:
    return (sys.executable, str(TRACE), "worker", "--startup", str(trace_dir), str(EXAMPLE), "--store", store,
            "--model", rc.model, "--epochs", str(NEVER), "--steps-per-epoch", str(rc.steps_per_epoch),
            "--batch-size", str(rc.batch_size), "--save-every", str(save_every), "--batches-per-commit", "10")


def _read_trace(trace_dir: Path) -> list[Event]:
    out: list[Event] = []
    for path in trace_dir.glob("*.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return sorted(out, key=lambda e: e["t"])


def launch_marks(events: Sequence[Event], trace: Sequence[Event], launched_at: float,
                 hosts: Sequence[str]) -> dict[str, float]:
    """Seconds after launch by which every rank passed each point (restore: rank 0 only)."""
    marks: dict[str, float] = {}

    def latest(source: Sequence[Event], kind: str) -> float | None:
        times = []
        for host in hosts:
            found = [e["t"] for e in source if e.get("event") == kind and e.get("host") == host
                     and e["t"] >= launched_at]
            if not found:
                return None
            times.append(min(found))
        return max(times) - launched_at

    for name, source in (("exec", trace), ("init_done", trace), ("start", events), ("ring", events),
                         ("first_step", events)):
        t = latest(source, name)
        if t is not None:
            marks[name] = t
    for name in ("restore_begin", "restore_end"):
        found = [e["t"] for e in trace if e.get("event") == name and e["t"] >= launched_at]
        if found:
            marks[name] = min(found) - launched_at
    return marks


LAUNCH_PHASES = (
    ("exec", "horovodrun + discovery + worker interpreters up"),
    ("init_done", "imports (TensorFlow, Horovod) + hvd.init"),
    ("restore_begin", "model built and compiled"),
    ("restore_end", "checkpoint restore (rank 0)"),
    ("start", "KerasState + callback set-up"),
    ("ring", "state sync (broadcast from rank 0) + fit starts"),
    ("first_step", "first step (tracing) completes"),
)
SHORT = {"exec": "procs up", "init_done": "hvd.init", "restore_begin": "model", "restore_end": "restore",
         "start": "state", "ring": "sync", "first_step": "1st step"}


def launch_phases(marks: Mapping[str, float]) -> dict[str, float]:
    """Seconds of each phase: the gap to the previous mark present."""
    out: dict[str, float] = {}
    prev = 0.0
    for name, _text in LAUNCH_PHASES:
        t = marks.get(name)
        if t is None:
            continue
        out[name] = max(0.0, t - prev)
        prev = max(prev, t)
    return out


def _cluster(store: str, hosts: Sequence[str], command: tuple[str, ...], workdir: Path) -> Any:
    from hvd_transient.testing.local_cluster import LocalCluster, LocalClusterSpec

    return LocalCluster(LocalClusterSpec(store=store, hosts=tuple(hosts), command=command, workdir=workdir))


def _first_steps(cluster: Any, size: int) -> Any:
    def found(ev: list[Event]) -> list[Event]:
        hits = [e for e in ev if e.get("event") == "first_step" and e.get("size") == size
                and e["t"] >= cluster.started_at]
        return hits if len({e["host"] for e in hits}) == size else []
    return found


def write_checkpoint(store: str, rc: RestartConfig, workdir: Path) -> int:
    """Train on 3 workers until a periodic checkpoint of all 3 commits, then lose the whole cluster."""
    from ckpt_service.manager import CheckpointManager
    from hvd_transient.testing.local_cluster import of

    save_every = 2 * rc.steps_per_epoch
    cmd = example_command(store, rc, workdir / "trace", save_every=save_every)
    with _cluster(store, WRITER_HOSTS, cmd, workdir) as c:
        c.wait_for(lambda ev: of(ev, "commit", kind="periodic", size=3), LAUNCH_TIMEOUT_S,
                   "a checkpoint written by 3 workers")
        c.stop()
    with CheckpointManager(store, max_to_keep=None) as mgr:
        step = mgr.latest_step()
        if step is None:
            raise BenchError(f"no committed checkpoint in {store} after the 3-worker run")
        manifest = mgr.restore(step).manifest
        if manifest.world_size != 3:
            raise BenchError(f"latest checkpoint of {store} was written by {manifest.world_size} workers, not 3")
    return step


def measure_launch(kind: str, repeat: int, store: str, rc: RestartConfig, workdir: Path,
                   checkpoint_step: int | None) -> Launch:
    cmd = example_command(store, rc, workdir / "trace", save_every=NEVER)
    with _cluster(store, RESTART_HOSTS, cmd, workdir) as c:
        firsts = c.wait_for(_first_steps(c, len(RESTART_HOSTS)), LAUNCH_TIMEOUT_S, f"the first step ({kind})")
        launched_at = c.started_at
        # the first step's event may still be buffered in a rank; the start events are flushed at once
        events = c.events()
        c.stop()
    starts = [e for e in events if e.get("event") == "start" and e["t"] >= launched_at]
    restored = next((e.get("restored_step") for e in starts if e.get("restored_step") is not None), None)
    if kind == "cold_restart" and restored != checkpoint_step:
        raise BenchError(f"the relaunch restored step {restored}, expected {checkpoint_step}")
    if kind == "fresh_start" and restored is not None:
        raise BenchError(f"the fresh start restored step {restored} from an empty store")
    marks = launch_marks(events, _read_trace(workdir / "trace"), launched_at, RESTART_HOSTS)
    first = max(e["t"] for e in firsts) - launched_at
    marks["first_step"] = first
    return Launch(kind, repeat, first, marks, restored, checkpoint_step)


@contextlib.contextmanager
def run_store(spec: str, tmp: Path) -> Iterator[Any]:
    """A factory of fresh store URLs: ``local`` (temporary directory), ``gcs`` (fake-gcs-server
    started here) or a URL prefix."""
    counter = iter(range(10**6))
    if spec == "local":
        yield lambda name: str(tmp / "stores" / f"{name}-{next(counter)}")
    elif spec == "gcs":
        from ckpt_service.testing.gcs_emulator import gcs_emulator

        with gcs_emulator() as emu:  # the workers inherit STORAGE_EMULATOR_HOST
            bucket = emu.new_bucket("restore")
            yield lambda name: f"gs://{bucket}/{name}-{next(counter)}"
    else:
        root = spec.rstrip("/")
        yield lambda name: f"{root}/{name}-{next(counter)}"


def cold_restart(rc: RestartConfig, tmp: Path) -> tuple[list[Launch], dict[str, Any]]:
    launches: list[Launch] = []
    with run_store(rc.store, tmp) as new_store:
        store = new_store("checkpointed")
        t0 = time.perf_counter()
        step = write_checkpoint(store, rc, tmp / "writer")
        from ckpt_service.manager import CheckpointManager

        with CheckpointManager(store, max_to_keep=None) as mgr:
            read_t0 = time.perf_counter()
            ckpt = mgr.restore(step)
            read_s = time.perf_counter() - read_t0
            info = {"step": step, "writers": ckpt.manifest.world_size, "bytes": ckpt.manifest.nbytes,
                    "tensors": len(ckpt.tensors), "read_in_bench_process_s": read_s,
                    "write_run_s": time.perf_counter() - t0}
        print(f"checkpoint: step {step}, {info['bytes'] / 1e6:.2f} MB by {info['writers']} workers",
              file=sys.stderr, flush=True)
        for repeat in range(rc.repeats):
            for kind in ("cold_restart", "fresh_start"):  # alternate: load drift hits both alike
                target = store if kind == "cold_restart" else new_store("fresh")
                launch = measure_launch(kind, repeat, target, rc, tmp / f"{kind}-{repeat}",
                                        step if kind == "cold_restart" else None)
                launches.append(launch)
                print(f"  {kind:12} #{repeat}: first step {launch.first_step_s:.1f} s after launch",
                      file=sys.stderr, flush=True)
    return launches, info


# --------------------------------------------------------------------------- summary & report


def summarize(rows: Sequence[ckpt_io.Row], cfg: ckpt_io.Config | None, launches: Sequence[Launch],
              ckpt_info: Mapping[str, Any] | None) -> dict[str, Any]:
    summary: dict[str, Any] = {"units": "MB = 10**6 bytes; medians over repeats"}
    if cfg is not None and rows:
        largest = ckpt_io.size_label(max(cfg.sizes_mb))
        full = ckpt_io.summarize(rows, cfg)
        summary["restore_mb_per_s_by_size"] = full["restore_mb_per_s"]
        summary["restore_mb_per_s"] = {}
        summary["restore_best_combination"] = {}
        for store in cfg.stores:
            best = best_restore(rows, store, largest)
            if best is not None:
                summary["restore_mb_per_s"][store] = best.mb_per_s.median
                summary["restore_best_combination"][store] = f"{best.extra['writers']}->{best.extra['readers']}"
        summary["restore_size"] = largest
    if launches:
        by_kind: dict[str, list[Launch]] = {}
        for launch in launches:
            by_kind.setdefault(launch.kind, []).append(launch)
        for kind, key in (("cold_restart", "cold_restart_s"), ("fresh_start", "fresh_start_s")):
            found = by_kind.get(kind, [])
            if found:
                s = spread([x.first_step_s for x in found])
                summary[key] = s.median
                summary[f"{key}_spread"] = spread_summary(s)
                phases = [launch_phases(x.marks) for x in found]
                summary[f"{kind}_phases_s"] = {
                    name: spread_summary(spread([p[name] for p in phases if name in p]))
                    for name, _ in LAUNCH_PHASES if any(name in p for p in phases)}
        cold, fresh = summary.get("cold_restart_s"), summary.get("fresh_start_s")
        if cold and fresh:
            # launch-to-launch noise on a shared machine is seconds: this difference can have either sign
            summary["cold_minus_fresh_s"] = cold - fresh
        restore_s = [x.marks["restore_end"] - x.marks["restore_begin"] for x in by_kind.get("cold_restart", [])
                     if "restore_begin" in x.marks and "restore_end" in x.marks]
        if restore_s:
            # the restore itself, timed inside rank 0: its share of the cold restart's start-up
            summary["restore_in_worker_s"] = spread_summary(spread(restore_s))
            if cold:
                summary["restore_share_of_cold_restart"] = spread(restore_s).median / cold
        summary["checkpoint"] = dict(ckpt_info or {})
    return summary


def _rate(row: ckpt_io.Row | None) -> str:
    return ckpt_io._rate(row)  # noqa: SLF001 - the same cell format as ckpt_io's tables


def throughput_table(rows: Sequence[ckpt_io.Row], cfg: ckpt_io.Config) -> tuple[list[str], list[list[str]]]:
    combos = [(w, r) for w in cfg.writers for r in cfg.readers]
    header = ["state", "store", *(f"{w}->{r}" for w, r in combos), "best"]
    body = []
    names = {"local": "local dir", "gcs": "GCS emulator"}
    for size in (ckpt_io.size_label(s) for s in cfg.sizes_mb):
        for store in cfg.stores:
            cells = [_rate(ckpt_io._find(restore_rows(rows), store=store, size=size,  # noqa: SLF001
                                         procs=f"{w}w -> {r}r")) for w, r in combos]
            best = best_restore(rows, store, size)
            body.append([size, names[store], *cells,
                         f"{best.extra['writers']}->{best.extra['readers']}" if best else "-"])
    return header, body


def _fmt(s: Mapping[str, Any] | None, digits: int = 1) -> str:
    if not s:
        return "-"
    if s["n"] < 2:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def launch_table(summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["phase (seconds; ends when ...)", "cold restart (restore)", "fresh start (no checkpoint)"]
    cold, fresh = summary.get("cold_restart_phases_s", {}), summary.get("fresh_start_phases_s", {})
    body = [[text, _fmt(cold.get(name), 2), _fmt(fresh.get(name), 2)] for name, text in LAUNCH_PHASES
            if name in cold or name in fresh]
    body.append(["**horovodrun start -> first step**", _fmt(summary.get("cold_restart_s_spread")),
                 _fmt(summary.get("fresh_start_s_spread"))])
    return header, body


def make_plot(path: Path, rows: Sequence[ckpt_io.Row], cfg: ckpt_io.Config | None,
              summary: Mapping[str, Any]) -> Path | None:
    panels = []
    if cfg is not None and rows:
        combos = [(w, r) for w in cfg.writers for r in cfg.readers]
        for store, title in (("local", "local directory"), ("gcs", "fake-gcs-server")):
            if store not in cfg.stores:
                continue
            series, errors = {}, {}
            for size in (ckpt_io.size_label(s) for s in cfg.sizes_mb):
                found = [ckpt_io._find(restore_rows(rows), store=store, size=size,  # noqa: SLF001
                                       procs=f"{w}w -> {r}r") for w, r in combos]
                series[size] = [f.mb_per_s.median if f else None for f in found]
                errors[size] = [(f.mb_per_s.min, f.mb_per_s.max) if f else None for f in found]
            panels.append(Panel(f"restore from {title}: N writers -> M readers (MB/s)", "MB/s",
                                tuple(f"{w}->{r}" for w, r in combos), series, errors))
    if summary.get("cold_restart_phases_s") or summary.get("fresh_start_phases_s"):
        names = [n for n, _ in LAUNCH_PHASES]
        series = {label: [(summary.get(f"{kind}_phases_s", {}).get(n) or {}).get("median") for n in names]
                  for kind, label in (("cold_restart", "cold restart"), ("fresh_start", "fresh start"))}
        panels.append(Panel("launch -> first step, by phase (s, median)", "seconds",
                            tuple(SHORT[n] for n in names), series))
    if not panels:
        return None
    return plot_panels(path, panels, title="cold restart from the store", columns=2)


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="restore",
        description="Cold restart: checkpoint read throughput (N writers -> M readers, local and GCS "
                    "emulator) and the start-up of a job restored on 2 workers from a checkpoint written "
                    "by 3, against a fresh start.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes-mb", type=csv_list(float), default=(100.0, 1000.0), help="state sizes for read throughput")
    p.add_argument("--writers", type=csv_list(int), default=(1, 2, 4))
    p.add_argument("--readers", type=csv_list(int), default=(1, 2, 4))
    p.add_argument("--stores", type=csv_list(str, ("local", "gcs")), default=("local", "gcs"),
                   help="stores for read throughput")
    p.add_argument("--repeats", type=int, default=3, help="restores per writer/reader combination")
    p.add_argument("--large-repeats", type=int, default=2, help="repeats for states of at least --large-mb")
    p.add_argument("--large-mb", type=float, default=1000.0)
    p.add_argument("--io-threads", type=int, default=8, help="CheckpointManager io_threads per process")
    p.add_argument("--store", default="local",
                   help="cold-restart store: 'local' (temporary directory), 'gcs' (fake-gcs-server started "
                        "here) or a URL prefix (directory, file://, gs://bucket/prefix)")
    p.add_argument("--model", choices=("small_cnn", "resnet32"), default="small_cnn", help="cold-restart model")
    p.add_argument("--restart-repeats", type=int, default=3, help="cold restarts and fresh starts each")
    p.add_argument("--steps-per-epoch", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--skip-throughput", action="store_true", help="only the cold-restart part")
    p.add_argument("--skip-restart", action="store_true", help="only the read-throughput part")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (.md and .png beside it)")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--tmpdir", type=Path, default=None, help="parent of the temporary working directory")
    p.add_argument("--keep", action="store_true", help="keep the working directory (logs, traces, stores)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    install_interrupt_handlers()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    if min(args.repeats, args.large_repeats, args.restart_repeats) < 1:
        print("restore: --repeats, --large-repeats and --restart-repeats must be at least 1", file=sys.stderr)
        return 2
    if args.skip_throughput and args.skip_restart:
        print("restore: nothing to do (both parts skipped)", file=sys.stderr)
        return 2
    cfg = None if args.skip_throughput else ckpt_io.Config(
        tuple(args.sizes_mb), tuple(sorted(set(args.writers))), tuple(sorted(set(args.readers))),
        tuple(dict.fromkeys(args.stores)), (), args.repeats, args.large_repeats, args.large_mb, args.io_threads,
        True, False, args.seed)
    rc = None if args.skip_restart else RestartConfig(args.model, args.restart_repeats, args.store,
                                                      args.steps_per_epoch, args.batch_size)
    machine = machine_info()
    print(f"machine: {machine_line(machine)}, load {machine['load_average_at_start']}", file=sys.stderr, flush=True)
    if args.tmpdir is not None:
        args.tmpdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="restore-", dir=args.tmpdir))
    started = time.perf_counter()
    rows: list[ckpt_io.Row] = []
    launches: list[Launch] = []
    ckpt_info: dict[str, Any] | None = None
    try:
        if cfg is not None:
            (tmp / "throughput").mkdir()
            rows = read_throughput(cfg, tmp / "throughput")
        if rc is not None:
            launches, ckpt_info = cold_restart(rc, tmp / "restart")
    except BenchError as exc:
        print(f"restore: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("restore: interrupted; workers and clusters stopped, no results written", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"working directory kept: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - started
    summary = summarize(rows, cfg, launches, ckpt_info)
    summary["elapsed_s"] = elapsed
    md_parts = [f"# restore results\n\nMachine: {machine_line(machine)}, load average at start "
                f"{machine['load_average_at_start']}  \nCommand: `{command_line()}`  \nRun time: {elapsed:.0f} s. "
                "Units: 1 MB = 10**6 bytes.\n"]
    print()
    if cfg is not None:
        header, body = throughput_table(rows, cfg)
        print_table(header, body, title="restore MB/s, N writers -> M readers (median (min-max))")
        md_parts.append("**Read throughput** (MB/s, median (min-max); N writers -> M reader processes, "
                        f"each reading its share, checked bit-exact)\n\n{markdown_table(header, body)}\n")
    if rc is not None:
        header, body = launch_table(summary)
        print_table(header, body, title=f"cold restart on {len(RESTART_HOSTS)} workers of a checkpoint written "
                                        f"by {len(WRITER_HOSTS)} ({rc.model}) vs a fresh start")
        md_parts.append(f"**Cold restart** ({rc.model}, checkpoint of "
                        f"{(ckpt_info or {}).get('bytes', 0) / 1e6:.2f} MB written by 3 workers, relaunched on 2; "
                        f"seconds, median (min-max))\n\n{markdown_table(header, body)}\n")
    notes = [
        "read throughput: the checkpoint is written once per writer count, then each reader count restores it; "
        "the time runs from a barrier to the last reader done; local reads come from the page cache",
        "cold restart: horovodrun start to the latest rank's first completed step; the checkpoint was written by "
        "3 workers of examples/keras_elastic.py whose whole cluster was then killed",
        "fresh start: the same command and hosts with an empty store",
        "machine shared with other jobs: compare medians measured in the same run",
    ]
    params: dict[str, Any] = {"throughput": None if cfg is None
                              else {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
                              "restart": None if rc is None else asdict(rc),
                              "writer_hosts": WRITER_HOSTS, "restart_hosts": RESTART_HOSTS}
    out_rows = ([{"part": "throughput", **r.as_dict()} for r in rows]
                + [{"part": "restart", **asdict(x)} for x in launches])
    out = write_results(args.out, name="restore", summary=summary, rows=out_rows, params=params, notes=notes,
                        machine=machine)
    markdown = "\n".join(md_parts)
    plot = (lambda png: make_plot(png, rows, cfg, summary)) if args.plot else None
    return finish_report(out, markdown, plot, elapsed)


if __name__ == "__main__":
    sys.exit(main())
