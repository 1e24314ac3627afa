"""The HTTP client of the cloud watchers: every request bounded in its *total* time.

A metadata request must never blind a watcher for longer than its bound. An HTTP library's
timeout covers each read from the socket, not the whole reply, so a server that trickles its
status line, a header, a chunk-size line or the body one byte every half second would hold a
request for as long as it likes. Here every read of the reply (``http.client`` reads it all
through one file object, which this module gives it) first sets the socket's timeout to what is
left of the request's total, and fails once the total is spent (``MetadataTimeoutError``): no
thread, no timer, the same on every platform. The host's name is looked up once per process on a
thread of its own, which a request waits on for at most what is left of its total: a resolver that
hangs makes the first requests fail in time, never the watcher blind (the address, once found, is
kept: metadata servers are link-local and never move).
The connection is this module's own (``http.client``, one per request), so no library state
is touched, and no proxy from the environment is ever used: metadata servers are link-local.
"""
from __future__ import annotations

import functools
import http.client
import io
import ipaddress
import json
import logging
import math
import socket
import ssl
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from email.message import Message
from typing import Any, Mapping, Sequence
from urllib.parse import urlencode, urlsplit

from .errors import MetadataGarbageError, MetadataServerError, MetadataTimeoutError, WatcherConfigError

log = logging.getLogger(__name__)

#: a metadata reply larger than this is no metadata (the real ones are a few hundred bytes)
MAX_BODY = 64 * 1024
#: the body is read in pieces of at most this size (each read returns whatever has arrived)
READ_SIZE = 4096


@dataclass(frozen=True)
class MetadataReply:
    """A whole reply: status, headers and body."""

    method: str
    url: str
    status_code: int
    headers: Message
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class MetadataClient:
    """Makes bounded requests: ``connect_timeout`` for the connection, ``total_timeout`` (unless a
    request gives its own) for everything from the connection to the body's last byte."""

    connect_timeout: float = 0.5
    total_timeout: float = 1.0

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "total_timeout"):
            _check_bound(name, getattr(self, name))

    def get(self, url: str, *, headers: Mapping[str, str] | None = None,
            params: Mapping[str, str] | None = None, total: float | None = None) -> MetadataReply:
        return self.request("GET", url, headers=headers, params=params, total=total)

    def put(self, url: str, *, headers: Mapping[str, str] | None = None,
            total: float | None = None) -> MetadataReply:
        return self.request("PUT", url, headers=headers, total=total)

    def request(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                params: Mapping[str, str] | None = None, total: float | None = None) -> MetadataReply:
        total_s = self.total_timeout if total is None else _check_bound("total", total)
        deadline = time.monotonic() + total_s
        full_url = f"{url}?{urlencode(dict(params))}" if params else url
        try:
            parts = urlsplit(full_url)
            given_port = parts.port
        except ValueError as exc:  # a port out of range or no number, a torn IPv6 address
            raise WatcherConfigError(f"metadata URL {full_url!r} cannot be read: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WatcherConfigError(f"metadata URL {full_url!r} needs an http:// scheme and a host")
        https = parts.scheme == "https"
        port = given_port or (443 if https else 80)
        conn_cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
        conn = conn_cls(parts.hostname, port, timeout=min(self.connect_timeout, total_s))
        try:
            conn.sock = _connect(parts.hostname, port, https, self.connect_timeout, deadline)
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            conn.request(method, target or "/", headers={**(headers or {}), "Connection": "close"})
            conn.response_class = functools.partial(_BoundedResponse, deadline=deadline)  # type: ignore[assignment]
            reply = conn.getresponse()
            body = _read_body(reply, full_url)
            return MetadataReply(method=method, url=full_url, status_code=reply.status,
                                 headers=reply.msg, content=body)
        except (socket.timeout, TimeoutError, _TotalSpent) as exc:
            raise MetadataTimeoutError(f"{method} {full_url}: no whole reply within {total_s:g} s ({exc})") from None
        except http.client.HTTPException as exc:  # a bad status line, a torn or over-long reply
            raise MetadataGarbageError(f"{method} {full_url}: not an HTTP reply ({exc!r:.120})") from None
        except OSError as exc:  # refused, reset mid-reply, unreachable: the server did not answer
            raise MetadataServerError(f"{method} {full_url}: no reply ({exc!r:.120})") from None
        finally:
            conn.close()


def _connect(host: str, port: int, https: bool, connect_timeout: float, deadline: float) -> socket.socket:
    """A connected socket within ``connect_timeout`` per address and the request's ``deadline`` in all:
    each address is tried in turn (the one that answered last first), whatever the one before did."""
    last: OSError | None = None
    for family, kind, proto, _, address in _RESOLVER.addresses(host, port, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as exc:  # a family this kernel lacks (IPv6 switched off)
            last = exc
            continue
        try:
            sock.settimeout(min(connect_timeout, left))
            sock.connect(address)
            if https:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        except OSError as exc:  # refused, unreachable, or no answer within its share: the next address
            sock.close()
            last = exc
            continue
        _RESOLVER.answered(host, port, address)
        return sock
    if last is not None:
        raise last
    raise _TotalSpent(f"the request's total time was spent before {host} could be reached")


#: what getaddrinfo gives for one address: family, kind, protocol, canonical name, address
Address = tuple[Any, Any, int, str, Any]
#: a lookup still under way after this long is started again beside it (a resolver that hung once must
#: not blind a watcher for good), at most this many at a time per name
LOOKUP_AGAIN_S = 2.0
MAX_LOOKUPS = 4


class _Resolver:
    """Looks each host name up on daemon threads (``getaddrinfo`` has no timeout of its own) and keeps
    what the first that succeeded found; a failed lookup is tried again by the next request, a hung one
    beside it after ``LOOKUP_AGAIN_S``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[tuple[str, int], list[Address]] = {}
        self._pending: dict[tuple[str, int], list[tuple[Future[list[Address]], float]]] = {}

    def addresses(self, host: str, port: int, deadline: float) -> Sequence[Address]:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            pass
        else:  # a literal address (the usual metadata URL): nothing to look up
            return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        key = (host, port)
        with self._lock:
            known = self._known.get(key)
            if known is not None:
                return list(known)
            now = time.monotonic()
            pending = [(f, at) for f, at in self._pending.get(key, []) if not f.done()]
            if not pending or (now - pending[-1][1] >= LOOKUP_AGAIN_S and len(pending) < MAX_LOOKUPS):
                lookup: Future[list[Address]] = Future()
                pending.append((lookup, now))
                threading.Thread(target=self._look_up, args=(key, lookup), daemon=True,
                                 name=f"hvdt-metadata-lookup-{host}").start()
            self._pending[key] = pending
            waiting = [f for f, _ in pending]
        done, _ = wait(waiting, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED)
        if not done:
            raise _TotalSpent(f"the request's total time was spent looking {host} up")
        return next(iter(done)).result()  # a failed lookup raises its error: the next request tries again

    def answered(self, host: str, port: int, address: Any) -> None:
        """``address`` took a connection: it is tried first from now on."""
        with self._lock:
            known = self._known.get((host, port))
            if known is not None and known[0][4] != address:
                known.sort(key=lambda a: a[4] != address)

    def _look_up(self, key: tuple[str, int], lookup: Future[list[Address]]) -> None:
        try:
            found = list(socket.getaddrinfo(key[0], key[1], type=socket.SOCK_STREAM))
        except (UnicodeError, ValueError) as exc:  # a name no lookup can take (a label over 63 characters)
            lookup.set_exception(WatcherConfigError(f"metadata host {key[0]!r} cannot be looked up: {exc}"))
        except Exception as exc:  # whatever the resolver raised, the request gets an error it knows
            lookup.set_exception(exc if isinstance(exc, OSError) else OSError(f"looking {key[0]} up: {exc!r}"))
        else:
            with self._lock:
                self._known.setdefault(key, found)
                self._pending.pop(key, None)
            lookup.set_result(found)


_RESOLVER = _Resolver()


def _check_bound(name: str, value: object) -> float:
    """A time bound: a positive, finite number of seconds (anything else bounds nothing)."""
    seconds = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not 0 < seconds < math.inf:
        raise WatcherConfigError(f"metadata request {name} must be a positive number of seconds, not {value!r}")
    return seconds


class _TotalSpent(Exception):
    """The request's total time ran out between two reads."""


class _DeadlineReader(io.RawIOBase):
    """The socket's own file (which keeps the socket open after the connection lets go of it, as
    ``http.client`` expects), read with at most what is left of the request's total per ``recv``."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline
        self._raw = sock.makefile("rb", buffering=0)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise _TotalSpent("the request's total time is spent")
        self._sock.settimeout(left)
        got = self._raw.readinto(buffer)
        return 0 if got is None else got

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineSocket:
    """What ``HTTPResponse`` takes for a socket: it only asks it for a file to read the reply from."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str, *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


class _BoundedResponse(http.client.HTTPResponse):
    """A reply whose status line, headers and body are all read within the request's total time."""

    def __init__(self, sock: socket.socket, debuglevel: int = 0, method: str | None = None,
                 url: str | None = None, *, deadline: float) -> None:
        super().__init__(_DeadlineSocket(sock, deadline), debuglevel, method, url)  # type: ignore[arg-type]


def _read_body(reply: http.client.HTTPResponse, url: str) -> bytes:
    """The body, read as it arrives (each read bounded by the reply's file), at most ``MAX_BODY``."""
    pieces: list[bytes] = []
    size = 0
    while True:
        piece = reply.read1(READ_SIZE)
        if not piece:
            return b"".join(pieces)
        pieces.append(piece)
        size += len(piece)
        if size > MAX_BODY:
            raise MetadataGarbageError(f"{url} answered with more than {MAX_BODY} bytes: not metadata")


def expect_status(reply: MetadataReply, *allowed: int) -> None:
    if reply.status_code not in allowed:
        raise MetadataServerError(
            f"{reply.method} {reply.url} answered HTTP {reply.status_code} "
            f"(expected {' or '.join(map(str, allowed))}): {reply.text[:120]!r}")


def json_object(reply: MetadataReply) -> dict[str, Any]:
    try:
        body = json.loads(reply.content)
    except ValueError:
        raise MetadataGarbageError(f"{reply.url} answered 200 with a body that is not JSON: "
                                   f"{reply.content[:80]!r}") from None
    if not isinstance(body, dict):
        raise MetadataGarbageError(f"{reply.url} answered 200 with JSON that is not an object: {body!r:.80}")
    return body


def printable_text(reply: MetadataReply, what: str) -> str:
    """The body as text, refusing anything that is not short printable ASCII."""
    raw = reply.content.strip()
    if not raw or len(raw) > 4096 or not all(0x20 <= b < 0x7F for b in raw):
        raise MetadataGarbageError(f"{reply.url} answered 200 with a {what} that is not "
                                   f"printable text: {raw[:80]!r}")
    return str(raw.decode("ascii"))
