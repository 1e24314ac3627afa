"""A small threaded HTTP proxy on 127.0.0.1 that injects faults in front of fake-gcs-server.

fake-gcs-server has no fault injection, so the failures a real bucket shows
(503s, a request applied whose response never arrives) come from here:

* :meth:`FaultProxy.fail_next` - answer the next N matching requests with a
  status (503 by default) without forwarding them;
* :meth:`FaultProxy.drop_response_of_next` - forward the next matching request,
  let the server apply it, then reset the client connection instead of replying.

Every request is recorded as a :class:`Seen` so tests can assert that the fault
really happened (and was then retried).
"""
from __future__ import annotations

import http.client
import json
import logging
import socket
import struct
import sys
import threading
import time
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
    kind: str  # "status" | "drop"
    remaining: int
    match: Matcher
    status: int = 503


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

    def slow_down(self, seconds: float, *, match: Matcher = is_upload) -> None:
        """Hold every matching request ``seconds`` before forwarding it (a slow network)."""
        with self._lock:
            self._latency = (seconds, match) if seconds > 0 else None

    def reset(self) -> None:
        """Disarm every fault and forget what was seen."""
        with self._lock:
            self._rules.clear()
            self.seen.clear()

    def pending_faults(self) -> int:
        with self._lock:
            return sum(r.remaining for r in self._rules)

    def outcomes(self, match: Matcher = any_request) -> list[str]:
        with self._lock:
            return [s.outcome for s in self.seen if match(s.request)]

    # ---- used by the handler ---------------------------------------------------------------

    def _take_rule(self, req: Request) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.remaining > 0 and rule.match(req):
                    rule.remaining -= 1
                    return rule
            return None

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
            rule = proxy._take_rule(req)
            if rule is not None and rule.kind == "status":
                payload = json.dumps(
                    {"error": {"code": rule.status, "message": f"injected by fault proxy: {rule.status}"}}
                ).encode()
                # Record before replying, so a client that has its answer always finds it in `seen`.
                proxy._record(req, f"injected-{rule.status}", rule.status)
                self.send_response(rule.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            latency = proxy._latency
            if latency is not None and latency[1](req):
                time.sleep(latency[0])  # the injected fault itself: a slow link
            status, reason, headers, data = self._forward(body)
            if rule is not None and rule.kind == "drop":
                proxy._record(req, "dropped-response", status)
                # RST instead of FIN: the client sees "connection reset by peer" after the
                # server has already applied the request.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()
                return
            proxy._record(req, "forwarded", status)
            self.send_response(status, reason)
            for name, value in headers:
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

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
