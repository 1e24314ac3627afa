"""Records of the run's store that discovery reads every second, cheaply enough to do so.

Any store URL works through :func:`ckpt_service.stores.open_store`. For ``gs://`` URLs that path
imports google-cloud-storage (about 0.6 s per call here), which Horovod would pay every second
on the driver; so ``gs://`` is read through the JSON API with ``requests`` instead (one listing,
then one small read per record: records are few and small), and handed to the reader as an
in-memory store, so the key layout and format stay defined in one place (the leaving hosts of
:func:`hvd_transient.core.membership.read_leaving`, the standbys' readiness of
:func:`hvd_transient.discovery.ready.read_ready`). ``STORAGE_EMULATOR_HOST`` is honoured, as by
the GCS store.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Callable, TypeVar
from urllib.parse import quote, urlparse

from hvd_transient.discovery.errors import DiscoveryConfigError, DiscoveryError

if TYPE_CHECKING:
    from ckpt_service.stores.base import ObjectStore
    from hvd_transient.core.membership import LeavingRecord

GCS_ENDPOINT = "https://storage.googleapis.com"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
READ_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"

T = TypeVar("T")


def leaving_from_url(url: str, *, timeout: float = 10.0) -> list["LeavingRecord"]:
    from hvd_transient.core.membership import read_leaving
    from hvd_transient.store_keys import LEAVING_PREFIX

    return read_from_url(url, LEAVING_PREFIX, read_leaving, timeout=timeout, what="leaving hosts")


def read_from_url(url: str, prefix: str, read: Callable[["ObjectStore"], T], *, timeout: float = 10.0,
                  what: str) -> T:
    """``read(store)`` on the run store at ``url``, of which it may only list and get under ``prefix``."""
    if urlparse(url).scheme.lower() == "gs":
        return read(_gcs_listing(url, prefix, timeout=timeout, what=what))
    return _store_read(url, read, what=what)


def _store_read(url: str, read: Callable[["ObjectStore"], T], *, what: str) -> T:
    from ckpt_service.errors import BadStoreURLError, CheckpointError
    from ckpt_service.stores import open_store

    try:
        store = open_store(url)
    except BadStoreURLError as exc:
        raise DiscoveryConfigError(f"--store: {exc}") from None
    except (CheckpointError, OSError) as exc:
        raise DiscoveryError(f"cannot open store {url}: {exc}") from None
    try:
        return read(store)
    except (CheckpointError, OSError) as exc:
        raise DiscoveryError(f"cannot list {what} in {url}: {exc}") from None
    finally:
        store.close()


def _gcs_listing(url: str, prefix: str, *, timeout: float, what: str) -> "ObjectStore":
    """The objects under ``prefix`` of a ``gs://`` run store, copied into a memory store."""
    from ckpt_service.stores import MemoryStore
    from hvd_transient.gcp.compute_api import (
        ComputeAPI,
        ComputeAPIError,
        ComputeAuthError,
        ComputeNotFoundError,
        make_session,
    )

    parsed = urlparse(url)
    bucket, root_prefix = parsed.netloc, parsed.path.strip("/")
    if not bucket:
        raise DiscoveryConfigError(f"--store {url!r}: a GCS URL needs a bucket, as in gs://my-bucket/runs/r1")
    root = f"{root_prefix}/" if root_prefix else ""
    emulator = os.environ.get(EMULATOR_ENV, "").rstrip("/")
    try:
        # The Compute client is a generic Google JSON-API client (pagination, retries, typed errors).
        api = ComputeAPI(make_session((READ_SCOPE,), anonymous=bool(emulator)),
                         f"{emulator or GCS_ENDPOINT}/storage/v1", timeout=timeout, attempts=3, backoff_max=2.0)
        names = [
            item["name"]
            for page in api.pages("GET", f"b/{bucket}/o",
                                  params={"prefix": root + prefix, "fields": "items(name),nextPageToken"})
            for item in page.get("items", [])
        ]
        listing = MemoryStore()
        for name in names:
            try:
                record = api.call("GET", f"b/{bucket}/o/{quote(name, safe='')}", params={"alt": "media"})
            except ComputeNotFoundError:  # deleted since the listing
                continue
            listing.put(name[len(root):], json.dumps(record).encode())
    except (ComputeAuthError, ComputeNotFoundError) as exc:  # wrong bucket or credentials: fix the setup
        raise DiscoveryConfigError(f"--store {url}: {exc}") from None
    except ComputeAPIError as exc:
        raise DiscoveryError(f"cannot list {what} in {url}: {exc}") from None
    return listing
