"""A static Horovod PyTorch job (``horovodrun -np N``, Gloo or MPI) made preemption-safe.

Without a discovery script (a static job) the ring cannot shrink, so on a preemption notice every
rank writes its share of an emergency checkpoint, the loop ends, and the job exits cleanly;
relaunching the same command, on any number of processes, resumes from that checkpoint at the exact
step and sample.

    horovodrun -np 2 -H localhost:1,127.0.0.1:1 python examples/torch_static.py --store /tmp/run3
    horovodrun -np 2 -H localhost:2 --mpi python examples/torch_static.py --store /tmp/run3
"""
from __future__ import annotations

import argparse
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_transient.torch as hvdt  # hvd-transient
from hvd_transient.testing.torch_workloads import MODELS, synthetic_cifar10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--store", required=True)
    p.add_argument("--model", choices=sorted(MODELS), default="resnet20")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=50_000, help="synthetic data set size (CIFAR-10's: 50,000)")
    p.add_argument("--base-lr", type=float, default=0.01)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--step-seconds", type=float, default=0.0)
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(1234)
    images, labels = synthetic_cifar10(args.samples)
    model = MODELS[args.model]()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=0.9),
                                         named_parameters=model.named_parameters())
    state = hvdt.static_state(model, optimizer, store=args.store)  # hvd-transient: rank 0's or the checkpoint's
    start = state.step
    transient = hvdt.Transient(state, store=args.store, base_lr=args.base_lr,  # hvd-transient
                               save_every_steps=args.save_every)
    for x, y in hvdt.elastic_batches(state, (images, labels), args.batch_size,  # hvd-transient
                                     epochs=1, steps_per_epoch=args.steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        transient.after_step()  # hvd-transient: ends the loop after a notice's checkpoint
        if args.step_seconds:
            time.sleep(args.step_seconds)
    if hvd.rank() == 0:
        controller = "MPI" if hvd.mpi_enabled() else "Gloo"
        print(f"stopped at step {state.step} (resumed from {start}) on {hvd.size()} processes over {controller}, "
              f"{state.samples} samples", flush=True)


if __name__ == "__main__":
    main()
