"""The measurement events of the plain Horovod elastic baselines (``plain_elastic_worker.py``, Keras, and
``plain_torch_elastic_worker.py``, PyTorch), framework-free: each worker tells :class:`StepEvents` its global
step, and it writes the events hvd-transient writes (start, ring, first_step, progress, reset, train_end), so
that ``hvd_transient.report.analysis`` reads a baseline's run as it reads the plugin's.

Not a benchmark (``hvd-transient bench`` skips modules whose names start with ``_``).
"""
from __future__ import annotations

import time

from hvd_transient.telemetry import schema as ev
from hvd_transient.telemetry.events import EventLog

PROGRESS_EVERY_STEPS = 10


class StepEvents:
    """Writes the measurement events; takes no part in training."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.ring_step: int | None = None  # None until the first ring
        self.last_step = -1
        self.last_step_at: float | None = None

    def begin(self, step: int, rank: int, size: int) -> None:
        """Training (re)starts on a ring, at ``step``."""
        if self.ring_step is None:
            self.log.emit(ev.Start(step=step, rank=rank, size=size))
        self.log.emit(ev.Ring(step=step, rank=rank, size=size, master=0,
                              master_host=self.log.host if rank == 0 else None))
        self.ring_step = self.last_step = step

    def stepped(self, step: int, size: int) -> None:
        """An optimizer step completed; ``step``: the global step count after it."""
        self.last_step, self.last_step_at = step, time.time()
        if self.ring_step is not None and step == self.ring_step + 1:
            self.log.emit(ev.FirstStep(step=step, size=size))
        elif step % PROGRESS_EVERY_STEPS == 0:
            self.log.emit(ev.Progress(step=step, size=size))

    def reset(self, step: int) -> None:
        """Horovod reset the ring; ``step``: after the state was rolled back (if it was)."""
        self.log.emit(ev.Reset(step=step, rolled_back=max(0, self.last_step - step), last_step=self.last_step,
                               last_step_at=self.last_step_at))
        self.last_step = step

    def end(self, step: int) -> None:
        self.log.emit(ev.TrainEnd(step=step))
