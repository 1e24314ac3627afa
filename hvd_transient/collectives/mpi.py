"""The Collectives the protocol needs, on any MPI program (mpi4py + numpy, no Horovod).

    from hvd_transient.collectives.mpi import mpi_transient
    impl = mpi_transient(TransientConfig(store=STORE))   # every rank of COMM_WORLD
    impl.begin(step)
    ...  # after each optimizer step: outcome = impl.after_step(step, snapshot, metadata)

Small objects travel as JSON bytes in MPI buffers, never pickles (mpi4py's lowercase
methods pickle): a record from another process must not be able to run code here.
Every call runs on a duplicate of the given communicator, so this traffic never
matches the application's own messages.

One watcher per VM: the ranks of one VM (one shared-memory node, see
``MPI.COMM_TYPE_SHARED``, with the same host name) share a single notice watcher,
run by the VM's lowest rank. Its notice reaches the VM's other ranks through the
per-step notice round: the protocol counts every rank of a VM under notice as leaving
(:func:`hvd_transient.core.election.decode_notice`, given each rank's host name), so no rank
of a dying VM can be elected checkpoint master.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ckpt_service.errors import SaveAbandonedError
from ckpt_service.gather import Gather
from ckpt_service.shard_records import RecordJSON
from hvd_transient.core.config import TransientConfig
from hvd_transient.core.hostname import default_host
from hvd_transient.core.transient import TransientImpl

if TYPE_CHECKING:
    from hvd_transient.watchers import Notice

log = logging.getLogger(__name__)

#: the longest pause between two looks for shard records (MPI has no wait with a timeout)
MAX_POLL_INTERVAL_S = 0.02


def _encode(obj: Any) -> np.ndarray[Any, Any]:
    return np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)


def _decode(data: np.ndarray[Any, Any]) -> Any:
    return json.loads(data.tobytes())


def _allgather_json(comm: MPI.Comm, obj: Any) -> list[Any]:
    payload = _encode(obj)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([payload.size], dtype=np.int64), sizes)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    comm.Allgatherv(payload, [data, (sizes, offsets), MPI.BYTE])
    return [_decode(data[o:o + n]) for o, n in zip(offsets.tolist(), sizes.tolist())]


class PeerNotices:
    """The notice source of a rank that does not watch: its VM's watcher runs on another rank.

    It never has a notice of its own; the VM's notice reaches it through the notice round.
    """

    notice: "Notice | None" = None
    warning: "Notice | None" = None
    instance_id: str | None = None

    def start(self) -> "PeerNotices":
        return self

    def stop(self) -> None:
        pass


class MPICollectives:
    """:class:`~hvd_transient.core.interfaces.Collectives` over an mpi4py communicator (COMM_WORLD by default).

    Collective: every rank of ``comm`` constructs it, in the same order as its other collectives.
    ``host`` is the name this rank's VM goes by (default: what :func:`default_host` gives); ranks
    on one node with the same name are one VM. ``one_watcher_per_vm=False`` gives every rank a
    watcher of its own (the ranks of one VM still leave together: the protocol groups them by name).
    """

    def __init__(self, comm: MPI.Comm | None = None, *, host: str | None = None,
                 one_watcher_per_vm: bool = True) -> None:
        base = comm if comm is not None else MPI.COMM_WORLD
        self.comm = base.Dup()          # collectives
        self._p2p = base.Dup()          # shard-record gathers: point to point, possibly on another thread
        self.host = host or default_host()
        self._rank, self._size = self.comm.Get_rank(), self.comm.Get_size()
        self._tag_ub = int(self._p2p.Get_attr(MPI.TAG_UB) or 32767)
        self._gathers = 0
        self._lock = threading.Lock()  # gathers may run on a background save's thread too
        self._stale: set[tuple[int, int]] = set()    # (source, tag) of records an abandoned gather left behind
        self._sends: list[tuple[MPI.Request, np.ndarray[Any, Any]]] = []  # records on their way, with their buffers

        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        try:
            peers = _allgather_json(node, [self._rank, self.host])
        finally:
            node.Free()
        vm = sorted(int(r) for r, h in peers if h == self.host) if one_watcher_per_vm else [self._rank]
        #: world rank of each rank's VM leader (the VM's lowest rank, which runs the watcher)
        self.vm_of_rank: list[int] = [int(v) for v in _allgather_json(self.comm, vm[0])]
        self.local_rank, self.local_size = vm.index(self._rank), len(vm)
        log.info("rank %d of %d: VM %s with %d rank(s)%s", self._rank, self._size, self.host, self.local_size,
                 ", runs its watcher" if self.watches else f", watched by rank {vm[0]}")

    @property
    def watches(self) -> bool:
        """Whether this rank runs its VM's notice watcher."""
        return self.local_rank == 0

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # ``name`` labels the call for the Collectives protocol; MPI matches collectives by order alone.
    def allreduce_sum(self, values: np.ndarray[Any, Any], *, name: str = "notice") -> np.ndarray[Any, Any]:
        """Elementwise sum over ranks, as float64."""
        send = np.ascontiguousarray(values, dtype=np.float64)
        summed = np.empty_like(send)
        self.comm.Allreduce(send, summed, op=MPI.SUM)
        return summed

    def allgather_json(self, obj: Any, *, name: str = "gather") -> list[Any]:
        return _allgather_json(self.comm, obj)

    def broadcast_json(self, obj: Any, root: int, *, name: str = "bcast") -> Any:
        payload = _encode(obj) if self._rank == root else np.empty(0, dtype=np.uint8)
        size = np.array([payload.size], dtype=np.int64)
        self.comm.Bcast(size, root=root)
        data = payload if self._rank == root else np.empty(int(size[0]), dtype=np.uint8)
        self.comm.Bcast(data, root=root)
        return _decode(data)

    def gather(self, coordinator: int = 0, *, deadline: float | None = None, timeout_s: float = 600.0) -> Gather:
        """A gather of shard records at ``coordinator`` over MPI, for ``CheckpointManager.save(gather=)``.

        Every rank must call this for every save, in the same order (it numbers the saves). Like
        :class:`~ckpt_service.gather.StoreGather`, a rank that is not the coordinator hands its
        record over and returns at once, and the coordinator raises SaveAbandonedError at
        ``deadline`` (Unix time; default ``timeout_s`` from now). It may run on a background
        thread (``save_async``) if MPI was initialised with ``MPI_THREAD_MULTIPLE``.
        """
        self._gathers += 1
        tag = 1 + self._gathers % (self._tag_ub - 1)
        # the wall-clock deadline becomes a monotonic one once, here: a clock step must not move it
        left_s = deadline - time.time() if deadline is not None else timeout_s
        return _MPIGather(self, tag, coordinator, time.monotonic() + left_s)

    def _drain(self) -> None:
        """Receive and drop records that arrived after their gather was abandoned; forget sent records."""
        status = MPI.Status()
        with self._lock:
            self._sends = [(req, buf) for req, buf in self._sends if not req.Test()]
            for source, tag in list(self._stale):
                msg = self._p2p.Improbe(source, tag, status)
                if msg is not None:
                    msg.Recv([np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8), MPI.BYTE])
                    self._stale.discard((source, tag))


class _MPIGather:
    """One save's gather; ``deadline`` is on the :func:`time.monotonic` clock."""

    def __init__(self, owner: MPICollectives, tag: int, coordinator: int, deadline: float) -> None:
        self.owner, self.tag, self.coordinator, self.deadline = owner, tag, coordinator, deadline

    def __call__(self, record: RecordJSON) -> list[RecordJSON] | None:
        owner, comm = self.owner, self.owner._p2p
        owner._drain()
        if owner.rank() != self.coordinator:
            payload = _encode(record)
            # not blocking: the coordinator may be late, or may have given up on this save
            request = comm.Isend([payload, MPI.BYTE], dest=self.coordinator, tag=self.tag)
            with owner._lock:
                owner._sends.append((request, payload))  # the buffer must live until the send completes
            return None
        records: dict[int, RecordJSON] = {self.coordinator: record}
        missing = set(range(owner.size())) - {self.coordinator}
        status = MPI.Status()
        interval = 0.0005
        while missing:
            msg = comm.Improbe(MPI.ANY_SOURCE, self.tag, status)
            if msg is not None:
                data = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                msg.Recv([data, MPI.BYTE])
                records[status.Get_source()] = _decode(data)
                missing.discard(status.Get_source())
                continue
            now = time.monotonic()
            if now >= self.deadline:
                with owner._lock:
                    owner._stale.update((source, self.tag) for source in missing)
                raise SaveAbandonedError(
                    f"ranks {sorted(missing)} did not report their shards before the deadline; the save was "
                    "abandoned and the previous checkpoint stays the latest")
            # MPI has no wait with a timeout: poll, backing off so a slow writer costs little CPU
            time.sleep(min(interval, self.deadline - now))
            interval = min(MAX_POLL_INTERVAL_S, interval * 2)
        return [records[r] for r in range(owner.size())]


def mpi_transient(config: TransientConfig, comm: MPI.Comm | None = None, *, host: str | None = None,
                  **kwargs: Any) -> TransientImpl:
    """A :class:`~hvd_transient.core.transient.TransientImpl` on MPI, with one notice watcher per VM.

    Collective over ``comm``. ``kwargs`` go to TransientImpl (``watcher=`` replaces the configured
    watcher on the ranks that watch).
    """
    collectives = MPICollectives(comm, host=host)
    if not collectives.watches:
        kwargs["watcher"] = PeerNotices()
    return TransientImpl(config, collectives, host=collectives.host, **kwargs)


__all__ = ["MPICollectives", "PeerNotices", "mpi_transient"]
