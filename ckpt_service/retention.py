"""Which committed steps to delete (pure)."""
from __future__ import annotations

from typing import Sequence


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
