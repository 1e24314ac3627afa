"""Reading logged events back as typed records, checked against their kinds' declared field types
(pure: no I/O; :mod:`hvd_transient.telemetry.events` reads the store).

Logs outlive the code that wrote them and can be damaged or hand-edited, so every field of an
event is checked against the type its kind declares in :mod:`hvd_transient.telemetry.schema`
(a float finite, an int within 64 bits, a time within :data:`TIME_LIMIT`): an event that fails is
skipped and counted by kind in a :class:`ParsedLog`, and whatever reads the records (the report's
analysers) can trust their types.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from dataclasses import dataclass
from types import UnionType
from typing import Any, Callable, Iterable, Mapping, TypeGuard, Union, get_args, get_origin, get_type_hints

from hvd_transient.telemetry.schema import EventBody, Record, from_json_dict

log = logging.getLogger(__name__)

#: the kind an event is counted under when it has no readable ``event`` name, and a line that is no JSON object
UNNAMED_KIND, UNREADABLE_LINE = "(no kind)", "(unreadable line)"
#: the widest integer an event field holds (JSON readers of other languages stop at 64 bits)
INT_LIMIT = 2 ** 63
#: the most seconds an epoch time may have (year 5138): beyond it a time is no time of a run
TIME_LIMIT = 1e11


@dataclass(frozen=True)
class ParsedLog:
    """A log's events as typed records, sorted by time, and what was skipped: kind -> how many events
    of it could not be read (of an unknown kind, a field missing or of the wrong type)."""

    records: tuple[Record[EventBody], ...]
    skipped: Mapping[str, int]

    @property
    def skipped_count(self) -> int:
        return sum(self.skipped.values())


def parse_log(events: Iterable[Record[EventBody] | Mapping[str, Any]]) -> ParsedLog:
    """Typed records of logged objects (records pass through), sorted by time, each checked against its
    kind's declared field types, so the report's analysers can trust them; the rest skipped and counted."""
    out: list[Record[EventBody]] = []
    skipped: Counter[str] = Counter()
    for e in events:
        record = e if isinstance(e, Record) else to_record(e) if isinstance(e, Mapping) else None
        if record is None:
            skipped[kind_name(e)] += 1
        else:
            out.append(record)
    if skipped:
        log.warning("skipped %d event(s) that could not be read: %s", sum(skipped.values()),
                    ", ".join(f"{kind} {n}" for kind, n in sorted(skipped.items())))
    return ParsedLog(tuple(sorted(out, key=lambda r: r.t)), dict(sorted(skipped.items())))


def parse_records(events: Iterable[Record[EventBody] | Mapping[str, Any]]) -> list[Record[EventBody]]:
    """Typed records of logged objects (records pass through), sorted by time (see :func:`parse_log`)."""
    return list(parse_log(events).records)


def kind_name(event: object) -> str:
    """The ``event`` name of a logged object, for counting it; :data:`UNNAMED_KIND` if it has none."""
    kind = event.get("event") if isinstance(event, Mapping) else None
    return kind[:40] if isinstance(kind, str) and kind else UNNAMED_KIND


def to_record(raw: Mapping[str, Any]) -> Record[EventBody] | None:
    """One logged object as a typed record whose envelope and fields have their declared types; None
    (and a debug line) when it is not one."""
    t, pid, host = raw.get("t"), raw.get("pid", 0), raw.get("host", "?")
    # the envelope first: from_json_dict converts it, and a time must sort and subtract
    if not (is_real(t) and abs(t) < TIME_LIMIT and _is_int(pid) and isinstance(host, str)):
        log.debug("skipping an event with a bad time, pid or host: %.120s", raw)
        return None
    record = from_json_dict(raw)
    if record is None:
        return None
    bad = next((name for name, hint in _field_types(type(record.body)).items()
                if not conforms(getattr(record.body, name), hint)), None)
    if bad is not None:
        log.debug("skipping a %s event whose %r is not of its declared type: %.120s", record.event, bad, raw)
        return None
    return record


def conforms(value: object, hint: object) -> bool:
    """Whether ``value`` (as :func:`~hvd_transient.telemetry.schema.from_json_dict` reads it) is of the
    declared type ``hint``; a float must be finite, an int (in a float field too) within :data:`INT_LIMIT`.
    A hint of a kind no event declares today passes anything (tests check every declared hint is understood)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        return any(conforms(value, arg) for arg in args)
    if origin is tuple:
        item = args[0] if args else object
        return isinstance(value, tuple) and all(conforms(v, item) for v in value)
    check = _SCALARS.get(hint)
    return check(value) if check is not None else True


def understood(hint: object) -> bool:
    """Whether :func:`conforms` checks ``hint`` rather than passing anything."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        return all(understood(arg) for arg in args)
    if origin is tuple:
        return len(args) == 2 and args[1] is Ellipsis and understood(args[0])
    return hint in _SCALARS


def is_real(value: object) -> TypeGuard[float]:
    return _is_int(value) or isinstance(value, float) and math.isfinite(value)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and -INT_LIMIT < value < INT_LIMIT


_SCALARS: dict[object, Callable[[object], bool]] = {
    int: _is_int, float: is_real, bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str),
    type(None): lambda v: v is None,
}


def _field_types(cls: type[EventBody]) -> dict[str, object]:
    """A kind's fields and their declared types (resolved once: the schema writes them as strings)."""
    types = _FIELD_TYPES.get(cls)
    if types is None:
        hints = get_type_hints(cls)
        types = _FIELD_TYPES[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return types


_FIELD_TYPES: dict[type[EventBody], dict[str, object]] = {}


__all__ = ["INT_LIMIT", "TIME_LIMIT", "UNNAMED_KIND", "UNREADABLE_LINE", "ParsedLog", "conforms", "is_real",
           "kind_name", "parse_log", "parse_records", "to_record", "understood"]
