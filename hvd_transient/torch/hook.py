"""The per-step hook of a PyTorch elastic loop: :class:`Transient` runs the protocol after every
optimizer step (the counterpart of :class:`hvd_transient.keras.TransientCallback`)."""
from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np
import torch

from ckpt_service.plan import SavePlan, TensorSpecs
from hvd_transient.core.lr_scaling import scaled_lr
from hvd_transient.core.transient import StepOutcome, TransientConfig
from hvd_transient.frontend.host_updates import HorovodHostUpdates
from hvd_transient.frontend.session import Session
from hvd_transient.frontend.share import NamedShare
from hvd_transient.torch.collectives import TorchCollectives
from hvd_transient.torch.lr import scale_learning_rates
from hvd_transient.torch.state import COUNTERS, full_crc, replicated_crc
from hvd_transient.torch.tensors import META_KEY, SpecCache, json_part, state_tensors, to_host

log = logging.getLogger(__name__)


class _Trainee:
    """The session's view of a PyTorch state (see :class:`hvd_transient.frontend.session.Trainee`)."""

    def __init__(self, state: Any, config: TransientConfig) -> None:
        self.state, self.config = state, config
        self._specs = SpecCache()
        self._tensors: Mapping[str, torch.Tensor] = {}

    def specs(self) -> TensorSpecs:
        # the tensors of this save: its share is taken from the same ones, before the next step
        self._tensors = state_tensors(self.state.model, self.state.optimizer)
        return self._specs(self._tensors)

    def share(self, plan: SavePlan, rank: int) -> list[np.ndarray[Any, Any]]:
        tensors = self._tensors
        return NamedShare(self._specs(tensors), lambda name: to_host(tensors[name]))(plan, rank)

    def metadata(self) -> dict[str, Any]:
        return {META_KEY: json_part(self.state.model, self.state.optimizer, self.state.hvdt_scheduler)}

    def learning_rate(self) -> float | None:
        groups = self.state.optimizer.param_groups
        return float(groups[0]["lr"]) if groups else None

    def set_learning_rate(self, lr: float, size: int) -> bool:
        # The rates are scaled by the ratio to the ring size they are scaled for, which the state keeps with
        # the optimizer (saved, restored, synced together): a scheduler's own changes are kept.
        assert self.config.base_lr is not None
        factor = lr / scaled_lr(self.config.base_lr, int(self.state.lr_size), self.config.lr_scaling)
        scale_learning_rates(self.state.optimizer, self.state.hvdt_scheduler, factor)
        self.state.lr_size = size
        return True

    def crcs(self) -> tuple[int, int]:
        return (replicated_crc(self.state.model, self.state.optimizer),
                full_crc(self.state.model, self.state.optimizer))


class Transient:
    """Preemption-aware checkpointing, master election and LR scaling for a PyTorch elastic loop.

    Call :meth:`after_step` right after every ``optimizer.step()`` (before ``state.commit()``), inside a
    loop over :func:`~hvd_transient.torch.elastic_batches`, which starts and ends the protocol on each
    ring. The options are :class:`~hvd_transient.keras.TransientCallback`'s: ``save_every_steps``,
    ``check_interval_s`` (or ``check_every_steps``), ``notice_window_s``, ``leave`` (``near_deadline``,
    the default: a worker under notice trains through its window; or ``at_notice``), ``leave_lead_s``,
    ``lr_scaling`` with ``base_lr`` (the single-worker learning rate the optimizer was made with; None:
    the learning rate is left alone), ``watcher``, ``max_to_keep``, ``keep_every_n_steps`` and
    ``save_on_train_end``.
    """

    def __init__(self, state: Any, *, store: str, save_every_steps: int | None = 500,
                 check_every_steps: int | None = None, check_interval_s: float = 1.0,
                 notice_window_s: float | None = None, leave_margin_s: float = 5.0,
                 lr_scaling: str = "linear", base_lr: float | None = None, watcher: str = "auto",
                 max_to_keep: int | None = 3, keep_every_n_steps: int | None = None,
                 save_on_train_end: bool = True, leave: str | None = None,
                 leave_lead_s: float | None = None) -> None:
        if getattr(state, "hvdt_position", None) is None:
            raise TypeError("Transient needs the state made by hvd_transient.torch.elastic_state or "
                            f"static_state, not {type(state).__name__}")
        self.state = state
        self.static = bool(getattr(state, "hvdt_static", False))
        if self.static and leave == "near_deadline":
            # a static job stops at the notice and is relaunched: its ring cannot shrink
            log.warning("leave=%r needs an elastic job; this static one leaves at the notice", leave)
        if self.static:
            leave = "at_notice"
        self.config = TransientConfig(
            store=store, save_every_steps=save_every_steps, check_every_steps=check_every_steps,
            check_interval_s=check_interval_s, notice_window_s=notice_window_s, leave_margin_s=leave_margin_s,
            watcher=watcher, max_to_keep=max_to_keep, keep_every_n_steps=keep_every_n_steps,
            lr_scaling=lr_scaling, base_lr=base_lr, leave=leave or "near_deadline", leave_lead_s=leave_lead_s)
        self.save_on_train_end = save_on_train_end
        trainee = _Trainee(state, self.config)
        trainee.metadata()  # what every save writes must be writable: refused now, not at every save
        self.session = Session(self.config, TorchCollectives, trainee, state.hvdt_position, counters=self._counters,
                               host_updates=None if self.static else HorovodHostUpdates(state))
        self.stopping = False
        state.hvdt_transient = self
        state.register_reset_callbacks([self._on_reset])

    @property
    def last_outcome(self) -> StepOutcome:
        return self.session.last_outcome

    def _counters(self) -> dict[str, int]:
        # the script's own integer values (e.g. epoch) and the learning rates' ring size
        saved = self.state._saved_state  # noqa: SLF001 (Horovod's names of the state's values)
        values = {key: getattr(self.state, key) for key in saved if key not in ("step", "samples")}
        return {key: value for key, value in values.items()
                if isinstance(value, int) and not isinstance(value, bool) or key in COUNTERS}

    def begin(self, steps_per_epoch: int | None = None) -> None:
        """A ring starts (called by :func:`~hvd_transient.torch.elastic_batches`)."""
        restored = getattr(self.state, "hvdt_restored", None)
        step = int(self.state.step)
        self.stopping = False
        self.session.begin(step, int(self.state.samples),
                           restored_step=restored.get("step") if restored else None)
        if steps_per_epoch:
            self.session.resumed(step, steps_per_epoch)

    def after_step(self) -> StepOutcome:
        """Every rank, right after each optimizer step: the step is counted and the protocol runs."""
        state = self.state
        state.step = step = int(state.step) + 1
        samples = state.hvdt_position.samples_at(step)
        if samples is not None:
            state.samples = samples
        outcome = self.session.after_step(step)
        if outcome.stop:
            self.stopping = True  # every rank saw the same request at this step
        elif outcome.emergency_step is not None and self.static:
            self.stopping = True  # a static job: the relaunch resumes from the emergency checkpoint
        elif outcome.check_hosts and not self.static:
            # Every rank agreed on the departure and on this step, so every rank calls Horovod's host
            # check (a collective) here; it raises HostsUpdatedInterrupt once discovery dropped the
            # leaving host (see hvd_transient.keras.callback for why the leaving worker cannot exit first).
            try:
                state.check_host_updates()
            except Exception:
                if outcome.leaving:  # this process ends in the reset: its last events must get out first
                    self.session.before_leaving()
                raise
        return outcome

    def end(self) -> None:
        """Training is over on this rank (called when :func:`~hvd_transient.torch.elastic_batches` ends)."""
        self.session.end(int(self.state.step), final_save=self.save_on_train_end)

    def close(self) -> None:
        """Stop the notice watcher, flush the event log and close the checkpoint manager (at exit at the latest)."""
        self.session.close()

    def _on_reset(self) -> None:
        self.session.note_reset(int(self.state.step))
