"""Start a Horovod worker, or hand its job to a standby that has already started it on this host.

Horovod's elastic driver starts a joining host's worker only after every current worker has
reset (``HostsUpdatedInterrupt``, ``hvd.shutdown(); hvd.init()``); the survivors' ``hvd.init()``
then waits in the rendezvous for the newcomer, so its whole start-up (interpreter, TensorFlow and
Horovod imports, data, model build and compile, the first step's tracing) stalls the job. Here a
new VM starts a **standby** when it boots, which does all of that *before* the VM is offered to
Horovod, and the job's command, run by ``horovodrun`` on that host, only hands it the job:

``python -m hvd_transient.worker SCRIPT [ARGS...]`` (the launcher, the job's command)
    If a standby of this command waits for this host and slot (a unix socket
    ``$HVDT_STANDBY_DIR/<HOROVOD_HOSTNAME>.<HOROVOD_LOCAL_RANK>.<command key>.sock``, or under the
    machine's host name if Horovod knows the host by IP, the directory defaulting to
    ``<tmp>/hvdt-standby-<uid>``), the launcher sends it its whole
    environment (Horovod's rendezvous variables, rank, ...), its working directory and its
    stdin/stdout/stderr (``socket.send_fds``), forwards SIGTERM, SIGINT and SIGHUP to it, and
    exits as the standby's worker exits (its code, or killed by its signal). Otherwise it runs
    SCRIPT in this process as ``python SCRIPT`` would (``runpy``: ``sys.argv``, ``__main__``).
    It imports only the standard library (and :mod:`hvd_transient.join.user_dirs`, which does too),
    so it costs nothing when no standby exists.

``python -m hvd_transient.worker --standby [--host H] SCRIPT [ARGS...]`` (started at boot)
    Runs SCRIPT with Horovod's initialisation deferred (:mod:`hvd_transient.join.standby`): imports,
    data, model build, compile, ``hvdt.elastic_state`` and a rehearsal of the train step (run
    once in a one-process Horovod world, then undone) all happen now; ``hvd.size()``, ``rank()``
    and ``local_rank()`` answer 1, 0 and ``--local-rank`` meanwhile. The call of the
    ``@hvd.elastic.run`` function publishes the host as ready
    (``hosts/ready/<host>.json`` in ``--store``, read by discovery's join gate,
    :mod:`hvd_transient.discovery.ready`) and blocks until a launcher hands over. Then it takes
    the launcher's environment, working directory and stdio, runs the real ``hvd.init()`` and goes
    on into Horovod's elastic wrapper (notification service, ``state.sync()``, training).

The standby is two processes: a small supervisor that owns the socket, and the worker it forks
before anything is imported. A non-child's exit status cannot be waited for, so the supervisor
reports the worker's to the launcher; it also kills the worker if the launcher dies (the driver
kills a worker's process tree, which the standby is not part of) and forwards the launcher's
signals. The socket's name carries a digest of the absolute script path and arguments, so only
the job's own command is handed to a standby; a standby that is still warming up when its
launcher arrives is waited for (it is ahead of a cold start), one that exits before the handoff
makes the launcher run the script itself.

Messages are JSON over a ``SOCK_SEQPACKET`` unix socket (one datagram each)::

    launcher -> standby   {"type": "handoff", "version": 1, "key": ..., "argv": [...], "env": {...},
                           "cwd": ..., "pid": ..., "fds": [0, 1, 2]}   + the fds, as ancillary data
    standby -> launcher   {"type": "accepted", "pid": WORKER_PID} | {"type": "refused", "reason": ...}
    launcher -> standby   {"type": "signal", "signal": 15}
    standby -> launcher   {"type": "exit", "code": 0} | {"type": "exit", "signal": 9}
    worker -> supervisor  {"type": "ready", "seconds": ...}   (the handoff is then forwarded to it)

On GCE, ``hvd-transient cluster up --standby 'train.py ARGS' --store gs://...`` makes every
worker's startup script start the standby at boot (a systemd unit, as the user ``horovodrun``
connects as, in ``--job-dir``), and ``cluster keep --job`` with the same options sets
``HVDT_STANDBY_SINCE`` for discovery at each launch; run the job as
``horovodrun ... python -m hvd_transient.worker train.py ARGS``.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import runpy
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Mapping, NoReturn, Sequence

from hvd_transient.core.hostname import default_host
from hvd_transient.join.user_dirs import ensure_dir, try_lock, user_dir

log = logging.getLogger(__name__)

DIR_ENV = "HVDT_STANDBY_DIR"
PROTOCOL_VERSION = 1
MAX_MESSAGE = 1 << 20  # a whole environment fits; SEQPACKET delivers one message per recv
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
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


# ---------------------------------------------------------------- the launcher


def recv_or_closed(sock: socket.socket) -> dict[str, Any] | None:
    """One message without fds, or None when the peer closed, failed or sent garbage: each of
    those ends the conversation the same way."""
    try:
        return recv_message(sock)[0]
    except (OSError, ValueError):
        return None


def _open_stdio() -> list[int]:
    fds = []
    for fd in STDIO:
        with contextlib.suppress(OSError):
            os.fstat(fd)
            fds.append(fd)
    return fds


class SignalWakeup:
    """The given signals as bytes on a socket, for a loop that waits on sockets with ``select``.

    A Python signal handler runs only between bytecodes: a signal that arrives just before a
    blocking ``recv`` or ``select`` would wait until something else wakes the process up. The
    interpreter also writes each signal's number to the wakeup fd from its C handler, so the
    loop sees it at once; the Python handlers only keep the default action (death) away.
    """

    def __init__(self, signals: Sequence[int]) -> None:
        self.reader, self.writer = socket.socketpair()
        for sock in (self.reader, self.writer):
            sock.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        self._previous = {sig: signal.signal(sig, _noted) for sig in signals}

    def take(self) -> list[int]:
        """The signals that arrived since the last call, in order."""
        got = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := self.reader.recv(256):
                got += chunk
        return list(got)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(self._previous_fd)
        self.reader.close()
        self.writer.close()

    def __enter__(self) -> "SignalWakeup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _noted(signum: int, frame: FrameType | None) -> None:
    """A handler that only keeps a signal's default action away (:class:`SignalWakeup` reports it)."""


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


# ---------------------------------------------------------------- the standby's supervisor


@dataclass(frozen=True)
class StandbyOptions:
    script: str
    args: tuple[str, ...]
    host: str
    local_rank: int = 0
    directory: Path | None = None
    store: str | None = None      # where to publish the host as ready (None: nowhere)
    instance_id: str | None = None
    warmup: bool = True           # trace the train step before offering the host

    @property
    def key(self) -> str:
        return command_key(self.script, self.args, os.getcwd())

    def socket_path(self) -> Path:
        return socket_path(self.directory or standby_dir(os.environ), self.host, self.local_rank, self.key)


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


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hvd_transient.worker",
        description="Run a Horovod worker's script, handing it to this host's pre-warmed standby if one waits; "
        "with --standby, be that standby.")
    parser.add_argument("--standby", action="store_true",
                        help="run SCRIPT up to its @hvd.elastic.run call now, then wait for the job's launcher")
    parser.add_argument("--host", default=None,
                        help="standby: the host name Horovod knows this host by (default $HOROVOD_HOSTNAME, "
                        "else the machine's host name)")
    parser.add_argument("--local-rank", type=int, default=0, help="standby: the slot on the host (default 0)")
    parser.add_argument("--store", default=None,
                        help="standby: run store URL to publish readiness in (default $HVDT_STORE)")
    parser.add_argument("--instance-id", default=None, help="standby: the cloud's id of this VM, for the record")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="standby: do not trace the train step before offering the host")
    parser.add_argument("script", metavar="SCRIPT")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    return parser


def _standby_main(ns: argparse.Namespace) -> NoReturn:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s standby[%(process)d] %(name)s: %(message)s")
    options = StandbyOptions(
        script=ns.script, args=tuple(ns.args),
        host=ns.host or default_host(),
        local_rank=ns.local_rank, store=ns.store or os.environ.get("HVDT_STORE") or None,
        instance_id=ns.instance_id, warmup=ns.warmup)
    try:
        status = serve_standby(options)
    except StandbyError as exc:
        print(f"python -m hvd_transient.worker: error: {exc}", file=sys.stderr)
        sys.exit(2)
    status.end_this_process()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # the launcher takes no options of its own: everything from SCRIPT on is the job's
    if not argv or argv[0].startswith("-"):
        ns = build_parser().parse_args(argv)
        if not ns.standby:
            build_parser().error("options are for --standby; the launcher's form is SCRIPT [ARGS...]")
        _standby_main(ns)
    launch(argv[0], argv[1:])


if __name__ == "__main__":
    main()
