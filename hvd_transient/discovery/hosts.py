"""Hosts as Horovod sees them: parse ``host[:slots]`` text, filter, format. Pure functions."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterable

from hvd_transient.discovery.errors import DiscoveryConfigError
from hvd_transient.json_numbers import finite_number

if TYPE_CHECKING:
    from hvd_transient.core.membership import LeavingRecord
    from hvd_transient.gcp.instances import Incarnation

# Host names, IPv4 addresses and DNS names; no ':' (Horovod splits on it), no spaces or commas.
_HOST_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int = 1
    # Other names of the same VM (its internal IP, or its instance name when ``name`` is the IP),
    # so a leaving notice published under either name removes it.
    aliases: frozenset[str] = field(default_factory=frozenset)
    # The VM now behind the name (gce): a leaving record of an earlier incarnation no longer applies.
    incarnation: "Incarnation | None" = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not _HOST_RE.match(self.name):
            raise DiscoveryConfigError(
                f"invalid host name {self.name!r}: use a host name or IPv4 address without ':' or spaces"
            )
        if not isinstance(self.slots, int) or self.slots < 1:
            raise DiscoveryConfigError(f"host {self.name!r}: slots must be a positive integer, not {self.slots!r}")

    @property
    def names(self) -> frozenset[str]:
        return self.aliases | {self.name}

    @property
    def line(self) -> str:
        return f"{self.name}:{self.slots}"


def parse_slots(text: str, *, where: str = "") -> int:
    try:
        slots = int(text)
    except ValueError:
        slots = 0
    if slots < 1:
        raise DiscoveryConfigError(f"{where}slots must be a positive integer, not {text!r}")
    return slots


def parse_host_spec(spec: str, default_slots: int = 1, *, where: str = "") -> Host:
    """``"a"`` -> Host("a", default_slots); ``"a:4"`` -> Host("a", 4)."""
    spec = spec.strip()
    name, sep, slots = spec.partition(":")
    if not name:
        raise DiscoveryConfigError(f"{where}empty host name in {spec!r}")
    if sep and ":" in slots:
        raise DiscoveryConfigError(f"{where}{spec!r}: expected host or host:slots")
    if not _HOST_RE.match(name):
        raise DiscoveryConfigError(
            f"{where}invalid host name {name!r}: use a host name or IPv4 address without ':' or spaces"
        )
    return Host(name, parse_slots(slots, where=f"{where}host {name!r}: ") if sep else default_slots)


def parse_host_lines(text: str, default_slots: int = 1, *, origin: str = "") -> list[Host]:
    """Lines of ``host[:slots]``; ``#`` starts a comment; blank lines are ignored."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            hosts.append(parse_host_spec(line, default_slots, where=f"{origin}:{number}: " if origin else ""))
    return hosts


def parse_host_list(csv: str, default_slots: int = 1) -> list[Host]:
    """``"a,b:2, c"`` as given to ``--hosts``."""
    return [parse_host_spec(item, default_slots) for item in csv.split(",") if item.strip()]


def parse_state_document(text: str, default_slots: int = 1, *, origin: str = "") -> list[Host]:
    """A local-simulator state file: JSON (list, or ``{"hosts": [...]}``) or ``host[:slots]`` lines.

    JSON items are ``"host[:slots]"`` strings or ``{"host": ..., "slots": ...}`` objects, which may
    also say which incarnation of the VM is listed (``"started_at"``: Unix seconds of its start,
    ``"instance_id"``), as the Compute API does for the gce backend.
    """
    if not text.lstrip().startswith(("[", "{")):
        return parse_host_lines(text, default_slots, origin=origin)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DiscoveryConfigError(f"{origin}: not valid JSON ({exc})") from None
    items = doc.get("hosts") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise DiscoveryConfigError(f"{origin}: expected a JSON list of hosts or an object with a 'hosts' list")
    hosts = []
    for index, item in enumerate(items):
        where = f"{origin}: hosts[{index}]: "
        if isinstance(item, str):
            hosts.append(parse_host_spec(item, default_slots, where=where))
        elif isinstance(item, dict) and isinstance(item.get("host"), str):
            slots = item.get("slots", default_slots)
            if isinstance(slots, bool) or not isinstance(slots, int):
                raise DiscoveryConfigError(f"{where}slots must be an integer, not {slots!r}")
            host = parse_host_spec(item["host"], slots, where=where)
            hosts.append(replace(host, incarnation=_incarnation(item, where)))
        else:
            raise DiscoveryConfigError(f"{where}expected \"host[:slots]\" or {{\"host\": ..., \"slots\": ...}}")
    return hosts


def _incarnation(item: dict[str, Any], where: str) -> "Incarnation | None":
    from hvd_transient.gcp.instances import Incarnation

    started_at, instance_id = item.get("started_at"), item.get("instance_id")
    if started_at is None and instance_id is None:
        return None
    if started_at is not None:
        if isinstance(started_at, bool) or not isinstance(started_at, (int, float)):
            raise DiscoveryConfigError(f"{where}started_at must be Unix seconds, not {started_at!r}")
        started_at = finite_number(started_at)
        if started_at is None:  # NaN, infinite, or an integer beyond any float
            raise DiscoveryConfigError(f"{where}started_at must be a finite number of Unix seconds")
    return Incarnation(instance_id=None if instance_id is None else str(instance_id), started_at=started_at)


def unique(hosts: Iterable[Host]) -> list[Host]:
    """Drop later duplicates of a name (Horovod would count a host twice)."""
    seen: set[str] = set()
    result = []
    for host in hosts:
        if host.name not in seen:
            seen.add(host.name)
            result.append(host)
    return result


def exclude_leaving(hosts: Iterable[Host], records: Iterable["LeavingRecord"], now: float, *,
                    grace_s: float) -> list[Host]:
    """Hosts none of whose names has a leaving record that still applies to the VM listed now."""
    from hvd_transient.core.membership import excluded

    hosts = list(hosts)
    by_name = {name: host.incarnation for host in hosts for name in host.names}
    gone = excluded(records, by_name, now, grace_s=grace_s)
    return [host for host in hosts if not (host.names & gone)]


def format_hosts(hosts: Iterable[Host]) -> str:
    """What Horovod reads: one ``host:slots`` line per host, nothing at all for no host."""
    lines = [host.line for host in hosts]
    return "".join(f"{line}\n" for line in lines)
