"""The launcher, the job's command on a host (``python -m hvd_transient.worker SCRIPT``): hand the job
to this host's standby and wait for its worker, else run the script in this process.

It imports only the standard library (and the join package's :mod:`~hvd_transient.join.wire`,
:mod:`~hvd_transient.join.signals` and :mod:`~hvd_transient.join.user_dirs`, which do too), so it
costs nothing when no standby exists.
"""
from __future__ import annotations

import contextlib
import logging
import os
import runpy
import selectors
import socket
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from hvd_transient.join.signals import FORWARDED_SIGNALS, SignalWakeup
from hvd_transient.join.wire import (
    HANDOFF_ACCEPT_TIMEOUT_S,
    PROTOCOL_VERSION,
    STDIO,
    ExitStatus,
    StandbyError,
    command_key,
    recv_or_closed,
    send_message,
    socket_path,
    standby_dir,
)

log = logging.getLogger(__name__)


def _open_stdio() -> list[int]:
    fds = []
    for fd in STDIO:
        with contextlib.suppress(OSError):
            os.fstat(fd)
            fds.append(fd)
    return fds


def hand_off(path: Path, script: str, args: Sequence[str], *, env: Mapping[str, str] | None = None,
             cwd: str | None = None, accept_timeout_s: float = HANDOFF_ACCEPT_TIMEOUT_S) -> ExitStatus | None:
    """Give the job to the standby listening at ``path`` and wait for its worker to end.

    None when no standby took it (none listening, a refusal, it went away before accepting, or
    it did not answer within ``accept_timeout_s``): the caller then runs the script itself.
    Giving up closes the connection, which makes a standby that wakes up later kill the worker
    it may have started, so the slot never runs the job twice.
    """
    env = dict(os.environ if env is None else env)
    cwd = os.getcwd() if cwd is None else cwd
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(os.fspath(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None  # no standby, or a stale socket of one that died
    fds = _open_stdio()
    msg = {"type": "handoff", "version": PROTOCOL_VERSION, "key": command_key(script, args, cwd),
           "argv": [script, *args], "env": env, "cwd": cwd, "pid": os.getpid(), "fds": fds}
    pending: list[int] = []  # signals not forwarded yet: the standby tells its worker's pid first
    with sock, SignalWakeup(FORWARDED_SIGNALS) as wakeup, selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        selector.register(wakeup.reader, selectors.EVENT_READ)
        accepted = False
        give_up_at = time.monotonic() + accept_timeout_s
        try:
            send_message(sock, msg, fds)
        except OSError:
            reply: dict[str, Any] | None = None
        else:
            while True:
                timeout = None if accepted else max(0.0, give_up_at - time.monotonic())
                ready = {key.fileobj for key, _ in selector.select(timeout)}
                if not accepted and not ready and time.monotonic() >= give_up_at:
                    reply = {"reason": f"no answer in {accept_timeout_s:g} s"}
                    break
                if wakeup.reader in ready:
                    pending += wakeup.take()
                    if accepted:
                        _send_signals(sock, pending)
                if sock not in ready:
                    continue
                reply = recv_or_closed(sock)
                if accepted and reply is not None and reply.get("type") == "exit":
                    return ExitStatus.from_message(reply)
                if accepted and reply is None:
                    log.error("the standby went away without reporting its worker's exit")
                    return ExitStatus(code=1)
                if not accepted and reply is not None and reply.get("type") == "accepted":
                    accepted = True
                    log.info("handed the job to the standby's worker (pid %s)", reply.get("pid"))
                    _send_signals(sock, pending)
                    continue
                if not accepted:
                    break
        why = reply.get("reason") if reply else "it went away"
        log.warning("the standby at %s did not take the job (%s); running %s here", path, why, script)
        pending += wakeup.take()
    for signum in pending:  # they were meant for the worker, which is this process after all
        os.kill(os.getpid(), signum)
    return None


def _send_signals(sock: socket.socket, pending: list[int]) -> None:
    while pending:
        signum = pending.pop(0)
        with contextlib.suppress(OSError):
            send_message(sock, {"type": "signal", "signal": signum})


def run_script(script: str, args: Sequence[str]) -> None:
    """Run ``script`` in this process as ``python script args...`` would."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def find_socket(directory: Path, hosts: Sequence[str], local_rank: int, key: str) -> Path:
    """Where this host's standby listens: under the first of ``hosts`` that has a socket there, else
    under the first. A standby started at boot names its host as the machine does, while Horovod
    may know the host by its IP (``discover --use-ip``, a multi-zone cluster): both are tried."""
    paths = [socket_path(directory, hosts[0], local_rank, key)]
    for host in hosts[1:]:
        with contextlib.suppress(StandbyError):
            paths.append(socket_path(directory, host, local_rank, key))
    return next((p for p in paths if p.exists()), paths[0])


def launch(script: str, args: Sequence[str]) -> None:
    """The job's command on a host: hand over to this host's standby, else run the script here."""
    host = os.environ.get("HOROVOD_HOSTNAME")
    if host:
        try:
            local_rank = int(os.environ.get("HOROVOD_LOCAL_RANK") or 0)
            path = find_socket(standby_dir(os.environ), (host, socket.gethostname()), local_rank,
                               command_key(script, args, os.getcwd()))
        except (StandbyError, ValueError) as exc:
            log.warning("no standby can be used: %s", exc)
        else:
            status = hand_off(path, script, args)
            if status is not None:
                status.end_this_process()
    run_script(script, args)
