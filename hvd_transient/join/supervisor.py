"""The standby's supervisor: owns the standby's socket, forks the worker and stands in for it to the launcher.

A non-child's exit status cannot be waited for, so the supervisor reports the worker's to the
launcher; it also kills the worker if the launcher dies (the driver kills a worker's process
tree, which the standby is not part of) and forwards the launcher's signals. The worker
(:mod:`hvd_transient.join.standby`) is forked before the script imports anything.
"""
from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
from pathlib import Path

from hvd_transient.join.options import StandbyOptions
from hvd_transient.join.signals import FORWARDED_SIGNALS, SignalWakeup
from hvd_transient.join.user_dirs import ensure_dir, try_lock
from hvd_transient.join.wire import (
    DIR_ENV,
    HANDOFF_READ_TIMEOUT_S,
    STDIO,
    ExitStatus,
    StandbyError,
    check_handoff,
    recv_message,
    recv_or_closed,
    send_message,
)

log = logging.getLogger(__name__)


def _lock(path: Path) -> int:
    fd = try_lock(path)
    if fd is None:
        raise StandbyError(f"another standby already waits at {path.with_suffix('.sock')}")
    return fd


def _prepare_dir(directory: Path) -> None:
    if ensure_dir(directory).st_uid != os.getuid():
        raise StandbyError(f"{directory} belongs to another user; set {DIR_ENV} to a directory of yours")


def serve_standby(options: StandbyOptions) -> ExitStatus:
    """Listen for this host's launcher and run the standby's worker; the worker's exit status.

    Returns in both processes after the fork: in the worker with its own status (the script
    ended), in the supervisor with the worker's.
    """
    path = options.socket_path()
    _prepare_dir(path.parent)
    lock_fd = _lock(path.with_suffix(".lock"))
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # we hold the lock: whatever is there is a dead standby's
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(os.fspath(path))
    listener.listen(4)
    ctl_parent, ctl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the worker
        listener.close()
        ctl_parent.close()
        os.close(lock_fd)
        _die_with_parent(parent)
        from hvd_transient.join import standby

        standby.run(options, ctl_child)
        return ExitStatus(0)
    ctl_child.close()
    supervisor = _Supervisor(options, pid, listener, ctl_parent, path)
    try:
        return supervisor.run()
    finally:
        supervisor.close()
        os.close(lock_fd)


def _die_with_parent(parent: int) -> None:
    """The worker must not outlive its supervisor (nobody would report or stop it)."""
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != parent:
        os._exit(1)


class _Supervisor:
    def __init__(self, options: StandbyOptions, worker: int, listener: socket.socket, ctl: socket.socket,
                 path: Path) -> None:
        self.options, self.worker, self.path = options, worker, path
        self.listener: socket.socket | None = listener
        self.ctl: socket.socket | None = ctl
        self.launcher: socket.socket | None = None
        self.reaped = False
        self.selector = selectors.DefaultSelector()

    def run(self) -> ExitStatus:
        pidfd = os.pidfd_open(self.worker)
        assert self.listener is not None and self.ctl is not None
        with SignalWakeup(FORWARDED_SIGNALS) as wakeup:
            self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
            self.selector.register(self.ctl, selectors.EVENT_READ, self._from_worker)
            self.selector.register(wakeup.reader, selectors.EVENT_READ, lambda: self._forward(wakeup.take()))
            self.selector.register(pidfd, selectors.EVENT_READ, None)
            log.info("standby for %s (slot %d) waits at %s; worker pid %d", self.options.host,
                     self.options.local_rank, self.path, self.worker)
            try:
                while True:
                    for key, _ in self.selector.select():
                        if key.data is None:  # the worker ended
                            return self._ended()
                        key.data()
            finally:
                os.close(pidfd)

    def close(self) -> None:
        self._stop_listening()
        for sock in (self.ctl, self.launcher):
            if sock is not None:
                sock.close()
        self.selector.close()

    def _forward(self, signals: list[int]) -> None:
        for signum in signals:
            self._signal(signum)

    def _signal(self, signum: int) -> None:
        if not self.reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.worker, signum)

    def _stop_listening(self) -> None:
        if self.listener is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.listener)
            self.listener.close()
            self.listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def _accept(self) -> None:
        assert self.listener is not None
        conn, _ = self.listener.accept()
        conn.settimeout(HANDOFF_READ_TIMEOUT_S)
        try:
            msg, fds = recv_message(conn, maxfds=len(STDIO))
        except (OSError, ValueError) as exc:
            log.warning("dropped a connection that sent no handoff: %s", exc)
            conn.close()
            return
        try:
            reason = "no message" if msg is None else check_handoff(msg, self.options.key)
            if reason is None and len(fds) != len(msg.get("fds", ())):  # type: ignore[union-attr]
                reason = "the file descriptors did not arrive"
            if reason is None:
                assert msg is not None and self.ctl is not None
                try:
                    send_message(self.ctl, msg, fds)
                except OSError:
                    reason = "the standby's worker has ended"
        finally:
            for fd in fds:
                os.close(fd)
        conn.settimeout(None)
        if reason is not None:
            log.warning("refused a handoff: %s", reason)
            with contextlib.suppress(OSError):
                send_message(conn, {"type": "refused", "reason": reason})
            conn.close()
            return
        self._stop_listening()  # one job per standby
        self.launcher = conn
        self.selector.register(conn, selectors.EVENT_READ, self._from_launcher)
        try:
            send_message(conn, {"type": "accepted", "pid": self.worker})
        except OSError:
            # the launcher gave up waiting and runs the job itself: this worker must not
            log.warning("the launcher left before the handoff was accepted; killing the worker")
            self._signal(signal.SIGKILL)
            return
        log.info("took the job of launcher pid %s", msg.get("pid") if msg else None)

    def _from_worker(self) -> None:
        assert self.ctl is not None
        msg = recv_or_closed(self.ctl)
        if msg is None:  # it closed its end after the handoff
            self.selector.unregister(self.ctl)
            self.ctl.close()
            self.ctl = None
        elif msg.get("type") == "ready":
            log.info("the worker is ready for a job after %.1fs", float(msg.get("seconds", 0.0)))

    def _from_launcher(self) -> None:
        assert self.launcher is not None
        msg = recv_or_closed(self.launcher)
        if msg is None:
            # the launcher is gone (the driver killed it, or its host): so must its worker be
            log.warning("the launcher went away; killing the worker")
            self.selector.unregister(self.launcher)
            self.launcher.close()
            self.launcher = None
            self._signal(signal.SIGKILL)
        elif msg.get("type") == "signal":
            self._signal(int(msg["signal"]))

    def _ended(self) -> ExitStatus:
        _, status = os.waitpid(self.worker, 0)
        self.reaped = True
        result = ExitStatus.from_wait_status(status)
        if self.launcher is not None:
            with contextlib.suppress(OSError):
                send_message(self.launcher, result.to_message())
        else:
            log.warning("the standby's worker ended before any handoff (%s)",
                        f"signal {result.signal}" if result.signal else f"exit {result.code}")
        return result
