"""The global sample offset a frontend's elastic state carries, exact across every reset.

The state holds the offset (``samples``) among the attributes Horovod saves, restores and
broadcasts; :class:`DataPosition` holds the cursor of the current ring (:class:`SampleCursor`:
the offset as a function of the optimizer step), set up again each time a ring begins.
"""
from __future__ import annotations

from hvd_transient.core.data_position import SampleCursor


class DataPosition:
    """The offset's cursor on the current ring; None until an input pipeline says its samples per step."""

    def __init__(self) -> None:
        self.per_step: int | None = None
        self.cursor: SampleCursor | None = None

    def track(self, per_step: int) -> None:
        """The input pipeline takes ``per_step`` samples per optimizer step from now on (all ranks together)."""
        if per_step < 1:
            raise ValueError(f"a step takes at least one sample, not {per_step}")
        self.per_step, self.cursor = per_step, None

    def begin(self, step: int, samples: int) -> None:
        """A ring starts at ``step`` with the synced offset ``samples``."""
        if self.per_step:
            self.cursor = SampleCursor(step, samples, self.per_step)

    def samples_at(self, step: int) -> int | None:
        """The offset after ``step`` on this ring (None while no pipeline is tracked)."""
        if self.cursor is None or step < self.cursor.step0:
            return None  # before the ring's start the state was restored, and the offset with it
        return self.cursor.samples_at(step)
