"""Timestamps inside Horovod's elastic machinery, for the resume-time breakdown of ``preemption_cost.py``.

Two modes, both wrappers that leave the wrapped program unchanged:

``_hvd_trace.py worker [--startup] TRACE_DIR SCRIPT [ARGS...]``
    Runs a training script (``examples/keras_elastic.py`` or ``bench/plain_elastic_worker.py``)
    as ``__main__`` after wrapping three points of ``horovod.common.elastic``, so each worker
    appends JSON lines to ``TRACE_DIR/trace-<host>-<pid>.jsonl``:

    exec            the interpreter is up (before the script imports TensorFlow)

    hosts_updated   the driver's host-change notification reached this worker (only the
                    coordinator, rank 0, gets it): driver_t (the driver's clock, whole seconds)
    interrupt       ``check_host_updates`` raised HostsUpdatedInterrupt on this rank
    reset_begin     the elastic loop caught the interrupt or failure (after rolling the state
                    back on a failure) and starts ``hvd.shutdown(); hvd.init()``
    reset_done      ``hvd.init()`` returned: the rendezvous on the new ring is complete

    With ``--startup`` (for ``bench/restore.py``; imports TensorFlow and hvd_transient.keras
    before the script does, which it would do anyway) also:

    init_done       the first ``hvd.init()`` returned
    restore_begin   ``hvd_transient.keras.restore_model`` called (rank 0 of a cold start)
    restore_end     it returned: step (None without a checkpoint)

``_hvd_trace.py discover LOG CLI [ARGS...]``
    Host discovery as ``horovodrun`` runs it each second: runs the console script ``CLI``
    (``hvd-transient``) with ARGS in this process and appends one JSON line per call to LOG
    (start and end time, exit code, the hosts printed), so the benchmark sees when discovery
    stopped listing a leaving host. LocalCluster's discovery script runs it when
    ``HVDT_CLI`` is set to ``python _hvd_trace.py discover LOG hvd-transient``.

Events are appended to local files (one small write each), not to the run's store.
:func:`read_jsonl` reads them back and :func:`departure_marks` turns them into the moments of a
departure that only Horovod's internals show.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

USAGE = ("usage: _hvd_trace.py worker [--startup] TRACE_DIR SCRIPT [ARGS...]\n"
         "       _hvd_trace.py discover LOG CLI [ARGS...]")


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


class Tracer:
    def __init__(self, trace_dir: Path) -> None:
        self.host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        self.path = trace_dir / f"trace-{self.host}-{os.getpid()}.jsonl"

    def __call__(self, kind: str, **fields: Any) -> None:
        _append(self.path, {"t": time.time(), "event": kind, "host": self.host, "pid": os.getpid(), **fields})

    def install(self) -> None:
        """Wrap Horovod's elastic loop; must run before ``horovod.tensorflow`` is imported."""
        import horovod.common.elastic as elastic
        from horovod.common.exceptions import HostsUpdatedInterrupt

        if "horovod.tensorflow.elastic" in sys.modules:
            raise RuntimeError("install the trace before importing horovod.tensorflow: "
                               "it binds run_fn at import time")
        trace = self
        run_fn = elastic.run_fn
        on_hosts_updated = elastic.State.on_hosts_updated
        check_host_updates = elastic.State.check_host_updates

        def traced_run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
            def traced_reset() -> None:
                trace("reset_begin")
                reset()
                trace("reset_done")
            wrapped: Callable[..., Any] = run_fn(func, traced_reset)
            return wrapped

        def traced_on_hosts_updated(state: Any, timestamp: Any, update_res: Any) -> None:
            trace("hosts_updated", driver_t=timestamp, result=int(update_res))
            on_hosts_updated(state, timestamp, update_res)

        def traced_check_host_updates(state: Any) -> None:
            try:
                check_host_updates(state)
            except HostsUpdatedInterrupt:
                trace("interrupt")
                raise

        elastic.run_fn = traced_run_fn
        elastic.State.on_hosts_updated = traced_on_hosts_updated
        elastic.State.check_host_updates = traced_check_host_updates


    def install_startup(self) -> None:
        """Time the first ``hvd.init`` and the checkpoint restore of a cold start."""
        import horovod.tensorflow as hvd_tf
        import horovod.tensorflow.keras as hvd_keras

        import hvd_transient.keras as hvdt

        trace = self
        init, restore_model = hvd_tf.init, hvdt.restore_model

        def traced_init(*args: Any, **kwargs: Any) -> Any:
            result = init(*args, **kwargs)
            trace("init_done")
            return result

        def traced_restore_model(model: Any, store: str) -> Any:
            trace("restore_begin")
            restored = restore_model(model, store)
            trace("restore_end", step=restored.get("step") if restored else None)
            return restored

        # the script calls hvd.init through horovod.tensorflow.keras; elastic_state looks
        # restore_model up in its module at call time
        hvd_keras.init = traced_init
        hvdt.restore_model = traced_restore_model


def read_jsonl(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every record of these files (trace or discovery), sorted by time; torn lines are skipped."""
    out: list[dict[str, Any]] = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return sorted(out, key=lambda e: e.get("t", 0.0))


def _latest_first(trace: Sequence[dict[str, Any]], kind: str, hosts: Iterable[str], after: float) -> float | None:
    """When every host had recorded its first ``kind`` at or after ``after`` (None: one never did)."""
    firsts = [next((e["t"] for e in trace if e.get("event") == kind and e.get("host") == h and e["t"] >= after),
                   None) for h in hosts]
    return max(t for t in firsts if t is not None) if firsts and None not in firsts else None


def departure_marks(trace: Sequence[dict[str, Any]], discovery: Sequence[dict[str, Any]], *, host: str,
                    survivors: Iterable[str], left: float, graceful: bool) -> dict[str, float]:
    """Horovod-internal moments after ``host`` left at ``left`` (pure).

    graceful (published as leaving): ``discovery`` (the first successful discovery call that ended
    after the departure without the host; it may have started before), ``notified`` (the driver's
    notification reached the coordinator), ``interrupt`` (every survivor raised HostsUpdatedInterrupt);
    else ``failure_detected`` (the first survivor caught the failure). Both: ``rendezvous`` (every
    survivor's ``hvd.init`` returned on the new ring).
    """
    survivors = tuple(survivors)
    marks: dict[str, float | None] = {}
    if graceful:
        marks["discovery"] = next((d["end"] for d in discovery if d["end"] >= left and d.get("code") == 0
                                   and host not in d["hosts"]), None)
        marks["notified"] = next((e["t"] for e in trace if e.get("event") == "hosts_updated" and e["t"] >= left),
                                 None)
        marks["interrupt"] = _latest_first(trace, "interrupt", survivors, left)
    else:
        marks["failure_detected"] = next((e["t"] for e in trace if e.get("event") == "reset_begin"
                                          and e.get("host") in survivors and e["t"] >= left), None)
    marks["rendezvous"] = _latest_first(trace, "reset_done", survivors, left)
    return {k: v for k, v in marks.items() if v is not None}


def discovery_stats(runs: Sequence[Sequence[dict[str, Any]]], driver_sleep_s: float) -> dict[str, Any]:
    """How often Horovod's driver really ran discovery (``interval_s``), how long a call took in-process
    and the start-up around it (from one call's end to the next one's start, less the driver's sleep:
    bash, Python and the imports of the discovery command); median/min/max/n of each."""
    def summary(values: Sequence[float]) -> dict[str, float] | None:
        return {"median": statistics.median(values), "min": min(values), "max": max(values),
                "n": len(values)} if values else None

    pairs = [(a, b) for calls in runs for a, b in zip(calls, calls[1:])]
    return {"driver_sleep_s": driver_sleep_s,
            "interval_s": summary([b["t"] - a["t"] for a, b in pairs]),
            "call_in_process_s": summary([c["end"] - c["t"] for calls in runs for c in calls]),
            "start_up_s": summary([b["t"] - a["end"] - driver_sleep_s for a, b in pairs])}


def run_worker(trace_dir: str, script: str, args: Sequence[str], *, startup: bool = False) -> None:
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    tracer = Tracer(Path(trace_dir))
    tracer("exec")
    tracer.install()
    if startup:
        tracer.install_startup()
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def run_discovery(log: str, cli: str, args: Sequence[str]) -> int:
    """One discovery call, recorded; the hosts go to stdout exactly as the CLI printed them."""
    from hvd_transient.cli import main as cli_main  # the console script's own entry point

    del cli  # the entry point is imported, not exec'd: same code, same process start-up
    started = time.time()
    out = io.StringIO()
    code = 1
    try:
        with contextlib.redirect_stdout(out):
            code = int(cli_main(list(args)) or 0)
    finally:
        printed = out.getvalue()
        sys.stdout.write(printed)
        sys.stdout.flush()
        _append(Path(log), {"t": started, "end": time.time(), "code": code,
                            "hosts": [line.split(":")[0] for line in printed.split()]})
    return code


def main(argv: Sequence[str]) -> int:
    startup = len(argv) > 1 and argv[0] == "worker" and argv[1] == "--startup"
    if startup:
        argv = [argv[0], *argv[2:]]
    if len(argv) < 3 or argv[0] not in ("worker", "discover"):
        print(USAGE, file=sys.stderr)
        return 2
    mode, target, program, *rest = argv
    if mode == "worker":
        run_worker(target, program, rest, startup=startup)
        return 0
    return run_discovery(target, program, rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
