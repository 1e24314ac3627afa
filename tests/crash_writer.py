"""Child process for crash-safety tests: commits step 1, then saves step 2 and SIGKILLs
itself just before its N-th store write of that save (N=0: never; print the write count; the
last write is the commit marker's),
or, with ``--inside``, in the middle of it: its data written, not yet published.

With ``--next`` it instead saves the step after the latest committed one (step 1 in an empty
store) under retention (keep 3), so trials run one after another on one store pile up what
killed saves leave behind, as a preempted job restarted many times does.
"""
from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from ckpt_helpers import DelegatingStore, sample_state

from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import LocalStore, ObjectStore, open_store

KEEP = 3


class KillingStore(DelegatingStore):
    """Delegates to a real store; dies like a preempted VM at a chosen write (the conditional
    writes the base class builds on ``put``, the commit marker's among them, are counted too)."""

    def __init__(self, inner: ObjectStore, kill_at: int, inside: bool = False) -> None:
        super().__init__(inner)
        self.kill_at, self.armed, self.puts = kill_at, False, 0
        self.inside = inside
        if inside:  # the local store writes a temp file, then renames it: die between the two
            assert isinstance(inner, LocalStore), "--inside needs a local store"
            write_tmp = inner._write_tmp

            def write_then_die(path: Path, data: bytes) -> Path:
                tmp = write_tmp(path, data)
                if self.armed and self.puts == self.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return tmp

            inner._write_tmp = write_then_die  # type: ignore[method-assign]

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        if self.armed:
            self.puts += 1
            if self.puts == self.kill_at and not self.inside:
                os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.put(key, data, if_generation_match=if_generation_match)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("kill_at", type=int)
    parser.add_argument("--inside", action="store_true", help="die after the temp file, before the rename")
    parser.add_argument("--next", action="store_true", help="save the step after the latest committed one")
    args = parser.parse_args()
    store = KillingStore(open_store(args.url), args.kill_at, inside=args.inside)
    # io_threads=1 makes "the N-th write" a deterministic point of the save
    mgr = CheckpointManager(store, max_to_keep=KEEP if args.next else 1, chunk_bytes=64 * 1024, io_threads=1)
    if args.next:
        step = (mgr.latest_step() or 0) + 1
    else:
        mgr.save(1, sample_state(1, scale=8), {"step": 1})
        step = 2
    store.armed = True
    mgr.save(step, sample_state(step, scale=8), {"step": step})
    print(f"puts={store.puts}", flush=True)


if __name__ == "__main__":
    main()
