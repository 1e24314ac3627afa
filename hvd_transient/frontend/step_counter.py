"""The optimizer's step at each batch without reading it from the framework at every batch.

Reading a framework's step counter is an op: about 0.2 ms of CPU after a training step on a
2-core VM (the first op after other work pays the runtime's wake-up), which a plain step would pay
on every batch. The step is read exactly where it matters (the first batch of an epoch or a
ring, every step at which the protocol does more than the plain path, see
:meth:`~hvd_transient.core.transient.TransientImpl.plain_step`) and counted in between: one
optimizer step per batch, which the frontend asserts (Keras: the model's own ``train_step`` and a
fixed ``steps_per_execution``; a loss scale that skips a step and Horovod's gradient aggregation
still count one per batch). Where a count still differs from an exact read, every batch is read
exactly from then on, until the next ring.

Every rank counts the same batches and reads the same optimizer, so every rank takes the same
steps for plain (no rank can skip a round another one runs).
"""
from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)


class StepCounter:
    """``at(batch)``: the step after ``batch`` (its index in the epoch, as the framework passes it)."""

    def __init__(self, read: Callable[[], int], plain: Callable[[int], bool]) -> None:
        self._read, self._plain = read, plain
        self._anchor: tuple[int, int] | None = None  # (batch, step) of the last exact read
        self.counts = True  # False once a count was seen to differ from the optimizer's step
        self.exact_reads = 0

    def reset(self) -> None:
        """A new epoch: the next batch is read exactly."""
        self._anchor = None

    def restart(self, *, counts: bool) -> None:
        """A new ring (or ``fit``): the next batch is read exactly, and the steps are counted between
        the reads only where ``counts`` (the frontend knows one optimizer step per batch). Every rank
        of a ring restarts alike, so a worker that joins decides as the others do."""
        self._anchor, self.counts = None, counts

    def at(self, batch: int) -> int:
        anchor = self._anchor
        if self.counts and anchor is not None and batch > anchor[0]:
            counted = anchor[1] + batch - anchor[0]
            if self._plain(counted):
                return counted
        step = self._read()
        self.exact_reads += 1
        if self.counts and anchor is not None and batch > anchor[0] and step != anchor[1] + batch - anchor[0]:
            self.counts = False
            log.warning("the optimizer's step (%d) is not one per batch (counted %d): it is read at every "
                        "batch from now on", step, anchor[1] + batch - anchor[0])
        self._anchor = (batch, step)
        return step


__all__ = ["StepCounter"]
