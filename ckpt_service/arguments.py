"""Checks of a call's step and ranks, made before a save or restore reads or writes anything.

Integers are taken as ``operator.index`` takes them (numpy integers work); ``bool``, floats and
strings are refused rather than truncated or parsed, since ``True`` would silently be step 1.
"""
from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ckpt_service.errors import BadRankError, BadStepError


def exact_int(value: Any) -> int | None:
    """``value`` as an int if it is an integer (not a bool), else None."""
    if type(value) is int:  # the usual case, answered before the checks an async save's stall would pay
        return value
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def checked_step(step: Any) -> int:
    """``step`` as a non-negative int, or BadStepError."""
    value = exact_int(step)
    if value is None or value < 0:
        raise BadStepError(
            f"step {step!r} ({type(step).__name__}) is not a checkpoint step; steps are non-negative integers "
            "(int or a numpy integer; pass int(step) for a float that holds one)")
    return value


def checked_ranks(rank: Any, world_size: Any, coordinator: Any) -> tuple[int, int, int]:
    """(rank, world_size, coordinator) as ints, or BadRankError unless 0 <= rank, coordinator < world_size."""
    size = exact_int(world_size)
    if size is None or size < 1:
        raise BadRankError(f"world_size {world_size!r} must be a positive integer (the number of writers)")
    checked = []
    for what, value in (("rank", rank), ("coordinator", coordinator)):
        number = exact_int(value)
        if number is None or not 0 <= number < size:
            raise BadRankError(
                f"{what} {value!r} is outside [0, {size}): with world_size {size} the {what} must be an integer "
                f"from 0 to {size - 1}; nothing was written")
        checked.append(number)
    return checked[0], size, checked[1]
