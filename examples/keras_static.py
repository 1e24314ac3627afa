"""A static Horovod job (``horovodrun -np N``, Gloo or MPI) made preemption-safe.

Without a discovery script (a static job) the ring cannot shrink, so on a preemption notice every
rank writes its share of an emergency checkpoint, ``fit`` stops, and the job
exits cleanly; relaunching the same command resumes from that checkpoint.

    horovodrun -np 2 -H localhost:1,127.0.0.1:1 python examples/keras_static.py --store /tmp/run2
    horovodrun -np 2 -H localhost:2 --mpi python examples/keras_static.py --store /tmp/run2
"""
from __future__ import annotations

import argparse

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import tensorflow as tf

import hvd_transient.keras as hvdt  # hvd-transient
from hvd_transient.testing.workloads import MODELS, batches, synthetic_cifar10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--store", required=True)
    p.add_argument("--model", choices=sorted(MODELS), default="resnet32")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--base-lr", type=float, default=0.01)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--step-seconds", type=float, default=0.0)
    args = p.parse_args()

    hvd.init()
    images, labels = synthetic_cifar10()
    model = MODELS[args.model]()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(args.base_lr * hvd.size())),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hvdt.build_optimizer_slots(model)                                       # hvd-transient
    resumed = hvdt.restore_model(model, args.store) if hvd.rank() == 0 else None  # hvd-transient
    # every rank starts from rank 0's (possibly restored) weights and optimizer state
    hvd_tf.broadcast_variables(list(hvdt.state_variables(model).values()), root_rank=0)
    start = hvd_tf.broadcast_object(resumed["step"] if resumed else 0, root_rank=0)
    callbacks = [
        hvdt.TransientCallback(None, store=args.store, save_every_steps=args.save_every,  # hvd-transient
                               base_lr=args.base_lr),
    ]
    if args.step_seconds:
        import time
        callbacks.append(tf.keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: time.sleep(args.step_seconds)))
    remaining = max(0, args.steps - start)
    if remaining:
        model.fit(batches(images, labels, args.batch_size, seed=1000 * hvd.rank() + start),
                  steps_per_epoch=remaining, epochs=1, callbacks=callbacks, verbose=0)
    if hvd.rank() == 0:
        controller = "MPI" if hvd.mpi_enabled() else "Gloo"
        print(f"stopped at step {int(model.optimizer.iterations.numpy())} (resumed from {start}) "
              f"on {hvd.size()} processes over {controller}", flush=True)


if __name__ == "__main__":
    main()
