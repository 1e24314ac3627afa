"""How the protocol is configured: :class:`TransientConfig`, the ways a VM may leave, and the
time bounds that keep a slow store from holding up training (see :mod:`hvd_transient.core.transient`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection

from ckpt_service.errors import CheckpointError
from hvd_transient.core.election import SLOWDOWN_ALLOWANCE

#: the shortest notice a cloud gives (GCE Spot default), for a notice without a deadline
#: outside a notice, a lease move (at a ring's start) waits on the store at most this long; a
#: master that could not take the lease in time cannot commit (its saves fail and are reported)
LEASE_MOVE_TIMEOUT_S = 30.0
#: how long the master may look at the store before the final save (else it saves anyway)
FINAL_SAVE_CHECK_TIMEOUT_S = 30.0
#: housekeeping in the background (pruning expired leaving records) gives up after this long
HOUSEKEEPING_TIMEOUT_S = 60.0
#: a leaving rank's last copy of its events, as Horovod resets it away, takes at most this long
#: (and never past its VM's deadline)
LEAVE_FLUSH_MAX_S = 10.0
#: inside a notice, a durable event waits for its write at most this share of the time left
#: before the save's deadline (and never longer than the event log's own bound)
NOTICE_EVENT_SHARE = 0.05
#: how a VM under notice leaves: as soon as its emergency checkpoint is taken, or by training on
#: until ``leave_lead_s`` before its deadline
LEAVE_MODES = ("at_notice", "near_deadline")
#: ``leave="near_deadline"``: a VM leaves at a step boundary, so its lead is one wait for a step at
#: which it can leave (:meth:`TransientConfig.boundary_wait_s`), plus the time leaving takes and a
#: margin: this long until this job has timed a departure (or ``leave_lead_s``, if given). Leaving takes
#: Horovod's host check (about 1 s) and the ring's reset (a few seconds on a loaded box), and the rest
#: is margin: the VM must be out of the ring before it is stopped
DEFAULT_LEAVE_LEAD_S = 10.0
#: once a departure was timed (its ``leave_at`` -> the survivors' new ring), that part of the lead is
#: the slowest one timed so far, times this factor, plus this pad: the margin scales with what leaving
#: took on this job, up as well as down (a cluster whose discovery is slow gets a longer lead)
LEAVE_LEAD_FACTOR = 2.0
LEAVE_LEAD_PAD_S = 2.0
#: a leaving rank's ``leave_published`` waits for its write at most this long: every rank waits
#: for the leaving one in the next collective, and it copies its events once more as Horovod
#: resets it out of the ring (:meth:`~hvd_transient.core.transient.TransientImpl.before_leaving`)
LEAVE_EVENT_WAIT_S = 0.1


class LeaveConfigError(CheckpointError, ValueError):
    """``leave`` or ``leave_lead_s`` of :class:`TransientConfig` is not valid."""


@dataclass(frozen=True)
class TransientConfig:
    store: str
    save_every_steps: int | None = 500
    #: notice collective every N steps; None: adaptive, about once per ``check_interval_s``
    check_every_steps: int | None = None
    check_interval_s: float = 1.0
    max_check_every_steps: int = 1000
    #: adaptive cadence: rounds are at most this many check intervals apart at the slowest
    #: step seen on the ring (see :func:`hvd_transient.core.election.steps_until_next_check`)
    check_slowdown_allowance: float = SLOWDOWN_ALLOWANCE
    #: how long a notice gives when the notice itself carries no deadline; None: what the VM is
    #: configured with (GCE: ``cluster up --preemption-notice-duration``, else 30 s)
    notice_window_s: float | None = None
    #: seconds of the window kept for leaving the ring after the emergency commit
    leave_margin_s: float = 5.0
    watcher: str = "auto"
    max_to_keep: int | None = 3
    keep_every_n_steps: int | None = None
    async_gather_timeout_s: float = 300.0
    lr_scaling: str = "linear"
    base_lr: float | None = None
    progress_every_steps: int = 10
    #: ``at_notice``: a VM under notice leaves the ring as soon as its emergency checkpoint is
    #: taken; ``near_deadline``: it trains on until ``leave_lead_s`` before its deadline (elastic
    #: jobs: a static job stops at the notice, and its relaunch must not get the host). The Keras
    #: callback picks ``near_deadline`` for an elastic job; an MPI job is static.
    leave: str = "at_notice"
    #: ``near_deadline``: seconds a VM keeps before its deadline for leaving, beyond one wait for a step
    #: boundary (see :meth:`lead_s`); None: measured
    leave_lead_s: float | None = None

    def __post_init__(self) -> None:
        if self.check_every_steps is not None and not _whole_at_least_1(self.check_every_steps):
            raise ValueError(f"check_every_steps must be None (adaptive) or a whole number of steps, at least 1, "
                             f"not {self.check_every_steps!r}")
        if not 0 < self.check_interval_s < math.inf:
            raise ValueError(f"check_interval_s must be a positive number of seconds, not {self.check_interval_s}")
        if not _whole_at_least_1(self.max_check_every_steps):
            raise ValueError(f"max_check_every_steps must be a whole number of steps, at least 1, "
                             f"not {self.max_check_every_steps!r}")
        if not 1.0 <= self.check_slowdown_allowance < math.inf:
            raise ValueError(f"check_slowdown_allowance must be at least 1 (check intervals) and finite, "
                             f"not {self.check_slowdown_allowance}")
        if self.notice_window_s is not None and not 0 < self.notice_window_s < math.inf:
            raise ValueError(f"notice_window_s must be None (the VM's own) or a positive number of seconds, "
                             f"not {self.notice_window_s}")
        if not 0 <= self.leave_margin_s < math.inf:
            raise ValueError(f"leave_margin_s must be zero or more seconds, not {self.leave_margin_s}")
        if self.leave not in LEAVE_MODES:
            raise LeaveConfigError(f"leave must be one of {', '.join(map(repr, LEAVE_MODES))}, not {self.leave!r}")
        if self.leave_lead_s is not None and not 0 <= self.leave_lead_s < math.inf:
            raise LeaveConfigError(f"leave_lead_s must be None (measured) or zero or more seconds before "
                                   f"the VM's deadline, not {self.leave_lead_s}")

    def boundary_wait_s(self, step_s: float, gap_s: float = 0.0) -> float:
        """The longest a VM under notice waits for a step at which it can leave, at steps of ``step_s``
        with gaps of up to ``gap_s`` between two of them (pure). It leaves when Horovod's host check sees
        discovery drop it, and that check runs at the notice rounds until its ``leave_at`` has passed
        (then at every step): a round every ``check_every_steps`` steps, or (adaptive) within
        ``check_interval_s`` while steps are no slower than the slowest seen, and at every step once a
        step is longer than that. A gap between two steps (an epoch end's evaluation) holds no check: one
        that begins just before ``leave_at`` is waited out, then the step after it."""
        step_s = max(0.0, step_s)
        gap_s = max(0.0, gap_s) if math.isfinite(gap_s) else math.inf
        steps = self.check_every_steps * step_s if self.check_every_steps else max(step_s, self.check_interval_s)
        return max(steps, gap_s + step_s) if gap_s > 0 else steps

    def departure_allowance_s(self, slowest_departure_s: float | None) -> float:
        """What the lead keeps for leaving itself and a margin, beyond the wait for a step boundary
        (pure): ``leave_lead_s`` if given; else ``DEFAULT_LEAVE_LEAD_S`` until a departure of this job was
        timed, then the slowest departure timed (``leave_at`` -> the survivors' new ring) times
        ``LEAVE_LEAD_FACTOR`` plus ``LEAVE_LEAD_PAD_S``."""
        if self.leave_lead_s is not None:
            return self.leave_lead_s
        if slowest_departure_s is None:
            return DEFAULT_LEAVE_LEAD_S
        return LEAVE_LEAD_FACTOR * slowest_departure_s + LEAVE_LEAD_PAD_S

    def lead_s(self, slowest_departure_s: float | None, step_s: float = 0.0, gap_s: float = 0.0) -> float:
        """How long before its deadline a VM under notice leaves (pure): one wait for a step boundary at
        steps of ``step_s`` with gaps of ``gap_s`` (the slowest and longest this job timed,
        :meth:`boundary_wait_s`) plus
        :meth:`departure_allowance_s`. A VM leaves only at a step boundary: a lead shorter than a step
        could let the VM start a step that its deadline cuts short, inside the ring."""
        # a timing that is negative or no number (a clock that stepped back, a torn round) counts as none
        departure = slowest_departure_s if slowest_departure_s is None or slowest_departure_s >= 0 else None
        return (self.boundary_wait_s(step_s if step_s >= 0 else 0.0, gap_s if gap_s >= 0 else 0.0)
                + self.departure_allowance_s(departure))

    def trains_through(self, hosts: Collection[str], leaving: Collection[str]) -> bool:
        """Whether the VMs under notice (``leaving``) of a ring of ``hosts`` train on until their
        ``leave_at``: with ``near_deadline``, while some host of the ring is not under notice (a wave
        that takes every host leaves nobody to carry the state, and the checkpoint is what counts)."""
        return self.leave == "near_deadline" and not set(leaving) >= set(hosts)


def _whole_at_least_1(value: object) -> bool:
    """A count of steps: a whole number (an int, or a float with no fraction) of at least 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value >= 1 and float(value).is_integer()


__all__ = ["DEFAULT_LEAVE_LEAD_S", "FINAL_SAVE_CHECK_TIMEOUT_S", "HOUSEKEEPING_TIMEOUT_S", "LEASE_MOVE_TIMEOUT_S",
           "LEAVE_EVENT_WAIT_S", "LEAVE_FLUSH_MAX_S", "LEAVE_LEAD_FACTOR", "LEAVE_LEAD_PAD_S", "LEAVE_MODES",
           "NOTICE_EVENT_SHARE", "LeaveConfigError", "TransientConfig"]
