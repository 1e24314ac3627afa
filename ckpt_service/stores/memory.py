"""In-process store, for unit tests and for `memory://name` URLs within one process."""
from __future__ import annotations

import threading
import time
from typing import Iterator

from ckpt_service.errors import ObjectNotFoundError, PreconditionFailedError
from ckpt_service.stores.base import ObjectInfo, ObjectStore, check_key

_NAMED: dict[str, "MemoryStore"] = {}
_NAMED_LOCK = threading.Lock()


class MemoryStore(ObjectStore):
    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        self._objects: dict[str, tuple[bytes, int, float]] = {}
        self._lock = threading.Lock()
        self._generation = 0

    @classmethod
    def named(cls, name: str) -> "MemoryStore":
        """The process-wide store of that name, so several managers can share it."""
        with _NAMED_LOCK:
            if name not in _NAMED:
                _NAMED[name] = cls(name)
            return _NAMED[name]

    def get(self, key: str) -> bytes:
        with self._lock:
            try:
                return self._objects[check_key(key)][0]
            except KeyError:
                raise ObjectNotFoundError(f"{self.url}/{key} does not exist") from None

    def stat(self, key: str) -> ObjectInfo | None:
        with self._lock:
            entry = self._objects.get(check_key(key))
        return None if entry is None else ObjectInfo(key, len(entry[0]), entry[1], entry[2])

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        with self._lock:
            entry = self._objects.get(check_key(key))
        return None if entry is None else (entry[0], entry[1])

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        check_key(key)
        with self._lock:
            current = self._objects.get(key)
            if if_generation_match is not None:
                have = 0 if current is None else current[1]
                if have != if_generation_match:
                    raise PreconditionFailedError(
                        f"{self.url}/{key}: generation is {have}, expected {if_generation_match}"
                    )
            self._generation += 1
            self._objects[key] = (bytes(data), self._generation, time.time())
            return self._generation

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(check_key(key), None)

    def delete_if_generation(self, key: str, generation: int) -> bool:
        with self._lock:
            entry = self._objects.get(check_key(key))
            if entry is None or entry[1] != generation:
                return False
            del self._objects[key]
            return True

    def store_time(self) -> float:
        return time.time()  # mtimes come from this process's clock

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix))
        yield from keys
