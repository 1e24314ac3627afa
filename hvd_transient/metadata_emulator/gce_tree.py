"""The GCE metadata tree as the real server renders it: values, directory listings, recursive JSON (pure).

What Google's metadata server does, and so this module (see "Query VM metadata"):

* a key answers its value as text (``Content-Type: application/text``), or as a JSON
  string with ``?alt=json``;
* a directory (a path ending in ``/``) lists its entries one per line,
  sub-directories with a trailing ``/`` (``?alt=json``: a JSON list);
* a directory asked without its trailing slash is redirected (301) to it;
* ``?recursive=true`` on a directory returns its whole subtree as JSON, entry names
  in camelCase (``maintenance-event`` -> ``maintenanceEvent``) and numeric ids as
  numbers; with ``?alt=text``, one ``path value`` line per key.

Values come in as a flat mapping of ``computeMetadata/v1/``-relative keys; a key
ending in ``/`` with an empty value stands for an empty directory (``attributes/``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

TEXT = "application/text"
JSON = "application/json"
#: keys whose recursive-JSON value is a number, as on the real server
NUMERIC = frozenset({"id", "numeric-project-id"})


class UnknownPathError(KeyError):
    """No such key or directory."""


@dataclass(frozen=True)
class Reply:
    body: str
    content_type: str = TEXT
    redirect: str | None = None  # a directory asked without its trailing slash


def camel(name: str) -> str:
    head, *rest = name.split("-")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _entries(values: Mapping[str, str], directory: str) -> list[str]:
    """Relative paths under ``directory`` (``""`` is the root), empty-directory markers included."""
    return [key[len(directory):] for key in values if key.startswith(directory) and key != directory]


def _nest(values: Mapping[str, str], directory: str) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for rel in _entries(values, directory):
        *parents, leaf = rel.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(camel(part), {})
        if leaf:  # an empty-directory marker ends in "/" and adds only its folder
            value = values[directory + rel]
            node[camel(leaf)] = int(value) if leaf in NUMERIC and value.isdigit() else value
    return tree


def render(values: Mapping[str, str], key: str, *, recursive: bool = False, alt: str | None = None) -> Reply:
    """The reply to ``GET computeMetadata/v1/<key>``; raises UnknownPathError for a missing path."""
    if key in values and not key.endswith("/"):
        value = values[key]
        return Reply(json.dumps(value), JSON) if alt == "json" else Reply(value)
    directory = key if key.endswith("/") or not key else key + "/"
    entries = _entries(values, directory)
    if not entries and directory not in values:
        raise UnknownPathError(key)
    if key and not key.endswith("/"):
        return Reply("", redirect=directory)
    if recursive:
        if alt == "text":
            lines = [f"{rel} {values[directory + rel]}" for rel in sorted(entries) if not rel.endswith("/")]
            return Reply("".join(line + "\n" for line in lines))
        return Reply(json.dumps(_nest(values, directory), sort_keys=True), JSON)
    names = sorted({rel.split("/", 1)[0] + ("/" if "/" in rel else "") for rel in entries})
    if alt == "json":
        return Reply(json.dumps(names), JSON)
    return Reply("".join(name + "\n" for name in names))
