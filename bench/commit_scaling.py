"""How the commit protocol's cost grows with the number of writers.

N ranks (threads, one 64 KiB piece each: protocol cost, not bytes) save one step against fake-gcs-server,
gathering shard records through the store; rank 0 holds the lease and commits. Per N: store requests and
objects by kind, and the commit latency (last record -> commit marker), fitted against N and log2 N.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench import common
from ckpt_service.gather import StoreGather
from ckpt_service.lease import Lease
from ckpt_service.manager import CheckpointManager
from ckpt_service.shard_records import RecordJSON
from ckpt_service.stores.gcs import GCSStore
from ckpt_service.testing.delegating import DelegatingStore

KINDS = ("data", "record", "manifest", "lease", "marker", "other")


def kind_of(key: str) -> str:
    return ("lease" if key.startswith("lease/") else "marker" if key.startswith("commits/")
            else "record" if "/records/" in key else "manifest" if "/manifest." in key
            else "data" if "/data/" in key else "other")


def _counted(op: str, name: str) -> Callable[..., Any]:
    def method(self: CountingStore, key: str = "", *args: Any, **kwargs: Any) -> Any:
        self._count(op, key)
        return getattr(self.inner, name)(key, *args, **kwargs)
    return method


class CountingStore(DelegatingStore):
    """Counts every store call by (operation, object kind) and times record and marker writes."""

    def __init__(self, inner: GCSStore, rtt_s: float = 0.0) -> None:
        super().__init__(inner)
        self.lock, self.rtt_s = threading.Lock(), rtt_s
        self.reset()

    def reset(self) -> None:
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.last_record_at = self.marker_at = 0.0

    def _count(self, op: str, key: str) -> None:
        with self.lock:
            self.calls[(op, kind_of(key))] += 1
        if self.rtt_s:
            time.sleep(self.rtt_s)

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        self._count("put", key)
        generation = self.inner.put(key, data, if_generation_match=if_generation_match)
        with self.lock:
            if kind_of(key) == "record":
                self.last_record_at = max(self.last_record_at, time.perf_counter())
            elif kind_of(key) == "marker":
                self.marker_at = time.perf_counter()
        return generation

    # reads, listings and deletes are counted (as their operation, on their key's kind) and forwarded
    get, get_versioned, stat = (_counted("get", name) for name in ("get", "get_versioned", "stat"))
    list, delete = _counted("list", "list"), _counted("delete", "delete")


def one_save(store: CountingStore, managers: list[CheckpointManager], lease: Lease, step: int,
             read_threads: int) -> dict[str, Any]:
    n = len(managers)
    tensors = {"w": np.full(n * 16384, step, np.float32)}  # 64 KiB per rank: one piece each
    start, gathered = threading.Barrier(n), dict[str, float]()
    attempt = f"scaling-{step}"

    def rank_main(rank: int) -> None:
        inner = StoreGather(store, step, rank, n, attempt=attempt, timeout_s=300.0,
                            read_threads=read_threads)

        def gather(record: RecordJSON) -> list[RecordJSON] | None:
            t0 = time.perf_counter()
            out = inner(record)
            if rank == 0:
                gathered.update(enter=t0, done=time.perf_counter())
            return out

        start.wait()
        managers[rank].save(step, tensors, rank=rank, world_size=n, gather=gather, attempt=attempt,
                            lease=lease if rank == 0 else None)

    store.reset()
    with ThreadPoolExecutor(n) as pool:  # one thread per rank
        failed = [exc for f in [pool.submit(rank_main, r) for r in range(n)] if (exc := f.exception())]
    if failed:
        raise common.BenchError(f"N={n} step {step}: {len(failed)} ranks failed, first: {failed[0]!r}")
    calls = dict(store.calls)
    objects = collections.Counter(kind_of(k) for k in store.inner.list(f"steps/{step:012d}/"))
    by_kind = {k: sum(v for (_op, kind), v in calls.items() if kind == k) for k in KINDS}
    return {
        "config": f"rtt {store.rtt_s * 1e3:g} ms, {read_threads} read threads", "writers": n, "step": step,
        "requests": sum(calls.values()), "requests_by_kind": by_kind,
        "requests_by_op": {op: sum(v for (o, _k), v in calls.items() if o == op)
                           for op in ("put", "get", "list", "delete")},
        "coordinator_record_reads": calls.get(("get", "record"), 0), "lease_writes": calls.get(("put", "lease"), 0),
        "objects": sum(objects.values()) + 1, "record_objects": objects["record"],  # + 1: the commit marker
        "commit_latency_s": store.marker_at - store.last_record_at,
        "gather_after_last_record_s": gathered["done"] - store.last_record_at,
        "gather_s": gathered["done"] - gathered["enter"],
    }


def fit(ns: list[int], ys: list[float]) -> dict[str, Any]:
    """Least squares of y = a + b*x for x = N and x = log2 N; the better one by RMS residual."""
    out: dict[str, Any] = {}
    for name, x in (("linear", np.asarray(ns, float)), ("log2", np.log2(ns))):
        coef, res, *_ = np.polyfit(x, ys, 1, full=True)
        rms = float(np.sqrt(res[0] / len(ns))) if len(res) else 0.0
        out[name] = {"slope_s": float(coef[0]), "intercept_s": float(coef[1]), "rms_s": rms}
    out["better"] = min(("linear", "log2"), key=lambda k: out[k]["rms_s"])
    return out


def run(writers: tuple[int, ...], repeats: int, rtts_ms: tuple[float, ...],
        threads: tuple[int, ...]) -> list[dict[str, Any]]:
    from ckpt_service.testing.gcs_emulator import gcs_emulator
    rows = []
    with gcs_emulator() as emu:
        for n, rtt_ms, read_threads in ((n, r, t) for r in rtts_ms for t in threads for n in writers):
            gcs = GCSStore(emu.new_bucket("scaling"), max_connections=max(32, n))
            store = CountingStore(gcs, rtt_ms / 1e3)
            managers = [CheckpointManager(store, max_to_keep=None, io_threads=1) for _ in range(n)]
            lease = Lease(store, "rank-0")
            lease.acquire()
            try:
                for step in range(1, repeats + 1):
                    rows.append(one_save(store, managers, lease, step, read_threads))
                    r = rows[-1]
                    print(f"{r['config']}: N={n:4d} step {step}: commit {r['commit_latency_s'] * 1e3:7.1f} ms, gather "
                          f"{r['gather_s'] * 1e3:7.1f} ms, {r['requests']} requests, {r['objects']} objects",
                          flush=True)
            finally:
                for m in managers:
                    m.close()
                gcs.close()
    return rows


def main() -> int:
    p = common.parser("commit_scaling", __doc__.splitlines()[0])
    p.add_argument("--writers", type=common.csv_list(int), default=(8, 16, 32, 64, 128, 256))
    p.add_argument("--repeats", type=common.positive_int, default=3)
    p.add_argument("--rtt-ms", type=lambda t: tuple(max(0.0, float(x)) for x in t.split(",")), default=(0.0, 20.0),
                   help="sleep in every store call: a real bucket's round trip (the emulator's is ~1 ms)")
    p.add_argument("--read-threads", type=common.csv_list(int), default=(1, 16), help="coordinator's record reads")
    args = p.parse_args()
    rows, elapsed, machine = common.measured(
        "commit_scaling", lambda _w: run(args.writers, args.repeats, args.rtt_ms, args.read_threads), args.tmpdir)
    cols = ["config", "N", "commit latency ms", "coordinator gather ms", "requests", "requests/writer",
            "record reads", "list calls", "objects", "lease writes"]
    summary: dict[str, Any] = {}
    table, fit_lines = [], []
    for config in dict.fromkeys(r["config"] for r in rows):
        ns = sorted({r["writers"] for r in rows if r["config"] == config})
        per_n = {n: [r for r in rows if r["config"] == config and r["writers"] == n] for n in ns}
        med = {key: {str(n): float(np.median([r[key] for r in per_n[n]])) for n in ns}
               for key in ("commit_latency_s", "gather_after_last_record_s", "gather_s", "requests", "objects",
                           "coordinator_record_reads", "lease_writes")}
        lists = {n: float(np.median([r["requests_by_op"]["list"] for r in per_n[n]])) for n in ns}
        f = fit(ns, [med["commit_latency_s"][str(n)] for n in ns]) if len(ns) > 2 else None
        summary[config] = {**med, "fit_commit_latency": f,
                           "requests_per_writer": {str(n): med["requests"][str(n)] / n for n in ns}}
        table += [[config, n, common.spread([r["commit_latency_s"] * 1e3 for r in per_n[n]]).text(),
                   common.spread([r["gather_s"] * 1e3 for r in per_n[n]]).text(), f"{med['requests'][str(n)]:.0f}",
                   f"{med['requests'][str(n)] / n:.1f}", f"{med['coordinator_record_reads'][str(n)]:.0f}",
                   f"{lists[n]:.0f}", f"{med['objects'][str(n)]:.0f}", f"{med['lease_writes'][str(n)]:.0f}"]
                  for n in ns]
        if f:
            lin, log2 = ({k: v * 1e3 for k, v in f[name].items()} for name in ("linear", "log2"))
            fit_lines.append(f"- {config}: linear {lin['slope_s']:.2f} ms/writer + {lin['intercept_s']:.1f} ms (RMS "
                             f"{lin['rms_s']:.1f} ms); log2 {log2['slope_s']:.1f} ms/doubling + "
                             f"{log2['intercept_s']:.1f} ms (RMS {log2['rms_s']:.1f} ms); better: {f['better']}")
    title = ("**Commit protocol cost per checkpoint** (median (min-max) over repeats; requests: store calls of all "
             "ranks, incl. retention after the commit)")
    fits = "Commit latency vs N, least squares on the medians:\n\n" + "\n".join(fit_lines) + "\n"
    print(markdown := f"{title}\n\n{common.markdown_table(cols, table)}\n\n{fits}", flush=True)
    notes = ["writers are threads of one process sharing one GCS client; all ranks start together",
             "commit latency: last shard record written -> commit marker written (coordinator gather, manifest, "
             "lease fence, marker)", "rtt: a sleep added to every store call, modelling a real bucket's round trip"]

    def plot(path: Path) -> Path | None:
        ns = sorted({r["writers"] for r in rows})
        lat = {c: [v["commit_latency_s"].get(str(n), 0.0) * 1e3 for n in ns] for c, v in summary.items()}
        return common.plot_panels(path, [common.Panel("Commit latency after the last record", "ms",
                                                      tuple(map(str, ns)), lat, log_y=True)],
                                  title="Commit protocol vs writers (N)") if args.plot else None

    return common.publish(args.out, name="commit_scaling", summary=summary, rows=rows,
                          params={"writers": list(args.writers), "repeats": args.repeats, "rtt_ms": list(args.rtt_ms),
                                  "read_threads": list(args.read_threads)}, notes=notes,
                          machine=machine, elapsed=elapsed, markdown=markdown, plot=plot)


if __name__ == "__main__":
    raise SystemExit(main())
