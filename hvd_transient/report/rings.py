"""The rings of a run, rebuilt from the per-rank ``ring`` events (pure): one :class:`Ring` per (re)start
of training, with its member processes."""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from hvd_transient.report.records import AnyRecord, ProcessKey
from hvd_transient.report.records import key as _key
from hvd_transient.report.records import of as _of
from hvd_transient.report.run_analysis import Ring
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.schema import Record


def rings_of(events: Sequence[AnyRecord], by_proc: Mapping[ProcessKey, Sequence[AnyRecord]]
             ) -> tuple[list[Ring], list[tuple[ProcessKey, ...]]]:
    """The rings in start order, and the member processes of each (in rank order)."""
    rings: list[Ring] = []
    members_of: list[tuple[ProcessKey, ...]] = []
    seen: set[ProcessKey] = set()
    groups = _group_rings(_of(events, ev.Ring))
    for i, (sig, group) in enumerate(groups):
        members = sorted(group, key=lambda e: (e.body.rank, e.t))
        keys = tuple(_key(e) for e in members)
        new = [k for k in keys if k not in seen]
        relaunch = len(new) == len(keys)
        next_start = min(e.t for e in groups[i + 1][1]) if i + 1 < len(groups) else math.inf
        started_at = min(e.t for e in members)
        ended_at = min(max(by_proc[k][-1].t for k in keys), next_start)
        rings.append(Ring(
            started_at=started_at,
            ended_at=ended_at,
            step=sig["step"],
            size=sig["size"],
            master_host=str(sig["master_host"]),
            hosts=tuple(k[0] for k in keys),
            joined=() if relaunch else tuple(k[0] for k in new),
            relaunch=relaunch,
            steps_per_s=_steps_per_s([by_proc[k] for k in keys], started_at, ended_at),
        ))
        members_of.append(keys)
        seen.update(keys)
    return rings, members_of


def _steps_per_s(members: Sequence[Sequence[AnyRecord]], start: float, end: float) -> float | None:
    best = max(([e for e in _of(evs, ev.Progress) if start <= e.t <= end] for evs in members), key=len, default=[])
    if len(best) < 2 or best[-1].t <= best[0].t:
        return None
    return (best[-1].body.step - best[0].body.step) / (best[-1].t - best[0].t)


def _group_rings(ring_events: Sequence[Record[ev.Ring]]) -> list[tuple[dict[str, Any], list[Record[ev.Ring]]]]:
    """Group per-rank ``ring`` events into ring (re)starts.

    Ranks of one ring all write (step, size, master_host); a process appears at most once
    per ring and a ring has at most ``size`` members. A rank that does not know the
    master's host (``master_host`` None) joins the group its step and size match.
    """
    groups: list[tuple[dict[str, Any], list[Record[ev.Ring]]]] = []
    for e in ring_events:
        sig: dict[str, Any] = {"step": e.body.step, "size": e.body.size, "master_host": e.body.master_host}
        if groups:
            head, members = groups[-1]
            same_master = None in (head["master_host"], sig["master_host"]) or head["master_host"] == sig["master_host"]
            if (head["step"] == sig["step"] and head["size"] == sig["size"] and same_master
                    and _key(e) not in {_key(m) for m in members} and len(members) < max(1, sig["size"])):
                members.append(e)
                head["master_host"] = head["master_host"] or sig["master_host"]
                continue
        groups.append((sig, [e]))
    return groups



__all__ = ["rings_of"]
