"""A plain MPI data-parallel training loop (mpi4py + numpy, no Horovod) made preemption-safe.

Linear regression with momentum SGD on synthetic data: every step has one global batch,
each rank computes the gradient of its slice of it, and one Allreduce sums them, so the
trajectory does not depend on the number of ranks. hvd-transient adds a notice watcher
per VM, periodic sharded checkpoints in the background, an emergency checkpoint on a
preemption notice, and a resume from the latest checkpoint with any number of ranks.

An MPI job cannot shrink, so on a notice every rank stops after the emergency checkpoint
and exits with 75 (EX_TEMPFAIL): relaunch on the VMs that remain, or on new ones, to
resume. Exit 0: trained to --steps, or stopped by ``hvd-transient stop STORE``.

    mpirun -np 4 python examples/mpi_numpy.py --store gs://bucket/runs/lr --steps 2000
    until mpirun -np 2 python examples/mpi_numpy.py --store /tmp/run; [ $? -ne 75 ]; do :; done
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from ckpt_service.errors import CorruptCheckpointError
from hvd_transient.collectives.mpi import mpi_transient
from hvd_transient.core.control import clear_stop
from hvd_transient.core.transient import StepOutcome, TransientConfig, TransientImpl
from hvd_transient.telemetry import schema as ev

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: the job stopped for a preemption; relaunch it to resume


def global_batch(step: int, seed: int, dim: int, size: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The samples of one step (the same on every rank, for any rank count); the last feature is 1 (bias)."""
    w_true = np.random.default_rng(seed).standard_normal(dim)
    rng = np.random.default_rng([seed, step])
    x = rng.standard_normal((size, dim))
    x[:, -1] = 1.0
    return x, x @ w_true + 0.1 * rng.standard_normal(size)


def restore(impl: TransientImpl, state: dict[str, np.ndarray[Any, Any]]) -> int:
    """Load the latest checkpoint into ``state``; its step, or 0 if there is none.

    Each rank reads a byte-balanced share of the tensors, whatever number of ranks wrote
    them, and broadcasts what it read: the store is read once, not once per rank.
    """
    coll, comm = impl.comm, MPI.COMM_WORLD
    manager = impl.manager
    step = coll.broadcast_json(manager.latest_step() if comm.rank == 0 else None, 0)
    if step is None:
        return 0
    try:
        ckpt = manager.restore(step, partition=(comm.rank, comm.size), expected=state)
        ok = True
    except CorruptCheckpointError:
        ok = False
    if not all(coll.allgather_json(ok)):  # the readers agree on one step: never a mix of two
        step = coll.broadcast_json(manager.restorable_step() if comm.rank == 0 else None, 0)
        ckpt = manager.restore(step, partition=(comm.rank, comm.size), expected=state)
    for owner, names in enumerate(coll.allgather_json(sorted(ckpt.tensors))):
        for name in names:
            if owner == comm.rank:
                state[name][...] = ckpt.tensors[name]
            comm.Bcast(state[name], root=owner)
    return int(step)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="checkpoint store URL: a directory or gs://bucket/prefix")
    p.add_argument("--steps", type=int, default=1000, help="total optimizer steps of the run")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=100, help="periodic checkpoint every N steps")
    p.add_argument("--host", help="the name of this rank's VM (default: the host name); {rank} is replaced "
                                  "by the MPI rank, e.g. to emulate one VM per rank on one machine")
    p.add_argument("--step-seconds", type=float, default=0.0, help="simulated compute time per step")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    host = args.host.format(rank=rank) if args.host else None
    config = TransientConfig(store=args.store, save_every_steps=args.save_every)
    impl = mpi_transient(config, host=host)  # collective: every rank
    state = {"w": np.zeros(args.dim), "velocity": np.zeros(args.dim)}
    start = step = restore(impl, state)
    if rank == 0:
        clear_stop(impl.manager.store)  # a stop request was for the previous launch
    impl.events.emit(ev.Start(step=step, rank=rank, size=size, restored_step=start or None))
    impl.begin(step)

    lo, hi = args.batch_size * rank // size, args.batch_size * (rank + 1) // size  # this rank's slice
    outcome, loss = StepOutcome(), float("nan")
    try:
        while step < args.steps:
            x, y = global_batch(step, args.seed, args.dim, args.batch_size)
            x, y = x[lo:hi], y[lo:hi]
            residual = x @ state["w"] - y
            local = np.append(x.T @ residual, 0.5 * residual @ residual)  # gradient sum, loss sum
            total = np.empty_like(local)
            comm.Allreduce(local, total, op=MPI.SUM)
            grad, loss = total[:-1] / args.batch_size, float(total[-1]) / args.batch_size
            state["velocity"] *= args.momentum
            state["velocity"] += grad
            state["w"] -= args.lr * state["velocity"]
            if args.step_seconds:
                time.sleep(args.step_seconds)
            step += 1
            outcome = impl.after_step(step, lambda: state, lambda: {"loss": loss})
            if outcome.emergency_step is not None or outcome.stop:
                break  # every rank agreed on this at this step
        if outcome.emergency_step is not None and not outcome.committed and rank == 0:
            log.warning("the emergency checkpoint of step %d did not commit: a relaunch resumes from an "
                        "earlier one", step)
        impl.end(step)  # lets a background save finish
        # a final checkpoint, unless this step is committed already (the master's view decides)
        if outcome.emergency_step is None and impl.final_save_needed(step):
            impl.save_now(step, state, {"loss": loss}, coordinator=impl.run.master, deadline=None, kind="final")
    finally:
        impl.close()  # closes the manager it made too

    preempted = outcome.emergency_step is not None
    if rank == 0:
        why = "preempted" if preempted else "stop requested" if outcome.stop else "done"
        print(f"stopped at step {step} (resumed from {start}) on {size} processes: {why}, loss {loss:.6f}",
              flush=True)
    return EXIT_PREEMPTED if preempted else 0


if __name__ == "__main__":
    sys.exit(main())
