"""Google Cloud Storage as an object store, through the official ``google-cloud-storage`` client.

Keys map to object names ``<prefix>/<key>`` in one bucket. The store's
generations are GCS object generations, and conditional writes are GCS
``ifGenerationMatch`` preconditions, which GCS evaluates atomically on the server.

Retries are data, not loops: reads use the library's ``DEFAULT_RETRY`` and
conditional writes a ``ConditionalRetryPolicy`` around it (the policy behind
``DEFAULT_RETRY_IF_GENERATION_SPECIFIED``). Unconditional whole-object writes
are retried as well: re-sending the same bytes leaves the same object.
A retried create-only write whose first attempt was applied but whose response
was lost fails with a precondition error on the caller's *own* write, and one
whose every reply is lost gives up although it was applied;
:meth:`ObjectStore.put_resolved` tells these apart by reading back (one download
gives the bytes and their generation).

A store bounded by a deadline (:meth:`GCSStore.within`) runs each call under the
same policy, driven by the same ``Retry`` object with its timeout cut to the call's
window (:mod:`ckpt_service.deadline`), and gives each request a timeout that ends
inside that window; a call that runs out of it raises ``StoreDeadlineError``.

``STORAGE_EMULATOR_HOST`` (e.g. fake-gcs-server) is honoured: the client then
uses anonymous credentials and never looks for Application Default Credentials.

One ``storage.Client`` per store, created on first use and shared by every
thread: that is the sharing python-storage supports (``Blob``/``Bucket``
objects are created per call and never shared).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar, Union

import requests
import tenacity
from google.api_core import exceptions as gexc
from google.api_core.retry import Retry
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption
from google.cloud.storage.retry import DEFAULT_RETRY, ConditionalRetryPolicy, is_generation_specified
from requests.adapters import HTTPAdapter

from ckpt_service.deadline import Deadline, call_window
from ckpt_service.errors import (
    BadStoreURLError,
    CorruptCheckpointError,
    MissingBucketError,
    MissingCredentialsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreDeadlineError,
    StoreUnavailableError,
)
from ckpt_service.stores.base import ObjectInfo, ObjectStore, check_key

if TYPE_CHECKING:
    from google.cloud.storage import Blob, Bucket

log = logging.getLogger(__name__)

_T = TypeVar("_T")
#: what the client takes as ``retry=``: a policy, a policy applied only to idempotent calls, or none
RetryPolicy = Union[Retry, ConditionalRetryPolicy, None]
#: one client call, given the retry policy and the per-request timeout to run it with
ClientCall = Callable[[RetryPolicy, float], _T]

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
#: project id used against an emulator (it accepts any), so no credential lookup happens
EMULATOR_PROJECT = "test"
#: reads of one object that must all fail their transfer checksum before it is called corrupt (the read,
#: then up to three more)
CORRUPT_READ_ATTEMPTS = 4
#: upload_from_string switches from one multipart request to a resumable upload above this
MULTIPART_LIMIT = 8 * 1024 * 1024

_CREDENTIALS_HELP = (
    "run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS "
    "to a service-account key file, or run on a GCE VM with a service account "
    "(for a local emulator set STORAGE_EMULATOR_HOST=http://host:port)"
)


class GCSStore(ObjectStore):
    """A bucket (and optional prefix) in Google Cloud Storage.

    ``retry`` is a ``google.api_core.retry.Retry`` (default: the library's
    ``DEFAULT_RETRY``, 120 s deadline); tests pass one with short delays.
    ``timeout`` is the per-request HTTP timeout in seconds.
    ``max_connections`` sizes the HTTP connection pool so a thread pool of
    writers does not churn connections. ``deadline`` bounds every call (see
    :meth:`within`, which is how a bounded view is normally made).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: storage.Client | None = None,
        retry: Retry = DEFAULT_RETRY,
        timeout: float = 60.0,
        max_connections: int = 32,
        deadline: Deadline | None = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise BadStoreURLError(f"invalid GCS bucket name {bucket!r}: use gs://my-bucket/optional/prefix")
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.url = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        self.retry = retry
        self.conditional_retry = ConditionalRetryPolicy(retry, is_generation_specified, ["query_params"])
        self.timeout = timeout
        self.max_connections = max_connections
        self.deadline = deadline
        self._client = client
        self._owns_client = client is None
        self._bucket: Bucket | None = None
        self._lock = threading.Lock()
        # Set once any call proved the bucket exists; until then a 404 on an
        # object is double-checked, because GCS answers 404 for a missing bucket too.
        self._bucket_seen = False

    def within(self, deadline: Deadline) -> GCSStore:
        """A view of this store (same client, bucket and retry policy) whose every call ends by
        ``deadline``; closing it leaves the client open."""
        bounded = GCSStore(self.bucket_name, self.prefix, client=self.client, retry=self.retry,
                           timeout=self.timeout, max_connections=self.max_connections, deadline=deadline)
        bounded._bucket_seen = self._bucket_seen
        return bounded

    def _run(self, what: str, call: ClientCall[_T], *, conditional: bool = False) -> _T:
        """Run one client call under the store's policy, or, with a deadline, inside its call window.

        Without a deadline: ``self.retry`` (``conditional_retry`` for a conditional write) and
        ``self.timeout``, as the client is normally used. With one, the same ``Retry`` drives the
        attempts with its timeout cut to the window, and each request's timeout ends inside it.
        """
        if self.deadline is None:
            return call(self.conditional_retry if conditional else self.retry, self.timeout)
        now = time.time()
        window = call_window(self.deadline, now, conditional_write=conditional)
        if window is None:
            raise StoreDeadlineError(f"{what}: no time left before the deadline; not sent", attempted=False)
        sent = 0
        last_error: Exception | None = None

        def attempt() -> _T:
            nonlocal sent, last_error
            timeout = window.attempt_timeout(time.time(), self.timeout)
            if timeout is None:
                raise _WindowSpent()
            sent += 1
            try:
                return call(None, timeout)
            except Exception as exc:
                last_error = exc
                raise

        try:
            return self.retry.with_timeout(window.left(now))(attempt)()
        except (gexc.RetryError, _WindowSpent) as exc:
            raise StoreDeadlineError(
                f"{what}: not done within its {window.seconds:.2f} s before the deadline "
                f"({sent} request(s) sent, the last error {last_error!r})", attempted=sent > 0) from exc

    # ---- client -------------------------------------------------------------------------

    @property
    def client(self) -> storage.Client:
        self._ensure_bucket()
        assert self._client is not None
        return self._client

    def _ensure_bucket(self) -> Bucket:
        bucket = self._bucket
        if bucket is not None:
            return bucket
        with self._lock:
            if self._bucket is None:
                if self._client is None:
                    self._client = _make_client(self.max_connections)
                self._bucket = self._client.bucket(self.bucket_name)
            return self._bucket

    def _object_name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _blob(self, key: str) -> Blob:
        return self._ensure_bucket().blob(self._object_name(key))

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        """Turn client exceptions into the service's typed errors (NotFound is the caller's)."""
        try:
            yield
        except gexc.PreconditionFailed as exc:
            raise PreconditionFailedError(f"{what}: precondition failed ({exc.message})") from exc
        except (gexc.Forbidden, gexc.Unauthorized) as exc:
            raise StoreUnavailableError(
                f"{what}: access denied ({exc.code}). The credentials in use cannot read/write "
                f"gs://{self.bucket_name}: grant them roles/storage.objectAdmin on the bucket, or "
                f"{_CREDENTIALS_HELP}"
            ) from exc
        except auth_exc.DefaultCredentialsError as exc:
            raise MissingCredentialsError(f"{what}: no Google Cloud credentials found; {_CREDENTIALS_HELP}") from exc
        except auth_exc.RefreshError as exc:
            raise MissingCredentialsError(
                f"{what}: Google Cloud credentials could not be refreshed ({exc}); {_CREDENTIALS_HELP}"
            ) from exc
        except DataCorruption as exc:
            raise CorruptCheckpointError(
                f"{what}: checksum mismatch on {CORRUPT_READ_ATTEMPTS} reads in a row: the stored bytes do not match "
                f"the object's checksum ({exc})") from exc
        except gexc.RetryError as exc:
            raise StoreUnavailableError(
                f"{what}: gave up after retrying ({exc.cause!r}); check that {self.url} is reachable"
            ) from exc
        except (gexc.ServerError, gexc.TooManyRequests, requests.ConnectionError, requests.Timeout) as exc:
            raise StoreUnavailableError(f"{what}: {exc}; check that {self.url} is reachable") from exc

    def _missing_bucket_error(self, what: str) -> MissingBucketError:
        return MissingBucketError.naming(what, self.bucket_name)

    def _check_bucket_after_miss(self, what: str) -> None:
        """A 404 on an object: make sure it was the object, not the whole bucket, that is missing."""
        if self._bucket_seen:
            return
        with self._translated(what):
            try:
                # objects.list needs only the permission a checkpoint writer has anyway
                # (buckets.get is often not granted).
                def probe(retry: RetryPolicy, timeout: float) -> None:
                    blobs = self.client.list_blobs(
                        self.bucket_name, max_results=1, prefix=self.prefix, retry=retry, timeout=timeout)
                    next(iter(blobs), None)

                self._run(what, probe)
            except gexc.NotFound as exc:
                raise self._missing_bucket_error(what) from exc
        self._bucket_seen = True

    # ---- ObjectStore ----------------------------------------------------------------------

    def _download(self, key: str, what: str) -> tuple[bytes, Blob] | None:
        """The object's bytes and the blob that read them (it holds their generation); None if absent."""
        blob = self._blob(key)
        # A checksum mismatch in transfer is a network fault the client does not retry: read again
        # before calling the object corrupt. Only a mismatch on every read means the bytes at rest differ.
        again = tenacity.Retrying(stop=tenacity.stop_after_attempt(CORRUPT_READ_ATTEMPTS), reraise=True,
                                  retry=tenacity.retry_if_exception_type(DataCorruption),
                                  before_sleep=lambda state: log.warning("%s: checksum mismatch in transfer; "
                                                                         "reading it again", what))
        with self._translated(what):
            try:
                data: bytes = again(self._run, what,
                                    lambda retry, timeout: blob.download_as_bytes(retry=retry, timeout=timeout))
            except gexc.NotFound:
                self._check_bucket_after_miss(what)
                return None
        self._bucket_seen = True
        return data, blob

    def get(self, key: str) -> bytes:
        found = self._download(key, f"get {self.url}/{key}")
        if found is None:
            raise ObjectNotFoundError(f"{self.url}/{key} does not exist")
        return found[0]

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        # One download: the client takes the generation from its x-goog-generation header.
        what = f"read back {self.url}/{key}"
        found = self._download(key, what)
        if found is None:
            return None
        data, blob = found
        if blob.generation is None:
            raise StoreUnavailableError(f"{what}: the server returned no object generation")
        return data, int(blob.generation)

    def stat(self, key: str) -> ObjectInfo | None:
        name = self._object_name(key)
        what = f"stat {self.url}/{key}"
        with self._translated(what):
            blob = self._run(
                what, lambda retry, timeout: self._ensure_bucket().get_blob(name, retry=retry, timeout=timeout))
        if blob is None:
            self._check_bucket_after_miss(what)
            return None
        self._bucket_seen = True
        return _info(key, blob)

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        blob = self._blob(key)
        what = f"put {self.url}/{key}"
        if if_generation_match is not None and len(data) > MULTIPART_LIMIT:
            log.debug("%s: conditional write of %d bytes goes through a resumable upload", what, len(data))
        payload = bytes(data)

        def upload(retry: RetryPolicy, timeout: float) -> None:
            blob.upload_from_string(payload, content_type="application/octet-stream",
                                    if_generation_match=if_generation_match, retry=retry, timeout=timeout)

        with self._translated(what):
            try:
                self._run(what, upload, conditional=if_generation_match is not None)
            except gexc.NotFound as exc:
                raise self._missing_bucket_error(what) from exc
        self._bucket_seen = True
        generation = blob.generation
        if generation is None:  # the upload response always carries it; be loud if not
            raise StoreUnavailableError(f"{what}: the server returned no object generation")
        return int(generation)

    def delete(self, key: str) -> None:
        blob = self._blob(key)
        what = f"delete {self.url}/{key}"
        with self._translated(what):
            try:
                self._run(what, lambda retry, timeout: blob.delete(retry=retry, timeout=timeout))
            except gexc.NotFound:
                pass  # absent already (or a retried delete whose first attempt was applied)

    def delete_if_generation(self, key: str, generation: int) -> bool:
        blob = self._blob(key)
        what = f"delete {self.url}/{key} at generation {generation}"
        try:
            with self._translated(what):
                try:
                    self._run(what, lambda retry, timeout: blob.delete(
                        if_generation_match=generation, retry=retry, timeout=timeout), conditional=True)
                except gexc.NotFound:
                    return False
        except PreconditionFailedError:
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        what = f"list {self.url}/{prefix}"

        def names(retry: RetryPolicy, timeout: float) -> list[str]:
            # with a deadline, one attempt reads every page: a retried listing starts again
            return [b.name for b in self.client.list_blobs(
                self.bucket_name, prefix=root + prefix, retry=retry, timeout=timeout)]

        with self._translated(what):
            try:
                listed = self._run(what, names)
            except gexc.NotFound as exc:
                raise self._missing_bucket_error(what) from exc
        self._bucket_seen = True
        # Names ending in '/' are "folder" placeholders some tools create; they are not keys.
        yield from sorted(n[len(root):] for n in listed if not n.endswith("/"))

    def close(self) -> None:
        """Close the client this store created (a client passed in belongs to the caller)."""
        if not self._owns_client:
            return
        with self._lock:
            client, self._client, self._bucket = self._client, None, None
        if client is not None:
            client.close()


class _WindowSpent(Exception):
    """Too little of a call's window is left for another request (never retried)."""


def _info(key: str, blob: Blob) -> ObjectInfo:
    updated = blob.updated
    return ObjectInfo(
        key=key,
        size=int(blob.size or 0),
        generation=int(blob.generation),
        mtime=updated.timestamp() if updated is not None else 0.0,
    )


def _make_client(max_connections: int) -> storage.Client:
    """One client per store. Against an emulator: anonymous, fixed project, no ADC lookup."""
    if os.environ.get(EMULATOR_ENV):
        client = storage.Client(
            project=os.environ.get("GOOGLE_CLOUD_PROJECT") or EMULATOR_PROJECT,
            credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]  # google-auth leaves it unannotated
        )
    else:
        try:
            # project=None: object I/O needs no project, so do not fail when ADC carries none.
            client = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT") or None)
        except auth_exc.DefaultCredentialsError as exc:
            raise MissingCredentialsError(f"no Google Cloud credentials found; {_CREDENTIALS_HELP}") from exc
    adapter = HTTPAdapter(pool_connections=4, pool_maxsize=max_connections)
    client._http.mount("https://", adapter)
    client._http.mount("http://", adapter)
    return client
