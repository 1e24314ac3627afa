"""The state of one emulated VM and what each cloud's metadata API says about it.

Pure logic, no I/O and no locks: ``registry.py`` serialises access and
``handler.py`` turns these values into HTTP replies. Keeping the cloud
semantics here means they can be read (and tested) without a server.

Faults (``Fault``) model a metadata server that misbehaves: every reply of one instance, on
every cloud's API, is an error, garbage, late (``hang``: held until the fault ends, then
answered), never sent (``lose``) or sent a byte at a time (``trickle``: the headers at once,
then one byte of the real body every ``trickle_s`` seconds). A fault lasts until it is cleared,
or ends by itself at ``fault_until`` when it was set for a given time.

A VM's name (``vm_name``: GCE ``instance/name``, Azure ``compute/name`` and the ``Resources``
of its events) may differ from the name the emulator knows it by (the Horovod host name, which
is also its OS host name, Azure ``osProfile.computerName``). A notice may have started before
now (``preempt(ago=...)``: a watcher that starts after it). An Azure event is ``Started``,
with a blank ``NotBefore``, once its ``NotBefore`` has passed or once it is started early
(``start_azure_event``, what approving it does on Azure).

Timeline of a preemption (all times are epoch seconds)::

    scheduled_at          notice_at = scheduled_at          deadline = notice_at + window
        |  preempt(at=T)      |  GCE preempted=TRUE            |  kill_pid gets its signal
        |                     |  AWS instance-action appears   |  (AWS "time", Azure NotBefore)
        |                     |  Azure Preempt event appears   |
"""
from __future__ import annotations

import email.utils
import enum
import hashlib
import json
import math
import signal
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

DEFAULT_WINDOW_S = 30.0
DEFAULT_PROJECT_ID = "hvd-transient-local"
DEFAULT_PROJECT_NUMBER = 123456789012
DEFAULT_ZONE = "us-central1-a"
MAINTENANCE_EVENTS = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")
AWS_TOKEN_TTL_MAX_S = 21600
# A 200 reply whose body is no metadata at all (what a captive proxy or a
# broken server might send); not UTF-8 on purpose.
GARBAGE_BODY = b"<html><body>\xff\xfe\x00 502 upstream confused %%\x07</body></html>"


class EmulatorError(Exception):
    """Base class of the errors the emulator's control API reports."""
    cli_exit_status = 2  # the command line or configuration must change

    http_status = 500


class UnknownInstanceError(EmulatorError, KeyError):
    http_status = 404

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown instance"


class ConflictError(EmulatorError):
    http_status = 409


class InstanceExistsError(ConflictError):
    """An instance of that name already exists."""


class AlreadyPreemptedError(ConflictError):
    """The instance already has a preemption scheduled or under way."""


class InvalidRequestError(EmulatorError, ValueError):
    http_status = 400


class Fault(str, enum.Enum):
    """A failure injected into every metadata reply of one instance (GCE, AWS and Azure alike)."""

    OK = "ok"            # no fault
    HANG = "hang"        # hold each request unanswered until the fault ends (or the server
                         # stops), then answer it with the state of that moment
    LOSE = "lose"        # accept and read each request, never answer it, not even after the
                         # fault ends: it is held until its client hangs up or the server stops
    ERROR_500 = "500"    # 500 Internal Server Error
    ERROR_503 = "503"    # 503 Service Unavailable (a metadata server that is restarting)
    GARBAGE = "garbage"  # 200 with a nonsense body
    TRICKLE = "trickle"  # the real answer: its headers at once, then one byte of body every
                         # ``trickle_s`` seconds

    @property
    def answers(self) -> bool:
        """Whether a request under this fault gets the real answer (perhaps slowly)."""
        return self in (Fault.OK, Fault.TRICKLE)

    @classmethod
    def parse(cls, value: str) -> "Fault":
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(f.value for f in cls)
            raise InvalidRequestError(f"unknown fault {value!r}: use one of {valid}") from None


def etag_of(key: str, value: str) -> str:
    """GCE ETags follow the content: a changed value always has a new ETag."""
    return hashlib.sha256(f"{key}\0{value}".encode()).hexdigest()[:16]


def iso8601_z(epoch: float) -> str:
    """AWS spot ``time`` format, e.g. ``2026-11-22T08:22:00Z`` (whole seconds)."""
    return datetime.fromtimestamp(int(epoch), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc1123(epoch: float) -> str:
    """Azure ``NotBefore`` format, e.g. ``Mon, 19 Sep 2016 18:29:47 GMT``."""
    return email.utils.formatdate(epoch, usegmt=True)


def _iso8601_micro(epoch: float) -> str:
    """ISO 8601 with microseconds, never later than ``epoch`` (datetime would round to nearest)."""
    micros = math.floor(epoch * 1_000_000)
    whole = datetime.fromtimestamp(micros // 1_000_000, tz=timezone.utc)
    return whole.strftime("%Y-%m-%dT%H:%M:%S") + f".{micros % 1_000_000:06d}Z"


#: how AWS ``instance-action`` ``time`` may be written (``preempt(aws_time_format=...)``); the
#: real service sends ``iso8601``, the rest are what a server could send too
AWS_TIME_FORMATS: dict[str, Callable[[float], Any]] = {
    "iso8601": iso8601_z,
    "iso8601-lower-z": lambda t: iso8601_z(t).replace("Z", "z"),
    "iso8601-fraction": lambda t: _iso8601_micro(t),
    "iso8601-offset": lambda t: datetime.fromtimestamp(int(t), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S+0000"),
    "iso8601-no-zone": lambda t: datetime.fromtimestamp(int(t), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"),
    "iso8601-minutes": lambda t: datetime.fromtimestamp(int(t), tz=timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
    "epoch": lambda t: str(int(t)),
    "epoch-number": int,
    "rfc1123": rfc1123,
    "unreadable": lambda t: "in two minutes",
    "missing": lambda t: None,
}


def parse_signal(value: int | str | None) -> signal.Signals:
    if value is None:
        return signal.SIGTERM
    try:
        if isinstance(value, int) or str(value).isdigit():
            return signal.Signals(int(value))
        name = str(value).upper()
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise InvalidRequestError(f"unknown signal {value!r}: use a name like SIGTERM or a number") from None


@dataclass(frozen=True)
class InstanceSnapshot:
    """A consistent, read-only view of one instance (what the control API returns)."""

    name: str
    hostname: str
    zone: str
    project_id: str
    preempted: bool
    maintenance_event: str
    fault: str
    fault_until: float | None  # when a fault set for a given time ends by itself
    window: float | None
    scheduled_at: float | None
    notice_at: float | None
    deadline: float | None
    rebalance_at: float | None
    kill_pid: int | None
    kill_signal: str | None
    killed_at: float | None
    kill_error: str | None
    requests: int
    fault_hits: dict[str, int]
    path_hits: dict[str, int]
    vm_name: str = ""
    trickle_s: float = 0.0
    aws_time_format: str = "iso8601"
    azure_started_at: float | None = None  # an Azure event started early (approved)

    def to_json(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


@dataclass
class InstanceState:
    """Mutable state of one emulated VM. Not thread-safe: the registry locks around it."""

    name: str
    hostname: str
    zone: str = DEFAULT_ZONE
    project_id: str = DEFAULT_PROJECT_ID
    project_number: int = DEFAULT_PROJECT_NUMBER
    maintenance_event: str = "NONE"
    fault: Fault = Fault.OK
    fault_until: float | None = None
    window: float | None = None
    scheduled_at: float | None = None
    notice_at: float | None = None
    kill_pid: int | None = None
    kill_signal: signal.Signals | None = None
    killed_at: float | None = None
    kill_error: str | None = None
    azure_incarnation: int = 1
    aws_tokens: dict[str, float] = field(default_factory=dict)  # token -> expiry epoch
    requests: int = 0
    fault_hits: dict[str, int] = field(default_factory=dict)  # fault -> requests that met it
    path_hits: dict[str, int] = field(default_factory=dict)   # API path (no query) -> requests
    attributes: dict[str, str] = field(default_factory=dict)  # custom metadata (instance/attributes/)
    rebalance_at: float | None = None  # AWS: when a rebalance recommendation was issued
    vm_name: str | None = None  # the VM's own name where it is not ``name``
    trickle_s: float = 0.5  # seconds between two bytes of a trickled reply
    aws_time_format: str = "iso8601"
    azure_started_at: float | None = None

    @property
    def vm(self) -> str:
        """The VM's name (GCE ``instance/name``, Azure ``compute/name``)."""
        return self.vm_name or self.name

    # ---- preemption life cycle -------------------------------------------------
    @property
    def preempted(self) -> bool:
        return self.notice_at is not None

    @property
    def deadline(self) -> float | None:
        if self.notice_at is None or self.window is None:
            return None
        return self.notice_at + self.window

    def schedule_preemption(self, at: float, window: float, kill_pid: int | None,
                            kill_signal: signal.Signals, aws_time_format: str = "iso8601") -> None:
        if aws_time_format not in AWS_TIME_FORMATS:
            raise InvalidRequestError(f"unknown AWS time format {aws_time_format!r}: use one of "
                                      f"{', '.join(AWS_TIME_FORMATS)}")
        if self.preempted or self.scheduled_at is not None:
            raise AlreadyPreemptedError(
                f"instance {self.name!r} is already preempted or scheduled for preemption; "
                "reset it first to model a new VM under the same name")
        if window < 0:
            raise InvalidRequestError(f"notice window must be >= 0 seconds, got {window}")
        self.scheduled_at, self.window = at, window
        self.kill_pid, self.kill_signal = kill_pid, kill_signal
        self.aws_time_format = aws_time_format

    def backdate_notice(self, at: float, now: float) -> None:
        """Make a scheduled notice one that came at ``at``, before ``now`` (a watcher that starts
        after it never saw it come)."""
        if self.scheduled_at is None or self.preempted or at > now:
            raise InvalidRequestError("only a notice scheduled for a time already past can be backdated")
        self.notice_at = at
        self.azure_incarnation += 1

    def start_azure_event(self, now: float) -> None:
        """Azure: the eviction starts now, before its ``NotBefore`` (as approving the event does)."""
        if not self.preempted:
            raise InvalidRequestError(f"instance {self.name!r} has no notice whose event could start")
        if self.azure_started_at is None:
            self.azure_started_at = now
            self.azure_incarnation += 1

    def activate_if_due(self, now: float) -> bool:
        """Turn a scheduled preemption into a visible notice once its time has come."""
        if self.scheduled_at is None or self.preempted or now < self.scheduled_at:
            return False
        self.notice_at = max(now, self.scheduled_at)
        self.azure_incarnation += 1
        return True

    def kill_due(self, now: float) -> bool:
        return (self.kill_pid is not None and self.killed_at is None and self.kill_error is None
                and self.deadline is not None and now >= self.deadline)

    def next_due(self) -> float | None:
        """The next time the scheduler must act for this instance, if any."""
        dues = [self.fault_until]
        if self.scheduled_at is not None and not self.preempted:
            dues.append(self.scheduled_at)
        elif self.kill_pid is not None and self.killed_at is None and self.kill_error is None:
            dues.append(self.deadline)
        return min((d for d in dues if d is not None), default=None)

    # ---- faults -------------------------------------------------------------------
    def set_fault(self, fault: Fault, *, now: float, duration: float | None = None,
                  trickle_s: float | None = None) -> None:
        """Apply ``fault`` until cleared or, with ``duration``, for that many seconds from ``now``;
        ``trickle_s``: the seconds between two bytes of a trickled reply."""
        if trickle_s is not None:
            if not math.isfinite(trickle_s) or trickle_s <= 0:
                raise InvalidRequestError(f"trickle interval must be a positive number of seconds, got {trickle_s}")
            self.trickle_s = trickle_s
        if duration is not None:
            if fault is Fault.OK:
                raise InvalidRequestError("a duration needs a fault mode other than 'ok'")
            if not math.isfinite(duration) or duration <= 0:
                raise InvalidRequestError(f"fault duration must be a positive number of seconds, got {duration}")
        self.fault = fault
        self.fault_until = None if duration is None else now + duration

    def end_fault_if_due(self, now: float) -> bool:
        """Clear a fault set for a given time once that time is over."""
        if self.fault_until is None or now < self.fault_until:
            return False
        self.fault, self.fault_until = Fault.OK, None
        return True

    def reset(self) -> None:
        """A fresh VM reusing the name: no notice, no maintenance, no fault."""
        changed = self.preempted
        self.maintenance_event, self.fault, self.fault_until = "NONE", Fault.OK, None
        self.window = self.scheduled_at = self.notice_at = self.rebalance_at = self.azure_started_at = None
        self.aws_time_format = "iso8601"
        self.kill_pid = self.kill_signal = self.killed_at = self.kill_error = None
        self.aws_tokens.clear()
        if changed:
            self.azure_incarnation += 1

    def set_maintenance(self, event: str) -> None:
        event = str(event).upper()
        if event not in MAINTENANCE_EVENTS:
            raise InvalidRequestError(
                f"unknown maintenance event {event!r}: use one of {', '.join(MAINTENANCE_EVENTS)}")
        self.maintenance_event = event

    # ---- GCE --------------------------------------------------------------------
    def gce_values(self) -> dict[str, str]:
        """Every GCE key this emulator serves, relative to ``computeMetadata/v1/``."""
        return {
            "instance/preempted": "TRUE" if self.preempted else "FALSE",
            "instance/maintenance-event": self.maintenance_event,
            "instance/hostname": self.hostname,
            "instance/name": self.vm,
            "instance/id": str(int(hashlib.sha256(self.name.encode()).hexdigest()[:15], 16)),
            "instance/zone": f"projects/{self.project_number}/zones/{self.zone}",
            "instance/machine-type": f"projects/{self.project_number}/machineTypes/n1-standard-8",
            # a Spot VM: what the real server shows under scheduling/
            "instance/scheduling/automatic-restart": "FALSE",
            "instance/scheduling/on-host-maintenance": "TERMINATE",
            "instance/scheduling/preemptible": "TRUE",
            **({f"instance/attributes/{k}": v for k, v in self.attributes.items()}
               or {"instance/attributes/": ""}),
            **{f"instance/network-interfaces/0/{k}": v for k, v in self._network_interface().items()},
            "project/project-id": self.project_id,
            "project/numeric-project-id": str(self.project_number),
            "project/attributes/": "",
        }

    def _network_interface(self) -> dict[str, str]:
        """nic0 of a VPC "default" network; the address follows the name, like the instance id."""
        digest = int(hashlib.sha256(self.name.encode()).hexdigest()[:8], 16)
        ip = f"10.128.{digest % 16}.{digest // 16 % 252 + 2}"  # in 10.128.0.0/20, past the gateway
        return {
            "gateway": "10.128.0.1",
            "ip": ip,
            # GCE MACs are 42:01 followed by the internal IPv4 address
            "mac": "42:01:" + ":".join(f"{int(octet):02x}" for octet in ip.split(".")),
            "mtu": "1460",
            "network": f"projects/{self.project_number}/networks/default",
            "subnetmask": "255.255.240.0",
        }

    # ---- AWS IMDSv2 -------------------------------------------------------------
    def aws_token_valid(self, token: str | None, now: float) -> bool:
        expiry = self.aws_tokens.get(token or "")
        return expiry is not None and now < expiry

    def aws_values(self) -> dict[str, str]:
        """IMDS keys relative to ``latest/meta-data/``; absent keys are 404."""
        values = {
            "instance-id": "i-" + hashlib.sha256(self.name.encode()).hexdigest()[:17],
            "hostname": self.hostname,
            "local-hostname": self.hostname,
            "placement/availability-zone": self.zone,
        }
        if self.rebalance_at is not None:
            values["events/recommendations/rebalance"] = json.dumps({"noticeTime": iso8601_z(self.rebalance_at)})
        if self.preempted and self.deadline is not None:
            when = AWS_TIME_FORMATS[self.aws_time_format](self.deadline)
            values["spot/instance-action"] = json.dumps(
                {"action": "terminate", **({} if when is None else {"time": when})})
        return values

    # ---- Azure Scheduled Events -------------------------------------------------
    def azure_started(self, now: float) -> bool:
        """An event starts once its NotBefore has passed, or once started early."""
        return self.azure_started_at is not None or (self.deadline is not None and now >= self.deadline)

    def azure_events(self, now: float) -> list[dict[str, Any]]:
        """This VM's Scheduled Events (the registry shows every VM's to every VM, as Azure does
        within an availability set)."""
        events = []
        if self.preempted and self.deadline is not None:
            started = self.azure_started(now)
            events.append({
                "EventId": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{self.name}/{self.notice_at}")).upper(),
                "EventType": "Preempt",
                "ResourceType": "VirtualMachine",
                "Resources": [self.vm],
                "EventStatus": "Started" if started else "Scheduled",
                "NotBefore": "" if started else rfc1123(self.deadline),
                "Description": "The virtual machine is being evicted (Spot).",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            })
        return events

    def azure_compute(self) -> dict[str, Any]:
        """The part of IMDS ``/metadata/instance/compute`` the watchers read (and a little more)."""
        return {
            "name": self.vm,
            "osProfile": {"computerName": self.hostname, "adminUsername": "azureuser"},
            "location": "eastus",
            "priority": "Spot",
            "resourceGroupName": self.project_id,
            "vmId": str(uuid.uuid5(uuid.NAMESPACE_URL, f"azure/{self.name}")),
            "vmScaleSetName": "",
            "vmSize": "Standard_NC6s_v3",
            "zone": "",
        }

    # ---- views ------------------------------------------------------------------
    def snapshot(self) -> InstanceSnapshot:
        return InstanceSnapshot(
            name=self.name, hostname=self.hostname, zone=self.zone, project_id=self.project_id,
            preempted=self.preempted, maintenance_event=self.maintenance_event,
            fault=self.fault.value, fault_until=self.fault_until, window=self.window, scheduled_at=self.scheduled_at,
            notice_at=self.notice_at, deadline=self.deadline, rebalance_at=self.rebalance_at,
            kill_pid=self.kill_pid,
            kill_signal=self.kill_signal.name if self.kill_signal else None,
            killed_at=self.killed_at, kill_error=self.kill_error,
            requests=self.requests, fault_hits=dict(self.fault_hits), path_hits=dict(self.path_hits),
            vm_name=self.vm, trickle_s=self.trickle_s, aws_time_format=self.aws_time_format,
            azure_started_at=self.azure_started_at,
        )
