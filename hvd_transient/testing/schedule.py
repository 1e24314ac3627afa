"""Preemption schedules for the local transient cluster (pure).

An action fires once its trigger holds: ``at_step`` (the cluster reached that
training step) or ``at_s`` (seconds since the first training step). Targets:
``worker`` (a live host that is not the checkpoint master), ``master`` (the
current checkpoint master), ``new`` (for ``join``: the next spare host alias),
or a host name.

A schedule file is JSON: ``[{"at_step": 40, "action": "notice", "target": "worker"}, ...]``
with actions ``notice`` (preemption notice, then SIGTERM when the window ends),
``kill`` (no notice: the VM just vanishes) and ``join`` (a new VM appears).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

ACTIONS = ("notice", "kill", "join")
HOURS = 3600.0


class ScheduleError(ValueError):
    """A schedule file or option is malformed."""
    cli_exit_status = 2  # the command line or configuration must change


@dataclass(frozen=True)
class Action:
    action: str
    target: str
    at_step: int | None = None
    at_s: float | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ScheduleError(f"unknown action {self.action!r}; use one of {', '.join(ACTIONS)}")
        if (self.at_step is None) == (self.at_s is None):
            raise ScheduleError(f"{self}: give exactly one of at_step or at_s")
        if self.action == "join" and self.target not in ("new",) and not self.target:
            raise ScheduleError("a join needs target 'new' or a host name")

    def due(self, step: int, elapsed_s: float) -> bool:
        return (self.at_step is not None and step >= self.at_step) or (
            self.at_s is not None and elapsed_s >= self.at_s)

    def describe(self) -> str:
        when = f"step {self.at_step}" if self.at_step is not None else f"{self.at_s:.0f} s"
        return f"{self.action} {self.target} at {when}"


def default_schedule(total_steps: int, *, join: bool = True) -> tuple[Action, ...]:
    """The story the demo tells: a worker is preempted, then the master, then (``join``) a new VM
    joins; with the keeper refilling the preempted VMs the demo needs no scripted join."""
    actions = (
        Action("notice", "worker", at_step=max(1, total_steps // 5)),
        Action("notice", "master", at_step=max(2, 2 * total_steps // 5)),
    )
    return (*actions, Action("join", "new", at_step=max(3, 3 * total_steps // 5))) if join else actions


def load_schedule(path: str | Path) -> tuple[Action, ...]:
    try:
        items = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ScheduleError(f"cannot read schedule {path}: {exc}") from exc
    if not isinstance(items, list):
        raise ScheduleError(f"{path}: a schedule is a JSON list of actions")
    try:
        return tuple(Action(**_fields(item)) for item in items)
    except TypeError as exc:
        raise ScheduleError(f"{path}: {exc}; each action has action, target and at_step or at_s") from exc


def _fields(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ScheduleError(f"schedule entries are objects, got {item!r}")
    return item


def sample_lifetime_h(rng: random.Random) -> float:
    """One GCE preemptible GPU VM lifetime in hours, shaped like ICAC'19 Figure 3.

    About 20% are revoked within the first two hours, about 70% live the full 24 h,
    and the rest are revoked in between.
    """
    u = rng.random()
    if u < 0.20:
        return rng.uniform(0.05, 2.0)
    if u < 0.30:
        return rng.uniform(2.0, 24.0)
    return 24.0


def lifetime_schedule(hosts: Sequence[str], *, seed: int, run_s: float, day_s: float) -> tuple[Action, ...]:
    """Notices at lifetimes drawn per host, 24 hours compressed into ``day_s`` seconds.

    Hosts whose drawn lifetime is the full 24 h, or that would outlive the run
    (``run_s``), are not preempted.
    """
    rng = random.Random(seed)
    actions = []
    for host in hosts:
        hours = sample_lifetime_h(rng)
        at = hours / 24.0 * day_s
        if hours < 24.0 and at < run_s:
            actions.append(Action("notice", host, at_s=round(at, 1)))
    return tuple(sorted(actions, key=lambda a: a.at_s or 0.0))
