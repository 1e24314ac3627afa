"""One rank of :mod:`bench.scale` under ``horovodrun``: ``examples/keras_elastic.py``'s job, with the step
boundary of :class:`~hvd_transient.keras.TransientCallback` timed and every store request logged.

Lines go to ``$HVDT_SCALE_OUT/<host>-<pid>.jsonl``, written by the training thread after a step boundary
(twice a second, and at once when the worker leaves: it ends in an abort): ``["step", t, step, size,
wall_s, cpu_s, round]`` per step boundary, ``["req", t, op, key]`` per store request.
"""
from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "keras_elastic.py"
OPS = ("get", "get_into", "get_into_parts", "get_versioned", "stat", "put", "put_parts", "delete",
       "delete_if_generation", "list")
_lines: list[list[Any]] = []
_lock = threading.Lock()


def _record(*line: Any) -> None:
    with _lock:
        _lines.append(list(line))


def _flush(path: Path) -> None:
    with _lock:
        batch = _lines[:]
        del _lines[:]
    if batch:
        with path.open("a") as out:
            out.write("".join(json.dumps(line) + "\n" for line in batch))


_inside = threading.local()  # a store method calling another (put -> put_parts) is one request


def _counted(op: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, key: str = "", *args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "depth", 0) == 0:
            _record("req", time.time(), op, key)
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return method(self, key, *args, **kwargs)
        finally:
            _inside.depth -= 1
    return call


def count_requests(store_url: str) -> None:
    """Log every call of the store class the run's URL opens (the event log's, the checkpoints', the lease's)."""
    cls: type
    if store_url.startswith("gs://"):
        from ckpt_service.stores.gcs import GCSStore as cls
    else:
        from ckpt_service.stores.local import LocalStore as cls
    for op in OPS:
        if op in vars(cls):
            setattr(cls, op, _counted(op, vars(cls)[op]))


def timed_callback(path: Path) -> None:
    """Make ``hvdt.TransientCallback`` (as the example script uses it) the timed subclass."""
    import hvd_transient.keras as hvdt

    class TimedTransientCallback(hvdt.TransientCallback):
        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            rounds = self.impl.notice_rounds if self.impl is not None else 0
            step, size = self._step(), self.impl.comm.size() if self.impl is not None else 0
            wall, cpu = time.perf_counter(), time.thread_time()
            ended = True
            try:
                super().on_train_batch_end(batch, logs)
                ended = self.last_outcome.leaving
            finally:
                _record("step", time.time(), step, size, time.perf_counter() - wall, time.thread_time() - cpu,
                        self.impl is not None and self.impl.notice_rounds > rounds)
                if ended or wall - self._flushed > 0.5:  # an exception: the ring changes, maybe without us
                    _flush(path)
                    self._flushed = wall

        _flushed = 0.0

    setattr(hvdt, "TransientCallback", TimedTransientCallback)


def main() -> None:
    out = Path(os.environ["HVDT_SCALE_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    host = os.environ.get("HOROVOD_HOSTNAME", "host")
    count_requests(sys.argv[sys.argv.index("--store") + 1])
    timed_callback(out / f"{host}-{os.getpid()}.jsonl")
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
