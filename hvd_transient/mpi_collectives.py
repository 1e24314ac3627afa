"""The documented import path of the protocol over mpi4py: :mod:`hvd_transient.collectives.mpi`."""
from __future__ import annotations

from hvd_transient.collectives.mpi import MPICollectives, PeerNotices, mpi_transient

__all__ = ["MPICollectives", "PeerNotices", "mpi_transient"]
