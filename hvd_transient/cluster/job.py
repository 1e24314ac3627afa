"""The training job the keeper supervises: the :class:`Job` protocol and :class:`CommandJob`, the
``keep --job`` command line run in a session of its own (the decisions are in :mod:`.job_plan`)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Mapping, Protocol, Sequence

from hvd_transient.discovery.ready import JOIN_TIMEOUT_ENV, STANDBY_SINCE_ENV

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
                 env: Mapping[str, str] | None = None, join_timeout_s: float | None = None) -> None:
        if not command:
            raise ValueError("the job's command is empty")
        self.command = command
        self.cwd, self.env = cwd, None if env is None else dict(env)
        self.join_timeout_s = join_timeout_s  # not None: the workers publish themselves ready
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, workers: Sequence[str]) -> None:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("the job is still running")
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
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the session is gone already


__all__ = ["CommandJob", "Job", "exit_status"]
