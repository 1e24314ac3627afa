"""Where a Keras ``fit`` resumes: the hook (:class:`ResumeAt`) that makes it start at the optimizer's step,
installed by :class:`~hvd_transient.keras.callback.TransientCallback`."""
from __future__ import annotations

from typing import Callable

from hvd_transient.frontend.resume import resume_point


class ResumeAt:
    """Makes Keras ``fit`` start at the batch the optimizer step says, not at the epoch's start.

    Keras 2 asks ``model._training_state`` (BackupAndRestore's hook) for its initial epoch and
    step right after ``on_train_begin``. With Horovod's ``epochs=EPOCHS - state.epoch`` pattern
    the epoch is counted from ``state.epoch`` (``epoch_offset``); otherwise it is absolute.
    """

    def __init__(self, step: int, epoch_offset: int, on_resume: Callable[[int, int], None]) -> None:
        self.step, self.epoch_offset, self.on_resume = step, epoch_offset, on_resume

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch: int | None, initial_epoch: int,
                                              mode: object = None) -> tuple[int, int]:
        if not steps_per_epoch:
            return initial_epoch, 0
        at = resume_point(self.step, int(steps_per_epoch))
        self.on_resume(self.step, at.steps_per_epoch)  # (step, steps_per_epoch)
        return initial_epoch + max(0, at.epoch - self.epoch_offset), at.batch
