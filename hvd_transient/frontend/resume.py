"""Where a training loop resumes: the epoch and the batch inside it that the optimizer step says (pure)."""
from __future__ import annotations

from dataclasses import dataclass

from hvd_transient.core.data_position import epoch_and_batch


@dataclass(frozen=True)
class ResumePoint:
    step: int
    epoch: int
    batch: int
    steps_per_epoch: int


def resume_point(step: int, steps_per_epoch: int) -> ResumePoint:
    """The point at which a loop of ``steps_per_epoch`` steps an epoch resumes after ``step`` steps."""
    epoch, batch = epoch_and_batch(step, steps_per_epoch)
    return ResumePoint(step, epoch, batch, steps_per_epoch)
