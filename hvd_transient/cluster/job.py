"""The training job the keeper supervises: the :class:`Job` protocol and :class:`CommandJob`, the
``keep --job`` command line run in a session of its own (the decisions are in :mod:`.job_plan`)."""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from hvd_transient.discovery.ready import JOIN_TIMEOUT_ENV, STANDBY_SINCE_ENV
from hvd_transient.join.user_dirs import ensure_dir, private

log = logging.getLogger(__name__)


class Job(Protocol):
    """The training job the keeper supervises, launched from the driver VM."""

    def start(self, workers: Sequence[str]) -> None:
        """Launch it (again); ``workers``: the workers RUNNING now."""
        ...

    def poll(self) -> int | None:
        """Its exit status once it has ended, else None."""
        ...

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for it to end: its exit status, or None."""
        ...

    def stop(self, timeout: float) -> int:
        """End it: SIGTERM, SIGKILL after ``timeout`` seconds; its exit status."""
        ...


def exit_status(returncode: int) -> int:
    """A subprocess's return code as a shell reports it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class CommandJob:
    """A command line run by ``/bin/sh -c`` (or an argv run as is), e.g. the ``horovodrun`` line,
    in a session of its own: stopping it reaches every process it started. Its output goes
    where the keeper's goes."""

    def __init__(self, command: str | Sequence[str], *, cwd: str | None = None,
                 env: Mapping[str, str] | None = None, join_timeout_s: float | None = None,
                 pidfile: Path | None = None, stop_timeout_s: float = 30.0) -> None:
        if not command:
            raise ValueError("the job's command is empty")
        self.command = command
        self.cwd, self.env = cwd, None if env is None else dict(env)
        self.join_timeout_s = join_timeout_s  # not None: the workers publish themselves ready
        # where the running job's process is noted: a keeper started after one that died finds its job
        self.pidfile, self.stop_timeout_s = pidfile, stop_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, workers: Sequence[str]) -> None:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("the job is still running")
        if self.pidfile is not None:
            self._end_left_behind(self.pidfile)
        shell = isinstance(self.command, str)
        env = dict(os.environ if self.env is None else self.env)
        if self.join_timeout_s is not None:
            # discovery holds a VM that boots from now on back until it is ready (its boot done, or
            # its standby warm), at most this long (the VMs of this launch run the job at once)
            env[STANDBY_SINCE_ENV] = repr(time.time())
            env[JOIN_TIMEOUT_ENV] = repr(self.join_timeout_s)
        log.info("launching the job on %d worker(s): %s", len(workers), self.command)
        self.process = subprocess.Popen(self.command, shell=shell, cwd=self.cwd, env=env,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        if self.pidfile is not None:
            try:  # the job runs either way: a failure here must not look like a failed launch
                note_process(self.pidfile, self.process.pid)
            except OSError as exc:
                log.warning("could not note the job's process in %s: %s", self.pidfile, exc)

    def _end_left_behind(self, pidfile: Path) -> None:
        """End the job a keeper that died (SIGKILL, OOM) left running, so that two jobs never train on the
        same workers and store. Only a process that is provably that job (this user's, same pid and start
        time, noted in a directory only this user can write) is ended."""
        if not private(pidfile.parent):
            return  # none yet, or another user could have written it: it proves nothing
        try:
            noted = json.loads(pidfile.read_text())
            pid, started = int(noted["pid"]), noted["started"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # none, or unreadable: nothing to prove
        if started is None or start_ticks(pid) != started or not owned(pid):
            return  # ended, or the pid now belongs to another process
        log.warning("a previous keeper left its job running (pid %d): ending it before launching", pid)
        end_session(pid, self.stop_timeout_s)

    def poll(self) -> int | None:
        code = None if self.process is None else self.process.poll()
        return None if code is None else exit_status(code)

    def wait(self, timeout: float) -> int | None:
        if self.process is None:
            return None
        try:
            return exit_status(self.process.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float) -> int:
        process = self.process
        if process is None:
            raise RuntimeError("the job was never started")
        if process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("the job did not end %.0f s after SIGTERM: killing it", timeout)
        # what is left of its session (a worker that ignored SIGTERM) goes too
        self._signal(signal.SIGKILL)
        return exit_status(process.wait())

    def _signal(self, sig: int) -> None:
        assert self.process is not None
        signal_session(self.process.pid, sig)


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat), or None if unknown or gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22; the name before ")" may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def owned(pid: int) -> bool:
    """Whether process ``pid`` runs as this user."""
    try:
        return Path(f"/proc/{pid}").stat().st_uid == os.getuid()
    except OSError:
        return False


def note_process(pidfile: Path, pid: int) -> None:
    """Note ``pid`` and its start time in ``pidfile``, in a directory only this user can write."""
    ensure_dir(pidfile.parent)
    if not private(pidfile.parent):
        raise PermissionError(f"{pidfile.parent} is not this user's alone")
    tmp = pidfile.with_name(pidfile.name + ".tmp")
    tmp.write_text(json.dumps({"pid": pid, "started": start_ticks(pid)}))
    os.replace(tmp, pidfile)  # a reader never sees half a note


def end_session(pid: int, timeout: float) -> None:
    """SIGTERM the session ``pid`` leads (a job started with ``start_new_session``), SIGKILL what is left
    after ``timeout`` seconds. ``pid`` need not be a child: its exit is awaited through a pidfd, or, where
    there are none (kernels before 5.3, some sandboxes), by watching its start time."""
    started = start_ticks(pid)
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:
        fd = None
    try:
        signal_session(pid, signal.SIGTERM)
        if not _ends(pid, started, fd, timeout):
            log.warning("process %d did not end %.0f s after SIGTERM: killing its session", pid, timeout)
        signal_session(pid, signal.SIGKILL)
    finally:
        if fd is not None:
            os.close(fd)


def _ends(pid: int, started: int | None, fd: int | None, timeout: float) -> bool:
    if fd is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    deadline = time.monotonic() + timeout
    while start_ticks(pid) == started:  # no event to wait on: look every 0.1 s
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def signal_session(pgid: int, sig: int) -> None:
    """Send ``sig`` to every process of the session (process group) ``pgid`` leads, if any is left."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the session is gone already


__all__ = ["CommandJob", "Job", "end_session", "exit_status", "note_process", "start_ticks"]
