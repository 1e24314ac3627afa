"""The PyTorch baseline of ``bench/preemption_cost.py`` and ``goodput.py``: plain Horovod elastic, no hvd-transient.

Same model, data, seed, learning rate, batch and commit cadence as ``examples/torch_elastic.py``, written as
Horovod's elastic PyTorch docs and examples write it: ``hvd.elastic.TorchState(model, optimizer, sampler=...,
epoch=0, batch=0)`` with an ``ElasticSampler``, ``@hvd.elastic.run``, ``state.commit()`` every
``--batches-per-commit`` batches and ``state.check_host_updates()`` at the batches between, the learning
rate rescaled to ``base_lr * size`` on reset; nobody watches for notices. An epoch is ``--steps-per-epoch``
steps, as in the example; the sampler starts its next pass over the data when one ends. The step is
``epoch * steps_per_epoch + batch``, rolled back with the state. :class:`StepEvents` only writes
hvd-transient's events, so ``hvd_transient.report.analysis`` reads both runs the same way.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from horovod.torch.elastic import ElasticSampler
from torch.utils.data import DataLoader, TensorDataset

from ckpt_service.stores import open_store
from hvd_transient.telemetry.events import EventLog
from hvd_transient.testing.torch_workloads import MODELS, synthetic_cifar10

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench/ is not installed
from bench._step_events import StepEvents  # noqa: E402

#: batches between host checks (each a small broadcast); a commit checks too. Horovod's examples check
#: ten times per commit; here that is every batch.
BATCHES_PER_HOST_CHECK = 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events-store", required=True, help="store URL the measurement events are written to")
    p.add_argument("--model", choices=sorted(MODELS), default="resnet20")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=50_000, help="synthetic data set size (CIFAR-10's: 50,000)")
    p.add_argument("--base-lr", type=float, default=0.01, help="single-worker learning rate")
    p.add_argument("--batches-per-commit", type=int, default=10, help="Horovod in-memory commit cadence")
    p.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step")
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(1234)  # identical initial weights on every worker
    dataset = TensorDataset(*synthetic_cifar10(args.samples))
    sampler = ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = MODELS[args.model]()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.base_lr * hvd.size(),
                                                         momentum=0.9),
                                         named_parameters=model.named_parameters())

    host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    log = EventLog(open_store(args.events_store), host)
    events = StepEvents(log)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    def step_of(state: Any) -> int:
        return int(state.epoch * args.steps_per_epoch + state.batch)

    def on_state_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.base_lr * hvd.size()
        events.reset(step_of(state))

    state.register_reset_callbacks([on_state_reset])

    def batches() -> Iterator[list[torch.Tensor]]:
        """The rest of this pass over the data (the sampler's share for this rank), then the next passes."""
        while True:
            fresh, n = sampler.processed_num == 0, 0
            for n, batch in enumerate(loader, 1):
                yield batch
            if fresh and n == 0:
                raise SystemExit(f"--samples {args.samples}: not one batch of {args.batch_size} per worker")
            sampler.set_epoch(sampler.epoch + 1)

    @hvd.elastic.run  # type: ignore[untyped-decorator]
    def train(state: Any) -> None:
        events.begin(step_of(state), hvd.rank(), hvd.size())
        data = batches()
        while state.epoch < args.epochs:
            while state.batch < args.steps_per_epoch:
                x, y = next(data)
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                sampler.record_batch(state.batch, args.batch_size)
                state.batch += 1
                events.stepped(step_of(state), hvd.size())
                if args.step_seconds:
                    time.sleep(args.step_seconds)
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
                elif state.batch % BATCHES_PER_HOST_CHECK == 0:
                    state.check_host_updates()
            state.epoch, state.batch = state.epoch + 1, 0
        events.end(step_of(state))

    train(state)
    log.flush()
    if hvd.rank() == 0:
        print(f"done at step {step_of(state)} on {hvd.size()} workers (pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    main()
