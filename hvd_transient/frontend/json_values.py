"""A framework's non-tensor state as JSON, exactly, never pickled (pure).

Optimizers' and schedulers' ``state_dict`` values are not all JSON: ``MultiStepLR`` keeps a ``Counter``
with integer keys, ``ReduceLROnPlateau`` an infinite ``best``, Adam its ``betas`` as a tuple. Plain JSON
would turn the keys into strings (the scheduler then never decays), refuse the infinity (no save could
be taken) and make the tuple a list. :func:`encode` writes such values as small tagged objects, and
:func:`decode` gives back the same types and values. Numbers of other numeric types (numpy's) are written
as int or float, and mappings of other types as dict (a ``Counter`` stays one); any other object is
refused with the path to it, since a checkpoint holds no code.
"""
from __future__ import annotations

import math
from collections import Counter
from numbers import Integral, Real
from typing import Any

#: the key of a tagged object; a plain dict that uses it is tagged itself, so none is misread
TAG = "__hvdt__"


class UnsupportedValueError(TypeError):
    """A value of a type a checkpoint's JSON part cannot hold (it would need pickling)."""


def encode(value: Any, path: str = "") -> Any:
    """``value`` as JSON values (see the module's docstring); :func:`decode` reverses it."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, Integral):
        return int(value)
    if isinstance(value, Real):
        number = float(value)
        return number if math.isfinite(number) else {TAG: "float", "v": repr(number)}
    if isinstance(value, tuple):
        return {TAG: "tuple", "v": [encode(item, f"{path}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        items = [(encode(k, f"{path}<key>"), encode(v, f"{path}[{k!r}]")) for k, v in value.items()]
        if isinstance(value, Counter):
            return {TAG: "counter", "v": [list(kv) for kv in items]}
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return dict(items)
        return {TAG: "dict", "v": [list(kv) for kv in items]}
    raise UnsupportedValueError(f"{path or 'the value'} is a {type(value).__name__}, which a checkpoint's JSON "
                                "part cannot hold (only None, bool, int, float, str, tuple, list, dict, Counter)")


def decode(value: Any) -> Any:
    """The value :func:`encode` was given (values written before tagging read as they are)."""
    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind is None:
        return {k: decode(v) for k, v in value.items()}
    items: Any = value.get("v")
    if kind == "float":
        return float(items)
    if kind == "tuple":
        return tuple(decode(item) for item in items)
    if kind == "counter":
        return Counter({decode(k): decode(v) for k, v in items})
    if kind == "dict":
        return {decode(k): decode(v) for k, v in items}
    raise ValueError(f"unknown tagged value {kind!r} in a checkpoint's JSON part (written by a newer version?)")


__all__ = ["TAG", "UnsupportedValueError", "decode", "encode"]
