"""Preemption-notice watchers: GCE, AWS, Azure metadata servers, and a local file / SIGTERM.

    watcher = make_watcher("auto", on_notice=handle).start()
    ...
    notice = watcher.notice          # None until seen
    watcher.stop()
"""
from __future__ import annotations

from . import deadline
from .aws import AwsWatcher
from .azure import AzureWatcher
from .base import Notice, Poller, Watcher
from .detect import WATCHERS, choose_kind, make_watcher, read_dmi
from .errors import MetadataGarbageError, MetadataServerError, WatcherConfigError, WatcherError
from .gce import GceWatcher
from .local import LocalWatcher

__all__ = [
    "AwsWatcher", "AzureWatcher", "GceWatcher", "LocalWatcher", "MetadataGarbageError",
    "MetadataServerError", "Notice", "Poller", "WATCHERS", "Watcher", "WatcherConfigError",
    "WatcherError", "choose_kind", "deadline", "make_watcher", "read_dmi",
]
