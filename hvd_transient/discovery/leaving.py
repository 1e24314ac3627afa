"""Records of the run's store that discovery reads every second, cheaply enough to do so.

Any store URL works through :func:`ckpt_service.stores.open_store`, except that a ``gs://`` store
is opened read-only through the JSON API (:mod:`ckpt_service.stores.gcs_json`): the full client
would cost discovery about 0.6 s of imports every second. Any other store does without an HTTP client
(``requests`` is 0.08 s of imports, a third of a discovery call on a local store). The key layout and
record formats stay defined in one place (the leaving hosts of :func:`hvd_transient.core.membership.read_leaving`, the
standbys' readiness of :func:`hvd_transient.discovery.ready.read_ready`).
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable, Collection, TypeVar
from urllib.parse import urlparse

from hvd_transient.discovery.errors import DiscoveryConfigError, DiscoveryError

if TYPE_CHECKING:
    from ckpt_service.stores.base import ObjectStore
    from hvd_transient.core.membership import LeavingRecord


T = TypeVar("T")


def leaving_from_url(url: str, *, timeout: float = 10.0, only: Collection[str] | None = None) -> list["LeavingRecord"]:
    """The leaving records at ``url``; with ``only``, just those of these host names (what discovery lists)."""
    from hvd_transient.core.membership import read_leaving

    return read_from_url(url, partial(read_leaving, only=only), timeout=timeout, what="leaving hosts")


def read_from_url(url: str, read: Callable[["ObjectStore"], T], *, timeout: float = 10.0, what: str) -> T:
    """``read(store)`` on the run store at ``url``, which it may only list and read."""
    from ckpt_service.errors import BadStoreURLError, CheckpointError, MissingBucketError, MissingCredentialsError
    from ckpt_service.stores import open_store

    parsed = urlparse(url)
    try:
        if parsed.scheme.lower() == "gs":
            from ckpt_service.stores.gcs_json import GCSReadOnlyStore  # requests: only for a gs:// store

            store: ObjectStore = GCSReadOnlyStore(parsed.netloc, parsed.path, timeout=timeout)
        else:
            store = open_store(url)
    except (BadStoreURLError, MissingCredentialsError) as exc:
        raise DiscoveryConfigError(f"--store {url}: {exc}") from None
    except (CheckpointError, OSError) as exc:
        raise DiscoveryError(f"cannot open store {url}: {exc}") from None
    try:
        return read(store)
    except (MissingBucketError, MissingCredentialsError) as exc:  # wrong bucket or credentials: fix the set-up
        raise DiscoveryConfigError(f"--store {url}: {exc}") from None
    except (CheckpointError, OSError) as exc:
        raise DiscoveryError(f"cannot list {what} in {url}: {exc}") from None
    finally:
        store.close()
