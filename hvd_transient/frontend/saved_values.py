"""The values a Horovod state saves (its ``_saved_state``) kept apart from the live ones.

Horovod's states save, restore and broadcast a script's values by reference: a list the script
appends to, or a dict it updates in place, is one object with the rollback point, so a rollback
would keep every change made since the commit while the model goes back. The frontends' states copy
the values on the way in (each save) and out (each restore), so the rollback point holds them as
they were, with the model of the same step.
"""
from __future__ import annotations

import copy
from typing import Any


def keep_apart(state: Any) -> None:
    """After a save (or a sync that saved): the saved values become copies of their own."""
    state._saved_state = copy.deepcopy(state._saved_state)  # noqa: SLF001 (Horovod's name)


def restore_copies(state: Any) -> None:
    """After a restore: the live values become copies of the saved ones, which stay as they are."""
    for key, value in state._saved_state.items():  # noqa: SLF001
        setattr(state, key, copy.deepcopy(value))


__all__ = ["keep_apart", "restore_copies"]
