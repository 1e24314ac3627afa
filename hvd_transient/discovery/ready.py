"""The join gate: a new VM is offered to Horovod once its standby worker, or its boot, is ready.

Horovod starts a joining host's worker only after every current worker has reset, so with
a cold start the survivors wait for the newcomer's whole start-up (interpreter, TensorFlow,
model build, first trace). A VM that boots while the job runs starts a *standby* instead
(``python -m hvd_transient.worker --standby``, :mod:`hvd_transient.join.standby`), which does all of
that before the VM is listed, then publishes ``hosts/ready/<host>.json`` in the run's store.
A VM without a standby publishes the same record at the end of its boot (``hvd-transient
ready``, from its startup script): a worker started on a VM that is still installing or
starting sshd fails, and Horovod blacklists the host. Discovery holds such a VM back until that
record exists for its current incarnation, for at most ``join_timeout_s`` after the VM started;
after that it is listed anyway (and joins cold).

Which hosts are held back (:class:`JoinGate`, pure):

* only VMs that started after ``standby_since`` (``--standby-since``, normally when the job
  was launched): hosts present at launch are never held back;
* only VMs whose start time is known (the gce backend's ``lastStartTimestamp``, the local
  simulator's ``started_at``); a host without one is listed as before;
* a record applies to the VM listed now if it was published after that VM started and, where
  both are known, names the same instance id (a STOP-preempted VM started again, or a VM
  recreated under the same name, waits for its new standby);
* VMs that started together join together (``gather_s``, ``--join-gather``): a ready VM is
  also held back while a VM that started within ``gather_s`` of it, and before it was ready,
  is still warming up, for at most ``gather_s`` after the first of the VMs that started within
  ``gather_s`` of it was ready (so those ready by then are listed in one call). Each listing
  is a ring change that stalls every worker (a Horovod reset, and on GPUs a new NCCL
  communicator); VMs that a wave of preemptions brought back together would otherwise each
  cost one as its standby came ready, where holding one back costs only its own share of the
  throughput. A VM once let through is never held back again (a host taken out of the list
  is a worker Horovod stops, and its standby is spent): discovery remembers the VMs it let
  through for the job (``--listed-file``: one small file on the launching host, where Horovod
  runs discovery), whatever it reads later (a peer the cloud lists late, a record rewritten,
  its clock stepped back). The rule alone already ends only once where the cloud lists a VM
  from its start and records are not rewritten: the peers it waits for started before the VM
  was ready, they come from the cloud's list before leaving records are applied (a record
  that expires would bring a peer back), and a peer past its join timeout still counts for
  when the first was ready.

The record format (JSON, times Unix seconds)::

    {"host": "w-3", "ready_at": 1764000100.0, "pid": 4242, "instance_id": "4521..." | null}

Records are overwritten by the host's next standby and never block anything once stale, so
nobody deletes them.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Iterable, Mapping, Sequence

from hvd_transient.discovery.hosts import Host, unique
from hvd_transient.json_numbers import finite_number

if TYPE_CHECKING:
    from ckpt_service.stores.base import ObjectStore
    from hvd_transient.gcp.instances import Incarnation

log = logging.getLogger(__name__)

#: seconds after a new VM started during which discovery waits for its standby
DEFAULT_JOIN_TIMEOUT_S = 120.0
#: how long discovery holds a new VM back at most (seconds; ``--join-timeout``'s default)
JOIN_TIMEOUT_ENV = "HVDT_JOIN_TIMEOUT_S"
#: how long VMs that started together wait for each other (seconds; ``--join-gather``'s default)
DEFAULT_JOIN_GATHER_S = 10.0
JOIN_GATHER_ENV = "HVDT_JOIN_GATHER_S"
#: where discovery keeps the VMs it let through the gate (``--listed-file``'s default; else :func:`listed_path`)
LISTED_FILE_ENV = "HVDT_LISTED_FILE"
#: the job's launch time (Unix seconds), set by whoever launches it: VMs started later publish a ready
#: record (their standby's, or their boot's) before they are listed
STANDBY_SINCE_ENV = "HVDT_STANDBY_SINCE"


@dataclass(frozen=True)
class ReadyRecord:
    host: str
    ready_at: float
    pid: int | None = None
    instance_id: str | None = None  # the cloud's id of the VM the standby runs on, where known

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, host: str, data: bytes) -> "ReadyRecord | None":
        """A stored record, or None if it cannot be read (such a record admits nobody)."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep ([[[[...)
            return None
        ready_at = finite_number(doc.get("ready_at")) if isinstance(doc, dict) else None
        if ready_at is None:
            return None
        pid, instance_id = doc.get("pid"), doc.get("instance_id")
        return cls(host=host, ready_at=ready_at,
                   pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                   instance_id=str(instance_id) if instance_id not in (None, "") else None)

    def applies_to(self, incarnation: "Incarnation") -> bool:
        """Whether this record was published by a standby of the VM ``incarnation`` describes (pure)."""
        if self.instance_id and incarnation.instance_id and self.instance_id != incarnation.instance_id:
            return False
        return incarnation.started_at is None or self.ready_at >= incarnation.started_at


@dataclass(frozen=True)
class ListedVM:
    """A VM (one incarnation) that discovery admitted once: whatever it reads later (a peer listed late by the
    cloud, a record rewritten, its clock stepped back), it does not hold that VM back again (a host taken out of
    the list is a worker Horovod stops, and its standby is spent)."""

    name: str
    instance_id: str | None
    started_at: float | None

    @classmethod
    def of(cls, host: Host) -> "ListedVM":
        incarnation = host.incarnation
        return cls(host.name, incarnation.instance_id if incarnation else None,
                   incarnation.started_at if incarnation else None)


@dataclass(frozen=True)
class JoinGate:
    """Holds back VMs that started after ``standby_since`` until their standby is ready, and ready ones while
    a VM that started with them (within ``gather_s``) is still warming up, for at most ``gather_s``."""

    standby_since: float
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    gather_s: float = 0.0

    def awaits(self, host: Host, now: float) -> bool:
        """Whether ``host``'s listing depends on its standby's readiness at ``now`` (pure)."""
        started = host.incarnation.started_at if host.incarnation is not None else None
        return started is not None and started > self.standby_since and now < started + self.join_timeout_s

    def admit(self, hosts: Iterable[Host], records: Iterable[ReadyRecord], now: float, *,
              started_with: Iterable[Host] | None = None, listed: Collection[ListedVM] = ()) -> list[Host]:
        """``hosts`` without those still waiting for their standby, or for VMs that started with them (pure).
        ``started_with``: every VM the cloud lists, before any is left out as leaving (default ``hosts``);
        ``listed``: the VMs (incarnations) admitted before, never held back again."""
        by_name: dict[str, list[ReadyRecord]] = {}
        for record in records:
            by_name.setdefault(record.host, []).append(record)
        hosts = list(hosts)
        everyone = unique([*hosts, *(started_with or ())])
        admitted = []
        for host in hosts:
            if not self.awaits(host, now) or ListedVM.of(host) in listed:
                admitted.append(host)
                continue
            ready_at = _ready_at(host, by_name)
            if ready_at is None:
                log.info("holding %s back until its standby is ready (at most %.0fs after its start)",
                         host.name, self.join_timeout_s)
            elif self._gathering(host, ready_at, everyone, by_name, now):
                log.info("holding %s back while VMs that started with it warm up (at most %.0fs)",
                         host.name, self.gather_s)
            else:
                admitted.append(host)
        return admitted

    def _gathering(self, host: Host, ready_at: float, everyone: Sequence[Host],
                   by_name: Mapping[str, Sequence[ReadyRecord]], now: float) -> bool:
        """Whether the ready ``host`` waits for a VM that started within ``gather_s`` of it and before it was
        ready, still warming up: until ``gather_s`` after the first VM that started within ``gather_s`` of it
        was ready."""
        if self.gather_s <= 0:
            return False
        assert host.incarnation is not None and host.incarnation.started_at is not None  # awaited
        started = host.incarnation.started_at
        first_ready, waiting = ready_at, False
        for peer in everyone:
            peer_started = peer.incarnation.started_at if peer.incarnation is not None else None
            if peer.name == host.name or peer_started is None or peer_started <= self.standby_since \
                    or abs(peer_started - started) > self.gather_s:
                continue
            peer_ready = _ready_at(peer, by_name)
            if peer_ready is not None:
                first_ready = min(first_ready, peer_ready)
            elif peer_started <= ready_at and self.awaits(peer, now):
                waiting = True
        return waiting and now < first_ready + self.gather_s


def _ready_at(host: Host, by_name: Mapping[str, Sequence[ReadyRecord]]) -> float | None:
    """When the VM listed as ``host`` published itself ready (its first record that applies), or None."""
    assert host.incarnation is not None  # only awaited hosts are asked about
    times = [r.ready_at for name in host.names for r in by_name.get(name, ()) if r.applies_to(host.incarnation)]
    return min(times) if times else None


# ---- the store (I/O) ----------------------------------------------------------------------------


def publish_ready(store: "ObjectStore", host: str, *, pid: int | None = None, instance_id: str | None = None,
                  now: float | None = None) -> ReadyRecord:
    from ckpt_service.stores.base import check_key
    from hvd_transient.store_keys import ready_key

    record = ReadyRecord(host=host, ready_at=time.time() if now is None else now, pid=pid,
                         instance_id=instance_id)
    store.put(check_key(ready_key(host)), record.to_json())
    log.info("published %s as ready to join", host)
    return record


def read_listed(path: Path) -> set[ListedVM]:
    """The VMs this job's discovery admitted from the gate before (an unreadable file is none: the gather may
    hold one of them again, nothing worse)."""
    try:
        items = json.loads(path.read_text())
        return {ListedVM(str(name), None if iid is None else str(iid), None if at is None else float(at))
                for name, iid, at in items}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, TypeError, RecursionError, OverflowError) as exc:
        log.warning("cannot read %s (%s): treating it as empty", path, exc)
        return set()


def write_listed(path: Path, vms: Iterable[ListedVM]) -> None:
    """Replace ``path`` with ``vms`` at once (a reader sees the old list or the new one); a failure is logged."""
    rows = sorted(([vm.name, vm.instance_id, vm.started_at] for vm in vms), key=repr)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rows))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write %s (%s): a VM listed now may be held back by the gather again", path, exc)


def listed_path(store_url: str, standby_since: float) -> Path:
    """Where discovery keeps the VMs it admitted for the job launched at ``standby_since`` on ``store_url``
    (Horovod runs discovery on the launching host, one call at a time)."""
    import hashlib
    import tempfile

    digest = hashlib.sha256(f"{store_url}\0{standby_since!r}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "hvd-transient" / f"listed-{digest}.json"


def read_ready(store: "ObjectStore") -> list[ReadyRecord]:
    """Every readable record in the store (one deleted while listing is skipped). An entry that is no record (a
    file whose name is no store key, a local link that leads nowhere) is skipped with a warning, as unreadable
    contents are: its VM waits for its join timeout, and the others are listed."""
    from ckpt_service.errors import BadStoreKeyError, ObjectNotFoundError
    from hvd_transient import store_keys as keys

    records = []
    for key in store.list(keys.READY_PREFIX):
        host = keys.host_of_ready_key(key)
        if host is None:
            continue
        try:
            record = ReadyRecord.from_json(host, store.get(key))
        except ObjectNotFoundError:
            continue
        except (BadStoreKeyError, OSError) as exc:
            log.warning("skipping %r in the ready records: %s", key, exc)
            continue
        if record is not None:
            records.append(record)
    return records


def ready_from_url(url: str, *, timeout: float = 10.0) -> list[ReadyRecord]:
    from hvd_transient.discovery.leaving import read_from_url

    return read_from_url(url, read_ready, timeout=timeout, what="ready standbys")
