"""Where training is in its data, exactly, across resets and world-size changes (pure).

Two counters define the position, and both survive every reset and cold restart:

* the **optimizer step** (``optimizer.iterations``, part of the model state that
  Horovod syncs and the checkpoint stores): with a fixed ``steps_per_epoch`` it
  gives the Keras epoch and the batch inside it, so ``fit`` resumes at that exact
  batch instead of re-running the epoch;
* the **global sample offset**: how many samples all workers together have
  consumed, a position in an endless stream of passes over the data set, each
  pass a fresh permutation. A step on ``size`` workers of ``batch_size`` each
  takes the next ``size * batch_size`` positions, rank ``r`` the ``r``-th block.
  Because the offset counts samples, not steps, it stays exact when the number
  of workers changes mid-pass: every sample of a pass is used exactly once.

CheckFreq's resumable iterator keeps a per-worker position, valid for one world
size; the global offset is what makes the elastic case work.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SampleCursor:
    """The sample offset as a function of the step, on one ring (fixed world size)."""

    step0: int          # the step the ring started at
    samples0: int       # the offset at that step
    per_step: int       # samples per optimizer step on this ring: world size x per-worker batch

    def samples_at(self, step: int) -> int:
        return self.samples0 + (step - self.step0) * self.per_step


def epoch_and_batch(step: int, steps_per_epoch: int) -> tuple[int, int]:
    """The Keras epoch and the batch inside it at which training resumes after ``step`` steps."""
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be at least 1, not {steps_per_epoch}")
    return divmod(step, steps_per_epoch)


def pass_and_index(position: int, num_samples: int) -> tuple[int, int]:
    """Stream position -> (pass number, position inside that pass's permutation)."""
    return divmod(position, num_samples)
