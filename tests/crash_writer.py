"""Child process for crash-safety tests: commits step 1, then saves step 2 and SIGKILLs
itself just before its N-th store write of that save (N=0: never; print the write count),
or, with ``inside``, in the middle of it: its data written, not yet published."""
from __future__ import annotations

import os
import signal
import sys

from ckpt_helpers import sample_state

from ckpt_service.manager import CheckpointManager
from ckpt_service.stores import open_store


class KillingStore:
    """Delegates to a real store; dies like a preempted VM at a chosen write."""

    def __init__(self, inner, kill_at: int, inside: bool = False) -> None:
        self._inner, self.kill_at, self.armed, self.puts = inner, kill_at, False, 0
        if inside:  # the local store writes a temp file, then renames it: die between the two
            write_tmp = inner._write_tmp

            def write_then_die(path, data):
                tmp = write_tmp(path, data)
                if self.armed and self.puts == self.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return tmp

            inner._write_tmp = write_then_die
        self.inside = inside

    def put(self, key, data, **kw):
        if self.armed:
            self.puts += 1
            if self.puts == self.kill_at and not self.inside:
                os.kill(os.getpid(), signal.SIGKILL)
        return self._inner.put(key, data, **kw)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def main() -> None:
    url, kill_at = sys.argv[1], int(sys.argv[2])
    store = KillingStore(open_store(url), kill_at, inside=sys.argv[3:] == ["inside"])
    # io_threads=1 makes "the N-th write" a deterministic point of the save
    mgr = CheckpointManager(store, max_to_keep=1, chunk_bytes=64 * 1024, io_threads=1)  # type: ignore[arg-type]
    mgr.save(1, sample_state(1, scale=8), {"step": 1})
    store.armed = True
    mgr.save(2, sample_state(2, scale=8), {"step": 2})
    print(f"puts={store.puts}", flush=True)


if __name__ == "__main__":
    main()
