"""The name this worker's VM goes by, the same for the plugin and for the worker launcher."""
from __future__ import annotations

import os
import socket


def default_host() -> str:
    """The host name Horovod assigned this worker (one alias per slot locally), else the real one."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def host_names(host: str) -> list[str]:
    """Every name this worker's VM goes by: ``host`` (Horovod's name, e.g. an internal IP where discovery
    lists IPs) and the machine's own name (what a standby on it publishes its ready record under)."""
    return list(dict.fromkeys(n for n in (host, socket.gethostname()) if n))
