"""Who is the checkpoint master (pure): the lowest rank that is not leaving.

Every rank evaluates this on the same agreed inputs (the notice vector from one
collective), so all ranks agree without a further round of messages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import numpy as np


@dataclass(frozen=True)
class NoticeRound:
    """The outcome of one notice collective: which ranks are leaving and by when,
    and whether the operator asked the job to stop."""

    leaving: tuple[int, ...]
    deadline: float | None  # the earliest deadline among the leaving ranks
    stop: bool = False
    busy: bool = False      # some rank is still persisting a background save
    elapsed_s: float = 0.0  # mean over ranks of the seconds since each one's previous round
    early_warning: bool = False  # some rank got an early warning: checkpoint now, nobody leaves
    #: per rank: the deadline of its own VM's notice (the earliest its ranks were given), None if not leaving
    vm_deadlines: tuple[float | None, ...] = ()
    slowest_step_s: float = 0.0  # the longest single step any rank took since its previous round
    committed_step: int | None = None  # the latest step the master knows committed
    #: the slowest departure any rank timed on this job (``leave_at`` -> its new ring), None: none yet
    departure_s: float | None = None
    #: the slowest single step any rank timed on this job (0: none timed yet, or steps of 0 s)
    step_s: float = 0.0
    #: some rank timed a step of this job: where none did, ``step_s`` says nothing of the step time, and a VM
    #: under notice leaves at once (:func:`~hvd_transient.core.leave_plan.plan_for_round`)
    step_timed: bool = True
    #: the longest gap between two steps (an epoch end's evaluation, kept out of the step time) any rank
    #: timed on this job: no host check runs inside it (0: none timed)
    gap_s: float = 0.0
    #: steps until the current epoch's end (the fewest any rank counts), where the frontend says how
    #: long its epochs are (Keras); None: unknown
    epoch_left_steps: int | None = None
    #: the mean time a step took since the previous round (agreed; 0: not known)
    mean_step_s: float = 0.0
    #: the latest wall clock (epoch seconds) any rank read as the round began: one "now" that every
    #: rank shares, so decisions taken on the clock (when a VM leaves) are the same on every rank
    at: float = 0.0
    #: some rank holds a host update that the framework's host check has not taken (Horovod tells rank 0):
    #: every rank runs that check at this round
    hosts_changed: bool = False
    #: ranks whose VM's leaving record (its latest version) is in the store, as the rank that writes it knows
    records_landed: tuple[int, ...] = ()

    @property
    def any(self) -> bool:
        return bool(self.leaving)

    def deadline_of(self, rank: int) -> float | None:
        """The deadline of ``rank``'s own VM, as its watcher (or its VM's) gave it."""
        return self.vm_deadlines[rank] if rank < len(self.vm_deadlines) else None


#: per-rank blocks, then these scalar slots
_BLOCKS = 9
_STOP, _BUSY, _ELAPSED, _WARNING, _COMMITTED, _HOSTS = range(6)
_SCALARS = 6


def encode_notice(rank: int, size: int, deadline: float | None, stop: bool = False,
                  busy: bool = False, elapsed_s: float = 0.0, early_warning: bool = False, *,
                  slowest_step_s: float = 0.0, committed_step: int | None = None,
                  departure_s: float | None = None, job_step_s: float = 0.0,
                  wall: float = 0.0, gap_s: float = 0.0,
                  epoch_left_steps: int | None = None, hosts_changed: bool = False,
                  record_landed: bool = False, step_timed: bool = True) -> np.ndarray[Any, Any]:
    """This rank's contribution; summing every rank's vector gives the whole picture.

    Layout: ``[leaving flag per rank | deadline per rank | slowest step us per rank | slowest departure
    us per rank | job's slowest step us + 1 per rank (0: none timed) | wall clock per rank | job's longest gap
    between steps us per rank | steps to the epoch's end + 1 per rank | leaving record landed per rank | stop |
    busy | elapsed us | early warning | committed step + 1 | host update pending]``. Times travel in whole
    microseconds (a wall clock and a deadline as they are: one non-zero addend per slot) and steps as integers,
    so the sum is exact and every rank derives the same decisions from it. Only the master gives
    ``committed_step``; per-rank slots keep what a sum would lose (the earliest deadline, the slowest step, the
    slowest departure, the latest clock).
    """
    vec = np.zeros(_BLOCKS * size + _SCALARS, dtype=np.float64)
    if deadline is not None:
        vec[rank] = 1.0
        vec[size + rank] = deadline
    vec[2 * size + rank] = float(round(max(0.0, slowest_step_s) * 1e6))
    if departure_s is not None:  # + 1 us: a departure timed at 0 s is still one that was timed
        vec[3 * size + rank] = float(round(max(0.0, departure_s) * 1e6)) + 1.0
    if step_timed:  # + 1 us: a step timed at 0 s (a fake clock) is still one that was timed
        vec[4 * size + rank] = float(round(max(0.0, job_step_s) * 1e6)) + 1.0
    vec[5 * size + rank] = max(0.0, wall)
    vec[6 * size + rank] = float(round(max(0.0, gap_s) * 1e6)) if math.isfinite(gap_s) else 0.0
    if epoch_left_steps is not None and epoch_left_steps >= 0:  # + 1: an epoch ending here is still known
        vec[7 * size + rank] = float(epoch_left_steps) + 1.0
    vec[8 * size + rank] = 1.0 if record_landed else 0.0
    base = _BLOCKS * size
    vec[base + _STOP] = 1.0 if stop else 0.0
    vec[base + _BUSY] = 1.0 if busy else 0.0
    vec[base + _ELAPSED] = float(round(max(0.0, elapsed_s) * 1e6))
    vec[base + _WARNING] = 1.0 if early_warning else 0.0
    vec[base + _COMMITTED] = float(committed_step + 1) if committed_step is not None else 0.0
    vec[base + _HOSTS] = 1.0 if hosts_changed else 0.0
    return vec


def decode_notice(summed: np.ndarray[Any, Any], size: int, hosts: Sequence[str] | None = None) -> NoticeRound:
    """The round every rank agrees on, from the summed vectors.

    ``hosts``: each rank's VM. A notice to one rank of a VM puts all its ranks under notice: a
    revoked VM takes all its ranks with it, and one watcher may speak for all of them (under MPI,
    one rank per VM polls the metadata server). The round's deadline is the earliest given; each
    leaving rank's own VM deadline is the earliest given to a rank of that VM.
    """
    if summed.shape != (_BLOCKS * size + _SCALARS,):
        raise ValueError(f"a notice vector of {size} ranks has {_BLOCKS * size + _SCALARS} values, "
                         f"not {summed.shape}")
    noticed = [int(i) for i in np.flatnonzero(summed[:size] > 0.5)]
    deadline = min((float(summed[size + i]) for i in noticed), default=None)
    vm_of = list(hosts) if hosts is not None else [str(r) for r in range(size)]
    vm_deadline: dict[str, float] = {}
    for i in noticed:
        vm_deadline[vm_of[i]] = min(vm_deadline.get(vm_of[i], float("inf")), float(summed[size + i]))
    leaving = tuple(r for r in range(size) if vm_of[r] in vm_deadline)
    base = _BLOCKS * size
    committed = int(round(summed[base + _COMMITTED]))
    departure_us = float(np.max(summed[3 * size:4 * size]))
    job_step_us = float(np.max(summed[4 * size:5 * size]))
    epoch_left = summed[7 * size:8 * size]
    known_left = epoch_left[epoch_left > 0.5]
    return NoticeRound(leaving, deadline, bool(summed[base + _STOP] > 0.5), bool(summed[base + _BUSY] > 0.5),
                       float(summed[base + _ELAPSED]) / 1e6 / size, bool(summed[base + _WARNING] > 0.5),
                       vm_deadlines=tuple(vm_deadline.get(vm_of[r]) for r in range(size)),
                       slowest_step_s=float(np.max(summed[2 * size:3 * size])) / 1e6,
                       committed_step=committed - 1 if committed > 0 else None,
                       departure_s=(departure_us - 1.0) / 1e6 if departure_us > 0.5 else None,
                       step_s=max(0.0, job_step_us - 1.0) / 1e6, step_timed=job_step_us > 0.5,
                       at=float(np.max(summed[5 * size:6 * size])),
                       gap_s=float(np.max(summed[6 * size:7 * size])) / 1e6,
                       epoch_left_steps=int(round(float(np.min(known_left)))) - 1 if known_left.size else None,
                       hosts_changed=bool(summed[base + _HOSTS] > 0.5),
                       records_landed=tuple(int(i) for i in np.flatnonzero(summed[8 * size:9 * size] > 0.5)))


#: default for how many check intervals a round may be apart when steps are as slow as the
#: slowest one seen on the ring (see :func:`steps_until_next_check`)
SLOWDOWN_ALLOWANCE = 10.0


def steps_until_next_check(elapsed_s: float, steps: int, interval_s: float, max_steps: int, *,
                           slowest_step_s: float = 0.0, ring_slowest_step_s: float = 0.0,
                           allowance: float = SLOWDOWN_ALLOWANCE) -> int:
    """How many steps to train before the next notice collective (pure; same on every rank).

    Aims at one collective per ``interval_s``: frequent enough that a notice costs at most about
    ``interval_s`` of its window, rare enough that the collective's fixed cost (a few ms on a
    loaded ring) stays a small share of the step time. The count is the smallest of:

    * ``max_steps``;
    * ``interval_s`` at the mean step rate since the previous round (``steps`` in ``elapsed_s``);
    * ``interval_s`` at ``slowest_step_s``, the longest single step any rank took since the
      previous round: one slow step lowers the count at once, however many fast ones it followed;
    * ``allowance x interval_s`` at ``ring_slowest_step_s``, the longest step seen since the ring
      began: a ring that has been slow before keeps a bound should it become that slow again.

    What this promises (at least one step always runs): if none of the next steps is longer than
    ``slowest_step_s``, the next round comes within ``interval_s`` of steps; if none is longer than
    ``ring_slowest_step_s``, within ``allowance x interval_s``. A step longer than anything seen
    stretches the wait by the ratio: the ranks can only take a decision they all agree on without a
    collective, so the step count is fixed at the round and no rank's clock can shorten it.
    """
    if steps <= 0 or elapsed_s <= 0.0:
        return 1
    limit = min(float(max_steps), interval_s * steps / elapsed_s)
    if slowest_step_s > 0.0:
        limit = min(limit, interval_s / slowest_step_s)
    if ring_slowest_step_s > 0.0:
        limit = min(limit, allowance * interval_s / ring_slowest_step_s)
    return int(max(1, limit + 1e-9))  # + 1e-9: 1.0 / 0.1 must give 10


def elect_master(size: int, leaving: Collection[int]) -> int:
    """Lowest rank not leaving; if every rank is leaving, rank 0 still commits the last save."""
    for rank in range(size):
        if rank not in leaving:
            return rank
    return 0
