"""What a standby runs and for which slot: :class:`StandbyOptions`, shared by the standby's supervisor
(:mod:`hvd_transient.join.supervisor`) and its worker (:mod:`hvd_transient.join.standby`), which the
supervisor forks.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hvd_transient.join.wire import command_key, socket_path, standby_dir


@dataclass(frozen=True)
class StandbyOptions:
    """What a standby runs and for which slot (``python -m hvd_transient.worker --standby``'s options)."""

    script: str
    args: tuple[str, ...]
    host: str
    local_rank: int = 0
    directory: Path | None = None
    store: str | None = None      # where to publish the host as ready (None: nowhere)
    instance_id: str | None = None
    warmup: bool = True           # trace the train step before offering the host

    @property
    def key(self) -> str:
        return command_key(self.script, self.args, os.getcwd())

    def socket_path(self) -> Path:
        return socket_path(self.directory or standby_dir(os.environ), self.host, self.local_rank, self.key)


__all__ = ["StandbyOptions"]
