"""Checks of a call's arguments (step, ranks, deadline, names), made before a save or restore reads
or writes anything.

Integers are taken as ``operator.index`` takes them (numpy integers work); ``bool``, floats and
strings are refused rather than truncated or parsed, since ``True`` would silently be step 1.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import numpy as np

from ckpt_service.errors import BadDeadlineError, BadNamesError, BadRankError, BadStepError
from ckpt_service.layout import STEP_DIGITS, STEP_LIMIT, describe_int


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
    """``step`` as an int from 0 to ``STEP_LIMIT - 1`` (what the store's keys can hold), or BadStepError."""
    value = exact_int(step)
    if value is None or value < 0:
        shown = describe_int(value) if value is not None else repr(step)
        raise BadStepError(
            f"step {shown} ({type(step).__name__}) is not a checkpoint step; steps are non-negative integers "
            "(int or a numpy integer; pass int(step) for a float that holds one)")
    if value >= STEP_LIMIT:
        raise BadStepError(
            f"step {describe_int(value)} is too large: steps are written as {STEP_DIGITS} digits in the store's "
            f"keys, so they go from 0 to {STEP_LIMIT - 1}")
    return value


def checked_deadline(value: Any) -> float | None:
    """A save's ``deadline`` as finite epoch seconds (None: no deadline), or BadDeadlineError.

    NaN would compare as never expired and infinity overflows the store clients' timeouts, so
    both are refused; a deadline already past is a valid one (the save gives up at once).
    """
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise BadDeadlineError(
            f"deadline {value!r} ({type(value).__name__}) is not a time: pass epoch seconds as a number "
            "(e.g. time.time() + 20), or None for no deadline")
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if not math.isfinite(seconds):
        shown = describe_int(value) if isinstance(value, int) else repr(value)
        raise BadDeadlineError(
            f"deadline {shown} is not a finite number of epoch seconds: pass e.g. time.time() + 20, or None "
            "for no deadline; nothing was written")
    return seconds


def checked_names(names: Any) -> list[str] | None:
    """A restore's ``names`` as a list of tensor names (None: every tensor), or BadNamesError."""
    if names is None:
        return None
    if isinstance(names, (str, bytes)):
        raise BadNamesError(
            f"names {names!r} is one string: names must be a list of tensor names, e.g. names=[{names!r}]")
    try:
        listed = list(names)
    except TypeError:
        raise BadNamesError(
            f"names {names!r} ({type(names).__name__}) is not a list of tensor names; pass e.g. "
            "names=['dense/kernel:0'], or None for every tensor") from None
    odd = [n for n in listed if not isinstance(n, str)]
    if odd:
        raise BadNamesError(f"names holds {odd[0]!r} ({type(odd[0]).__name__}): tensor names are strings")
    return listed


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
