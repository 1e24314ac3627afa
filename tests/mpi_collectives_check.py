"""MPICollectives checked under ``mpirun -np 3 python -m mpi4py tests/mpi_collectives_check.py DIR``.

Run by tests/test_mpi_e2e.py. ``-m mpi4py`` turns an uncaught error on any rank into an
MPI abort, so a failed check fails the whole job instead of leaving the others waiting.
Rank 0 prints ``mpi collectives: N ranks ok`` at the end.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ckpt_service.errors import SaveAbandonedError
from ckpt_service.layout import step_prefix
from ckpt_service.manager import CheckpointManager
from hvd_transient.collectives.mpi import MPICollectives, PeerNotices, mpi_transient
from hvd_transient.core.config import TransientConfig
from hvd_transient.core.election import NoticeRound, decode_notice, encode_notice
from hvd_transient.watchers import Notice

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
D = 2_000_000_000.0  # a deadline (Unix seconds)


def check_basics(coll: MPICollectives) -> None:
    assert (coll.rank(), coll.size()) == (RANK, SIZE)
    summed = coll.allreduce_sum(np.arange(5) * (RANK + 1))  # ints in, float64 out
    assert summed.dtype == np.float64 and summed.tolist() == (np.arange(5) * sum(range(1, SIZE + 1))).tolist()
    # uneven sizes, one past the eager limits, non-ASCII text
    objs = [{"rank": r, "text": "é" * (r * 50_000), "nested": [None, True, 1.5, {"k": r}]} for r in range(SIZE)]
    assert coll.allgather_json(objs[RANK]) == objs
    for root in range(SIZE):
        sent = {"root": root, "blob": "x" * 70_000, "list": list(range(root))}
        assert coll.broadcast_json(sent if RANK == root else "not this", root) == sent
    assert coll.broadcast_json(None, 1) is None
    try:  # JSON only: an object JSON cannot hold fails on every rank, before anything is sent
        coll.allgather_json(object())
        raise AssertionError("a non-JSON object was sent")
    except TypeError:
        pass


def check_gather(coll: MPICollectives, store: str) -> None:
    mgr = CheckpointManager(store, max_to_keep=None)
    tensors = {"a": np.arange(10_000, dtype=np.float32), "b": np.full((7, 3), 2.5)}
    for coordinator in (0, SIZE - 1):
        step = 10 + coordinator
        manifest = mgr.save(step, tensors, {"c": coordinator}, rank=RANK, world_size=SIZE,
                            gather=coll.gather(coordinator), coordinator=coordinator)
        assert (manifest is not None) == (RANK == coordinator)
        COMM.Barrier()
        ckpt = mgr.restore(step)
        assert ckpt.manifest.world_size == SIZE and ckpt.metadata == {"c": coordinator}
        assert all(np.array_equal(ckpt.tensors[k], v) for k, v in tensors.items())
        # the records went over MPI, not through the store
        assert not list(mgr.store.list(step_prefix(step) + "records/"))

    # A rank that reports after the deadline: the coordinator abandons the save; its late record
    # is dropped, never mistaken for a record of the next save.
    late = coll.gather(1, deadline=time.time() + 0.5)
    if RANK == 1:
        try:
            late({"rank": 1, "late": False})
            raise AssertionError("the gather did not give up at its deadline")
        except SaveAbandonedError as exc:
            assert "ranks [2]" in str(exc), exc
    elif RANK == 0:
        assert late({"rank": 0, "late": False}) is None
    COMM.Barrier()  # rank 1 has given up
    if RANK == 2:
        assert late({"rank": 2, "late": True}) is None
    fresh = coll.gather(1)({"rank": RANK, "late": False})
    if RANK == 1:
        assert fresh == [{"rank": r, "late": False} for r in range(SIZE)], fresh
        limit = time.monotonic() + 30
        while coll._stale and time.monotonic() < limit:  # the late record is drained once it is here
            coll._drain()
            time.sleep(0.001)
        assert not coll._stale
    else:
        assert fresh is None

    # A background save gathers over MPI on its own thread while this one runs collectives.
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
    assert mgr.save_async(30, tensors, rank=RANK, world_size=SIZE, gather=coll.gather(0), coordinator=0)
    for _ in range(50):
        coll.allreduce_sum(np.ones(3))
    mgr.wait(timeout=60)
    COMM.Barrier()
    assert mgr.restore(30).manifest.world_size == SIZE
    mgr.close()


def check_one_watcher_per_vm() -> None:
    hosts = ["a", "a", "b"]  # ranks 0 and 1 share a VM (they do share a node here)
    coll = MPICollectives(host=hosts[RANK])
    assert coll.vm_of_rank == [0, 0, 2]
    assert (coll.watches, coll.local_rank, coll.local_size) == [(True, 0, 2), (False, 1, 2), (True, 0, 1)][RANK]

    def agree(notices: dict[int, float], c: MPICollectives = coll) -> NoticeRound:
        return decode_notice(c.allreduce_sum(encode_notice(RANK, SIZE, notices.get(RANK))), SIZE, hosts)

    assert agree({}).leaving == ()
    assert (agree({0: D}).leaving, agree({0: D}).deadline) == ((0, 1), D)   # the VM leaves with all its ranks
    assert agree({2: D}).leaving == (2,)
    assert (agree({0: D + 9, 1: D}).leaving, agree({0: D + 9, 1: D}).deadline) == ((0, 1), D)
    both = agree({0: D + 5, 2: D})
    assert (both.leaving, both.deadline) == ((0, 1, 2), D)
    assert coll.allreduce_sum(np.ones(4)).tolist() == [SIZE] * 4   # other vectors are plain sums
    each = MPICollectives(host=hosts[RANK], one_watcher_per_vm=False)   # every rank watches
    assert each.watches and agree({1: D}, each).leaving == (0, 1)


class _Watcher:
    def __init__(self) -> None:
        self.notice: Notice | None = None
        self.warning: Notice | None = None
        self.instance_id: str | None = None

    def start(self) -> "_Watcher":
        return self

    def stop(self) -> None:
        pass


def check_protocol(store: str) -> None:
    """TransientImpl on MPI: the notice to rank 0's VM (ranks 0 and 1) makes rank 2 the master."""
    config = TransientConfig(store=store, save_every_steps=None, check_every_steps=1, leave_margin_s=1.0)
    watcher = _Watcher()
    impl = mpi_transient(config, host=["a", "a", "b"][RANK], watcher=watcher)
    assert isinstance(impl.watcher, PeerNotices) == (RANK == 1)
    state = {"w": np.arange(3000, dtype=np.float32) + 1, "b": np.ones(7)}
    impl.begin(0)
    assert impl.after_step(1, lambda: state, lambda: {}).emergency_step is None
    if RANK == 0:
        now = time.time()
        watcher.notice = Notice("test", "a", now, now + 30, "preempted")
    outcome = impl.after_step(2, lambda: state, lambda: {})
    assert (outcome.emergency_step, outcome.committed) == (2, True), outcome
    assert outcome.leaving == (RANK != 2) and impl.run.master == 2
    COMM.Barrier()
    ckpt = impl.manager.restore()
    assert ckpt.step == 2 and ckpt.manifest.world_size == SIZE and np.array_equal(ckpt.tensors["w"], state["w"])
    impl.close()
    impl.manager.close()


def main() -> None:
    root = Path(sys.argv[1])
    assert SIZE == 3, "run with mpirun -np 3"
    coll = MPICollectives()
    check_basics(coll)
    check_gather(coll, str(root / "gather"))
    check_one_watcher_per_vm()
    check_protocol(str(root / "protocol"))
    COMM.Barrier()
    if RANK == 0:
        print(f"mpi collectives: {SIZE} ranks ok", flush=True)


if __name__ == "__main__":
    main()
