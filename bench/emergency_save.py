"""Emergency save: from a preemption notice (a barrier the armed writers leave) to a durable commit, N writer
processes (records gathered through a queue, as by Horovod's allgather) against one writing ``np.savez``;
no deadline is set, the largest state that fits a 30 s notice is extrapolated from the best MB/s.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import bench.common as bc
from bench.ckpt_io import OURS, STORE_NAMES, Config, Row, config, run, state_parser

log = logging.getLogger(__name__)

NOTICE_WINDOW_S = 30.0
LEAVE_MARGIN_S = 5.0  # TransientConfig.leave_margin_s: the commit deadline is the notice's end minus this


def by_method(rows: Sequence[Row], store: str, size: str) -> tuple[list[Row], Row | None]:
    """The sharded saves (by writer count) and the single writer's save of one store and size."""
    mine = [r for r in rows if (r.store, r.size, r.op) == (store, size, "save")]
    return [r for r in mine if r.method == OURS[0]], next((r for r in mine if r.method != OURS[0]), None)


def summarize(rows: Sequence[Row], cfg: Config) -> dict[str, Any]:
    largest = bc.size_label(max(cfg.sizes_mb))
    out: dict[str, Any] = {"largest_size": largest, "notice_window_s": NOTICE_WINDOW_S,
                           "commit_deadline_s": NOTICE_WINDOW_S - LEAVE_MARGIN_S, "notice_to_commit_s": {},
                           "single_writer_s": {}, "sharded_speedup_vs_single": {}, "max_state_mb_in_30s": {},
                           "fits_in_30s": {}}
    for store in cfg.stores:
        for size in map(bc.size_label, cfg.sizes_mb):
            ours, single = by_method(rows, store, size)
            out["notice_to_commit_s"].setdefault(store, {})[size] = {str(r.writers): r.seconds.median for r in ours}
            fits = out["fits_in_30s"].setdefault(store, {})
            fits.update({f"{size} {r.writers}w": r.seconds.max <= NOTICE_WINDOW_S for r in ours})
            if single:
                out["single_writer_s"].setdefault(store, {})[size] = single.seconds.median
                fits[f"{size} single"] = single.seconds.max <= NOTICE_WINDOW_S
        ours, single = by_method(rows, store, largest)
        if not ours:
            continue
        fastest = min(ours, key=lambda r: r.seconds.median)
        if single:
            out["sharded_speedup_vs_single"][store] = {
                "best": single.seconds.median / fastest.seconds.median, "best_writers": fastest.writers,
                **{str(r.writers): single.seconds.median / r.seconds.median for r in ours}}
        rate = fastest.mb_per_s.median
        out["max_state_mb_in_30s"][store] = {
            "mb": rate * NOTICE_WINDOW_S, "mb_before_commit_deadline": rate * (NOTICE_WINDOW_S - LEAVE_MARGIN_S),
            "mb_per_s": rate, "writers": fastest.writers, "from_size": largest, "extrapolated": True,
            **({"single_writer_mb": single.mb_per_s.median * NOTICE_WINDOW_S} if single else {})}
    return out


def readme_table(rows: Sequence[Row], cfg: Config) -> str:
    def _cell(row: Row | None) -> str:
        return "-" if row is None else f"{row.seconds.text('{:.2f}')} s, {row.mb_per_s.median:,.0f} MB/s"

    body = []
    for size in map(bc.size_label, cfg.sizes_mb):
        for store in cfg.stores:
            ours, single = by_method(rows, store, size)
            cells = [_cell(next((r for r in ours if r.writers == w), None)) for w in cfg.writers]
            fastest = min(ours, key=lambda r: r.seconds.median) if ours else None
            ratio = (f"x{single.seconds.median / fastest.seconds.median:.2f} ({fastest.writers}w)"
                     if single and fastest else "-")
            body.append([size, STORE_NAMES[store], *cells, *([_cell(single), ratio] if cfg.baselines else [])])
    columns = ["state", "store", *(f"hvd-transient, {w} writer{'s' * (w > 1)}" for w in cfg.writers)]
    return bc.markdown_table(columns + (["single writer np.savez", "speed-up (best)"] if cfg.baselines else []), body)


def capacity_text(summary: Mapping[str, Any]) -> str:
    parts = [f"{STORE_NAMES[store]}: ~{e['mb']:,.0f} MB in 30 s (~{e['mb_before_commit_deadline']:,.0f} MB by the "
             f"commit deadline) at {e['mb_per_s']:,.0f} MB/s with {e['writers']} writer(s)"
             + (f"; single writer ~{e['single_writer_mb']:,.0f} MB" if "single_writer_mb" in e else "")
             for store, e in summary["max_state_mb_in_30s"].items()]
    return ("Largest state that fits the 30 s notice, EXTRAPOLATED linearly from the best configuration's MB/s at "
            f"the largest measured state ({summary['largest_size']}): " + "; ".join(parts) + ".")


def make_plot(path: Path, rows: Sequence[Row], cfg: Config) -> Path | None:
    sizes = tuple(map(bc.size_label, cfg.sizes_mb))
    panels = []
    for store in cfg.stores:
        found = [by_method(rows, store, s) for s in sizes]
        series = {f"hvd-transient, {w} writer(s)": [next((r.seconds for r in ours if r.writers == w), None)
                                                     for ours, _ in found] for w in cfg.writers}
        if cfg.baselines:
            series["single writer np.savez"] = [single.seconds if single else None for _, single in found]
        panels.append(bc.Panel(f"{STORE_NAMES[store]}: notice -> commit (s, log; 30 s window)", "seconds", sizes,
                               series, log_y=True))
    return bc.plot_panels(path, panels, title="emergency save: time from notice to durable commit", columns=2)


def main(argv: Sequence[str] | None = None) -> int:
    p = state_parser("emergency_save", __doc__, sizes=(10.0, 100.0, 500.0, 2000.0), readers=False, large_repeats=1,
                     large_mb=2000.0)
    p.add_argument("--store", help="only this store (directory, file://, gs://bucket/prefix) instead of --stores")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the single-writer baseline")
    args = p.parse_args(argv)
    if args.store and args.store.startswith("memory://"):
        p.error("memory:// stores live in one process; use a directory or gs://")
    cfg = config(args, stores=("url",) if args.store else args.stores, baselines=("savez",) * args.baseline,
                 async_stall=False, gather="queue")
    rows, elapsed, machine = bc.measured("emergency_save", lambda tmp: run(cfg, tmp, args.store), args.tmpdir)
    summary = summarize(rows, cfg)
    table, capacity = readme_table(rows, cfg), capacity_text(summary)
    print(f"\n{table}\n\n{capacity}")
    notes = ["from the armed writers leaving a barrier (the notice) to the last one returning (rank 0: commit marker "
             "written); fits_in_30s: the slowest repeat; max_state_mb_in_30s: extrapolated (MB/s x 30 s), not measured",
             "all writers share this machine's cores (and the emulator's); on a cluster each writer is its own VM"]
    return bc.publish(args.out, name="emergency_save", summary=summary, rows=[r.as_dict() for r in rows],
                      params={**asdict(cfg), "store": args.store or "local directory + GCS emulator"}, notes=notes,
                      machine=machine, elapsed=elapsed,
                      markdown=f"**Notice -> commit** (median (min-max), and MB/s)\n\n{table}\n\n{capacity}\n",
                      plot=(lambda png: make_plot(png, rows, cfg)) if args.plot else None)


if __name__ == "__main__":
    sys.exit(main())
