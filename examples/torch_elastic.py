"""A standard Horovod elastic PyTorch script, made preemption-safe by hvd-transient.

The lines marked `# hvd-transient` are all it takes. Training resumes at the exact step and sample
after every reset (leave, join, rollback) and cold restart: it ends after exactly
epochs x steps-per-epoch optimizer steps, each sample of a pass over the data used once.
Run it with, for example (Horovod 0.28 is elastic when given a discovery script):

    HVDT_DISCOVERY_BACKEND=local HVDT_HOSTS=localhost,127.0.0.1 HVDT_STORE=/tmp/run1 \\
    horovodrun -np 2 --min-np 1 --max-np 4 \\
        --host-discovery-script launch/discover_hosts.sh --network-interfaces lo \\
        python examples/torch_elastic.py --store /tmp/run1
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import hvd_transient.torch as hvdt  # hvd-transient
from hvd_transient.testing.torch_workloads import MODELS, synthetic_cifar10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--store", required=True, help="checkpoint store: directory or gs://bucket/prefix")
    p.add_argument("--model", choices=sorted(MODELS), default="resnet20")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=50_000, help="synthetic data set size (CIFAR-10's: 50,000)")
    p.add_argument("--base-lr", type=float, default=0.01, help="single-worker learning rate")
    p.add_argument("--save-every", type=int, default=50, help="periodic checkpoint interval (steps)")
    p.add_argument("--batches-per-commit", type=int, default=10, help="Horovod in-memory commit cadence")
    p.add_argument("--notice-window", type=float, default=None,
                   help="seconds a notice gives (default: what the VM is configured with; GCE Spot: 30)")
    p.add_argument("--leave", choices=("at_notice", "near_deadline"), default=None,
                   help="a worker under notice trains on until --leave-lead seconds before its deadline "
                        "(near_deadline, the default), or leaves after its emergency checkpoint (at_notice)")
    p.add_argument("--leave-lead", type=float, default=None,
                   help="with --leave near_deadline: seconds before the deadline that the worker leaves")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="extra time per step, to stretch a tiny run over a preemption schedule")
    p.add_argument("--log-samples", help="directory: every rank appends the sample indices of each step it "
                                         "trains (JSON lines), to check that each sample is used once")
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(1234)  # identical initial weights on every worker
    images, labels = synthetic_cifar10(args.samples)
    model = MODELS[args.model]()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=0.9),
                                         named_parameters=model.named_parameters())

    state = hvdt.elastic_state(model, optimizer, store=args.store)  # hvd-transient
    transient = hvdt.Transient(state, store=args.store, base_lr=args.base_lr,  # hvd-transient
                               save_every_steps=args.save_every, notice_window_s=args.notice_window,
                               leave=args.leave, leave_lead_s=args.leave_lead)
    data: tuple[torch.Tensor, ...] = (images, labels)
    log = None
    if args.log_samples:
        data += (torch.arange(len(labels)),)  # each sample's index rides along with it
        Path(args.log_samples).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.log_samples) / f"{os.uname().nodename}-{os.getpid()}.jsonl", "a")

    @hvd.elastic.run
    def train(state):
        # resumes at the exact sample and step, on however many workers the ring has now
        for x, y, *ids in hvdt.elastic_batches(state, data, args.batch_size,  # hvd-transient
                                               epochs=args.epochs, steps_per_epoch=args.steps_per_epoch):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if log is not None:  # before after_step, which may end this ring at this step (a leave)
                ring = transient.session.impl.run.ring_id if transient.session.impl else None
                log.write(json.dumps({"step": state.step + 1, "rank": hvd.rank(), "size": hvd.size(),
                                      "ring": ring, "t": time.time(), "ids": ids[0].tolist()}) + "\n")
                log.flush()
            transient.after_step()  # hvd-transient
            if state.step % args.batches_per_commit == 0:
                state.commit()
            if args.step_seconds:
                time.sleep(args.step_seconds)

    train(state)
    if hvd.rank() == 0:
        print(f"done at step {state.step} on {hvd.size()} workers, {state.samples} samples, "
              f"loss {float(loss_of(model, images[:256], labels[:256])):.3f} (pid {os.getpid()})", flush=True)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.cross_entropy(model(x), y)


if __name__ == "__main__":
    main()
