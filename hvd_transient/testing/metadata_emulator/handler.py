"""HTTP routing of the emulator: GCE, AWS IMDSv2, Azure Scheduled Events and the control API.

Which instance answers, one rule for every API: a path under ``/i/<name>/`` is answered by
instance ``<name>`` (404 if there is none); any other path by the default instance, the first
one given (or ``default_instance=``), which ``GET /control/instances`` names as ``default``.
The Host header and the client's address play no part: every alias of 127.0.0.1 reaches the
same server, so only the path can tell instances apart.

Paths::

    GET  [/i/<inst>]/computeMetadata/v1/<key or dir/>[?recursive=true][&alt=json|text]
                                             [&wait_for_change=true&last_etag=E&timeout_sec=S]
    GET  [/i/<inst>]/  and  [/i/<inst>]/computeMetadata/       GCE directory listings (a ping)
    PUT  [/i/<inst>]/latest/api/token                    (X-aws-ec2-metadata-token-ttl-seconds)
    GET  [/i/<inst>]/latest/meta-data/<key>              (X-aws-ec2-metadata-token)
    GET  [/i/<inst>]/metadata/scheduledevents?api-version=2020-07-01   (Metadata: true)
    GET  [/i/<inst>]/metadata/instance/compute?api-version=...        (JSON: name, osProfile...)
    GET  [/i/<inst>]/metadata/instance/compute/name?api-version=...&format=text

    GET  /control/instances                   every instance's state
    GET  /control/instances/<inst>            one instance's state
    POST /control/instances                   {"name", "hostname"?, "zone"?, "project_id"?, "vm_name"?}
    POST /control/instances/<inst>/preempt    {"at"? | "delay"? | "ago"?, "window"?, "kill_pid"?, "signal"?,
                                               "aws_time_format"?}   ("ago": a notice that came
                                               that many seconds ago)
    POST /control/instances/<inst>/vm-name    {"vm_name"}  the VM's own name, apart from the host's
    POST /control/instances/<inst>/azure-start  the Azure eviction event starts now
    POST /control/instances/<inst>/maintenance {"event": "TERMINATE_ON_HOST_MAINTENANCE"}
    POST /control/instances/<inst>/rebalance  AWS rebalance recommendation now
    POST /control/instances/<inst>/fault      {"mode": "hang" | "lose" | "500" | "503" | "garbage" |
                                               "trickle" | "ok", "duration"?: seconds,
                                               "interval"?: seconds between trickled bytes}

A fault applies to every metadata path of the instance (GCE, AWS, Azure; not ``/control``).
Without ``duration`` it lasts until another mode is set; with one it ends by itself after that
many seconds (``fault_until`` in the instance's state). ``500``/``503``: that error at once
(GCE's carry ``Metadata-Flavor: Google``); ``garbage``: 200 with a nonsense body; ``hang``: no
answer until the fault ends, then the answer of that moment; ``lose``: no answer ever, even after
the fault ends (the request is held until its client hangs up or the emulator stops);
``trickle``: the real answer, its headers at once and then its body one byte every ``interval``
seconds (0.5 by default). A GCE long-poll already waiting when a fault begins is hit by it too,
as by a restarting server.
    POST /control/instances/<inst>/reset      a fresh VM under the same name
"""
from __future__ import annotations

import json
import logging
import select
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import parse_qs, unquote, urlsplit

from .gce_tree import HTML, error_page, is_directory_path
from .model import DEFAULT_WINDOW_S, GARBAGE_BODY, EmulatorError, Fault, InvalidRequestError
from .registry import UnknownKeyError

if TYPE_CHECKING:
    from .registry import Registry

log = logging.getLogger(__name__)

GCE_ROOT = "/computeMetadata"
#: on every GCE reply, errors included: clients (google-auth's ping, gcp-metadata) check it
GCE_HEADERS = {"Metadata-Flavor": "Google"}
AWS_TOKEN_PATH = "/latest/api/token"
AWS_META_PREFIX = "/latest/meta-data/"
AZURE_EVENTS_PATH = "/metadata/scheduledevents"
AZURE_NAME_PATH = "/metadata/instance/compute/name"
AZURE_COMPUTE_PATH = "/metadata/instance/compute"
MAX_BODY = 1 << 20
#: how often a lost request's handler looks whether its client has hung up or the emulator stops
LOST_CHECK_S = 0.2


class MetadataRequestHandler(BaseHTTPRequestHandler):
    # HTTP/1.0: one request per connection, so a hung or released request
    # never leaves a half-used keep-alive connection behind.
    protocol_version = "HTTP/1.0"
    server_version = "Metadata-Server-Emulator"
    sys_version = ""
    #: seconds between two body bytes of this request's reply; None: all at once
    trickle_s: float | None = None

    @property
    def registry(self) -> "Registry":
        registry: Registry = self.server.registry  # type: ignore[attr-defined]
        return registry

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # ---- routing ----------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path, query = unquote(url.path), {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if path == "/control" or path.startswith("/control/"):
                self._control(method, path, query)
                return
            path_instance, rest = _split_instance(path)
            name = self.registry.resolve(path_instance)
            fault = self.registry.begin_request(name, rest)
            if fault is None:  # stopping: drop the connection unanswered
                self.close_connection = True
                return
            if fault is Fault.LOSE:
                self._never_answer()
                return
            self.trickle_s = self.registry.trickle_interval(name)
            if _is_gce_path(rest):
                self._gce(method, name, rest[1:], query, fault)
            elif rest == AWS_TOKEN_PATH or rest.startswith(AWS_META_PREFIX):
                self._aws(method, name, rest, fault)
            elif rest.startswith("/metadata/"):
                self._azure(method, name, rest, query, fault)
            else:
                self._reply(404, f"no metadata API at {rest!r}\n")
        except EmulatorError as exc:
            self._reply_json(exc.http_status, {"error": str(exc)})

    # ---- GCE --------------------------------------------------------------------------
    def _gce(self, method: str, name: str, path: str, query: dict[str, str], fault: Fault) -> None:
        """``path`` is server-root-relative: ``computeMetadata/v1/...``, or a directory above it."""
        if not fault.answers:
            self._fault_reply(fault, gce=True)
            return
        url_path = urlsplit(self.path).path
        # the real server turns proxied requests away, and requires the header (SSRF guards)
        if self.headers.get("X-Forwarded-For"):
            self._gce_error(403, url_path, "Request had an X-Forwarded-For header.")
            return
        if self.headers.get("Metadata-Flavor") != "Google":
            self._gce_error(403, url_path, "Missing Metadata-Flavor:Google header.")
            return
        if method != "GET":
            self._gce_error(405, url_path)
            return
        try:
            q = parse_gce_query(query, path)
            if q.wait_for_change:
                waited = self.registry.gce_wait_for_change(name, path, q.last_etag, q.timeout_sec,
                                                           recursive=q.recursive, alt=q.alt)
                if waited is None:  # stopping
                    self.close_connection = True
                    return
                if isinstance(waited, Fault):  # a fault began while it waited
                    if waited is Fault.LOSE:
                        self._never_answer()
                    else:
                        self._fault_reply(waited, gce=True)
                    return
                found = waited
                self.trickle_s = self.registry.trickle_interval(name)  # a fault may have begun meanwhile
            else:
                found = self.registry.gce_read(name, path, recursive=q.recursive, alt=q.alt)
        except UnknownKeyError:
            self._gce_error(404, url_path)
            return
        except InvalidRequestError as exc:
            self._gce_error(400, url_path, str(exc))
            return
        reply, etag = found
        if reply.redirect is not None:  # a directory asked without its slash, as the real server does
            query_string = urlsplit(self.path).query
            location = urlsplit(self.path).path + "/" + (f"?{query_string}" if query_string else "")
            self._reply(301, "", content_type=HTML, headers={**GCE_HEADERS, "Location": location})
            return
        self._reply(200, reply.body, content_type=reply.content_type, headers={**GCE_HEADERS, "ETag": etag})

    def _gce_error(self, status: int, url_path: str, detail: str = "") -> None:
        # no ETag: the real server's error pages carry none
        self._reply(status, error_page(status, url_path, detail), content_type=HTML, headers=GCE_HEADERS)

    # ---- AWS IMDSv2 -------------------------------------------------------------------
    def _aws(self, method: str, name: str, path: str, fault: Fault) -> None:
        if not fault.answers:
            self._fault_reply(fault, gce=False)
            return
        if path == AWS_TOKEN_PATH:
            if method != "PUT":
                self._reply(405, "use PUT to get an IMDSv2 token\n")
                return
            if self.headers.get("X-Forwarded-For"):
                self._reply(403, "Forbidden\n")
                return
            raw = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            try:
                ttl = int(raw or "")
                token = self.registry.aws_issue_token(name, ttl)
            except (ValueError, InvalidRequestError):
                self._reply(400, "X-aws-ec2-metadata-token-ttl-seconds must be an integer 1..21600\n")
                return
            self._reply(200, token, headers={"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})
            return
        if method != "GET":
            self._reply(405, "Method Not Allowed\n")
            return
        try:
            value = self.registry.aws_read(name, path[len(AWS_META_PREFIX):],
                                           self.headers.get("X-aws-ec2-metadata-token"))
        except PermissionError:
            self._reply(401, "Unauthorized\n")
            return
        if value is None:
            self._reply(404, "Not Found\n")
        else:
            ctype = "application/json" if value.startswith("{") else "text/plain"
            self._reply(200, value, content_type=ctype)

    # ---- Azure ------------------------------------------------------------------------
    def _azure(self, method: str, name: str, path: str, query: dict[str, str], fault: Fault) -> None:
        if not fault.answers:
            self._fault_reply(fault, gce=False)
            return
        if self.headers.get("Metadata", "").lower() != "true":
            self._reply_json(400, {"error": "Bad request. Required metadata header not specified"})
            return
        if not query.get("api-version"):
            self._reply_json(400, {"error": "Bad request. api-version was not specified in the request"})
            return
        if method != "GET":
            self._reply_json(405, {"error": "only GET is emulated"})
            return
        if path.rstrip("/") == AZURE_EVENTS_PATH:
            self._reply_json(200, self.registry.azure_document(name))
        elif path.rstrip("/") == AZURE_COMPUTE_PATH:
            self._reply_json(200, self.registry.azure_compute(name))
        elif path == AZURE_NAME_PATH:
            vm_name = self.registry.azure_compute(name)["name"]
            if query.get("format") == "text":
                self._reply(200, vm_name)
            else:
                self._reply_json(200, vm_name)
        else:
            self._reply_json(404, {"error": f"{path} is not emulated"})

    # ---- control ----------------------------------------------------------------------
    def _control(self, method: str, path: str, query: dict[str, str]) -> None:
        parts = [p for p in path.split("/") if p][1:]  # after "control"
        reg = self.registry
        if method == "GET" and parts in ([], ["state"], ["instances"]):
            self._reply_json(200, {"now": time.time(), "default": reg.default,
                                   "instances": {n: s.to_json() for n, s in reg.snapshots().items()}})
            return
        if method == "GET" and len(parts) == 2 and parts[0] == "instances":
            self._reply_json(200, reg.snapshot(parts[1]).to_json())
            return
        if method != "POST" or not parts or parts[0] != "instances":
            self._reply_json(404, {"error": f"no control endpoint {method} {path}; see /control/instances"})
            return
        body = self._read_json()
        if len(parts) == 1:
            snap = reg.add(str(body.get("name", "")), hostname=body.get("hostname"),
                           zone=body.get("zone"), project_id=body.get("project_id"),
                           vm_name=body.get("vm_name"))
            self._reply_json(201, snap.to_json())
            return
        if len(parts) != 3:
            self._reply_json(404, {"error": f"no control endpoint {path}"})
            return
        name, action = parts[1], parts[2]
        if action == "preempt":
            window = _opt_float(body, "window")
            snap = reg.preempt(name, at=_opt_float(body, "at"), delay=_opt_float(body, "delay"),
                               ago=_opt_float(body, "ago"),
                               window=DEFAULT_WINDOW_S if window is None else window,
                               kill_pid=body.get("kill_pid"), kill_signal=body.get("signal"),
                               aws_time_format=str(body.get("aws_time_format") or "iso8601"))
        elif action == "maintenance":
            snap = reg.set_maintenance(name, str(body.get("event", "")))
        elif action == "rebalance":
            snap = reg.recommend_rebalance(name)
        elif action == "fault":
            snap = reg.set_fault(name, str(body.get("mode", "")), duration=_opt_float(body, "duration"),
                                 trickle_s=_opt_float(body, "interval"))
        elif action == "vm-name":
            snap = reg.set_vm_name(name, str(body.get("vm_name", "")))
        elif action == "azure-start":
            snap = reg.start_azure_event(name)
        elif action == "reset":
            snap = reg.reset(name)
        else:
            self._reply_json(404, {"error": f"unknown action {action!r}: "
                                            "use preempt, maintenance, rebalance, fault, vm-name, "
                                            "azure-start or reset"})
            return
        self._reply_json(200, snap.to_json())

    def _read_json(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise InvalidRequestError(f"request body of {length} bytes is too large")
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise InvalidRequestError(f"request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object")
        return body

    # ---- replies ----------------------------------------------------------------------
    def _never_answer(self) -> None:
        """A lost request: hold the connection unanswered until the client hangs up or the
        emulator stops. (The request is already read, so anything readable is its end.)"""
        self.close_connection = True
        sock = self.connection
        while not self.registry.wait_stopping(0.0):
            readable, _, _ = select.select([sock], [], [], LOST_CHECK_S)
            if readable:
                try:
                    if not sock.recv(4096):  # the client closed its side
                        return
                except OSError:  # reset by the client
                    return

    def _fault_reply(self, fault: Fault, *, gce: bool) -> None:
        headers = {"Metadata-Flavor": "Google", "ETag": uuid.uuid4().hex[:16]} if gce else {}
        if fault is Fault.ERROR_500:
            self._reply(500, "injected fault: internal server error\n", headers=headers)
        elif fault is Fault.ERROR_503:
            self._reply(503, "injected fault: service unavailable\n", headers=headers)
        else:  # GARBAGE (HANG has already been waited out by the registry)
            self._reply(200, GARBAGE_BODY, content_type="text/html", headers=headers)

    def _reply_json(self, status: int, obj: Any) -> None:
        self._reply(status, json.dumps(obj), content_type="application/json")

    def _reply(self, status: int, body: str | bytes, *, content_type: str = "text/plain",
               headers: dict[str, str] | None = None) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status, HTTPStatus(status).phrase)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.trickle_s is None:
            self.wfile.write(data)
            return
        for i in range(len(data)):  # the headers are out; now the body, a byte at a time
            if i and self.registry.wait_stopping(self.trickle_s):
                return
            self.wfile.write(data[i:i + 1])


def _is_gce_path(path: str) -> bool:
    """The root (which GCE clients ping) and everything under ``/computeMetadata``."""
    return path == "/" or path == GCE_ROOT or path.startswith(GCE_ROOT + "/")


def _split_instance(path: str) -> tuple[str | None, str]:
    """``/i/<name>/rest`` -> (name, ``/rest``); any other path -> (None, path)."""
    if path.startswith("/i/"):
        name, _, rest = path[3:].partition("/")
        return name, "/" + rest
    return None, path


@dataclass(frozen=True)
class GceQuery:
    """The query parameters of a GCE metadata request, checked."""

    recursive: bool = False
    alt: str | None = None
    wait_for_change: bool = False
    last_etag: str | None = None
    timeout_sec: int | None = None


def parse_gce_query(query: Mapping[str, str], path: str) -> GceQuery:
    """Check a GCE request's parameters as the real server does; InvalidRequestError -> 400."""
    alt = query.get("alt") or None
    if alt not in (None, "json", "text"):
        raise InvalidRequestError(f"alt must be json or text, got {alt!r}")
    recursive = query.get("recursive", "").lower() == "true"
    wait = query.get("wait_for_change", "").lower() == "true"
    if wait and is_directory_path(path) and not recursive:
        raise InvalidRequestError("wait_for_change on a directory needs recursive=true")
    raw = query.get("timeout_sec")
    timeout: int | None = None
    if raw:
        # GCE takes whole seconds only
        if not raw.isdigit():
            raise InvalidRequestError(f"timeout_sec must be a whole number of seconds, got {raw!r}")
        timeout = int(raw)
    return GceQuery(recursive=recursive, alt=alt, wait_for_change=wait,
                    last_etag=query.get("last_etag") or None, timeout_sec=timeout)


def _opt_float(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{key!r} must be a number, got {value!r}") from None
