"""Typed errors of the watchers. Watch loops catch them (log, back off, retry);
only configuration mistakes reach the caller."""
from __future__ import annotations


class WatcherError(Exception):
    """Base class of the watchers' errors."""


class WatcherConfigError(WatcherError, ValueError):
    """A watcher was asked for with settings that cannot work (unknown kind, bad URL...)."""


class MetadataServerError(WatcherError, ConnectionError):
    """The metadata server answered with an unexpected HTTP status (5xx, 401 ...)."""


class MetadataGarbageError(WatcherError, ValueError):
    """The metadata server answered 200 with a body that is not what the API returns."""


class MetadataTimeoutError(WatcherError, TimeoutError):
    """A metadata request did not end (connection, headers and whole body) within its bound."""
