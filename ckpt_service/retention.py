"""Which steps retention deletes (pure): old committed steps, and abandoned uncommitted ones."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class RetentionPolicy:
    max_to_keep: int | None = 3  # committed steps kept (None: all)
    keep_every_n_steps: int | None = None  # committed steps that are multiples of it are kept too
    # how long an uncommitted step's files, or a temp file of a write killed midway, stay untouched
    # before they are taken for abandoned (younger ones may belong to a save in flight)
    abandoned_after_s: float = 600.0


def steps_to_delete(committed: Sequence[int], max_to_keep: int | None,
                    keep_every_n_steps: int | None = None) -> list[int]:
    """Steps beyond the newest ``max_to_keep``, except multiples of ``keep_every_n_steps``.

    The newest committed step is never returned, whatever the arguments.
    """
    if max_to_keep is None:
        return []
    ordered = sorted(set(committed))
    keep = set(ordered[-max(1, max_to_keep):])
    if keep_every_n_steps:
        keep |= {s for s in ordered if s % keep_every_n_steps == 0}
    return [s for s in ordered if s not in keep]


def uncommitted_before_latest(written: Iterable[int], committed: Sequence[int]) -> list[int]:
    """Steps with files but no commit that are older than the latest committed step.

    Only those may be abandoned: a step newer than the latest may still be being written.
    """
    if not committed:
        return []
    latest, done = max(committed), set(committed)
    return [s for s in written if s not in done and s < latest]


def is_abandoned(last_written: float | None, now: float, abandoned_after_s: float) -> bool:
    """Whether files last written at ``last_written`` (None: there are none) are old enough to be abandoned."""
    return last_written is not None and now - last_written > abandoned_after_s
