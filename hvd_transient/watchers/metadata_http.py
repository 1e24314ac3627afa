"""The HTTP client of the cloud watchers: every request bounded in its *total* time.

A metadata request must never blind a watcher for longer than its bound. An HTTP library's
timeout covers each read from the socket, not the whole reply, so a server that sends its
headers and then one byte of body every half second would hold a request for as long as it
likes. Here the socket's timeout is set to what is left of the request's total before every
read of the body, and the reply is dropped once the total is spent (``MetadataTimeoutError``).
The connection is this module's own (``http.client``, one per request), so no library state
is touched, and no proxy from the environment is ever used: metadata servers are link-local.
"""
from __future__ import annotations

import http.client
import json
import logging
import socket
import time
from dataclasses import dataclass
from email.message import Message
from typing import Any, Mapping
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

    def get(self, url: str, *, headers: Mapping[str, str] | None = None,
            params: Mapping[str, str] | None = None, total: float | None = None) -> MetadataReply:
        return self.request("GET", url, headers=headers, params=params, total=total)

    def put(self, url: str, *, headers: Mapping[str, str] | None = None,
            total: float | None = None) -> MetadataReply:
        return self.request("PUT", url, headers=headers, total=total)

    def request(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                params: Mapping[str, str] | None = None, total: float | None = None) -> MetadataReply:
        total_s = self.total_timeout if total is None else float(total)
        deadline = time.monotonic() + total_s
        full_url = f"{url}?{urlencode(dict(params))}" if params else url
        parts = urlsplit(full_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WatcherConfigError(f"metadata URL {full_url!r} needs an http:// scheme and a host")
        conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(parts.hostname, parts.port, timeout=min(self.connect_timeout, total_s))
        try:
            conn.connect()
            sock = conn.sock  # kept: http.client lets go of it once a reply says it closes the connection
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            conn.request(method, target or "/", headers={**(headers or {}), "Connection": "close"})
            _set_left(sock, deadline, full_url, total_s)
            reply = conn.getresponse()
            body = _read_body(reply, sock, deadline, full_url, total_s)
            return MetadataReply(method=method, url=full_url, status_code=reply.status,
                                 headers=reply.msg, content=body)
        except (socket.timeout, TimeoutError) as exc:
            raise MetadataTimeoutError(f"{method} {full_url}: no whole reply within {total_s:g} s ({exc})") from None
        except http.client.HTTPException as exc:  # a bad status line, a torn or over-long reply
            raise MetadataGarbageError(f"{method} {full_url}: not an HTTP reply ({exc!r:.120})") from None
        finally:
            conn.close()


def _set_left(sock: socket.socket | None, deadline: float, url: str, total_s: float) -> None:
    """The socket waits at most what is left of the request's total time."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise MetadataTimeoutError(f"{url}: no whole reply within {total_s:g} s")
    if sock is not None:
        sock.settimeout(left)


def _read_body(reply: http.client.HTTPResponse, sock: socket.socket | None, deadline: float,
               url: str, total_s: float) -> bytes:
    """The body, read as it arrives, each read bounded by what is left of the total."""
    pieces: list[bytes] = []
    size = 0
    while True:
        _set_left(sock, deadline, url, total_s)
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
