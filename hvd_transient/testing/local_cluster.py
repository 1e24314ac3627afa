"""A transient cluster on one machine: real ``horovodrun`` over local host aliases.

Each host alias (``localhost``, ``127.0.0.1``, ``127.0.1``...) is a separate
Horovod host that starts without ssh, and a separate virtual instance of the
metadata-server emulator, so a "preemption" is exactly what a GCE VM sees: a
notice on its metadata server, then (optionally) SIGTERM to its worker when the
window ends. Host discovery is the real ``launch/discover_hosts.sh`` over a
state file this class rewrites, and drops hosts published as leaving.

With ``LocalClusterSpec(standby=True)`` a VM that appears while the job runs (:meth:`LocalCluster.add_host`,
a preempted VM started again) boots a standby worker for its host
(``python -m hvd_transient.worker --standby``, :mod:`hvd_transient.join.worker`), the job's command
becomes ``python -m hvd_transient.worker SCRIPT ...`` (``command`` must be ``(python, SCRIPT, ...)``)
and discovery holds a new VM back until its standby is ready, as on GCE.

Used by the end-to-end tests, ``hvd-transient demo`` and the benchmarks.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ckpt_service.stores import open_store
from hvd_transient.core.control import clear_stop, request_stop
from hvd_transient.telemetry.events import read_events
from hvd_transient.testing.horovodrun_main import HOROVODRUN
from hvd_transient.testing.metadata_emulator import MetadataEmulator
from hvd_transient.watchers.aws import ENDPOINT_ENV as AWS_ENDPOINT_ENV

log = logging.getLogger(__name__)

#: Names that resolve to this machine's loopback interface, each a distinct local host for Horovod.
HOST_ALIASES = ("localhost", "127.0.0.1", "127.0.1", "127.1", "2130706433", "0x7f000001")

REPO_ROOT = Path(__file__).resolve().parents[2]
DISCOVERY_SCRIPT = REPO_ROOT / "launch" / "discover_hosts.sh"

Event = dict[str, Any]


class ClusterError(RuntimeError):
    """The local cluster did not do what was expected in time."""
    cli_exit_status = 1  # the command ran and failed


@dataclass(frozen=True)
class LocalClusterSpec:
    store: str
    hosts: tuple[str, ...]
    command: tuple[str, ...]            # the training command each worker runs
    workdir: Path
    min_np: int = 1
    max_np: int = 4
    elastic: bool = True
    #: static jobs only: "gloo" or "mpi" (Horovod's elastic mode always uses Gloo)
    controller: str = "gloo"
    #: processes per host alias; more than one only for static jobs (an elastic host is
    #: blacklisted as a whole, so the elastic path keeps one slot per alias)
    slots: int = 1
    #: how long a rank waits on its peers in Gloo: at a join without a standby, or a launch, the others wait
    #: while a new worker imports its framework (10 s and more on a loaded machine); a killed peer's
    #: sockets close at once, so a long wait does not slow the survivors of a kill
    gloo_timeout_s: int = 60
    elastic_timeout_s: int = 60
    extra_env: tuple[tuple[str, str], ...] = ()
    #: metadata-emulator instances that exist from the start (hosts that may join later too)
    instances: tuple[str, ...] = field(default=())
    #: the VMs' configured preemption notice (seconds), as ``cluster up --preemption-notice-duration``
    #: writes it into each VM's metadata; the watchers read it from there
    notice_s: float = 30.0
    #: whose metadata server the workers' watchers poll: "gce" or "aws" (IMDSv2, rebalance recommendations)
    cloud: str = "gce"
    #: extra horovodrun options, e.g. ("--verbose",)
    horovodrun_args: tuple[str, ...] = ()
    #: new VMs boot a standby worker and join once it is ready (``command``: ``(python, SCRIPT, ARGS...)``)
    standby: bool = False
    #: discovery lists a new VM this long after it started even if its standby is not ready
    join_timeout_s: float = 120.0


class LocalCluster:
    def __init__(self, spec: LocalClusterSpec) -> None:
        if spec.controller not in ("gloo", "mpi"):
            raise ValueError(f"controller must be 'gloo' or 'mpi', not {spec.controller!r}")
        if spec.elastic and (spec.controller != "gloo" or spec.slots != 1):
            raise ValueError("an elastic local cluster runs one Gloo slot per host alias "
                             "(Horovod's elastic mode always uses Gloo); use elastic=False for MPI or slots > 1")
        if spec.cloud not in ("gce", "aws"):
            raise ValueError(f"cloud must be 'gce' or 'aws', not {spec.cloud!r}")
        if spec.slots < 1:
            raise ValueError(f"slots must be at least 1, not {spec.slots}")
        if spec.standby and (not spec.elastic or len(spec.command) < 2):
            raise ValueError("standby workers need an elastic cluster and a command (python, SCRIPT, ARGS...)")
        self.spec = spec
        self.store = open_store(spec.store)
        self.state_file = spec.workdir / "hosts.json"
        self.log_path = spec.workdir / "horovodrun.log"
        self.emulator = MetadataEmulator(instances=spec.instances or spec.hosts)
        self.process: subprocess.Popen[bytes] | None = None
        self._hosts = list(spec.hosts)
        self._vm_started: dict[str, float] = {}  # host -> when its current VM incarnation started
        self._lock = threading.Lock()  # the state file is rewritten from timer threads too
        self._timers: list[threading.Timer] = []
        self.started_at = 0.0
        self.job_started_at = 0.0  # VMs started later than this are new: they boot a standby (standby mode)
        self._standbys: dict[str, subprocess.Popen[bytes]] = {}
        # unix socket paths are short: not under a test's deep working directory
        self.standby_dir = Path(tempfile.mkdtemp(prefix="hvdt-sb-")) if spec.standby else None

    # ---------------------------------------------------------------- lifecycle

    def start(self, *, vm_started: Mapping[str, float] | None = None) -> "LocalCluster":
        """Launch horovodrun on fresh VMs: a leaving record an earlier VM of the same name
        published no longer applies. ``vm_started``: the hosts that are still the same VMs as
        before (e.g. another cluster's ``vm_started``), with their start times; their records
        expire with their deadline."""
        self.spec.workdir.mkdir(parents=True, exist_ok=True)
        self.emulator.start()
        for instance in self.emulator.state():
            self._configure_vm(instance)
        now = time.time()
        self.job_started_at = now
        for host in self._hosts:
            self._vm_started[host] = (vm_started or {}).get(host, now)
        clear_stop(self.store)
        self._write_hosts()
        env = self.environment()
        cmd = self.horovodrun_command()
        log.info("starting %s", " ".join(cmd))
        self.started_at = time.time()
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.spec.workdir)
        return self

    def horovodrun_command(self) -> list[str]:
        spec = self.spec
        cmd = [*HOROVODRUN, "-np", str(len(self._hosts) * spec.slots)]
        if spec.elastic:
            cmd += ["--min-np", str(spec.min_np), "--max-np", str(spec.max_np),
                    "--host-discovery-script", str(DISCOVERY_SCRIPT),
                    "--elastic-timeout", str(spec.elastic_timeout_s)]
        else:
            cmd += ["-H", ",".join(f"{h}:{spec.slots}" for h in self._hosts)]
        if spec.controller == "mpi":
            # horovodrun adds mpirun's --allow-run-as-root itself; ``lo`` keeps OpenMPI's TCP on loopback
            cmd += ["--mpi", "--network-interfaces", "lo"]
        else:
            cmd += ["--gloo", "--network-interfaces", "lo", "--gloo-timeout-seconds", str(spec.gloo_timeout_s)]
        return [*cmd, *spec.horovodrun_args, *self.job_command()]

    def job_command(self) -> tuple[str, ...]:
        """What horovodrun runs on each host: the spec's command, through the launcher in standby mode."""
        python, *script = self.spec.command
        return (python, "-m", "hvd_transient.worker", *script) if self.spec.standby else self.spec.command

    def standby_command(self, host: str) -> tuple[str, ...]:
        python, *script = self.spec.command
        return (python, "-m", "hvd_transient.worker", "--standby", "--host", host, *script)

    def environment(self) -> dict[str, str]:
        venv_bin = str(Path(sys.executable).parent)
        env = dict(os.environ)
        env.update({
            "PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', '')}",
            "HVDT_DISCOVERY_BACKEND": "local",
            "HVDT_STATE_FILE": str(self.state_file),
            "HVDT_STORE": self.spec.store,
            "HVDT_CLI": str(Path(venv_bin) / "hvd-transient"),
            "HVDT_WATCHER": self.spec.cloud,
            # each worker substitutes its own host name: one emulated VM per host alias
            "GCE_METADATA_HOST": f"127.0.0.1:{self.emulator.port}/i/{{host}}",
            "NO_GCE_CHECK": "true",
            "PYTHONUNBUFFERED": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            # several TensorFlow workers share two cores: one thread pool each
            "TF_NUM_INTRAOP_THREADS": "1",
            "TF_NUM_INTEROP_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        })
        if self.spec.cloud == "aws":
            env[AWS_ENDPOINT_ENV] = f"{self.emulator.url}/i/{{host}}"
        if self.standby_dir is not None:
            env.update({"HVDT_STANDBY_DIR": str(self.standby_dir), "HVDT_STANDBY_SINCE": repr(self.job_started_at),
                        "HVDT_JOIN_TIMEOUT_S": f"{self.spec.join_timeout_s:g}"})
        env.update(dict(self.spec.extra_env))
        return env

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"horovodrun did not finish within {timeout:.0f}s; log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        """Lose the whole cluster: horovodrun and every worker, at once."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for pid in self.worker_pids().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for host in list(self._standbys):
            self._stop_standby(host, signal.SIGKILL)

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self.stop()
        self.emulator.stop()
        if getattr(self, "_log", None):
            self._log.close()
        if self.standby_dir is not None:
            shutil.rmtree(self.standby_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ control

    def _write_hosts(self) -> None:
        # each VM's start time, as the Compute API's lastStartTimestamp: a leaving record
        # published before it was (re)started does not exclude it
        doc = {"hosts": [{"host": h, "slots": 1, "started_at": self._vm_started.get(h, self.started_at)}
                         for h in self._hosts]}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.state_file)  # discovery must never read half a file

    @property
    def vm_started(self) -> dict[str, float]:
        """When each host's current VM started (as the Compute API's ``lastStartTimestamp``)."""
        return dict(self._vm_started)

    def add_host(self, host: str, *, boot_s: float = 0.0) -> None:
        """A new VM appears (or a preempted one is started again): discovery lists it from now on. ``boot_s``:
        its boot takes that long before its startup script starts the standby (VMs started together boot at
        different speeds)."""
        if host not in self.emulator.state():
            self.emulator.add_instance(host)
            self._configure_vm(host)
        else:
            self.emulator.reset(host)  # a VM started again has no pending notice
        with self._lock:
            self._vm_started[host] = time.time()
            if self.spec.standby and boot_s <= 0:
                self._start_standby(host)  # as the VM's startup script would
            elif self.spec.standby:
                booted = threading.Timer(boot_s, self._booted, args=(host,))
                booted.daemon = True
                booted.start()
                self._timers.append(booted)
            if host not in self._hosts:
                self._hosts.append(host)
            self._write_hosts()

    def _booted(self, host: str) -> None:
        with self._lock:
            if host in self._hosts:  # not stopped while it booted
                self._start_standby(host)

    def _start_standby(self, host: str) -> None:
        self._stop_standby(host, signal.SIGKILL)  # an earlier VM's, gone with it
        env = self.environment()
        env["HOROVOD_HOSTNAME"] = host
        with open(self.standby_log_path(host), "ab") as out:
            self._standbys[host] = subprocess.Popen(
                self.standby_command(host), env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.spec.workdir)
        log.info("started the standby of %s (pid %d)", host, self._standbys[host].pid)

    def _stop_standby(self, host: str, sig: int = signal.SIGTERM) -> None:
        proc = self._standbys.pop(host, None)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # the supervisor and its worker
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def standby_log_path(self, host: str) -> Path:
        return self.spec.workdir / f"standby-{host}.log"

    def _configure_vm(self, host: str) -> None:
        from hvd_transient.gcp.metadata import NOTICE_ATTRIBUTE

        self.emulator.set_attribute(host, NOTICE_ATTRIBUTE, f"{self.spec.notice_s:g}")

    def _vm_stopped(self, host: str) -> None:
        """The window ended: Compute Engine stops a preempted VM, and it is listed no more (TERMINATED)."""
        with self._lock:
            if host in self._hosts:
                self._hosts.remove(host)
                self._write_hosts()
        self._stop_standby(host)  # with every other process of the VM

    def preempt(self, host: str, *, window_s: float | None = None, kill_at_deadline: bool = True) -> float:
        """Give ``host`` a preemption notice now (``window_s``, default the VMs' configured notice);
        SIGTERM its worker when the window ends. Returns the time."""
        window_s = self.spec.notice_s if window_s is None else window_s
        pid = self.worker_pids().get(host) if kill_at_deadline else None
        if kill_at_deadline and pid is None:
            raise ClusterError(f"no live worker is known on {host}")
        self.emulator.preempt(host, window=window_s, kill_pid=pid)
        if kill_at_deadline:
            stop = threading.Timer(window_s, self._vm_stopped, args=(host,))
            stop.daemon = True
            stop.start()
            self._timers.append(stop)
        return time.time()

    def vm_gone(self, host: str) -> None:
        """The VM is gone now, notice or not (a trace removed it before its worker was up): its worker, if
        any, is killed and discovery lists it no more."""
        pid = self.worker_pids().get(host)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._vm_stopped(host)

    def recommend_rebalance(self, host: str) -> None:
        """AWS: ``host`` is at elevated risk of interruption (an early warning, no notice yet)."""
        self.emulator.recommend_rebalance(host)

    def kill(self, host: str, sig: int = signal.SIGKILL) -> None:
        """The VM vanishes with no notice."""
        pid = self.worker_pids().get(host)
        if pid is None:
            raise ClusterError(f"no live worker is known on {host}")
        os.kill(pid, sig)

    def request_stop(self) -> None:
        """Ask the job to checkpoint and finish (as ``hvd-transient stop`` does)."""
        request_stop(self.store, "local cluster")

    def set_metadata_fault(self, host: str, mode: str) -> None:
        self.emulator.set_fault(host, mode)

    # --------------------------------------------------------------- observing

    def events(self) -> list[Event]:
        return read_events(self.store)

    def worker_pids(self) -> dict[str, int]:
        """The latest worker process seen on each host (from the event log)."""
        pids: dict[str, int] = {}
        for e in self.events():
            if e.get("event") == "start":
                pids[e["host"]] = int(e["pid"])
        return {h: p for h, p in pids.items() if _alive(p)}

    def wait_for(self, predicate: Callable[[list[Event]], Any], timeout: float, what: str) -> Any:
        """Poll the event log until ``predicate(events)`` is truthy; return its value."""
        deadline = time.time() + timeout
        while True:
            result = predicate(self.events())
            if result:
                return result
            if self.process is not None and self.process.poll() is not None:
                result = predicate(self.events())
                if result:
                    return result
                raise ClusterError(f"horovodrun exited ({self.process.returncode}) before {what}; "
                                   f"log tail:\n{self.log_tail()}")
            if time.time() > deadline:
                raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}; log tail:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)

    def wait_for_step(self, step: int, timeout: float, size: int | None = None) -> int:
        def reached(events: list[Event]) -> int | None:
            steps = [e["step"] for e in events if e.get("event") in ("progress", "first_step")
                     and e.get("step", -1) >= step and (size is None or e.get("size") == size)]
            return int(max(steps)) if steps else None
        return int(self.wait_for(reached, timeout, f"step {step}" + (f" on {size} workers" if size else "")))

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"


def of(events: Sequence[Event], kind: str, /, **match: Any) -> list[Event]:
    """Events of one kind whose fields equal ``match``."""
    return [e for e in events if e.get("event") == kind and all(e.get(k) == v for k, v in match.items())]


def default_hosts(n: int) -> tuple[str, ...]:
    if n > len(HOST_ALIASES):
        raise ValueError(f"at most {len(HOST_ALIASES)} local host aliases exist, asked for {n}")
    return HOST_ALIASES[:n]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by the driver) is not alive for our purposes
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


__all__ = ["ClusterError", "HOST_ALIASES", "LocalCluster", "LocalClusterSpec", "default_hosts", "of"]
