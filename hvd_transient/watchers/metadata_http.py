"""Small HTTP helpers shared by the cloud watchers (requests-based)."""
from __future__ import annotations

import json
from typing import Any

import requests

from .errors import MetadataGarbageError, MetadataServerError


def new_session() -> requests.Session:
    """A session that ignores proxy settings: metadata servers are link-local and
    must never be reached through an HTTP(S)_PROXY from the environment."""
    session = requests.Session()
    session.trust_env = False
    return session


def expect_status(reply: requests.Response, *allowed: int) -> None:
    if reply.status_code not in allowed:
        raise MetadataServerError(
            f"{reply.request.method} {reply.url} answered HTTP {reply.status_code} "
            f"(expected {' or '.join(map(str, allowed))}): {reply.text[:120]!r}")


def json_object(reply: requests.Response) -> dict[str, Any]:
    try:
        body = json.loads(reply.content)
    except ValueError:
        raise MetadataGarbageError(f"{reply.url} answered 200 with a body that is not JSON: "
                                   f"{reply.content[:80]!r}") from None
    if not isinstance(body, dict):
        raise MetadataGarbageError(f"{reply.url} answered 200 with JSON that is not an object: {body!r:.80}")
    return body


def printable_text(reply: requests.Response, what: str) -> str:
    """The body as text, refusing anything that is not short printable ASCII."""
    raw = reply.content.strip()
    if not raw or len(raw) > 4096 or not all(0x20 <= b < 0x7F for b in raw):
        raise MetadataGarbageError(f"{reply.url} answered 200 with a {what} that is not "
                                   f"printable text: {raw[:80]!r}")
    return str(raw.decode("ascii"))
