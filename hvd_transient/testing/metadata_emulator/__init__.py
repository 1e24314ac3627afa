"""A cloud metadata-server emulator (GCE, AWS IMDSv2, Azure Scheduled Events) for tests and demos.

``MetadataEmulator`` is the Python API; ``main`` is ``hvd-transient metadata-emulator``.

Which instance answers a request: the one named by an ``/i/<name>/`` path prefix, else the
default instance, the first one given (or ``default_instance=``), which ``GET
/control/instances`` reports as ``default``. The Host header and client address are ignored.

The GCE side follows Google's metadata server (keys, directory listings, ``?recursive=true``
JSON, ``alt=json|text``, ETags, ``wait_for_change``); see gce_tree.py.
"""
from __future__ import annotations

from .cli import main
from .model import (
    AWS_TIME_FORMATS,
    DEFAULT_WINDOW_S,
    MAINTENANCE_EVENTS,
    AlreadyPreemptedError,
    ConflictError,
    EmulatorError,
    Fault,
    InstanceExistsError,
    InstanceSnapshot,
    InvalidRequestError,
    UnknownInstanceError,
)
from .server import MetadataEmulator

__all__ = [
    "AWS_TIME_FORMATS", "DEFAULT_WINDOW_S", "MAINTENANCE_EVENTS", "AlreadyPreemptedError", "ConflictError",
    "EmulatorError", "Fault", "InstanceExistsError", "InstanceSnapshot", "InvalidRequestError",
    "MetadataEmulator", "UnknownInstanceError", "main",
]
