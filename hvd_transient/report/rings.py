"""The rings of a run, read from the per-rank ``ring`` events (pure): one :class:`Ring` per (re)start
of training, with its member processes.

A ``ring`` event names its ring (``ring``, the same id on every rank of one start) and the member hosts
in rank order (``hosts``): the rings are its events grouped by id, and a ring's hosts are what its events
say, even for a member whose own event never reached the log. Older logs and the plain-Horovod baseline
carry neither; their rings are rebuilt by grouping the events of one (re)start (same step, size and
master, each process once), which a clock that runs ahead or a lost event can mislead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from hvd_transient.report.records import AnyRecord, ProcessKey
from hvd_transient.report.records import key as _key
from hvd_transient.report.records import of as _of
from hvd_transient.report.run_analysis import Ring
from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.schema import Record


@dataclass(frozen=True)
class _Start:
    """What the ranks of one ring (re)start agree on; ``hosts`` where their events carry them."""

    step: int
    size: int
    master_host: str | None
    hosts: tuple[str, ...] | None = None


_Group = tuple[_Start, list[Record[ev.Ring]]]


def rings_of(events: Sequence[AnyRecord], by_proc: Mapping[ProcessKey, Sequence[AnyRecord]]
             ) -> tuple[list[Ring], list[tuple[ProcessKey, ...]]]:
    """The rings in start order, and the member processes of each (in rank order): those whose own
    ``ring`` event reached the log."""
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
            step=sig.step,
            size=sig.size,
            master_host=str(sig.master_host),
            hosts=sig.hosts if sig.hosts is not None else tuple(k[0] for k in keys),
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


def _group_rings(ring_events: Sequence[Record[ev.Ring]]) -> list[_Group]:
    """Group per-rank ``ring`` events (in time order) into ring (re)starts, in start order: by their
    ring id where they carry one, else as :func:`_guess_rings` rebuilds them."""
    by_id: dict[str, list[Record[ev.Ring]]] = {}
    unnamed: list[Record[ev.Ring]] = []
    for e in ring_events:
        if e.body.ring is not None:
            by_id.setdefault(e.body.ring, []).append(e)
        else:
            unnamed.append(e)
    groups = [(_named_start(members), members) for members in by_id.values()] + _guess_rings(unnamed)
    # a log can hold both (a run resumed by a newer version): the starts interleave by time
    return sorted(groups, key=lambda g: g[1][0].t)


def _named_start(members: Sequence[Record[ev.Ring]]) -> _Start:
    """The start of one ring from its events with one id (every rank writes the same step, size and hosts)."""
    first = members[0].body
    hosts = next((e.body.hosts for e in members if e.body.hosts is not None), None)
    master_host = next((e.body.master_host for e in members if e.body.master_host is not None), None)
    if master_host is None and hosts is not None and 0 <= first.master < len(hosts):
        master_host = hosts[first.master]
    return _Start(step=first.step, size=first.size, master_host=master_host, hosts=hosts)


def _guess_rings(ring_events: Sequence[Record[ev.Ring]]) -> list[_Group]:
    """Group per-rank ``ring`` events without a ring id into ring (re)starts.

    Ranks of one ring all write (step, size, master_host); a process appears at most once
    per ring and a ring has at most ``size`` members. A rank that does not know the
    master's host (``master_host`` None) joins the group its step and size match.
    """
    groups: list[_Group] = []
    for e in ring_events:
        sig = _Start(step=e.body.step, size=e.body.size, master_host=e.body.master_host, hosts=e.body.hosts)
        if groups:
            head, members = groups[-1]
            same_master = None in (head.master_host, sig.master_host) or head.master_host == sig.master_host
            if (head.step == sig.step and head.size == sig.size and same_master
                    and _key(e) not in {_key(m) for m in members} and len(members) < max(1, sig.size)):
                members.append(e)
                groups[-1] = (replace(head, master_host=head.master_host or sig.master_host,
                                      hosts=head.hosts or sig.hosts), members)
                continue
        groups.append((sig, [e]))
    return groups


__all__ = ["rings_of"]
