"""A ``gs://`` store read through GCS's JSON API with ``requests``: list, get and stat, no writes.

Importing google-cloud-storage costs about 0.6 s per process here. Host discovery runs once a
second under ``horovodrun`` and only lists and reads a run's few small records, so it opens the
store with :func:`open_read_only` and never imports the client. Everything else uses
:class:`~ckpt_service.stores.gcs.GCSStore`; both map keys to ``<prefix>/<key>`` in one bucket.

``STORAGE_EMULATOR_HOST`` is honoured as by the GCS store (anonymous requests to the emulator);
otherwise Application Default Credentials with a read-only scope. Transient failures (429, 5xx,
connection errors) are retried a few times with backoff (tenacity); every request has a timeout.
"""
from __future__ import annotations

import logging
import os
from datetime import datetime
from typing import Any, Iterator, Mapping
from urllib.parse import quote

import requests
import tenacity

from ckpt_service.errors import (
    BadStoreURLError,
    CheckpointError,
    MissingBucketError,
    MissingCredentialsError,
    ObjectNotFoundError,
    StoreUnavailableError,
)
from ckpt_service.stores.base import ObjectInfo, ObjectStore, check_key

log = logging.getLogger(__name__)

GCS_ENDPOINT = "https://storage.googleapis.com"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
READ_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
_RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class ReadOnlyStoreError(CheckpointError):
    """A write was attempted on a store opened read-only."""


class _Retryable(Exception):
    """A reply or a failure that a later attempt may not repeat."""


def _session(anonymous: bool) -> requests.Session:
    if anonymous:
        return requests.Session()
    import google.auth
    import google.auth.exceptions
    from google.auth.transport.requests import AuthorizedSession

    try:
        credentials, _project = google.auth.default(scopes=[READ_SCOPE])
    except google.auth.exceptions.DefaultCredentialsError as exc:
        raise MissingCredentialsError(
            "no Google Cloud credentials found: run `gcloud auth application-default login`, set "
            "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or run on a GCE VM with a service "
            f"account (for a local emulator set {EMULATOR_ENV}=http://host:port) ({exc})") from None
    return AuthorizedSession(credentials)  # type: ignore[no-untyped-call]


class GCSReadOnlyStore(ObjectStore):
    """One bucket's ``prefix`` through the JSON API, read-only."""

    def __init__(self, bucket: str, prefix: str = "", *, timeout: float = 10.0, attempts: int = 3,
                 page_size: int = 1000, session: requests.Session | None = None) -> None:
        if not bucket:
            raise BadStoreURLError("a GCS URL needs a bucket, as in gs://my-bucket/runs/r1")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"gs://{bucket}/{self.prefix}".rstrip("/")
        emulator = os.environ.get(EMULATOR_ENV, "").rstrip("/")
        self.api = f"{emulator or GCS_ENDPOINT}/storage/v1/b/{quote(bucket, safe='')}/o"
        self.timeout, self.attempts, self.page_size = timeout, attempts, page_size
        self.session = session or _session(anonymous=bool(emulator))

    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _request(self, path: str, params: Mapping[str, str], what: str) -> requests.Response | None:
        """The reply to one GET (None: 404), retrying transient failures."""
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts), wait=tenacity.wait_random_exponential(max=2.0),
            retry=tenacity.retry_if_exception_type(_Retryable), reraise=True)
        try:
            for attempt in retrying:
                with attempt:
                    try:
                        reply = self.session.get(f"{self.api}{path}", params=dict(params), timeout=self.timeout)
                    except (requests.ConnectionError, requests.Timeout) as exc:
                        raise _Retryable(str(exc)) from exc
                    if reply.status_code in _RETRIED_STATUS:
                        raise _Retryable(f"HTTP {reply.status_code}: {reply.text[:200]}")
        except _Retryable as exc:
            raise StoreUnavailableError(f"{what}: {exc}; check that {self.url} is reachable") from None
        if reply.status_code == 404:
            return None
        if reply.status_code in (401, 403):
            raise MissingCredentialsError(
                f"{what}: HTTP {reply.status_code}: these credentials may not read {self.url} "
                f"({reply.text[:200]})")
        if not reply.ok:
            raise StoreUnavailableError(f"{what}: HTTP {reply.status_code}: {reply.text[:200]}")
        return reply

    def get(self, key: str) -> bytes:
        reply = self._request(f"/{quote(self._name(key), safe='')}", {"alt": "media"}, f"read {self.url}/{key}")
        if reply is None:
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist")
        return bytes(reply.content)

    def stat(self, key: str) -> ObjectInfo | None:
        reply = self._request(f"/{quote(self._name(key), safe='')}", {"fields": "size,generation,updated"},
                              f"stat {self.url}/{key}")
        if reply is None:
            return None
        meta: dict[str, Any] = reply.json()
        updated = datetime.fromisoformat(str(meta["updated"]).replace("Z", "+00:00")).timestamp()
        return ObjectInfo(key, int(meta["size"]), int(meta["generation"]), updated)

    def list(self, prefix: str = "") -> Iterator[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        params = {"prefix": root + prefix, "fields": "items(name),nextPageToken", "maxResults": str(self.page_size)}
        while True:
            reply = self._request("", params, f"list {self.url}/{prefix}")
            if reply is None:
                raise MissingBucketError.naming(f"list {self.url}/{prefix}", self.bucket)
            page: dict[str, Any] = reply.json()
            for item in page.get("items", []):
                yield str(item["name"])[len(root):]
            if not page.get("nextPageToken"):
                return
            params = {**params, "pageToken": str(page["nextPageToken"])}

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        raise ReadOnlyStoreError(f"{self.url} was opened read-only; cannot write {key}")

    def delete(self, key: str) -> None:
        raise ReadOnlyStoreError(f"{self.url} was opened read-only; cannot delete {key}")

    def close(self) -> None:
        self.session.close()
