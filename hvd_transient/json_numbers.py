"""Numbers read from JSON that other processes wrote (records in the run store, state files): pure."""
from __future__ import annotations

import math


def finite_number(value: object) -> float | None:
    """A finite JSON number as a float, else None (a bool, a string, NaN, an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
