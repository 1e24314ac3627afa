"""How a worker's start, insert or delete that failed is classified: no capacity in the zone now
(a stock-out or a quota error: the keeper backs the zone off), the VM gone meanwhile, or an error."""
from __future__ import annotations

# Failure classes of a start/insert: the first two mean "no capacity here now"
STOCKOUT, QUOTA, GONE, ERROR = "stockout", "quota", "gone", "error"
STOCKOUT_CODES = frozenset({"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"})
QUOTA_CODES = frozenset({"QUOTA_EXCEEDED"})
NOT_FOUND_CODES = frozenset({"NOTFOUND", "RESOURCE_NOT_FOUND"})


def _normal(code: str) -> str:
    return code.replace("_", "").casefold()


_STOCKOUT_NORMAL = frozenset(map(_normal, STOCKOUT_CODES))
_QUOTA_NORMAL = frozenset(map(_normal, QUOTA_CODES))
_NOT_FOUND_NORMAL = frozenset(map(_normal, NOT_FOUND_CODES))


def classify_failure(code: str) -> str:
    """An operation error code (``ZONE_RESOURCE_POOL_EXHAUSTED``) or HTTP error reason
    (``quotaExceeded``) -> STOCKOUT, QUOTA, GONE (the VM vanished meanwhile) or ERROR."""
    norm = _normal(code)
    if norm in _STOCKOUT_NORMAL:
        return STOCKOUT
    if norm in _QUOTA_NORMAL:
        return QUOTA
    if norm in _NOT_FOUND_NORMAL:
        return GONE
    return ERROR


__all__ = ["ERROR", "GONE", "NOT_FOUND_CODES", "QUOTA", "QUOTA_CODES", "STOCKOUT", "STOCKOUT_CODES", "classify_failure"]
