"""A small real HTTP stand-in for the Compute Engine REST API (v1), for tests.

It listens on 127.0.0.1 on an ephemeral port and implements just what
discovery and ``hvd-transient cluster`` call, with the real API's shapes:

* ``GET  projects/P/zones/Z/instances`` (filter, maxResults, pageToken)
* ``GET  projects/P/aggregated/instances`` (same, items keyed by ``zones/Z``)
* ``POST projects/P/zones/Z/instanceGroupManagers/G/listManagedInstances``
* ``GET|DELETE projects/P/zones/Z/instances/NAME``, ``POST .../instances`` (insert),
  ``POST .../instances/NAME/start``
* ``GET projects/P/zones/Z/operations/OP`` and ``POST .../operations/OP/wait``

Filters support the subset the clients send: parenthesised ``field = "value"``
terms (``status``, ``name``, ``labels.KEY``), optionally joined by ``AND``.
Anything else is answered 400, as a typo would be by the real API.

Instances carry ``id`` and, once RUNNING, ``lastStartTimestamp`` (RFC 3339), as the
real API does; ``preempt`` models a Spot VM's preemption by its termination action:
STOP (the default) leaves it TERMINATED, keeping its name and id until ``.../start``
runs it again with a new ``lastStartTimestamp``; DELETE makes it disappear.

Test hooks: ``add_instance``, ``set_status``, ``preempt``, ``add_mig``, ``fail_next`` (inject
5xx), ``rejected_inserts`` (make an insert operation fail), ``exhaust``/``restore`` (a
zone's capacity or quota runs out and comes back: its inserts and starts fail, as real
Compute fails them, with a DONE operation whose ``error.errors[0].code`` is
``ZONE_RESOURCE_POOL_EXHAUSTED``, ``QUOTA_EXCEEDED``...), ``page_size`` (force
pagination), ``operation_polls`` (operations stay RUNNING for that many polls)
and ``requests`` (everything received).
"""
from __future__ import annotations

import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

PREFIX = "/compute/v1/"
BETA_PREFIX = "/compute/beta/"
#: fields only the beta API accepts; v1 rejects a body carrying them, as the real one does
BETA_SCHEDULING_FIELDS = ("preemptionNoticeDuration",)
STOCKOUT = "ZONE_RESOURCE_POOL_EXHAUSTED"
QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
_TERM = re.compile(r'\(\s*([A-Za-z0-9_.\-]+)\s*(=|!=)\s*"([^"]*)"\s*\)')


class HTTPError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str  # below /compute/v1/
    query: dict[str, str]
    body: Any
    authorization: str | None
    version: str = "v1"  # the API version the path was under


@dataclass
class _Operation:
    resource: dict
    polls_left: int
    on_done: Any = None  # callable applied when the operation completes


@dataclass
class _State:
    instances: dict[tuple[str, str, str], dict] = field(default_factory=dict)  # (project, zone, name)
    migs: dict[tuple[str, str, str], dict[str, str]] = field(default_factory=dict)  # -> {name: currentAction}
    operations: dict[str, _Operation] = field(default_factory=dict)


def parse_filter(text: str) -> list[tuple[str, str, str]]:
    """``(a = "b") AND (c != "d")`` -> [("a", "=", "b"), ("c", "!=", "d")]; ValueError otherwise."""
    terms = _TERM.findall(text)
    leftover = _TERM.sub("", text).replace("AND", "").strip()
    if leftover or (text.strip() and not terms):
        raise ValueError(f"unsupported filter expression: {text!r}")
    return terms


def _field(instance: dict, name: str) -> str | None:
    if name.startswith("labels."):
        return (instance.get("labels") or {}).get(name[len("labels."):])
    value = instance.get(name)
    return None if value is None else str(value)


def matches(instance: dict, terms: list[tuple[str, str, str]]) -> bool:
    for name, op, value in terms:
        equal = _field(instance, name) == value
        if equal != (op == "="):
            return False
    return True


class FakeComputeAPI:
    def __init__(self, *, page_size: int | None = None, operation_polls: int = 0) -> None:
        self.page_size = page_size
        self.operation_polls = operation_polls
        self.requests: list[RecordedRequest] = []
        self._state = _State()
        self._lock = threading.Lock()
        self._failures: list[int] = []
        self.rejected_inserts: dict[str, tuple[str, str]] = {}  # instance name -> (error code, message)
        #: zone -> (error code, message, Spot requests only): see exhaust()
        self.zone_errors: dict[str, tuple[str, str, bool]] = {}
        self._ids = itertools.count(1000)
        self._ips = itertools.count(10)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> "FakeComputeAPI":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def _handle(self) -> None:
                fake._dispatch(self)

            do_GET = do_POST = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-compute", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FakeComputeAPI":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self._server is not None, "start() the fake first"
        return f"http://127.0.0.1:{self._server.server_address[1]}/compute/v1"

    # ---- test hooks -------------------------------------------------------------------------

    def add_instance(
        self, project: str, zone: str, name: str, *, status: str = "RUNNING", labels: dict | None = None,
        gpus: int = 0, ip: str | None = None, provisioning_model: str = "STANDARD",
        machine_type: str = "n1-standard-8",
    ) -> dict:
        instance = {
            "kind": "compute#instance",
            "name": name,
            "machineType": self._url(project, zone, f"machineTypes/{machine_type}"),
            "labels": dict(labels or {}),
            "scheduling": {"provisioningModel": provisioning_model},
        }
        if gpus:
            instance["guestAccelerators"] = [{
                "acceleratorType": self._url(project, zone, "acceleratorTypes/nvidia-tesla-t4"),
                "acceleratorCount": gpus,
            }]
        with self._lock:
            stored = self._store(project, zone, instance, status=status, ip=ip)
        return json.loads(json.dumps(stored))

    def set_status(self, project: str, zone: str, name: str, status: str) -> None:
        with self._lock:
            self._set_status(self._state.instances[(project, zone, name)], status)

    def preempt(self, project: str, zone: str, name: str, *, action: str | None = None) -> None:
        """Compute Engine preempts a Spot VM: with termination action STOP (the VM's
        ``scheduling.instanceTerminationAction``, else STOP; ``action`` overrides it) it stays,
        TERMINATED; with DELETE it is gone."""
        with self._lock:
            key = (project, zone, name)
            instance = self._state.instances[key]
            scheduling = instance.get("scheduling", {})
            if scheduling.get("provisioningModel") != "SPOT":
                raise ValueError(f"{name} is not a Spot VM; only Spot VMs are preempted")
            action = action or scheduling.get("instanceTerminationAction") or "STOP"
            if action == "DELETE":
                del self._state.instances[key]
            else:
                self._set_status(instance, "TERMINATED")

    def exhaust(self, zone: str, code: str = STOCKOUT, *, spot_only: bool = False,
                message: str | None = None) -> None:
        """From now on inserts and starts in ``zone`` fail with ``code`` (e.g. ``ZONE_RESOURCE_POOL_EXHAUSTED``,
        ``ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS``, ``QUOTA_EXCEEDED``): the request is accepted and its
        operation ends DONE with that error, as real Compute does. ``spot_only``: on-demand requests still work."""
        if message is None:
            message = (f"Quota 'PREEMPTIBLE_NVIDIA_T4_GPUS' exceeded. Limit: 0.0 in region {zone.rsplit('-', 1)[0]}."
                       if "QUOTA" in code else
                       f"The zone 'projects/-/zones/{zone}' does not have enough resources available to fulfill "
                       "the request. Try a different zone, or try again later.")
        with self._lock:
            self.zone_errors[zone] = (code, message, spot_only)

    def restore(self, zone: str | None = None) -> None:
        """Capacity (or quota) is back in ``zone`` (every zone when None)."""
        with self._lock:
            if zone is None:
                self.zone_errors.clear()
            else:
                self.zone_errors.pop(zone, None)

    def add_mig(self, project: str, zone: str, group: str, members: dict[str, str]) -> None:
        """``members``: instance name -> currentAction (NONE, DELETING, ...)."""
        with self._lock:
            self._state.migs[(project, zone, group)] = dict(members)

    def fail_next(self, count: int, status: int = 503) -> None:
        with self._lock:
            self._failures.extend([status] * count)

    def instances(self, project: str | None = None) -> list[dict]:
        with self._lock:
            return [json.loads(json.dumps(i)) for (p, _z, _n), i in sorted(self._state.instances.items())
                    if project is None or p == project]

    def requests_matching(self, method: str, path_suffix: str) -> list[RecordedRequest]:
        return [r for r in self.requests if r.method == method and r.path.endswith(path_suffix)]

    # ---- internals --------------------------------------------------------------------------

    def _url(self, project: str, zone: str, rest: str = "") -> str:
        base = f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}"
        return f"{base}/{rest}" if rest else base

    @staticmethod
    def _set_status(instance: dict, status: str) -> None:
        if status == "RUNNING" and instance.get("status") != "RUNNING":
            instance["lastStartTimestamp"] = datetime.now(timezone.utc).isoformat(timespec="microseconds")
        instance["status"] = status

    def _store(self, project: str, zone: str, instance: dict, *, status: str, ip: str | None) -> dict:
        name = instance["name"]
        instance = dict(instance)
        instance.update({
            "id": str(next(self._ids)),
            "zone": self._url(project, zone),
            "selfLink": self._url(project, zone, f"instances/{name}"),
        })
        self._set_status(instance, status)
        nics = instance.get("networkInterfaces") or [{}]
        # Documentation range (RFC 5737): a string in JSON, never an address anything connects to.
        nics[0] = {**nics[0], "networkIP": ip or f"192.0.2.{next(self._ips)}"}
        instance["networkInterfaces"] = nics
        self._state.instances[(project, zone, name)] = instance
        return instance

    def _operation(self, project: str, zone: str, kind: str, target: str, on_done: Any) -> dict:
        name = f"operation-{next(self._ids)}"
        resource = {
            "kind": "compute#operation", "name": name, "operationType": kind, "status": "RUNNING",
            "zone": self._url(project, zone), "targetLink": self._url(project, zone, f"instances/{target}"),
            "selfLink": self._url(project, zone, f"operations/{name}"),
        }
        op = _Operation(resource, self.operation_polls, on_done)
        self._state.operations[name] = op
        self._advance(op, initial=True)
        return dict(op.resource)

    def _advance(self, op: _Operation, *, initial: bool = False) -> None:
        if op.resource["status"] == "DONE":
            return
        if not initial:
            op.polls_left -= 1
        if op.polls_left <= 0:
            error = op.on_done() if op.on_done else None
            op.resource["status"] = "DONE"
            if error:
                op.resource["error"] = {"errors": [{"code": error[0], "message": error[1]}]}

    def _zone_error(self, zone: str, spot: bool) -> tuple[str, str] | None:
        """The error a capacity-consuming request in ``zone`` meets now (decided when it is sent)."""
        found = self.zone_errors.get(zone)
        if found is None or (found[2] and not spot):
            return None
        return found[0], found[1]

    def _page(self, items: list, query: dict[str, str]) -> tuple[list, str | None]:
        size = int(query.get("maxResults", 500))
        if self.page_size:
            size = min(size, self.page_size)
        start = int(query.get("pageToken", "0") or 0)
        end = start + size
        return items[start:end], (str(end) if end < len(items) else None)

    def _dispatch(self, handler: BaseHTTPRequestHandler) -> None:
        parsed = urlparse(handler.path)
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        prefix = next((p for p in (PREFIX, BETA_PREFIX) if parsed.path.startswith(p)), None)
        version = prefix.strip("/").split("/")[-1] if prefix else ""
        path = parsed.path[len(prefix):] if prefix else parsed.path
        with self._lock:
            self.requests.append(RecordedRequest(
                handler.command, path, query, body, handler.headers.get("Authorization"), version))
            failure = self._failures.pop(0) if self._failures else None
        try:
            if failure:
                raise HTTPError(failure, "backendError", "injected failure")
            if prefix is None:
                raise HTTPError(404, "notFound", f"no such API path {parsed.path}")
            beta_only = [f for f in BETA_SCHEDULING_FIELDS
                         if isinstance(body, dict) and f in (body.get("scheduling") or {})]
            if version == "v1" and beta_only:
                raise HTTPError(400, "invalid", f"Invalid JSON payload received. Unknown name {beta_only[0]!r} "
                                "at 'instance.scheduling': Cannot find field.")
            status, payload = self._route(handler.command, path.split("/"), query, body)
        except HTTPError as exc:
            status, payload = exc.status, {"error": {
                "code": exc.status, "message": exc.message,
                "errors": [{"reason": exc.reason, "message": exc.message}]}}
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _route(self, method: str, parts: list[str], query: dict[str, str], body: Any) -> tuple[int, dict]:
        if len(parts) < 3 or parts[0] != "projects":
            raise HTTPError(404, "notFound", "unknown resource")
        project = parts[1]
        with self._lock:
            if parts[2:] == ["aggregated", "instances"] and method == "GET":
                return 200, self._aggregated(project, query)
            if len(parts) < 5 or parts[2] != "zones":
                raise HTTPError(404, "notFound", "unknown resource")
            zone, rest = parts[3], parts[4:]
            if rest == ["instances"] and method == "GET":
                return 200, self._list(project, zone, query)
            if rest == ["instances"] and method == "POST":
                return 200, self._insert(project, zone, body)
            if len(rest) == 2 and rest[0] == "instances":
                return 200, self._instance(method, project, zone, rest[1])
            if len(rest) == 3 and rest[0] == "instances" and rest[2] == "start" and method == "POST":
                return 200, self._start(project, zone, rest[1])
            if len(rest) == 3 and rest[0] == "instanceGroupManagers" and rest[2] == "listManagedInstances" \
                    and method == "POST":
                return 200, self._managed(project, zone, rest[1], query)
            if len(rest) >= 2 and rest[0] == "operations":
                op = self._state.operations.get(rest[1])
                if op is None:
                    raise HTTPError(404, "notFound", f"operation {rest[1]} not found")
                if rest[2:] == ["wait"] and method == "POST" or rest[2:] == [] and method == "GET":
                    self._advance(op)
                    return 200, dict(op.resource)
        raise HTTPError(404, "notFound", f"unsupported {method} {'/'.join(parts)}")

    def _filtered(self, items: list[dict], query: dict[str, str]) -> list[dict]:
        try:
            terms = parse_filter(query.get("filter", ""))
        except ValueError as exc:
            raise HTTPError(400, "invalid", str(exc)) from None
        return [i for i in items if matches(i, terms)]

    def _zone_instances(self, project: str, zone: str | None) -> list[dict]:
        return [i for (p, z, _n), i in sorted(self._state.instances.items())
                if p == project and (zone is None or z == zone)]

    def _list(self, project: str, zone: str, query: dict[str, str]) -> dict:
        items, token = self._page(self._filtered(self._zone_instances(project, zone), query), query)
        result: dict[str, Any] = {"kind": "compute#instanceList", "items": items}
        if token:
            result["nextPageToken"] = token
        return result

    def _aggregated(self, project: str, query: dict[str, str]) -> dict:
        items, token = self._page(self._filtered(self._zone_instances(project, None), query), query)
        grouped: dict[str, dict] = {}
        for instance in items:
            scope = "zones/" + instance["zone"].rsplit("/", 1)[-1]
            grouped.setdefault(scope, {"instances": []})["instances"].append(instance)
        grouped.setdefault("zones/empty-zone-a", {"warning": {"code": "NO_RESULTS_ON_PAGE"}})
        result: dict[str, Any] = {"kind": "compute#instanceAggregatedList", "items": grouped}
        if token:
            result["nextPageToken"] = token
        return result

    def _managed(self, project: str, zone: str, group: str, query: dict[str, str]) -> dict:
        members = self._state.migs.get((project, zone, group))
        if members is None:
            raise HTTPError(404, "notFound", f"instance group manager {group} not found in {zone}")
        managed = []
        for name, action in sorted(members.items()):
            instance = self._state.instances.get((project, zone, name))
            entry = {"instance": self._url(project, zone, f"instances/{name}"), "currentAction": action}
            if instance is not None:
                entry.update({"id": instance["id"], "instanceStatus": instance["status"]})
            managed.append(entry)
        items, token = self._page(managed, query)
        result: dict[str, Any] = {"managedInstances": items}
        if token:
            result["nextPageToken"] = token
        return result

    def _insert(self, project: str, zone: str, body: Any) -> dict:
        if not isinstance(body, dict) or not body.get("name") or not body.get("machineType"):
            raise HTTPError(400, "required", "instance body needs name and machineType")
        name = body["name"]
        if (project, zone, name) in self._state.instances:
            raise HTTPError(409, "alreadyExists", f"The resource 'projects/{project}/zones/{zone}/instances/"
                                                  f"{name}' already exists")
        self._store(project, zone, body, status="PROVISIONING", ip=None)
        spot = (body.get("scheduling") or {}).get("provisioningModel") == "SPOT"
        rejection = self.rejected_inserts.get(name) or self._zone_error(zone, spot)

        def done() -> tuple[str, str] | None:
            if rejection:  # e.g. no Spot capacity: the operation fails and the VM never appears
                self._state.instances.pop((project, zone, name), None)
                return rejection
            self._set_status(self._state.instances[(project, zone, name)], "RUNNING")
            return None

        return self._operation(project, zone, "insert", name, done)

    def _instance(self, method: str, project: str, zone: str, name: str) -> dict:
        key = (project, zone, name)
        if key not in self._state.instances:
            raise HTTPError(404, "notFound", f"The resource 'projects/{project}/zones/{zone}/instances/{name}' "
                                             "was not found")
        if method == "GET":
            return json.loads(json.dumps(self._state.instances[key]))
        if method == "DELETE":
            self._state.instances[key]["status"] = "STOPPING"

            def done() -> None:
                self._state.instances.pop(key, None)

            return self._operation(project, zone, "delete", name, done)
        raise HTTPError(405, "badRequest", f"{method} not supported on an instance")

    def _start(self, project: str, zone: str, name: str) -> dict:
        instance = self._instance("GET", project, zone, name)
        if instance["status"] not in ("TERMINATED", "STOPPED", "SUSPENDED"):
            return self._operation(project, zone, "start", name, None)
        # a stopped Spot VM needs new capacity to start: it stays TERMINATED when there is none
        failure = self._zone_error(zone, (instance.get("scheduling") or {}).get("provisioningModel") == "SPOT")

        def done() -> tuple[str, str] | None:
            if failure:
                return failure
            self._set_status(self._state.instances[(project, zone, name)], "RUNNING")
            return None

        return self._operation(project, zone, "start", name, done)
