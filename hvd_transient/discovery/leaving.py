"""The leaving records of the run's store, read cheaply enough to run every second.

Any store URL works through :func:`ckpt_service.stores.open_store` and
:func:`hvd_transient.membership.read_leaving`. For ``gs://`` URLs that path
imports google-cloud-storage (about 0.6 s per call here), which Horovod would
pay every second on the driver; so ``gs://`` is read through the JSON API with
``requests`` instead (one listing, then one small read per record: records
live only about as long as a notice window), and handed to ``read_leaving`` as
an in-memory store, so the key layout and format stay defined in one place.
``STORAGE_EMULATOR_HOST`` is honoured, as by the GCS store.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING
from urllib.parse import quote, urlparse

from hvd_transient.discovery.errors import DiscoveryConfigError, DiscoveryError

if TYPE_CHECKING:
    from hvd_transient.membership import LeavingRecord

GCS_ENDPOINT = "https://storage.googleapis.com"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
READ_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"


def leaving_from_url(url: str, *, timeout: float = 10.0) -> list["LeavingRecord"]:
    if urlparse(url).scheme.lower() == "gs":
        return _gcs_leaving(url, timeout=timeout)
    return _store_leaving(url)


def _store_leaving(url: str) -> list["LeavingRecord"]:
    from ckpt_service.errors import BadStoreURLError, CheckpointError
    from ckpt_service.stores import open_store
    from hvd_transient.membership import read_leaving

    try:
        store = open_store(url)
    except BadStoreURLError as exc:
        raise DiscoveryConfigError(f"--store: {exc}") from None
    except (CheckpointError, OSError) as exc:
        raise DiscoveryError(f"cannot open store {url}: {exc}") from None
    try:
        return read_leaving(store)
    except (CheckpointError, OSError) as exc:
        raise DiscoveryError(f"cannot list leaving hosts in {url}: {exc}") from None
    finally:
        store.close()


def _gcs_leaving(url: str, *, timeout: float) -> list["LeavingRecord"]:
    from ckpt_service.layout import LEAVING_PREFIX
    from ckpt_service.stores import MemoryStore
    from hvd_transient.cluster.compute_api import (
        ComputeAPI,
        ComputeAPIError,
        ComputeAuthError,
        ComputeNotFoundError,
        make_session,
    )
    from hvd_transient.membership import read_leaving

    parsed = urlparse(url)
    bucket, prefix = parsed.netloc, parsed.path.strip("/")
    if not bucket:
        raise DiscoveryConfigError(f"--store {url!r}: a GCS URL needs a bucket, as in gs://my-bucket/runs/r1")
    root = f"{prefix}/" if prefix else ""
    emulator = os.environ.get(EMULATOR_ENV, "").rstrip("/")
    try:
        # The Compute client is a generic Google JSON-API client (pagination, retries, typed errors).
        api = ComputeAPI(make_session((READ_SCOPE,), anonymous=bool(emulator)),
                         f"{emulator or GCS_ENDPOINT}/storage/v1", timeout=timeout, attempts=3, backoff_max=2.0)
        names = [
            item["name"]
            for page in api.pages("GET", f"b/{bucket}/o",
                                  params={"prefix": root + LEAVING_PREFIX, "fields": "items(name),nextPageToken"})
            for item in page.get("items", [])
        ]
        listing = MemoryStore()
        for name in names:
            try:
                record = api.call("GET", f"b/{bucket}/o/{quote(name, safe='')}", params={"alt": "media"})
            except ComputeNotFoundError:  # deleted since the listing: expired
                continue
            listing.put(name[len(root):], json.dumps(record).encode())
    except (ComputeAuthError, ComputeNotFoundError) as exc:  # wrong bucket or credentials: fix the setup
        raise DiscoveryConfigError(f"--store {url}: {exc}") from None
    except ComputeAPIError as exc:
        raise DiscoveryError(f"cannot list leaving hosts in {url}: {exc}") from None
    return read_leaving(listing)
