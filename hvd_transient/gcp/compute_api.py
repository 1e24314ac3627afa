"""A small Compute Engine REST (v1) client: ``requests`` + google-auth, retries by tenacity.

Only what host discovery and ``hvd-transient cluster`` need: paginated lists
(zonal, aggregated, managed-instance-group members), get/insert/delete/start of
one instance, and waiting on a zonal operation.

The base URL is overridable (``api_url=`` or ``$HVDT_COMPUTE_API``) so tests can
point it at a local stand-in; with ``$HVDT_COMPUTE_ANONYMOUS=1`` no credentials
are loaded (only allowed when the URL is not Google's). Otherwise credentials
are application-default ones (``google.auth.default()``): ``gcloud auth
application-default login`` on a workstation, the VM's service account on GCE.

Retries: 429, 5xx and connection failures are retried with jittered
exponential backoff. A retried ``insert`` whose first attempt was applied
comes back as 409 ``alreadyExists``; callers that create treat that as success.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterator, Mapping, Sequence

import requests
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

log = logging.getLogger(__name__)

DEFAULT_API_URL = "https://compute.googleapis.com/compute/v1"
API_URL_ENV = "HVDT_COMPUTE_API"
ANONYMOUS_ENV = "HVDT_COMPUTE_ANONYMOUS"
READONLY_SCOPE = "https://www.googleapis.com/auth/compute.readonly"
READWRITE_SCOPE = "https://www.googleapis.com/auth/compute"

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class ComputeAPIError(RuntimeError):
    """The Compute API refused or failed a request."""
    cli_exit_status = 1  # the command ran and failed

    def __init__(self, message: str, *, status: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class ComputeConfigError(ComputeAPIError, ValueError):
    """The client is misconfigured (a bad API URL): the setup must change, no request was sent."""
    cli_exit_status = 2  # the command line or configuration must change


class ComputeNotFoundError(ComputeAPIError, LookupError):
    """404: the project, zone, group or instance does not exist."""


class ComputeAuthError(ComputeAPIError, PermissionError):
    """No usable credentials, or 401/403 from the API."""
    cli_exit_status = 2  # the command line or configuration must change


class ComputeConflictError(ComputeAPIError):
    """409: e.g. an instance of that name already exists."""


class ComputeUnavailableError(ComputeAPIError, ConnectionError):
    """The API could not be reached, or kept failing after retries."""


class _Retryable(Exception):
    def __init__(self, error: ComputeAPIError) -> None:
        super().__init__(str(error))
        self.error = error


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def make_session(scopes: Sequence[str], *, anonymous: bool) -> requests.Session:
    """A plain session (anonymous) or an AuthorizedSession with application-default credentials."""
    if anonymous:
        return requests.Session()
    try:  # imported here: discovery against a stand-in never pays for it
        import google.auth
        import google.auth.exceptions
        from google.auth.transport.requests import AuthorizedSession
    except ImportError:
        raise ComputeAuthError(
            "google-auth is not installed; install it (pip install google-auth) to use Google credentials"
        ) from None

    try:
        credentials, _project = google.auth.default(scopes=list(scopes))
    except google.auth.exceptions.DefaultCredentialsError as exc:
        raise ComputeAuthError(
            "no Google credentials found: run 'gcloud auth application-default login', set "
            "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or run on a GCE VM "
            f"whose service account has the scopes {', '.join(scopes)} ({exc})"
        ) from None
    return AuthorizedSession(credentials)  # type: ignore[no-untyped-call]


def _error_from_response(response: requests.Response, what: str) -> ComputeAPIError:
    status = response.status_code
    message, reason = response.text[:500], ""
    try:
        error = response.json().get("error", {})
        message = error.get("message") or message
        errors = error.get("errors") or [{}]
        reason = errors[0].get("reason", "") or error.get("status", "")
    except (ValueError, AttributeError):
        pass
    text = f"{what}: HTTP {status} {reason}: {message}".replace(" : ", ": ")
    if status == 404:
        return ComputeNotFoundError(text, status=status, reason=reason)
    if status in (401, 403):
        return ComputeAuthError(
            f"{text} (check the project id and that the credentials have the compute scope "
            "and roles/compute.viewer or roles/compute.instanceAdmin.v1)",
            status=status, reason=reason,
        )
    if status == 409:
        return ComputeConflictError(text, status=status, reason=reason)
    if status in _RETRY_STATUS:
        return ComputeUnavailableError(text, status=status, reason=reason)
    return ComputeAPIError(text, status=status, reason=reason)


class ComputeAPI:
    def __init__(
        self,
        session: requests.Session,
        base_url: str = DEFAULT_API_URL,
        *,
        timeout: float = 30.0,
        attempts: int = 5,
        backoff_initial: float = 0.5,
        backoff_max: float = 8.0,
    ) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.attempts = max(1, attempts)
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max

    @classmethod
    def connect(
        cls,
        *,
        api_url: str | None = None,
        anonymous: bool | None = None,
        scopes: Sequence[str] = (READONLY_SCOPE,),
        **kwargs: Any,
    ) -> "ComputeAPI":
        """A client for ``api_url`` (or ``$HVDT_COMPUTE_API``, or Google's endpoint)."""
        url = (api_url or os.environ.get(API_URL_ENV) or DEFAULT_API_URL).rstrip("/")
        if anonymous is None:
            anonymous = _truthy(os.environ.get(ANONYMOUS_ENV))
        if anonymous and url == DEFAULT_API_URL:
            raise ComputeAuthError(
                f"{ANONYMOUS_ENV}=1 skips credentials and only works with a stand-in API: set "
                f"--api-url or {API_URL_ENV} as well, or unset {ANONYMOUS_ENV}"
            )
        if not url.startswith(("http://", "https://")):
            source = "--api-url" if api_url else API_URL_ENV if os.environ.get(API_URL_ENV) else "the API URL"
            raise ComputeConfigError(f"{source}: compute API URL {url!r} must start with http:// or https://")
        return cls(make_session(scopes, anonymous=anonymous), url, **kwargs)

    # ---- transport ------------------------------------------------------------------------

    def url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else f"{self.base_url}/{path.lstrip('/')}"

    def call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One request, retried on 429/5xx/connection errors; returns the JSON object."""
        url = self.url(path)
        what = f"{method} {url}"

        def attempt() -> dict[str, Any]:
            try:
                response = self.session.request(
                    method, url, params=params, json=body, timeout=self.timeout
                )
            except (requests.ConnectionError, requests.Timeout) as exc:
                raise _Retryable(ComputeUnavailableError(f"{what}: {exc}")) from None
            if response.status_code >= 400:
                error = _error_from_response(response, what)
                if response.status_code in _RETRY_STATUS:
                    raise _Retryable(error)
                raise error
            if not response.content:
                return {}
            try:
                data = response.json()
            except ValueError:
                raise ComputeAPIError(f"{what}: response is not JSON: {response.text[:200]!r}") from None
            if not isinstance(data, dict):
                raise ComputeAPIError(f"{what}: expected a JSON object, got {type(data).__name__}")
            return data

        retrying = Retrying(
            retry=retry_if_exception(lambda exc: isinstance(exc, _Retryable)),
            stop=stop_after_attempt(self.attempts),
            wait=wait_random_exponential(multiplier=self.backoff_initial, max=self.backoff_max),
            reraise=True,
            before_sleep=lambda state: log.warning(
                "compute API: %s (attempt %d of %d), retrying",
                state.outcome.exception() if state.outcome else "?", state.attempt_number, self.attempts,
            ),
        )
        try:
            return retrying(attempt)
        except _Retryable as exc:
            raise exc.error from None

    def pages(
        self, method: str, path: str, *, params: Mapping[str, Any] | None = None, page_size: int = 500
    ) -> Iterator[dict[str, Any]]:
        """Every page of a list call, following ``nextPageToken``."""
        query = dict(params or {})
        query.setdefault("maxResults", page_size)
        seen: set[str] = set()
        while True:
            page = self.call(method, path, params=query)
            yield page
            token = page.get("nextPageToken")
            if not token:
                return
            if token in seen:  # a server bug must not become an endless loop
                raise ComputeAPIError(f"{method} {self.url(path)}: page token {token!r} repeated")
            seen.add(token)
            query["pageToken"] = token

    # ---- typed calls ----------------------------------------------------------------------

    def list_instances(self, project: str, zone: str, *, filter: str | None = None) -> Iterator[dict[str, Any]]:
        params = {"filter": filter} if filter else {}
        for page in self.pages("GET", f"projects/{project}/zones/{zone}/instances", params=params):
            yield from page.get("items", [])

    def aggregated_instances(self, project: str, *, filter: str | None = None) -> Iterator[dict[str, Any]]:
        """Instances of every zone (each keeps its ``zone`` URL)."""
        params: dict[str, Any] = {"returnPartialSuccess": "true"}
        if filter:
            params["filter"] = filter
        for page in self.pages("GET", f"projects/{project}/aggregated/instances", params=params):
            for scope in (page.get("items") or {}).values():
                yield from scope.get("instances", [])

    def list_managed_instances(self, project: str, zone: str, group: str) -> Iterator[dict[str, Any]]:
        path = f"projects/{project}/zones/{zone}/instanceGroupManagers/{group}/listManagedInstances"
        for page in self.pages("POST", path):
            yield from page.get("managedInstances", [])

    def get_instance(self, project: str, zone: str, name: str) -> dict[str, Any] | None:
        try:
            return self.call("GET", f"projects/{project}/zones/{zone}/instances/{name}")
        except ComputeNotFoundError:
            return None

    def insert_instance(self, project: str, zone: str, body: Mapping[str, Any]) -> dict[str, Any]:
        base = api_base_for(self.base_url, body)  # a beta field goes to the beta API
        return self.call("POST", f"{base}/projects/{project}/zones/{zone}/instances", body=body)

    def delete_instance(self, project: str, zone: str, name: str) -> dict[str, Any]:
        return self.call("DELETE", f"projects/{project}/zones/{zone}/instances/{name}")

    def start_instance(self, project: str, zone: str, name: str) -> dict[str, Any]:
        return self.call("POST", f"projects/{project}/zones/{zone}/instances/{name}/start")

    def wait_operation(self, operation: Mapping[str, Any], *, timeout: float = 600.0) -> dict[str, Any]:
        """Block until a zonal operation is DONE; raise ComputeAPIError if it failed."""
        deadline = time.monotonic() + timeout
        op = dict(operation)
        while op.get("status") != "DONE":
            if time.monotonic() > deadline:
                raise ComputeUnavailableError(
                    f"operation {op.get('name')} on {op.get('targetLink', '?')} not done after {timeout:.0f} s"
                )
            zone = str(op.get("zone", "")).rsplit("/", 1)[-1]
            project = _project_of(op)
            # operations.wait long-polls server side (up to ~2 min), so this loop does not spin
            op = self.call("POST", f"projects/{project}/zones/{zone}/operations/{op['name']}/wait")
        errors = (op.get("error") or {}).get("errors") or []
        if errors:
            detail = "; ".join(f"{e.get('code', '?')}: {e.get('message', '')}" for e in errors)
            raise ComputeAPIError(
                f"operation {op.get('operationType', '')} on {op.get('targetLink', '?')} failed: {detail}",
                reason=str(errors[0].get("code", "")),
            )
        return op


def _project_of(op: Mapping[str, Any]) -> str:
    for link in (op.get("selfLink", ""), op.get("targetLink", ""), op.get("zone", "")):
        parts = str(link).split("/")
        if "projects" in parts:
            return parts[parts.index("projects") + 1]
    raise ComputeAPIError(f"operation {op.get('name')!r} names no project")


def last_segment(url: str) -> str:
    """``.../zones/us-central1-a`` -> ``us-central1-a``."""
    return str(url).rstrip("/").rsplit("/", 1)[-1]


def api_base_for(base_url: str, body: Mapping[str, Any]) -> str:
    """``base_url``, or its beta counterpart when ``body`` uses a beta-only field."""
    if "preemptionNoticeDuration" in (body.get("scheduling") or {}):
        return beta_url(base_url)
    return base_url


def beta_url(base_url: str) -> str:
    """``.../compute/v1`` -> ``.../compute/beta`` (the beta API takes the same requests)."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] + "/beta" if base.endswith("/v1") else base
