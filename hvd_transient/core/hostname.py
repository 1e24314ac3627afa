"""The name this worker's VM goes by, the same for the plugin and for the worker launcher."""
from __future__ import annotations

import os
import socket


def default_host() -> str:
    """The host name Horovod assigned this worker (one alias per slot locally), else the real one."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
