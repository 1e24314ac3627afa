"""`hvd-transient ckpt ...`: the operator's view of a checkpoint store.

    hvd-transient ckpt ls URL [--json]
    hvd-transient ckpt inspect URL [--step N] [--json]
    hvd-transient ckpt verify URL [--step N] [--json]     exit 1 on any corruption
    hvd-transient ckpt gc URL --keep K
    hvd-transient ckpt export URL --step N OUT.npz
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import zipfile
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
from numpy.lib.format import write_array
from numpy.typing import NDArray

from ckpt_service.arguments import checked_step
from ckpt_service.errors import BadStepError, BadTensorNameError, CheckpointError, NothingToRestoreError
from hvd_transient.commandline import (
    ArgumentParser,
    command,
    existing_store_url,
    non_negative_int,
    output_file,
    positive_int,
)

if TYPE_CHECKING:
    from ckpt_service.manager import CheckpointManager

PROG = "hvd-transient ckpt"


def checkpoint_step(text: str) -> int:
    """argparse type: a step the store's keys can hold (0 to 10**12 - 1); a longer one is refused
    here, naming ``--step``, rather than becoming a file name the file system refuses."""
    try:
        return checked_step(non_negative_int(text))
    except BadStepError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _manager(url: str) -> CheckpointManager:
    from ckpt_service.manager import CheckpointManager  # zarr only for commands that read checkpoints

    return CheckpointManager(url, max_to_keep=None)


def _step(mgr: CheckpointManager, step: int | None) -> int:
    if step is not None:
        return step
    latest = mgr.latest_step()
    if latest is None:
        raise NothingToRestoreError(_nothing_committed(mgr.url))
    return int(latest)


def _nothing_committed(url: str) -> str:
    return f"no committed checkpoint in {url}: check the URL, or wait for the job's first checkpoint"


def cmd_ls(args: argparse.Namespace) -> int:
    mgr = _manager(args.url)
    rows: list[dict[str, Any]] = []
    for step in mgr.all_steps():
        try:
            m = mgr.manifest(step)
            rows.append({"step": step, "bytes": m.nbytes, "tensors": len(m.tensors),
                         "writers": m.world_size, "created_at": m.created_at, "ok": True})
        except CheckpointError as exc:
            rows.append({"step": step, "ok": False, "error": str(exc)})
    if args.json:
        print(json.dumps({"url": mgr.url, "steps": rows}, indent=2))
    elif not rows:
        print(f"no committed checkpoints in {mgr.url}")
    else:
        print(f"{'step':>10}  {'MB':>10}  {'tensors':>7}  {'writers':>7}")
        for r in rows:
            if r["ok"]:
                print(f"{r['step']:>10}  {r['bytes'] / 1e6:>10.2f}  {r['tensors']:>7}  {r['writers']:>7}")
            else:
                print(f"{r['step']:>10}  UNREADABLE: {r['error']}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    mgr = _manager(args.url)
    step = _step(mgr, args.step)
    m = mgr.manifest(step)
    marker = mgr.commit_marker(step)
    if args.json:
        body = asdict(m)
        body["commit"] = asdict(marker)
        print(json.dumps(body, indent=2))
        return 0
    print(f"step {m.step}  format v{m.format_version}  writers {m.world_size}  {m.nbytes / 1e6:.2f} MB  "
          f"lease fence {marker.fence} (save began at {marker.based_on})")
    print(f"metadata: {json.dumps(m.metadata)}")
    for t in m.tensors:
        print(f"  {t.name:<50} {str(list(t.shape)):<20} {t.dtype}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    mgr = _manager(args.url)
    steps = [args.step] if args.step is not None else mgr.all_steps()
    if not steps:
        raise NothingToRestoreError(_nothing_committed(mgr.url))
    reports = [mgr.verify(s) for s in steps]
    if args.json:
        print(json.dumps({"url": mgr.url, "ok": all(r.ok for r in reports),
                          "steps": [asdict(r) for r in reports]}, indent=2))
    else:
        for r in reports:
            print(f"step {r.step}: {'OK' if r.ok else 'CORRUPT'} ({r.bytes_checked / 1e6:.2f} MB verified)")
            for problem in r.problems:
                print(f"  - {problem}")
    return 0 if all(r.ok for r in reports) else 1


def cmd_gc(args: argparse.Namespace) -> int:
    removed = _manager(args.url).gc(keep=args.keep)
    print(f"removed steps: {removed or 'none'}")
    return 0


#: the .npz entry holding the step's metadata (JSON text); no tensor may have this name
METADATA_ENTRY = "__metadata__"


def cmd_export(args: argparse.Namespace) -> int:
    mgr = _manager(args.url)
    names = [t.name for t in mgr.manifest(args.step).tensors]
    if METADATA_ENTRY in names:  # refused before anything is read or written
        raise BadTensorNameError(
            f"step {args.step} has a tensor named {METADATA_ENTRY!r}, the .npz entry that holds the metadata, "
            "so it cannot be exported to .npz; restore it with CheckpointManager.restore() instead")
    ckpt = mgr.restore(step=args.step)
    out = write_npz(args.out, {**ckpt.tensors, METADATA_ENTRY: np.array(json.dumps(ckpt.metadata))})
    print(f"exported step {ckpt.step} ({len(ckpt.tensors)} tensors) to {out}")
    return 0


def write_npz(path: str, arrays: Mapping[str, NDArray[Any]]) -> str:
    """Write ``arrays`` as ``np.savez`` does (``<name>.npy`` entries, no pickles), published whole by a
    rename; returns the file's path (``.npz`` appended if missing, as np.savez does).

    Any key works, unlike ``np.savez(path, **arrays)``, whose own parameter ``file`` a tensor named
    'file' would collide with; tensor names were validated (relative, no '..') at save time.
    """
    out = path if path.endswith(".npz") else path + ".npz"
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, array in arrays.items():
                with archive.open(name + ".npy", "w", force_zip64=True) as entry:
                    write_array(entry, np.asanyarray(array), allow_pickle=False)  # type: ignore[no-untyped-call]
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func: Any, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        # an existing store only: a mistyped directory would otherwise read as an empty store
        p.add_argument("url", type=existing_store_url, help="store URL: a directory, file:///dir, gs://bucket/prefix")
        p.set_defaults(func=func)
        return p

    for name, func, help_text in (("ls", cmd_ls, "list the committed steps"),
                                  ("inspect", cmd_inspect, "show one step's manifest"),
                                  ("verify", cmd_verify, "check stored data against its checksums")):
        p = add(name, func, help_text)
        if name != "ls":
            p.add_argument("--step", type=checkpoint_step, help="a committed step (default: latest; verify: all)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add("gc", cmd_gc, "delete all but the newest K committed steps")
    p.add_argument("--keep", type=positive_int, required=True,
                   help="committed steps to keep, at least 1 (the latest is never deleted)")
    p = add("export", cmd_export, "write one step's tensors to a .npz file")
    p.add_argument("--step", type=checkpoint_step, required=True, help="the committed step to export")
    p.add_argument("out", type=output_file, help="the .npz file to write")
    return parser


@command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main(None))
