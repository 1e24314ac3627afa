"""The per-step protocol driven for a frontend: one :class:`Session` per training process.

A frontend (a Keras callback, a PyTorch step hook) hands its framework's parts to the session as a
:class:`Trainee` and calls :meth:`Session.begin` when training (re)starts on a ring,
:meth:`Session.after_step` after every optimizer step, :meth:`Session.note_reset` on every reset and
:meth:`Session.end` when training is over. The session owns the protocol
(:class:`~hvd_transient.core.transient.TransientImpl`), the data position's cursor, the learning-rate
scaling and the checkpoint metadata, so every frontend gives the same guarantees and logs the same events.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from ckpt_service.manager import DeferredShare
from ckpt_service.plan import SavePlan
from hvd_transient.core.interfaces import Collectives
from hvd_transient.core.lr_scaling import scaled_lr
from hvd_transient.core.transient import StepOutcome, TransientConfig, TransientImpl
from hvd_transient.frontend.host_updates import HorovodHostUpdates
from hvd_transient.frontend.lost_joins import MemberSeen
from hvd_transient.frontend.position import DataPosition
from hvd_transient.frontend.resume import resume_point
from hvd_transient.telemetry import schema as ev

log = logging.getLogger(__name__)


class Trainee(Protocol):
    """What the session needs of a framework's training state."""

    def specs(self) -> Mapping[str, Any]:
        """The state's tensors' specs by name (shapes and dtypes), as of now."""

    def share(self, plan: SavePlan, rank: int) -> list[np.ndarray[Any, Any]] | DeferredShare:
        """This rank's pieces of ``plan``, as of now (see :data:`~ckpt_service.manager.ShareSnapshot`)."""

    def metadata(self) -> dict[str, Any]:
        """The framework's own JSON checkpoint metadata (e.g. an optimizer's hyperparameters)."""

    def learning_rate(self) -> float | None:
        """The current learning rate, if there is one to report."""

    def set_learning_rate(self, lr: float, size: int) -> bool:
        """Set the learning rate for a ring of ``size`` workers; whether it could be set."""

    def crcs(self) -> tuple[int, int]:
        """Checksums of the replicated state (identical on every rank) and of the whole state."""


class Session:
    """One process's protocol, for a frontend (see the module's docstring).

    ``counters`` reads the state's own counters that go into the metadata (e.g. ``epoch``, ``batch``);
    ``steps_per_epoch``, when the loop has a fixed one, adds the epoch and batch the step says. The
    protocol is made on the first :meth:`begin` (the collectives need the framework's ring by then).
    """

    def __init__(self, config: TransientConfig, make_collectives: Callable[[], Collectives], trainee: Trainee,
                 position: DataPosition, *, counters: Callable[[], Mapping[str, int]] = dict,
                 make_impl: Callable[[TransientConfig, Collectives], TransientImpl] = TransientImpl,
                 host_updates: HorovodHostUpdates | None = None) -> None:
        scaled_lr(1.0, 1, config.lr_scaling)  # validate early
        self.config = config
        self.trainee = trainee
        self.position = position
        self.counters = counters
        self.steps_per_epoch: int | None = None
        self.impl: TransientImpl | None = None
        self.last_outcome = StepOutcome()
        self._make_collectives = make_collectives
        self._make_impl = make_impl  # a test's watcher and host go in here
        self.host_updates = host_updates  # an elastic job's (the notice rounds run its host check when due)
        self._closer: "weakref.finalize[[], Session] | None" = None

    # ---- lifecycle ----------------------------------------------------------------------

    def begin(self, step: int, samples: int, *, restored_step: int | None = None) -> None:
        """Training (re)starts on a ring at ``step``, at the synced sample offset ``samples``."""
        if self.impl is None:
            self.impl = self._make_impl(self.config, self._make_collectives())
            self.impl.host_updates = self.host_updates
            if self.host_updates is not None:
                self.host_updates.events = self.impl.events
            self._closer = weakref.finalize(self, self.impl.close)  # at exit at the latest
            crc, full_crc = self.trainee.crcs()
            self.impl.events.emit(ev.Start(step=step, rank=self.impl.comm.rank(), size=self.impl.comm.size(),
                                           crc=crc, full_crc=full_crc, restored_step=restored_step))
        self.position.begin(step, samples)
        self.impl.begin(step)
        if self.host_updates is not None:
            run = self.impl.run
            members = [MemberSeen(frozenset(names), instance_id)
                       for names, instance_id in zip(run.member_names, run.member_ids)]
            self.host_updates.ring_began(members, rank=self.impl.comm.rank(), store=self.impl.manager.store)
        self._apply_lr()

    def resumed(self, step: int, steps_per_epoch: int) -> None:
        """The loop resumes at ``step`` with ``steps_per_epoch`` steps an epoch (logged, and in the metadata)."""
        self.steps_per_epoch = steps_per_epoch
        if self.impl is not None:
            at = resume_point(step, steps_per_epoch)
            self.impl.events.emit(ev.ResumeAt(step=step, epoch=at.epoch, batch=at.batch,
                                              steps_per_epoch=steps_per_epoch, samples=self.position.samples_at(step)))

    def epoch_left(self, steps: int | None) -> None:
        """The steps left in the current epoch after the step about to be reported (None: unknown), from a
        frontend that times each epoch's end with :meth:`before_step`: a VM under notice does not plan to
        train across an epoch's end before one was timed (one attribute write, at every step)."""
        if self.impl is not None:
            self.impl.run.epoch_left_steps = steps

    def before_step(self) -> None:
        """Training goes on after time that is no step (an evaluation, an epoch's end): the next step is
        timed from here (:meth:`~hvd_transient.core.transient.TransientImpl.before_step`)."""
        if self.impl is not None:
            self.impl.before_step()

    def plain_step(self, step: int) -> bool:
        """Whether :meth:`after_step` at ``step`` does no more than the plain path (so it may be counted)."""
        return self.impl is not None and self.impl.plain_step(step)

    def after_step(self, step: int) -> StepOutcome:
        """Every rank, after each optimizer step (``step``: the optimizer steps taken so far)."""
        assert self.impl is not None, "begin() first"
        outcome = self.impl.after_step(step, self.trainee.specs, lambda: self.metadata(step), self.trainee.share,
                                       samples=self.position.samples_at(step))
        self.last_outcome = outcome
        return outcome

    def note_reset(self, step: int) -> None:
        """Every rank, on every reset of the ring (``step``: the step training goes on from)."""
        if self.impl is not None:
            self.impl.note_reset(step)

    def before_leaving(self) -> None:
        """This leaving rank is being reset out of the ring: its last events go out first."""
        if self.impl is not None:
            self.impl.before_leaving()

    def end(self, step: int, *, final_save: bool = True) -> None:
        """Training is over on this rank: the last background save finishes, a final save if none has this step."""
        if self.impl is None:
            return
        self.impl.end(step)
        # the master's view of the store decides and one broadcast tells every rank: all take one branch
        if final_save and self.impl.final_save_needed(step):
            self.impl.save_now(step, self.trainee.specs(), self.metadata(step), coordinator=self.impl.run.master,
                               deadline=None, kind="final", share_snapshot=self.trainee.share)
        crc, _ = self.trainee.crcs()
        self.impl.events.emit(ev.Weights(step=step, crc=crc, size=self.impl.comm.size(), rank=self.impl.comm.rank()))

    def close(self) -> None:
        """Stop the watcher, flush the event log, close the checkpoint manager (at exit at the latest)."""
        if self.host_updates is not None:
            self.host_updates.close()
        if self._closer is not None:
            self._closer()

    # ---- parts --------------------------------------------------------------------------

    def metadata(self, step: int) -> dict[str, Any]:
        """The checkpoint's metadata at ``step``: the counters that place the run, and the framework's own."""
        meta: dict[str, Any] = {"step": step, "world_size": self.impl.comm.size() if self.impl else 1}
        if self.steps_per_epoch:
            at = resume_point(step, self.steps_per_epoch)
            meta.update(epoch=at.epoch, batch=at.batch, steps_per_epoch=self.steps_per_epoch)
        meta.update({key: int(value) for key, value in self.counters().items()})
        samples = self.position.samples_at(step)
        if samples is not None:
            meta["samples"] = samples
        lr = self.trainee.learning_rate()
        if lr is not None:
            meta["lr"] = lr
        meta.update(self.trainee.metadata())
        return meta

    def _apply_lr(self) -> None:
        if self.config.base_lr is None or self.impl is None:
            return
        size = self.impl.comm.size()
        lr = scaled_lr(self.config.base_lr, size, self.config.lr_scaling)
        if self.trainee.set_learning_rate(lr, size):
            self.impl.events.emit(ev.Lr(lr=lr, size=size, mode=self.config.lr_scaling))
