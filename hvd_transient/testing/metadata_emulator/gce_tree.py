"""The GCE metadata tree as the real server renders it: values, directory listings, recursive JSON (pure).

What Google's metadata server does, and so this module (Compute Engine docs, "View and query VM
metadata": directory listings, recursive contents, "Format query output", wait_for_change):

* a key answers its value as text (``Content-Type: application/text``), or as JSON with
  ``?alt=json`` (a string, or a number for numeric keys such as ``instance/id``);
* a directory (a path ending in ``/``) lists its entries one per line, sub-directories with a
  trailing ``/``; with ``?alt=json`` the listing is a JSON list;
* a directory asked without its trailing slash is redirected (301) to it;
* ``?recursive=true`` on a directory returns its whole subtree as JSON (``application/json``):
  entry names in camelCase (``maintenance-event`` -> ``maintenanceEvent``), numeric values as
  numbers, numbered directories (``network-interfaces/0/``) as JSON arrays; with ``?alt=text``,
  one ``relative/path value`` line per key, names as in the paths;
* ``wait_for_change`` works on a key or on a directory with ``recursive=true``, never on a
  plain directory listing (400);
* errors are Google's HTML error page (``text/html; charset=UTF-8``), e.g. a 404 that names
  the requested URL.

Values come in as a flat mapping of paths relative to the server root (``computeMetadata/v1/
instance/name``); a path ending in ``/`` with an empty value stands for an empty directory
(``instance/attributes/``), which a recursive query renders as ``{}``.
"""
from __future__ import annotations

import fnmatch
import html
import json
from dataclasses import dataclass
from typing import Any, Mapping

TEXT = "application/text"
JSON = "application/json"
HTML = "text/html; charset=UTF-8"
V1 = "computeMetadata/v1/"
#: keys (relative to ``computeMetadata/v1/``) whose JSON value is a number on the real server;
#: not every ``id``: ``instance/licenses/0/id`` is a string there
NUMERIC = ("instance/id", "project/numeric-project-id", "instance/network-interfaces/*/mtu")


class UnknownPathError(KeyError):
    """No such key or directory."""


@dataclass(frozen=True)
class Reply:
    body: str
    content_type: str = TEXT
    redirect: str | None = None  # the slash form of a directory asked without its trailing slash


def under_root(values: Mapping[str, str]) -> dict[str, str]:
    """``computeMetadata/v1/``-relative keys -> server-root-relative paths (so ``/`` and
    ``/computeMetadata/`` list their children like any other directory)."""
    return {V1 + key: value for key, value in values.items()}


def camel(name: str) -> str:
    head, *rest = name.split("-")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def typed(path: str, value: str) -> Any:
    """The JSON value of the key at ``path`` (server-root-relative)."""
    key = path[len(V1):] if path.startswith(V1) else path
    if any(fnmatch.fnmatchcase(key, pattern) for pattern in NUMERIC):
        try:
            return int(value)
        except ValueError:
            return value
    return value


def is_directory_path(path: str) -> bool:
    """Whether a request path asks for a directory (the root, or a trailing slash)."""
    return path == "" or path.endswith("/")


def _entries(values: Mapping[str, str], directory: str) -> list[str]:
    """Relative paths under ``directory`` (``""`` is the root), empty-directory markers included."""
    return [key[len(directory):] for key in values if key.startswith(directory) and key != directory]


def _arrays(node: Any) -> Any:
    """Numbered directories (``0/``, ``1/`` ...) become JSON arrays, as on the real server."""
    if not isinstance(node, dict):
        return node
    if node and all(name.isdigit() for name in node):
        return [_arrays(node[name]) for name in sorted(node, key=int)]
    return {name: _arrays(child) for name, child in node.items()}


def _nest(values: Mapping[str, str], directory: str) -> Any:
    tree: dict[str, Any] = {}
    for rel in _entries(values, directory):
        *parents, leaf = rel.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(camel(part), {})
        if leaf:  # an empty-directory marker ends in "/" and adds only its folder
            node[camel(leaf)] = typed(directory + rel, values[directory + rel])
    return _arrays(tree)


def render(values: Mapping[str, str], path: str, *, recursive: bool = False, alt: str | None = None) -> Reply:
    """The reply to ``GET /<path>`` (server-root-relative); raises UnknownPathError for a missing path."""
    if path in values and not path.endswith("/"):
        value = values[path]
        return Reply(json.dumps(typed(path, value)), JSON) if alt == "json" else Reply(value)
    directory = path if is_directory_path(path) else path + "/"
    entries = _entries(values, directory)
    if not entries and directory not in values:
        raise UnknownPathError(path)
    if not is_directory_path(path):
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


_REASONS = {400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed"}


def error_page(status: int, url_path: str, detail: str = "") -> str:
    """Google's HTML error page, as the metadata server sends it (``text/html; charset=UTF-8``)."""
    reason = _REASONS.get(status, "Error")
    code = f"<code>{html.escape(url_path)}</code>"
    if status == 404:
        message = f"The requested URL {code} was not found on this server."
    elif status == 403:
        message = f"Your client does not have permission to get URL {code} from this server."
    else:
        message = "Your client has issued a malformed or illegal request."
    if detail:
        message += " " + html.escape(detail)
    return (f"<!DOCTYPE html>\n<html lang=en>\n  <meta charset=utf-8>\n"
            f"  <title>Error {status} ({reason})!!1</title>\n"
            f"  <p><b>{status}.</b> <ins>That\u2019s an error.</ins>\n"
            f"  <p>{message}  <ins>That\u2019s all we know.</ins>\n")
