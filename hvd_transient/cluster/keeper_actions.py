"""What the keeper does to a worker (:class:`Start`, :class:`Create`, :class:`Delete`), or why it waits
(:class:`Wait`), what each VM action came to (:class:`Outcome`), and how an action reads (``--dry-run``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from hvd_transient.cluster.vm_failures import classify_failure

# Action reasons (written into the event log)
RESTART = "restart"                # a stopped Spot VM started again
RECREATE = "recreate"              # a missing Spot worker created
REPLACE_ON_DEMAND = "replace_on_demand"  # a Spot worker created/started while on-demand ones stand in
ON_DEMAND_FALLBACK = "on_demand_fallback"
SPOT_RUNNING = "spot_running"      # why an on-demand worker is deleted


@dataclass(frozen=True)
class Start:
    name: str
    zone: str
    spot: bool
    was: str  # the status it had
    reason: str = RESTART
    operation = "start"


@dataclass(frozen=True)
class Create:
    name: str
    zone: str
    spot: bool
    reason: str
    #: zones skipped for this provisioning model because they are backed off
    avoided: tuple[str, ...] = ()
    operation = "create"


@dataclass(frozen=True)
class Delete:
    name: str
    zone: str
    spot: bool
    reason: str
    operation = "delete"


@dataclass(frozen=True)
class Wait:
    """Nothing (more) can be done this pass; ``message`` says why."""

    reason: str  # "backoff" | "budget"
    message: str
    until: float | None = None  # backoff: when the first zone opens again
    cap: str = ""  # budget: "per_hour" | "total"
    limit: float | None = None
    blocked: int = 0  # budget: workers not started or created


VMAction = Union[Start, Create, Delete]
Action = Union[Start, Create, Delete, Wait]


@dataclass(frozen=True)
class Outcome:
    """What applying one action did: ``error`` None on success, else the API's code and message."""

    action: VMAction
    error: str | None = None
    code: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def failure(self) -> str | None:
        return None if self.ok else classify_failure(self.code)


def describe(action: Action) -> str:
    """One line for people (dry runs, logs)."""
    if isinstance(action, Wait):
        return f"wait    {action.message}"
    kind = "Spot" if action.spot else "on-demand"
    if isinstance(action, Start):
        return f"start   {action.name} ({kind}, {action.zone}, was {action.was}; {action.reason})"
    if isinstance(action, Create):
        avoided = f"; backed off: {', '.join(action.avoided)}" if action.avoided else ""
        return f"create  {action.name} ({kind}, {action.zone}, {action.reason}{avoided})"
    return f"delete  {action.name} ({kind}, {action.zone}): a Spot worker runs in its place"


def action_dict(action: Action) -> dict[str, Any]:
    from dataclasses import asdict

    out = asdict(action)
    out["action"] = type(action).__name__.lower()
    return out


__all__ = [
    "ON_DEMAND_FALLBACK", "RECREATE", "REPLACE_ON_DEMAND", "RESTART", "SPOT_RUNNING", "Action", "Create", "Delete",
    "Outcome", "Start", "VMAction", "Wait", "action_dict", "describe",
]
