"""The Keras callback: the per-step protocol (:mod:`hvd_transient.core.transient`) run from ``model.fit``.

:class:`TransientCallback` (re-exported by :mod:`hvd_transient.keras`) takes the checkpoints, reacts
to notices, scales the learning rate and makes each ``fit`` resume at the optimizer's step.
"""
from __future__ import annotations

import logging
import math
import operator
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from ckpt_service.manager import DeferredShare
from ckpt_service.plan import SavePlan, TensorSpecs
from hvd_transient.collectives.horovod import HorovodCollectives
from hvd_transient.core.checksums import state_crc
from hvd_transient.core.transient import StepOutcome, TransientConfig, TransientImpl
from hvd_transient.frontend.host_updates import HorovodHostUpdates
from hvd_transient.frontend.position import DataPosition
from hvd_transient.frontend.session import Session
from hvd_transient.frontend.step_counter import StepCounter
from hvd_transient.keras.autograph import skip_horovod_conversion
from hvd_transient.keras.resume import ResumeAt
from hvd_transient.keras.snapshot import FusedSnapshot
from hvd_transient.keras.state import (
    learning_rate_of,
    optimizer_step,
    optimizer_variables,
    state_variables,
    weights_crc,
)

log = logging.getLogger(__name__)


class _Trainee:
    """The session's view of a Keras model (see :class:`hvd_transient.frontend.session.Trainee`)."""

    def __init__(self, model: Callable[[], tf.keras.Model]) -> None:
        self._model = model  # the callback's, set by Keras
        self._fused: FusedSnapshot | None = None
        self._checked: tuple[int, int] | None = None  # (fit, optimizer variable count) last checked
        self.fits = 0

    def fused(self) -> FusedSnapshot:
        """The share snapshotter of the model's current variables.

        Listing them walks every layer (about 1.5 ms for ResNet-32), so it is done once per
        ``fit``, and again only if the optimizer has since created variables (legacy optimizers
        make their slots on the first step).
        """
        model = self._model()
        check = (self.fits, len(optimizer_variables(model.optimizer)))
        if self._fused is None or check != self._checked:
            variables = state_variables(model)
            if self._fused is None or not self._fused.holds(variables):
                self._fused = FusedSnapshot(variables)  # same variables: keep the traced functions
            self._checked = check
        return self._fused

    def specs(self) -> TensorSpecs:
        return self.fused().specs  # only shapes and dtypes: share() reads this rank's share in one call

    def share(self, plan: SavePlan, rank: int) -> list[np.ndarray[Any, Any]] | DeferredShare:
        return self.fused()(plan, rank)

    def metadata(self) -> dict[str, Any]:
        return {}

    def learning_rate(self) -> float | None:
        return learning_rate_of(self._model().optimizer)

    def set_learning_rate(self, lr: float, size: int) -> bool:
        try:
            tf.keras.backend.set_value(self._model().optimizer.learning_rate, lr)
        except (AttributeError, TypeError, ValueError) as exc:
            log.warning("cannot set the learning rate (a schedule?): %s", exc)
            return False
        return True

    def crcs(self) -> tuple[int, int]:
        model = self._model()
        return weights_crc(model), state_crc(state_variables(model))


def whole_steps(value: object) -> int | None:
    """A count of steps as Keras hands it back (an int, a numpy integer, a float with no fraction), or
    None where it is none (a dataset of unknown length)."""
    if isinstance(value, bool):
        return None
    try:
        steps = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        if not isinstance(value, float) or not math.isfinite(value) or not value.is_integer():
            return None
        steps = int(value)
    return steps if steps > 0 else None


class TransientCallback(tf.keras.callbacks.Callback):  # type: ignore[misc]
    """Preemption-aware checkpointing, master election and LR scaling for ``model.fit``.

    Args:
        state: the ``hvd.elastic.KerasState`` (from :func:`~hvd_transient.keras.state.elastic_state`), or None
            for a static job.
        store: checkpoint store URL (local directory, ``file://``, ``gs://bucket/prefix``).
        save_every_steps: periodic asynchronous sharded checkpoint interval (None: only on notice).
        check_interval_s: how often (seconds) the ranks run their one tiny notice collective; the
            step count between checks adapts to the measured step rate, so a notice costs at most
            about this much of its window. ``check_every_steps=N`` fixes it to every N steps instead.
        notice_window_s: how long a notice gives (None: the watcher finds it: on GCE the VM's
            configured notice, ``cluster up --preemption-notice-duration``, else 30 s; on AWS
            and Azure the deadline the notice carries).
        leave: how a worker under notice leaves. ``near_deadline`` (the default for an elastic
            job): the emergency checkpoint is taken at the notice, but the worker trains on and
            host discovery drops it only ``leave_lead_s`` before its VM's deadline, so the window's
            work is kept (a notice to every host leaves at once). ``at_notice``: as soon as the
            emergency checkpoint is taken (what a static job, ``state=None``, always does: it
            is relaunched at the notice).
        leave_lead_s: with ``near_deadline``, how long before its VM's deadline a worker leaves, beyond
            one wait for a step boundary (the slowest step timed, or the check interval if longer).
            None (the default): measured. 10 s until this job timed a departure (Horovod's host
            check, about 1 s, the ring's reset, a few seconds on a loaded box, and a margin); then
            twice the slowest departure timed (its ``leave_at`` -> the survivors' new ring) plus 2 s,
            shorter or longer than 10 s as this cluster leaves. A number fixes it.
        lr_scaling: ``linear`` | ``sqrt`` | ``none``: learning rate = f(active workers) x ``base_lr``.
        base_lr: the single-worker learning rate (None: leave the learning rate alone).
        watcher: ``auto`` | ``gce`` | ``aws`` | ``azure`` | ``local`` (env ``HVDT_WATCHER`` overrides).
        resume_position: make each ``fit`` start at the epoch and batch the optimizer step says
            (the script passes the whole run's ``epochs`` and ``steps_per_epoch``). None: on for an
            elastic job, off for a static one, whose script may count the remaining steps itself.
    """

    def __init__(self, state: Any, *, store: str, save_every_steps: int | None = 500,
                 check_every_steps: int | None = None, check_interval_s: float = 1.0,
                 notice_window_s: float | None = None, leave_margin_s: float = 5.0,
                 lr_scaling: str = "linear", base_lr: float | None = None, watcher: str = "auto",
                 max_to_keep: int | None = 3, keep_every_n_steps: int | None = None,
                 save_on_train_end: bool = True, resume_position: bool | None = None,
                 leave: str | None = None, leave_lead_s: float | None = None) -> None:
        super().__init__()
        skip_horovod_conversion()  # before fit traces its step: a cold start's first step comes sooner
        self.state = state
        if leave is None:  # the default: train through the window where the ring can shrink
            leave = "near_deadline" if state is not None else "at_notice"
        elif state is None and leave == "near_deadline":
            # a static job stops at the notice and is relaunched: a host discovery still listed
            # would be given to the relaunch and stopped under it
            log.warning("leave=%r needs an elastic job; this static one leaves at the notice", leave)
            leave = "at_notice"
        self.config = TransientConfig(
            store=store, save_every_steps=save_every_steps, check_every_steps=check_every_steps,
            check_interval_s=check_interval_s,
            notice_window_s=notice_window_s, leave_margin_s=leave_margin_s, watcher=watcher,
            max_to_keep=max_to_keep, keep_every_n_steps=keep_every_n_steps, lr_scaling=lr_scaling,
            base_lr=base_lr, leave=leave, leave_lead_s=leave_lead_s)
        self.save_on_train_end = save_on_train_end
        self.resume_position = state is not None if resume_position is None else resume_position
        self.trainee = _Trainee(lambda: self.model)
        # a static job's position is never tracked: its script places its data itself
        position = getattr(state, "hvdt_position", None) or DataPosition()
        self.session = Session(self.config, HorovodCollectives, self.trainee, position, counters=self._counters,
                               host_updates=HorovodHostUpdates(state) if state is not None else None)
        # the step read exactly where the protocol needs it, counted per batch in between
        self._steps = StepCounter(self._step, self.session.plain_step)
        self._epoch_steps: int | None = None  # fit's steps per epoch, once a fit began
        if state is not None:
            state.register_reset_callbacks([self._on_reset])

    @property
    def impl(self) -> TransientImpl | None:
        """The protocol, once the first ``fit`` began."""
        return self.session.impl

    @property
    def last_outcome(self) -> StepOutcome:
        return self.session.last_outcome

    def _step(self) -> int:
        return optimizer_step(self.model.optimizer)

    def _counters(self) -> dict[str, int]:
        # Horovod's own counters, where the script keeps them
        return {key: int(getattr(self.state, key)) for key in ("epoch", "batch") if hasattr(self.state, key)}

    def _advance(self, step: int) -> None:
        advance = getattr(self.state, "hvdt_advance", None)
        if advance is not None:
            advance(step)

    # ---- Keras hooks -------------------------------------------------------------------

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.trainee.fits += 1  # the model's variables may differ from the previous fit's
        # every rank of the ring decides alike, from the model's code (Horovod calls fit again on each ring)
        self._steps.restart(counts=one_step_per_batch(self.model))
        skip_horovod_conversion(getattr(self.model, "optimizer", None))  # fit traces its step after this
        restored = getattr(self.state, "hvdt_restored", None)
        step = self._step()
        self.session.begin(step, int(getattr(self.state, "samples", 0)),
                           restored_step=restored.get("step") if restored else None)
        # where epochs end: fit's steps per epoch (None for a dataset of unknown length), any whole number
        self._epoch_steps = whole_steps((self.params or {}).get("steps"))
        # resume at the exact batch; a BackupAndRestore callback, which uses the same hook, wins.
        # A reset leaves fit by an exception, without on_train_end: the old hook is replaced.
        hook = getattr(self.model, "_training_state", None)
        if self.resume_position and (hook is None or isinstance(hook, ResumeAt)):
            offset = int(getattr(self.state, "epoch", 0)) if self.state is not None else 0
            self.model._training_state = ResumeAt(step, offset, self.session.resumed)  # noqa: SLF001

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        # The evaluation and the callbacks' work at the previous epoch's end are no step: the next one is
        # timed from here. Within an epoch a step is timed from batch end to batch end, all of it.
        self._steps.reset()  # a new epoch's batches count from 0: its first is read exactly
        self.session.before_step()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # A plain step (no save, no notice round) costs a few attribute and clock reads: no store call,
        # no collective, no TensorFlow op, the step counted (tests/test_plain_step_counts.py).
        step = self._steps.at(batch)
        self._advance(step)
        if self._epoch_steps is not None:  # the batch index, not the global step: epochs need not align
            self.session.epoch_left(max(0, self._epoch_steps - 1 - batch))
        outcome = self.session.after_step(step)
        if outcome.stop:
            self.model.stop_training = True  # every rank saw the same request at this step
            return
        if outcome.emergency_step is not None and self.state is None:
            self.model.stop_training = True  # static job: the relaunch resumes from the checkpoint
            return
        if outcome.check_hosts and self.state is not None:
            # Every rank agreed on the departure and on this step, so every rank calls this collective
            # here; it raises HostsUpdatedInterrupt once discovery has dropped the leaving host. A
            # departure at the notice is looked for at every step; one that waits for its leave_at only
            # at the notice rounds (about once a second): a broadcast per step slowed a 4-rank CPU ring
            # by about 18% for the whole window.
            #
            # The leaving worker trains on until that reset and then exits inside Horovod: the new
            # ring's rendezvous answers it with rank -1, which Horovod's background thread raises as a
            # C++ exception ("removed from elastic job"), so the process aborts (code 134) in hvd.init()
            # before any Python code can run. It cannot exit 0 earlier: Horovod 0.28's driver takes a
            # worker that exits 0 while it still holds a rank as the job's success and stops every
            # worker; only the exit of a host it no longer assigns is ignored, and the worker learns
            # that it is no longer assigned only from the rendezvous that aborts it.
            try:
                self.state.check_host_updates()
            except Exception:
                if outcome.leaving:  # this process ends in the reset: its last events must get out first
                    self.session.before_leaving()
                raise

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if isinstance(getattr(self.model, "_training_state", None), ResumeAt):
            self.model._training_state = None  # noqa: SLF001
        if self.impl is None:
            return
        step = self._step()
        self._advance(step)  # the exact step: the next fit starts from this offset
        # lets an in-flight background save finish first; the final save, if one is needed, all ranks alike
        self.session.end(step, final_save=self.save_on_train_end)

    def close(self) -> None:
        """Stop the notice watcher, flush the event log and close the checkpoint manager.

        Done at the latest when the process exits (or the callback is collected). Not at the end
        of ``fit``: a script may call ``fit`` again, and the run's state (who left, the event
        log's segments) carries over from one ``fit`` to the next.
        """
        self.session.close()

    def _on_reset(self) -> None:
        self._steps.reset()
        if self.impl is not None:
            self.session.note_reset(self._step())


def one_step_per_batch(model: tf.keras.Model) -> bool:
    """Whether each batch ``fit`` reports is exactly one optimizer step (pure, the same on every rank):
    the model's own ``train_step`` (one ``apply_gradients`` per batch) and a ``steps_per_execution``
    that Keras passes whole (an autotuned one may change under a running execution)."""
    own_step = getattr(type(model), "train_step", None) is tf.keras.Model.train_step
    return own_step and not getattr(model, "autotune_steps_per_execution", False)
