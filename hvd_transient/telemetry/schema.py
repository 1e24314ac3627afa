"""Every kind of event the run's event log holds, declared once (pure: no I/O).

Each kind is a frozen dataclass of its fields; :data:`KINDS` maps the ``event``
name written to the log to its class. :meth:`hvd_transient.telemetry.events.EventLog.emit`
takes one of these objects, so an unknown kind, a missing or a misspelled field
fails where the event is made (a ``TypeError`` from the dataclass, and a mypy
error before that). A logged event is a :class:`Record`: when, which process,
and the body.

On disk an event is one JSON object, ``{"t", "event", "host", "pid", **fields}``
(:func:`to_json_dict`); :func:`from_json_dict` reads one back. Reading is
lenient, since logs outlive the code that wrote them: unknown fields are
ignored, a missing optional field takes its default, and an event of an
unknown kind, or without a required field, is skipped (``None``).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Generic, Mapping, TypeVar

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventBody:
    """The fields of one event kind; subclasses are registered with :func:`_declare`."""

    #: the name written as the ``event`` field
    event: ClassVar[str] = ""
    #: written to the store before ``emit`` returns: the process may vanish right after
    durable: ClassVar[bool] = False
    #: written at once by the background writer, bypassing the rate limit (followed while the job runs)
    urgent: ClassVar[bool] = False


B = TypeVar("B", bound=EventBody, covariant=True)
T = TypeVar("T", bound=type[EventBody])

#: the fields every event has on disk besides its body's
ENVELOPE = ("t", "event", "host", "pid")
#: event name -> its class
KINDS: dict[str, type[EventBody]] = {}
_FIELDS: dict[type[EventBody], tuple[tuple[str, bool, bool], ...]] = {}  # class -> ((name, required, omit), ...)
#: field metadata: left out of the JSON object while None (an optional field of the bulk of a log's events)
OMIT_NONE = {"omit_none": True}


def _declare(name: str, *, durable: bool = False, urgent: bool = False) -> Callable[[T], T]:
    def register(cls: T) -> T:
        fields = dataclasses.fields(cls)
        if name in KINDS or any(f.name in ENVELOPE for f in fields):
            raise ValueError(f"event kind {name!r} declared twice, or with a field named as one of {ENVELOPE}")
        cls.event, cls.durable, cls.urgent = name, durable, urgent
        KINDS[name] = cls
        _FIELDS[cls] = tuple((f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                              bool(f.metadata.get("omit_none"))) for f in fields)
        return cls
    return register


@dataclass(frozen=True)
class Record(Generic[B]):
    """One logged event: epoch seconds, the writing process, the body."""

    t: float
    host: str
    pid: int
    body: B

    @property
    def event(self) -> str:
        return self.body.event


# --------------------------------------------------------------------------- lifecycle


@_declare("start", urgent=True)
@dataclass(frozen=True)
class Start(EventBody):
    """A worker process began training (its first ring); ``crc``: replicated state, ``full_crc``:
    every variable, ``restored_step``: rank 0 of a cold restart that restored a checkpoint."""

    step: int
    rank: int
    size: int
    crc: int | None = None
    full_crc: int | None = None
    restored_step: int | None = None


@_declare("ring", urgent=True)
@dataclass(frozen=True)
class Ring(EventBody):
    """(every rank) Training (re)started on a ring. ``master_host`` may be None on ranks that do
    not know the master's host name (the plain-Horovod baseline names it on rank 0 only);
    ``lease_generation`` is set on the master only; ``ring`` is unique to this start of training
    on this ring."""

    step: int
    rank: int
    size: int
    master: int
    master_host: str | None
    previous_master: int | None = None
    lease_generation: int | None = None
    #: the ring's id, the same on every rank (its saves' attempt ids start with it); None in older logs
    ring: str | None = field(default=None, metadata=OMIT_NONE)
    #: the member hosts in rank order, the same on every rank; None in older logs and the baselines
    hosts: tuple[str, ...] | None = field(default=None, metadata=OMIT_NONE)


@_declare("lr")
@dataclass(frozen=True)
class Lr(EventBody):
    """The learning rate set for the ring (``mode``: how it scales with the size)."""

    lr: float
    size: int
    mode: str


@_declare("resume_at")
@dataclass(frozen=True)
class ResumeAt(EventBody):
    """(every rank) Where fit resumed; ``samples``: the global sample offset (elastic_dataset only)."""

    step: int
    epoch: int
    batch: int
    steps_per_epoch: int
    samples: int | None = None


@_declare("first_step")
@dataclass(frozen=True)
class FirstStep(EventBody):
    """The first step completed on a new ring; ``samples``: the global sample offset, if tracked."""

    step: int
    size: int
    samples: int | None = field(default=None, metadata=OMIT_NONE)


@_declare("progress")
@dataclass(frozen=True)
class Progress(EventBody):
    """Every N steps; ``samples`` as for :class:`FirstStep`."""

    step: int
    size: int
    samples: int | None = field(default=None, metadata=OMIT_NONE)


@_declare("reset", urgent=True)
@dataclass(frozen=True)
class Reset(EventBody):
    """Horovod reset the ring: ``step`` after it, ``last_step`` before it, ``rolled_back`` the difference;
    ``last_step_at``: when ``last_step`` completed on this rank (where the ring's stall begins)."""

    step: int
    rolled_back: int
    last_step: int
    last_step_at: float | None = field(default=None, metadata=OMIT_NONE)


@_declare("stop_requested", urgent=True)
@dataclass(frozen=True)
class StopRequested(EventBody):
    """(every rank) An operator stop was agreed at this step."""

    step: int


@_declare("train_end", durable=True)
@dataclass(frozen=True)
class TrainEnd(EventBody):
    step: int


@_declare("weights", durable=True)
@dataclass(frozen=True)
class Weights(EventBody):
    """The final weights: ``crc`` of the replicated state (equal on every rank of a healthy run)."""

    step: int
    crc: int
    size: int
    rank: int | None = None


# --------------------------------------------------------------------------- preemption


@_declare("notice", durable=True)
@dataclass(frozen=True)
class Notice(EventBody):
    """This host's watcher saw a preemption notice."""

    source: str
    reason: str
    detected_at: float | None
    deadline: float | None
    #: which bound the deadline was taken from (``hvd_transient.watchers.deadline``); older logs lack it
    deadline_basis: str | None = field(default=None, metadata=OMIT_NONE)


@_declare("early_warning", durable=True)
@dataclass(frozen=True)
class EarlyWarning(EventBody):
    """This host's watcher saw an early warning (AWS rebalance recommendation): a checkpoint is
    taken at once, training goes on, nobody leaves."""

    source: str
    reason: str
    detected_at: float | None


@_declare("notice_agreed", durable=True)
@dataclass(frozen=True)
class NoticeAgreed(EventBody):
    """(every rank) The step at which all ranks acted on a notice; ``leaving``: the hosts newly under
    notice in this round (not those handled in an earlier one); ``deadline``: the commit deadline."""

    step: int
    leaving: tuple[str, ...]
    deadline: float | None
    size: int


@_declare("wait_inflight")
@dataclass(frozen=True)
class WaitInflight(EventBody):
    """An in-flight background save was waited for before the emergency save (older versions;
    now such a save is cancelled: :class:`InflightCancelled`)."""

    step: int


@_declare("inflight_cancelled")
@dataclass(frozen=True)
class InflightCancelled(EventBody):
    """An in-flight background save was cancelled at ``step``: ``reason`` is ``emergency`` (an
    emergency save needs the store) or ``new_ring`` (the ring it was started on is gone)."""

    step: int
    reason: str


@_declare("election", urgent=True)
@dataclass(frozen=True)
class Election(EventBody):
    """The checkpoint master moved (``lease_generation`` on the new master only)."""

    step: int
    old_master: int
    new_master: int
    old_master_host: str
    new_master_host: str
    lease_generation: int | None = None


@_declare("leave_published", durable=True)
@dataclass(frozen=True)
class LeavePublished(EventBody):
    """This host published itself as leaving (host discovery drops it, at ``leave_at`` if set)."""

    step: int
    deadline: float | None
    was_master: bool | None = None
    #: it trains on and discovery drops it only then (``leave="near_deadline"``); None: at once
    leave_at: float | None = field(default=None, metadata=OMIT_NONE)


@_declare("leave_moved", durable=True)
@dataclass(frozen=True)
class LeaveMoved(EventBody):
    """A later round moved this host's leave earlier (its leaving record is written again): discovery
    drops it at ``leave_at``, or at once (None)."""

    step: int
    deadline: float | None
    leave_at: float | None = field(default=None, metadata=OMIT_NONE)


@_declare("leaving_pruned")
@dataclass(frozen=True)
class LeavingPruned(EventBody):
    """(master, when a ring begins) Expired leaving records were deleted."""

    hosts: tuple[str, ...]


#: :class:`HostUpdateAnnounced` ``change``: a VM that Horovod's driver listed but told no rank of, or dropped
ANNOUNCED_JOIN = "join"
ANNOUNCED_REMOVAL = "removal"


@_declare("host_update_announced")
@dataclass(frozen=True)
class HostUpdateAnnounced(EventBody):
    """(rank 0) Horovod's driver lost its one message of a change in the hosts discovery lists (it came as
    the ring re-formed): rank 0 announced it to its own host check. ``change``: ``join`` (a standby ready
    as the ring formed, not in it) or ``removal`` (a VM under notice still in the ring past its due time)."""

    change: str
    hosts: tuple[str, ...]


@_declare("lease_error")
@dataclass(frozen=True)
class LeaseError(EventBody):
    error: str


# --------------------------------------------------------------------------- checkpoints


@_declare("save_start")
@dataclass(frozen=True)
class SaveStart(EventBody):
    """A synchronous save began (``kind``: emergency | final)."""

    step: int
    kind: str  # emergency | periodic | final
    size: int


@_declare("save_end")
@dataclass(frozen=True)
class SaveEnd(EventBody):
    """A synchronous save ended on this rank: ``bytes`` is this rank's share."""

    step: int
    kind: str
    seconds: float
    bytes: int


@_declare("async_save", urgent=True)
@dataclass(frozen=True)
class AsyncSave(EventBody):
    """A background save started; ``stall_ms``: what training waited for the snapshot.
    ``kind``: None for a periodic save, ``early`` when an early warning asked for it."""

    step: int
    stall_ms: float
    size: int
    kind: str | None = field(default=None, metadata=OMIT_NONE)


@_declare("save_skipped")
@dataclass(frozen=True)
class SaveSkipped(EventBody):
    """A periodic save was skipped (one still in flight, or the step already committed)."""

    step: int
    reason: str


@_declare("commit", urgent=True)
@dataclass(frozen=True)
class Commit(EventBody):
    """(master) A checkpoint committed; ``bytes``: the whole step (periodic saves only)."""

    step: int
    kind: str
    size: int
    lease_generation: int | None = None
    bytes: int | None = field(default=None, metadata=OMIT_NONE)


@_declare("save_failed", urgent=True)
@dataclass(frozen=True)
class SaveFailed(EventBody):
    step: int
    kind: str
    error: str


@_declare("restore", urgent=True)
@dataclass(frozen=True)
class Restore(EventBody):
    """(rank 0) A checkpoint was restored: by how many writers it was written, how many bytes."""

    step: int
    writers: int
    bytes: int


# --------------------------------------------------------------------------- the cluster keeper
# (``hvd-transient cluster keep``, on the driver VM)


@_declare("keeper_start")
@dataclass(frozen=True)
class KeeperStart(EventBody):
    """The keeper began: what it keeps, and the prices and caps it counts with (USD)."""

    cluster: str
    workers: int
    zones: tuple[str, ...]
    instance_type: str
    spot_per_hour: float
    on_demand_per_hour: float
    on_demand_after_s: float | None
    max_cost_per_hour: float | None
    max_total_cost: float | None
    interval_s: float


@_declare("keeper_refill")
@dataclass(frozen=True)
class KeeperRefill(EventBody):
    """A worker was started again (``operation`` start; ``was`` its status) or created (create).
    ``reason``: restart | recreate | replace_on_demand | on_demand_fallback; ``avoided_zones``:
    zones skipped because they were backed off after a stock-out or quota error (a failover)."""

    name: str
    zone: str
    provisioning: str  # spot | on-demand
    operation: str
    reason: str
    was: str | None = None
    avoided_zones: tuple[str, ...] = ()


@_declare("keeper_stockout")
@dataclass(frozen=True)
class KeeperStockout(EventBody):
    """A start/create failed for want of capacity (``kind`` stockout) or quota (quota); the zone
    is not tried for that provisioning model for ``retry_in_s``."""

    name: str
    zone: str
    provisioning: str
    operation: str
    code: str
    kind: str
    failures: int
    retry_in_s: float


@_declare("keeper_error")
@dataclass(frozen=True)
class KeeperError(EventBody):
    """An action or the look at the fleet failed otherwise; ``retry_in_s``: the zone's backoff, if any."""

    operation: str
    error: str
    name: str | None = None
    zone: str | None = None
    retry_in_s: float | None = None


@_declare("keeper_release")
@dataclass(frozen=True)
class KeeperRelease(EventBody):
    """An on-demand worker was deleted because a RUNNING Spot worker took its place."""

    name: str
    zone: str
    reason: str


@_declare("keeper_fallback")
@dataclass(frozen=True)
class KeeperFallback(EventBody):
    """On-demand stand-ins began (``phase`` begin: after ``no_spot_s`` without Spot capacity) or
    the last one was released (end: how long it lasted and what the on-demand workers cost)."""

    phase: str
    on_demand_workers: int
    no_spot_s: float | None = None
    seconds: float | None = None
    on_demand_cost: float | None = None


@_declare("keeper_budget")
@dataclass(frozen=True)
class KeeperBudget(EventBody):
    """A cap (``cap`` per_hour | total, ``limit`` USD) stopped ``blocked`` workers from being started
    or created; reported once per distinct message."""

    cap: str
    limit: float
    rate_per_hour: float
    spent: float
    blocked: int
    message: str


@_declare("keeper_cost")
@dataclass(frozen=True)
class KeeperCost(EventBody):
    """The workers' spend so far (USD, accrued by observed RUNNING time), split by provisioning;
    ``on_demand_premium``: what the on-demand time cost beyond the same time on Spot."""

    spent: float
    spent_spot: float
    spent_on_demand: float
    on_demand_premium: float
    rate_per_hour: float
    spot_running: int
    on_demand_running: int
    wanted: int


@_declare("keeper_job")
@dataclass(frozen=True)
class KeeperJob(EventBody):
    """The training job the keeper supervises (``cluster keep --job``). ``phase``: start (the
    first launch) | relaunch (``waited_s`` since the previous attempt ended) | exit (``exit_code``;
    ``seconds`` it ran; ``reason`` no_workers or keeper_stopped when the keeper ended it) |
    give_up (it failed and ``--max-relaunches`` are used up). ``attempt`` counts launches from 1;
    ``workers``: the workers RUNNING at a launch."""

    phase: str
    attempt: int
    workers: tuple[str, ...] = ()
    exit_code: int | None = field(default=None, metadata=OMIT_NONE)
    reason: str | None = field(default=None, metadata=OMIT_NONE)
    waited_s: float | None = field(default=None, metadata=OMIT_NONE)
    seconds: float | None = field(default=None, metadata=OMIT_NONE)


#: every kind the keeper writes (none is a worker's: the run's analysis keeps them apart)
KEEPER_KINDS: tuple[type[EventBody], ...] = (KeeperStart, KeeperRefill, KeeperStockout, KeeperError,
                                             KeeperRelease, KeeperFallback, KeeperBudget, KeeperCost, KeeperJob)


# --------------------------------------------------------------------------- JSON


def to_json_dict(record: Record[EventBody]) -> dict[str, Any]:
    """The on-disk object: the envelope, then the body's fields (tuples become JSON lists)."""
    body = record.body
    out: dict[str, Any] = {"t": record.t, "event": body.event, "host": record.host, "pid": record.pid}
    for name, _required, omit_none in _FIELDS[type(body)]:
        value = getattr(body, name)
        if value is None and omit_none:
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def from_json_dict(raw: Mapping[str, Any]) -> Record[EventBody] | None:
    """A logged object as a typed record; None (and a debug line) for what cannot be one."""
    cls = KINDS.get(str(raw.get("event")))
    t = raw.get("t")
    if cls is None or not isinstance(t, (int, float)) or isinstance(t, bool):
        log.debug("skipping an event of unknown kind or without a time: %.120s", raw)
        return None
    values: dict[str, Any] = {}
    for name, required, _omit_none in _FIELDS[cls]:
        if name in raw:
            value = raw[name]
            values[name] = tuple(value) if isinstance(value, list) else value
        elif required:
            log.warning("skipping a %s event without %r: %.120s", cls.event, name, raw)
            return None
    pid = raw.get("pid")
    return Record(float(t), str(raw.get("host", "?")), int(pid) if isinstance(pid, (int, float)) else 0,
                  cls(**values))


__all__ = ["ANNOUNCED_JOIN", "ANNOUNCED_REMOVAL", "ENVELOPE", "KINDS", "AsyncSave", "Commit", "EarlyWarning",
           "Election", "EventBody", "FirstStep", "HostUpdateAnnounced", "KEEPER_KINDS", "KeeperBudget", "KeeperCost",
           "KeeperError", "KeeperFallback", "KeeperJob", "KeeperRefill", "KeeperRelease", "KeeperStart",
           "KeeperStockout", "LeaseError", "LeaveMoved", "LeavePublished", "LeavingPruned", "Lr", "Notice",
           "NoticeAgreed", "Progress", "Record", "Reset", "Restore", "ResumeAt", "Ring", "SaveEnd", "SaveFailed",
           "SaveSkipped", "SaveStart", "Start", "StopRequested", "TrainEnd", "WaitInflight", "InflightCancelled",
           "Weights", "from_json_dict", "to_json_dict"]
