"""A store wrapper that forwards every call; fault-injecting wrappers subclass it."""
from __future__ import annotations

from typing import Iterator

from ckpt_service.stores.base import ObjectInfo, ObjectStore


class DelegatingStore(ObjectStore):
    """An ObjectStore forwarding every call to ``inner``; fault-injecting wrappers override a few.

    An ObjectStore itself, so the helpers the base class builds on ``put`` and ``get_versioned``
    (create_exclusive, put_resolved) run through the wrapper's overrides. ``within(deadline)``
    returns the wrapper itself (its calls reach ``inner`` unbounded), so that a wrapper's state
    stays one object; a wrapper that must honour deadlines overrides it.
    """

    def __init__(self, inner: ObjectStore) -> None:
        self.inner, self.url = inner, inner.url

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        return self.inner.put(key, data, if_generation_match=if_generation_match)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        return self.inner.get_versioned(key)

    def stat(self, key: str) -> ObjectInfo | None:
        return self.inner.stat(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def delete_if_generation(self, key: str, generation: int) -> bool:
        return self.inner.delete_if_generation(key, generation)

    def store_time(self) -> float:
        return self.inner.store_time()

    def sweep_temporary(self, older_than_s: float, *, now: float | None = None) -> int:
        return self.inner.sweep_temporary(older_than_s, now=now)
