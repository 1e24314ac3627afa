"""This user's directories and locks on the local machine: the standbys' sockets
(:mod:`hvd_transient.join.wire`, :mod:`hvd_transient.join.supervisor`) and the keeper's note of its job
(:mod:`hvd_transient.cluster.job`).

Standard library only: the worker launcher imports it on every job start.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path


def user_dir(configured: str | None, prefix: str) -> Path:
    """``configured``, else ``<tmp>/<prefix>-<uid>``."""
    return Path(configured) if configured else Path(tempfile.gettempdir()) / f"{prefix}-{os.getuid()}"


def ensure_dir(directory: Path) -> os.stat_result:
    """Create ``directory`` (mode 0700) unless it exists; its status, to check whose it is."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory.stat()


def private(directory: Path) -> bool:
    """Whether ``directory`` exists, is this user's and only they can write in it."""
    try:
        st = directory.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def try_lock(path: Path) -> int | None:
    """Take the lock ``path`` for as long as this process lives (or until the descriptor is closed):
    its descriptor, or None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
