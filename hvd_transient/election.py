"""Who is the checkpoint master (pure): the lowest rank that is not leaving.

Every rank evaluates this on the same agreed inputs (the notice vector from one
collective), so all ranks agree without a further round of messages.
"""
from __future__ import annotations

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
    committed_step: int | None = None  # the latest step the master knows committed

    @property
    def any(self) -> bool:
        return bool(self.leaving)

    def deadline_of(self, rank: int) -> float | None:
        """The deadline of ``rank``'s own VM, as its watcher (or its VM's) gave it."""
        return self.vm_deadlines[rank] if rank < len(self.vm_deadlines) else None


def encode_notice(rank: int, size: int, deadline: float | None, stop: bool = False,
                  busy: bool = False, elapsed_s: float = 0.0, early_warning: bool = False, *,
                  committed_step: int | None = None) -> np.ndarray[Any, Any]:
    """This rank's contribution; summing every rank's vector gives the whole picture.

    Layout: ``[leaving flag per rank | deadline per rank | stop | busy | elapsed us | early warning |
    committed step + 1]``. The elapsed time travels in whole microseconds and the step as an
    integer, so the sum is exact and every rank derives the same decisions from it. Only the
    master gives ``committed_step``.
    """
    vec = np.zeros(2 * size + 5, dtype=np.float64)
    if deadline is not None:
        vec[rank] = 1.0
        vec[size + rank] = deadline
    vec[2 * size] = 1.0 if stop else 0.0
    vec[2 * size + 1] = 1.0 if busy else 0.0
    vec[2 * size + 2] = float(round(max(0.0, elapsed_s) * 1e6))
    vec[2 * size + 3] = 1.0 if early_warning else 0.0
    vec[2 * size + 4] = float(committed_step + 1) if committed_step is not None else 0.0
    return vec


def decode_notice(summed: np.ndarray[Any, Any], size: int, hosts: Sequence[str] | None = None) -> NoticeRound:
    """The round every rank agrees on, from the summed vectors.

    ``hosts``: each rank's VM. A notice to one rank of a VM puts all its ranks under notice: a
    revoked VM takes all its ranks with it, and one watcher may speak for all of them (under MPI,
    one rank per VM polls the metadata server). The round's deadline is the earliest given; each
    leaving rank's own VM deadline is the earliest given to a rank of that VM.
    """
    if summed.shape != (2 * size + 5,):
        raise ValueError(f"a notice vector of {size} ranks has {2 * size + 5} values, not {summed.shape}")
    noticed = [int(i) for i in np.flatnonzero(summed[:size] > 0.5)]
    deadline = min((float(summed[size + i]) for i in noticed), default=None)
    vm_of = list(hosts) if hosts is not None else [str(r) for r in range(size)]
    vm_deadline: dict[str, float] = {}
    for i in noticed:
        vm_deadline[vm_of[i]] = min(vm_deadline.get(vm_of[i], float("inf")), float(summed[size + i]))
    leaving = tuple(r for r in range(size) if vm_of[r] in vm_deadline)
    committed = int(round(summed[2 * size + 4]))
    return NoticeRound(leaving, deadline, bool(summed[2 * size] > 0.5), bool(summed[2 * size + 1] > 0.5),
                       float(summed[2 * size + 2]) / 1e6 / size, bool(summed[2 * size + 3] > 0.5),
                       vm_deadlines=tuple(vm_deadline.get(vm_of[r]) for r in range(size)),
                       committed_step=committed - 1 if committed > 0 else None)


def steps_until_next_check(elapsed_s: float, steps: int, interval_s: float, max_steps: int) -> int:
    """How many steps to train before the next notice collective (pure; same on every rank).

    Aims at one collective per ``interval_s`` at the recent step rate: frequent enough that a
    notice costs at most about ``interval_s`` of its window, rare enough that the collective's
    fixed cost (a few ms on a loaded ring) stays a small share of the step time.
    """
    if steps <= 0 or elapsed_s <= 0.0:
        return 1
    per_interval = interval_s * steps / elapsed_s + 1e-9  # + 1e-9: 1.0 / 0.1 must give 10
    return int(max(1, min(max_steps, per_interval)))


def elect_master(size: int, leaving: Collection[int]) -> int:
    """Lowest rank not leaving; if every rank is leaving, rank 0 still commits the last save."""
    for rank in range(size):
        if rank not in leaving:
            return rank
    return 0
