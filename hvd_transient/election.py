"""Who is the checkpoint master (pure): the lowest rank that is not leaving.

Every rank evaluates this on the same agreed inputs (the notice vector from one
collective), so all ranks agree without a further round of messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import numpy as np


@dataclass(frozen=True)
class NoticeRound:
    """The outcome of one notice collective: which ranks are leaving and by when,
    and whether the operator asked the job to stop."""

    leaving: tuple[int, ...]
    deadline: float | None  # the earliest deadline among the leaving ranks
    stop: bool = False
    busy: bool = False      # some rank is still persisting a background save

    @property
    def any(self) -> bool:
        return bool(self.leaving)


def encode_notice(rank: int, size: int, deadline: float | None, stop: bool = False,
                  busy: bool = False) -> np.ndarray:
    """This rank's contribution; summing every rank's vector gives the whole picture.

    Layout: ``[leaving flag per rank | deadline per rank | stop | busy]``.
    """
    vec = np.zeros(2 * size + 2, dtype=np.float64)
    if deadline is not None:
        vec[rank] = 1.0
        vec[size + rank] = deadline
    vec[2 * size] = 1.0 if stop else 0.0
    vec[2 * size + 1] = 1.0 if busy else 0.0
    return vec


def decode_notice(summed: np.ndarray, size: int) -> NoticeRound:
    leaving = tuple(int(i) for i in np.flatnonzero(summed[:size] > 0.5))
    deadline = min((float(summed[size + i]) for i in leaving), default=None)
    return NoticeRound(leaving, deadline, bool(summed[2 * size] > 0.5), bool(summed[2 * size + 1] > 0.5))


def elect_master(size: int, leaving: Collection[int]) -> int:
    """Lowest rank not leaving; if every rank is leaving, rank 0 still commits the last save."""
    for rank in range(size):
        if rank not in leaving:
            return rank
    return 0
