"""One :class:`Join` per host entering a running ring, with the survivors' stall (pure)."""
from __future__ import annotations

import math
from typing import Sequence

from hvd_transient.report.records import TRAINING_KINDS, AnyRecord, ProcessKey
from hvd_transient.report.records import key as _key
from hvd_transient.report.records import of as _of
from hvd_transient.report.records import of_any as _of_any
from hvd_transient.report.run_analysis import Join, Ring
from hvd_transient.telemetry import schema as ev


def joins_of(events: Sequence[AnyRecord], rings: Sequence[Ring],
             ring_members: Sequence[tuple[ProcessKey, ...]]) -> tuple[Join, ...]:
    """The joins of ``rings`` (a relaunch is none); ``ring_members``: the member processes of each ring."""
    joins = []
    training = _of_any(events, TRAINING_KINDS)
    first_steps = _of(events, ev.FirstStep)
    resets = _of(events, ev.Reset)
    for i, (ring, members) in enumerate(zip(rings, ring_members)):
        if ring.relaunch or not ring.joined or i == 0:
            continue
        survivors = {k for k in members if k[0] not in ring.joined}
        since, until = rings[i - 1].started_at, rings[i + 1].started_at if i + 1 < len(rings) else math.inf
        # Horovod resets the survivors (rendezvous included) before the new ring's ring events
        theirs = [e for e in resets if _key(e) in survivors and since < e.t <= ring.started_at]
        changed_at = min((e.t for e in theirs), default=ring.started_at)
        # the survivors' last completed step, as their resets give it; else (older logs) their last
        # training event, which can be up to one progress interval earlier
        last_steps = [e.body.last_step_at for e in theirs
                      if e.body.last_step_at is not None and since <= e.body.last_step_at <= changed_at]
        stalled_from = max(last_steps, default=None) or max(
            (e.t for e in training if _key(e) in survivors and since <= e.t < changed_at), default=None)
        resumed_at = min((e.t for e in first_steps if _key(e) in survivors and ring.started_at <= e.t < until),
                         default=None)
        for host in ring.joined:
            pid = next(k[1] for k in members if k[0] == host)
            joins.append(Join(host=host, pid=pid, t=ring.started_at, step=ring.step, size=ring.size,
                              stalled_from=stalled_from, resumed_at=resumed_at,
                              steps_rolled_back=max((e.body.rolled_back for e in theirs), default=0)))
    return tuple(joins)


__all__ = ["joins_of"]
