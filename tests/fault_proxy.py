"""A small threaded HTTP proxy on 127.0.0.1 that injects faults in front of fake-gcs-server.

fake-gcs-server has no fault injection, so the failures a real bucket shows
(503s, a request applied whose response never arrives) come from here:

* :meth:`FaultProxy.fail_next` - answer the next N matching requests with a
  status (503 by default) without forwarding them;
* :meth:`FaultProxy.drop_response_of_next` - forward the next matching request,
  let the server apply it, then reset the client connection instead of replying;
* :meth:`FaultProxy.reset_before_next` - reset the connection without forwarding
  (the request never reaches the server);
* :meth:`FaultProxy.truncate_reply_of_next` - forward, then send only half the reply;
* :meth:`FaultProxy.flip_reply_byte_of_next` - forward, then reply with one body byte flipped
  (a transfer that its checksum header no longer matches);
* :meth:`FaultProxy.blackhole` - swallow matching requests: never forwarded, never
  answered, until the client gives up;
* :meth:`FaultProxy.delay_replies` - forward at once, hold every matching reply;
* :meth:`FaultProxy.slow_down` - hold every matching request before forwarding it;
* :meth:`FaultProxy.mix` - a random fault (or none) for every request, from :class:`Chaos`.

Every request is recorded as a :class:`Seen` so tests can assert that the fault
really happened (and was then retried).
"""
from __future__ import annotations

import http.client
import json
import logging
import random
import socket
import struct
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

# Hop-by-hop headers are per connection and must not be relayed.
_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "te", "trailers", "transfer-encoding", "upgrade",
}


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # path plus query string, as sent


Matcher = Callable[[Request], bool]


def any_request(_: Request) -> bool:
    return True


def is_upload(req: Request) -> bool:
    return req.method in ("POST", "PUT") and req.path.startswith("/upload/")


def is_download(req: Request) -> bool:
    return req.method == "GET" and req.path.startswith("/download/")


@dataclass(frozen=True)
class Seen:
    request: Request
    outcome: str  # "forwarded", "injected-<status>", "dropped-response"
    status: int | None  # status the upstream (or the injection) produced


@dataclass
class _Rule:
    kind: str  # "status" | "drop" | "reset" | "truncate" | "flip" | "blackhole"
    remaining: int
    match: Matcher
    status: int = 503


@dataclass(frozen=True)
class Chaos:
    """Per-request fault probabilities for :meth:`FaultProxy.mix` (the rest are forwarded as they are).

    ``delay_s`` bounds the hold of a delayed reply (uniform); ``seed`` makes the draws repeatable
    for one sequence of requests (threads may interleave them differently).
    """

    p_503: float = 0.0
    p_reset_before: float = 0.0  # connection reset, request never forwarded
    p_reset_after: float = 0.0  # forwarded and applied, then the connection reset
    p_truncate: float = 0.0  # forwarded and applied, half the reply sent
    p_delay: float = 0.0  # forwarded and applied, the reply held
    delay_s: tuple[float, float] = (0.0, 1.0)
    match: Matcher = any_request
    seed: int = 0

    def draw(self, rng: random.Random) -> tuple[str | None, float]:
        """The fault for one request (None: none) and, for a delay, its length."""
        x = rng.random()
        for kind, p in (("status", self.p_503), ("reset", self.p_reset_before), ("drop", self.p_reset_after),
                        ("truncate", self.p_truncate), ("delay", self.p_delay)):
            if x < p:
                return kind, rng.uniform(*self.delay_s) if kind == "delay" else 0.0
            x -= p
        return None, 0.0


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: tuple[str, int]) -> None:
        # Clients drop pooled keep-alive connections at will (and we reset some on purpose).
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("fault-proxy: connection from %s ended: %r", client_address, exc)
        else:
            super().handle_error(request, client_address)


class FaultProxy:
    """Forwards to ``upstream`` (http://127.0.0.1:port); faults are armed by the test."""

    def __init__(self, upstream: str, *, rewrite_path: Callable[[str], str] | None = None) -> None:
        """``rewrite_path`` alters every forwarded path, e.g. to mimic a server that drops a parameter."""
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError(f"upstream must be http://127.0.0.1:<port>, not {upstream!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self.rewrite_path = rewrite_path
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self.seen: list[Seen] = []
        self._latency: tuple[float, Matcher] | None = None
        self._reply_delay: tuple[float, Matcher] | None = None
        self._chaos: tuple[Chaos, random.Random] | None = None
        # set by reset()/stop(): held replies go out at once, held (blackholed) requests are dropped
        self._release = threading.Event()
        self._held: set[socket.socket] = set()
        self._server = _QuietServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._release_held()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- arming faults ---------------------------------------------------------------------

    def fail_next(self, count: int, *, status: int = 503, match: Matcher = any_request) -> None:
        """Answer the next ``count`` matching requests with ``status`` (not forwarded)."""
        with self._lock:
            self._rules.append(_Rule("status", count, match, status))

    def drop_response_of_next(self, *, match: Matcher = any_request, count: int = 1) -> None:
        """Forward the next matching request(s), then reset the connection instead of replying."""
        with self._lock:
            self._rules.append(_Rule("drop", count, match))

    def reset_before_next(self, *, match: Matcher = any_request, count: int = 1) -> None:
        """Reset the connection of the next matching request(s) without forwarding them."""
        with self._lock:
            self._rules.append(_Rule("reset", count, match))

    def truncate_reply_of_next(self, *, match: Matcher = any_request, count: int = 1) -> None:
        """Forward the next matching request(s), then send the headers and only half the body."""
        with self._lock:
            self._rules.append(_Rule("truncate", count, match))

    def flip_reply_byte_of_next(self, *, match: Matcher = any_request, count: int = 1) -> None:
        """Forward the next matching request(s), then reply with the middle byte of the body flipped."""
        with self._lock:
            self._rules.append(_Rule("flip", count, match))

    def blackhole(self, *, match: Matcher = any_request, count: int = 10**6) -> None:
        """Swallow the next matching request(s): never forwarded, never answered. The connection
        is closed once the client gives up on it (or on :meth:`reset`)."""
        with self._lock:
            self._rules.append(_Rule("blackhole", count, match))

    def slow_down(self, seconds: float, *, match: Matcher = is_upload) -> None:
        """Hold every matching request ``seconds`` before forwarding it (a slow network)."""
        with self._lock:
            self._latency = (seconds, match) if seconds > 0 else None

    def delay_replies(self, seconds: float, *, match: Matcher = any_request) -> None:
        """Forward every matching request at once (the server applies it) and hold its reply ``seconds``."""
        with self._lock:
            self._reply_delay = (seconds, match) if seconds > 0 else None

    def mix(self, chaos: Chaos | None) -> None:
        """Draw a fault for every request from ``chaos`` (None: stop); armed rules come first."""
        with self._lock:
            self._chaos = (chaos, random.Random(chaos.seed)) if chaos is not None else None

    def reset(self) -> None:
        """Disarm every fault, release what is held and forget what was seen."""
        with self._lock:
            self._rules.clear()
            self.seen.clear()
            self._latency = self._reply_delay = self._chaos = None
        self._release_held()

    def pending_faults(self) -> int:
        with self._lock:
            return sum(r.remaining for r in self._rules)

    def outcomes(self, match: Matcher = any_request) -> list[str]:
        with self._lock:
            return [s.outcome for s in self.seen if match(s.request)]

    # ---- used by the handler ---------------------------------------------------------------

    def _release_held(self) -> None:
        with self._lock:
            release, self._release = self._release, threading.Event()
            held, self._held = self._held, set()
        release.set()
        for sock in held:  # wakes the handler blocked on it
            try:
                sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass

    def _fault_for(self, req: Request) -> tuple[str | None, float, int, threading.Event]:
        """What to do with a request: (fault kind or None, reply delay, status, release event)."""
        with self._lock:
            release = self._release
            for rule in self._rules:
                if rule.remaining > 0 and rule.match(req):
                    rule.remaining -= 1
                    return rule.kind, 0.0, rule.status, release
            if self._reply_delay is not None and self._reply_delay[1](req):
                return "delay", self._reply_delay[0], 503, release
            if self._chaos is not None and self._chaos[0].match(req):
                kind, delay = self._chaos[0].draw(self._chaos[1])
                return kind, delay, 503, release
            return None, 0.0, 503, release

    def _hold(self, sock: socket.socket) -> None:
        """Track a held connection, so that reset() and stop() can let it go."""
        with self._lock:
            self._held.add(sock)

    def _unhold(self, sock: socket.socket) -> None:
        with self._lock:
            self._held.discard(sock)

    def _record(self, req: Request, outcome: str, status: int | None) -> None:
        with self._lock:
            self.seen.append(Seen(req, outcome, status))


def _handler_for(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like GCS: a reset hits a pooled connection

        def log_message(self, fmt: str, *args: object) -> None:
            log.debug("fault-proxy: " + fmt, *args)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            req = Request(self.command, self.path)
            kind, delay, status_code, release = proxy._fault_for(req)
            if kind == "status":
                payload = json.dumps(
                    {"error": {"code": status_code, "message": f"injected by fault proxy: {status_code}"}}
                ).encode()
                # Record before replying, so a client that has its answer always finds it in `seen`.
                proxy._record(req, f"injected-{status_code}", status_code)
                self.send_response(status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            if kind == "reset":
                proxy._record(req, "reset-before", None)
                self._reset()
                return
            if kind == "blackhole":
                proxy._record(req, "blackholed", None)
                self._wait_for_client_to_give_up()
                self.close_connection = True
                return
            latency = proxy._latency
            if latency is not None and latency[1](req):
                release.wait(latency[0])  # the injected fault itself: a slow link
            status, reason, headers, data = self._forward(body)
            if kind == "drop":
                proxy._record(req, "dropped-response", status)
                self._reset()  # after the server has already applied the request
                return
            if kind == "delay":
                proxy._record(req, "delayed-reply", status)
                release.wait(delay)  # the fault itself: the reply is late (reset() sends it at once)
            elif kind == "truncate":
                proxy._record(req, "truncated-reply", status)
            elif kind == "flip" and data:
                proxy._record(req, "flipped-reply", status)
                middle = len(data) // 2
                data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
            else:
                proxy._record(req, "forwarded", status)
            self.send_response(status, reason)
            for name, value in headers:
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "HEAD":
                return
            if kind == "truncate":
                self.wfile.write(data[:len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data)

        def _reset(self) -> None:
            # RST instead of FIN: the client sees "connection reset by peer".
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()

        def _wait_for_client_to_give_up(self) -> None:
            """Block until the client closes the connection (or the proxy releases it)."""
            sock = self.connection
            proxy._hold(sock)
            try:
                sock.settimeout(None)
                while sock.recv(4096):  # a client never sends more on a request it awaits
                    pass
            except OSError:
                pass
            finally:
                proxy._unhold(sock)

        def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
            conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                path = proxy.rewrite_path(self.path) if proxy.rewrite_path else self.path
                conn.request(self.command, path, body=body or None, headers=headers)
                resp = conn.getresponse()
                return resp.status, resp.reason, resp.getheaders(), resp.read()
            finally:
                conn.close()

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

    return Handler
