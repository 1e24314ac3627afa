"""Storage backends and the URL that picks one.

* ``/path`` or ``file:///path`` - a local directory (the embedded default)
* ``gs://bucket/prefix`` - Google Cloud Storage (honours ``STORAGE_EMULATOR_HOST``)
* ``memory://name`` - in-process, for tests
"""
from __future__ import annotations

from urllib.parse import urlparse

from ckpt_service.errors import BadStoreURLError
from ckpt_service.stores.base import ObjectInfo, ObjectStore, check_key
from ckpt_service.stores.local import LocalStore
from ckpt_service.stores.memory import MemoryStore

__all__ = ["ObjectInfo", "ObjectStore", "LocalStore", "MemoryStore", "open_store", "check_key"]


def open_store(url: str) -> ObjectStore:
    """Open the store a URL names. Raises BadStoreURLError for anything else."""
    if not isinstance(url, str) or not url.strip():
        raise BadStoreURLError("empty store URL: give a directory, file:///dir, gs://bucket/prefix or memory://name")
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file"):
        if scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise BadStoreURLError(f"{url!r}: file URLs must be file:///absolute/path (no host)")
        return LocalStore(parsed.path if scheme == "file" else url)
    if scheme == "gs":
        if not parsed.netloc:
            raise BadStoreURLError(f"{url!r}: a GCS URL needs a bucket, as in gs://my-bucket/runs/r1")
        from ckpt_service.stores.gcs import GCSStore  # imports google-cloud-storage lazily

        return GCSStore(parsed.netloc, parsed.path.strip("/"))
    if scheme == "memory":
        return MemoryStore.named(parsed.netloc + parsed.path)
    raise BadStoreURLError(
        f"unsupported store URL scheme {scheme!r} in {url!r}: use a local path, file://, gs:// or memory://"
    )
