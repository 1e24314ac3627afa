"""Which hosts the run's store lists as leaving, read cheaply enough to run every second.

Any store URL works through :func:`ckpt_service.stores.open_store` and
:func:`hvd_transient.membership.leaving_hosts`. For ``gs://`` URLs that path
imports google-cloud-storage (about 0.6 s per call here), which Horovod would
pay every second on the driver; so ``gs://`` is listed with one JSON-API call
through ``requests`` instead, and the listing is handed to ``leaving_hosts``
as an in-memory store, so the key layout stays defined in one place.
``STORAGE_EMULATOR_HOST`` is honoured, as by the GCS store.
"""
from __future__ import annotations

import os
from urllib.parse import urlparse

from hvd_transient.discovery.errors import DiscoveryConfigError, DiscoveryError

GCS_ENDPOINT = "https://storage.googleapis.com"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
READ_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"


def leaving_from_url(url: str, *, timeout: float = 10.0) -> set[str]:
    if urlparse(url).scheme.lower() == "gs":
        return _gcs_leaving(url, timeout=timeout)
    return _store_leaving(url)


def _store_leaving(url: str) -> set[str]:
    from ckpt_service.errors import BadStoreURLError, CheckpointError
    from ckpt_service.stores import open_store
    from hvd_transient.membership import leaving_hosts

    try:
        store = open_store(url)
    except BadStoreURLError as exc:
        raise DiscoveryConfigError(f"--store: {exc}") from None
    except (CheckpointError, OSError) as exc:
        raise DiscoveryError(f"cannot open store {url}: {exc}") from None
    try:
        return leaving_hosts(store)
    except (CheckpointError, OSError) as exc:
        raise DiscoveryError(f"cannot list leaving hosts in {url}: {exc}") from None
    finally:
        store.close()


def _gcs_leaving(url: str, *, timeout: float) -> set[str]:
    from ckpt_service.stores import MemoryStore
    from hvd_transient.cluster.compute_api import (
        ComputeAPI,
        ComputeAPIError,
        ComputeAuthError,
        ComputeNotFoundError,
        make_session,
    )
    from hvd_transient.membership import LEAVING_PREFIX, leaving_hosts

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
    except (ComputeAuthError, ComputeNotFoundError) as exc:  # wrong bucket or credentials: fix the setup
        raise DiscoveryConfigError(f"--store {url}: {exc}") from None
    except ComputeAPIError as exc:
        raise DiscoveryError(f"cannot list leaving hosts in {url}: {exc}") from None
    listing = MemoryStore()
    for name in names:
        listing.put(name[len(root):], b"")
    return leaving_hosts(listing)
