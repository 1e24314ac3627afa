"""A standard Horovod elastic Keras script, made preemption-safe by hvd-transient.

The lines marked `# hvd-transient` are all it takes. Training resumes at the exact step and
sample after every reset (leave, join, rollback) and cold restart: it ends after exactly
epochs x steps-per-epoch optimizer steps, each sample of a pass over the data used once.
Run it with, for example (Horovod 0.28 is elastic when given a discovery script):

    HVDT_DISCOVERY_BACKEND=local HVDT_HOSTS=localhost,127.0.0.1 HVDT_STORE=/tmp/run1 \\
    horovodrun -np 2 --min-np 1 --max-np 4 \\
        --host-discovery-script launch/discover_hosts.sh --network-interfaces lo \\
        python examples/keras_elastic.py --store /tmp/run1
"""
from __future__ import annotations

import argparse
import os
import time

import horovod.tensorflow.keras as hvd
import tensorflow as tf

import hvd_transient.keras as hvdt  # hvd-transient
from hvd_transient.testing.workloads import MODELS, load_cifar10, synthetic_cifar10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--store", required=True, help="checkpoint store: directory or gs://bucket/prefix")
    p.add_argument("--model", choices=sorted(MODELS), default="resnet32")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--base-lr", type=float, default=0.01, help="single-worker learning rate")
    p.add_argument("--save-every", type=int, default=50, help="periodic checkpoint interval (steps)")
    p.add_argument("--batches-per-commit", type=int, default=10, help="Horovod in-memory commit cadence")
    p.add_argument("--notice-window", type=float, default=None,
                   help="seconds a notice gives (default: what the VM is configured with; GCE Spot: 30)")
    p.add_argument("--leave", choices=("at_notice", "near_deadline"), default=None,
                   help="a worker under notice trains on until --leave-lead seconds before its deadline "
                        "(near_deadline, the default), or leaves after its emergency checkpoint (at_notice)")
    p.add_argument("--leave-lead", type=float, default=None,
                   help="with --leave near_deadline: seconds before the deadline that the worker leaves "
                        "(default: measured, 10 s until a departure was timed)")
    p.add_argument("--cifar10-npz", help="real CIFAR-10 (.npz with x_train, y_train); synthetic if absent")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="extra time per step, to stretch a tiny run over a preemption schedule")
    p.add_argument("--print-saved-crc", action="store_true",
                   help="every rank prints the checksum of its replicated state at each periodic save step "
                        "(to check that a checkpoint holds one attempt's state)")
    args = p.parse_args()

    hvd.init()
    tf.random.set_seed(1234)  # identical initial weights on every worker
    images, labels = load_cifar10(args.cifar10_npz) if args.cifar10_npz else synthetic_cifar10()
    model = MODELS[args.model]()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(args.base_lr, momentum=0.9)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    state = hvdt.elastic_state(model, store=args.store)  # hvd-transient
    callbacks = [
        hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
        hvdt.TransientCallback(state, store=args.store, base_lr=args.base_lr,  # hvd-transient
                               save_every_steps=args.save_every, notice_window_s=args.notice_window,
                               leave=args.leave, leave_lead_s=args.leave_lead),
    ]
    if args.print_saved_crc:
        def print_crc(batch: int, logs: object) -> None:
            step = int(model.optimizer.iterations.numpy())
            if step % args.save_every == 0:  # the state the periodic save of this step took
                print(f"saved-state step {step} size {hvd.size()} rank {hvd.rank()} crc {hvdt.weights_crc(model)}",
                      flush=True)

        callbacks.append(tf.keras.callbacks.LambdaCallback(on_train_batch_end=print_crc))
    if args.step_seconds:
        callbacks.append(tf.keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: time.sleep(args.step_seconds)))

    @hvd.elastic.run
    def train(state):
        # resumes at the exact sample and batch, on however many workers the ring has now
        model.fit(hvdt.elastic_dataset(state, (images, labels), args.batch_size),  # hvd-transient
                  steps_per_epoch=args.steps_per_epoch, epochs=args.epochs, callbacks=callbacks,
                  verbose=2 if hvd.rank() == 0 else 0)

    train(state)
    if hvd.rank() == 0:
        print(f"done at step {int(model.optimizer.iterations.numpy())} on {hvd.size()} workers, "
              f"{state.samples} samples (pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    main()
