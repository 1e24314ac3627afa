"""A cloud metadata-server emulator (GCE, AWS IMDSv2, Azure Scheduled Events) for tests and demos.

``MetadataEmulator`` is the Python API; ``main`` is ``hvd-transient metadata-emulator``.
"""
from __future__ import annotations

from .cli import main
from .model import (
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
    "DEFAULT_WINDOW_S", "MAINTENANCE_EVENTS", "AlreadyPreemptedError", "ConflictError",
    "EmulatorError", "Fault", "InstanceExistsError", "InstanceSnapshot", "InvalidRequestError",
    "MetadataEmulator", "UnknownInstanceError", "main",
]
