"""The standby socket's protocol: where a standby listens, the messages on its socket, and exit statuses.

Shared by the launcher (:mod:`hvd_transient.join.launcher`), the standby's supervisor
(:mod:`hvd_transient.join.supervisor`) and its worker (:mod:`hvd_transient.join.standby`). Standard
library only (and :mod:`hvd_transient.join.user_dirs`, which is too): the launcher imports it on
every job start.

Messages are JSON over a ``SOCK_SEQPACKET`` unix socket (one datagram each)::

    launcher -> standby   {"type": "handoff", "version": 1, "key": ..., "argv": [...], "env": {...},
                           "cwd": ..., "pid": ..., "fds": [0, 1, 2]}   + the fds, as ancillary data
    standby -> launcher   {"type": "accepted", "pid": WORKER_PID} | {"type": "refused", "reason": ...}
    launcher -> standby   {"type": "signal", "signal": 15}
    standby -> launcher   {"type": "exit", "code": 0} | {"type": "exit", "signal": 9}
    worker -> supervisor  {"type": "ready", "seconds": ...}   (the handoff is then forwarded to it)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NoReturn, Sequence

from hvd_transient.join.user_dirs import user_dir

DIR_ENV = "HVDT_STANDBY_DIR"
PROTOCOL_VERSION = 1
MAX_MESSAGE = 1 << 20  # a whole environment fits; SEQPACKET delivers one message per recv
STDIO = (0, 1, 2)
HANDOFF_READ_TIMEOUT_S = 10.0  # a peer that connects must send its handoff at once
#: a standby answers a handoff within milliseconds; one that has not after this long is stuck
HANDOFF_ACCEPT_TIMEOUT_S = 30.0
_MAX_SOCKET_PATH = 107  # sun_path, less its terminating NUL


class StandbyError(RuntimeError):
    """The standby cannot be set up (a bad directory, another standby holding the slot)."""


# ---------------------------------------------------------------- names and messages (pure)


def command_key(script: str, args: Sequence[str], cwd: str) -> str:
    """What identifies a job's command across processes: the absolute script path and the arguments."""
    absolute = os.path.normpath(os.path.join(cwd, script))
    return hashlib.sha256(json.dumps([absolute, *args]).encode()).hexdigest()[:16]


def standby_dir(env: Mapping[str, str]) -> Path:
    return user_dir(env.get(DIR_ENV), "hvdt-standby")


def socket_path(directory: Path, host: str, local_rank: int, key: str) -> Path:
    if not host or "/" in host or host.startswith("."):
        raise StandbyError(f"invalid host name for a standby socket: {host!r}")
    path = directory / f"{host}.{local_rank}.{key}.sock"
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise StandbyError(f"standby socket path too long for a unix socket ({len(str(path))} bytes): {path}; "
                           f"set {DIR_ENV} to a shorter directory")
    return path


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended: its exit code, or the signal that killed it."""

    code: int = 0
    signal: int | None = None

    @classmethod
    def from_wait_status(cls, status: int) -> "ExitStatus":
        if os.WIFSIGNALED(status):
            return cls(code=128 + os.WTERMSIG(status), signal=os.WTERMSIG(status))
        return cls(code=os.waitstatus_to_exitcode(status))

    def to_message(self) -> dict[str, Any]:
        return {"type": "exit", "code": self.code, "signal": self.signal}

    @classmethod
    def from_message(cls, msg: Mapping[str, Any]) -> "ExitStatus":
        sig = msg.get("signal")
        return cls(code=int(msg.get("code", 1)), signal=int(sig) if sig is not None else None)

    def end_this_process(self) -> NoReturn:
        """Exit as the reported process did, so whoever waits for this one sees the same."""
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if self.signal is not None:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(self.signal, signal.SIG_DFL)
            os.kill(os.getpid(), self.signal)
            os._exit(self.code)  # a signal that does not kill (ignored or caught elsewhere)
        sys.exit(self.code)


def check_handoff(msg: Mapping[str, Any], key: str) -> str | None:
    """Why a handoff cannot be taken (None: it can). Pure."""
    if msg.get("type") != "handoff":
        return f"expected a handoff, got {msg.get('type')!r}"
    if msg.get("version") != PROTOCOL_VERSION:
        return f"protocol version {msg.get('version')!r}, this standby speaks {PROTOCOL_VERSION}"
    if msg.get("key") != key:
        return "another command than this standby's"
    if not isinstance(msg.get("env"), dict) or not isinstance(msg.get("cwd"), str):
        return "no environment or working directory"
    fds = msg.get("fds")
    if not isinstance(fds, list) or not set(fds) <= set(STDIO):
        return f"unexpected file descriptors {fds!r}"
    return None


# ---------------------------------------------------------------- sending and receiving


def send_message(sock: socket.socket, msg: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(msg).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"message of {len(data)} bytes is over {MAX_MESSAGE}")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv_message(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the fds that came with it; (None, []) when the peer has closed."""
    if maxfds:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, maxfds)
    else:
        data, fds = sock.recv(MAX_MESSAGE), []
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        msg = json.loads(data)
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        for fd in fds:
            os.close(fd)
        raise ValueError("malformed message on the standby socket")
    return msg, list(fds)


def recv_or_closed(sock: socket.socket) -> dict[str, Any] | None:
    """One message without fds, or None when the peer closed, failed or sent garbage: each of
    those ends the conversation the same way."""
    try:
        return recv_message(sock)[0]
    except (OSError, ValueError):
        return None
