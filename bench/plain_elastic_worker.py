"""The baseline for ``bench/preemption_cost.py``: a standard Horovod elastic Keras script, no hvd-transient.

Same model, data, learning rate and commit cadence as ``examples/keras_elastic.py``, written like Horovod's
elastic Keras example (``KerasState``, commit / batch / epoch callbacks, LR rescaled on reset); nobody
watches for notices. :class:`KerasStepEvents` only writes hvd-transient's events (start, ring, first_step,
progress, reset, train_end; ``bench/_step_events.py``, shared with the PyTorch baseline
``plain_torch_elastic_worker.py``), so ``hvd_transient.report.analysis`` reads both runs the same way.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import horovod.tensorflow.keras as hvd
import tensorflow as tf

from ckpt_service.stores import open_store
from hvd_transient.telemetry.events import EventLog
from hvd_transient.testing.workloads import MODELS, batches, load_cifar10, synthetic_cifar10

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench/ is not installed
from bench._step_events import StepEvents  # noqa: E402


class KerasStepEvents(tf.keras.callbacks.Callback):  # type: ignore[misc]  # Keras is untyped
    """:class:`StepEvents` as a Keras callback, its step the optimizer's."""

    def __init__(self, log: EventLog) -> None:
        super().__init__()
        self.events = StepEvents(log)

    def _step(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.events.begin(self._step(), hvd.rank(), hvd.size())

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.events.stepped(self._step(), hvd.size())

    def on_reset(self) -> None:
        """Horovod calls this after a reset, once the state was rolled back (if it was)."""
        self.events.reset(self._step())

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.events.end(self._step())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events-store", required=True, help="store URL the measurement events are written to")
    p.add_argument("--model", choices=sorted(MODELS), default="resnet32")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--base-lr", type=float, default=0.01, help="single-worker learning rate")
    p.add_argument("--batches-per-commit", type=int, default=10, help="Horovod in-memory commit cadence")
    p.add_argument("--cifar10-npz", help="real CIFAR-10 (.npz with x_train, y_train); synthetic if absent")
    p.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step")
    args = p.parse_args()

    hvd.init()
    tf.random.set_seed(1234)  # identical initial weights on every worker
    images, labels = load_cifar10(args.cifar10_npz) if args.cifar10_npz else synthetic_cifar10()
    model = MODELS[args.model]()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(args.base_lr * hvd.size(), momentum=0.9)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    # Slot variables must exist before the state is made (the documented workaround for
    # horovod#2652); the plugin's elastic_state does the same, so both runs train identically.
    model.optimizer.build(model.trainable_variables)

    host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    log = EventLog(open_store(args.events_store), host)
    events = KerasStepEvents(log)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    def on_state_reset() -> None:
        tf.keras.backend.set_value(model.optimizer.learning_rate, args.base_lr * hvd.size())
        events.on_reset()

    state.register_reset_callbacks([on_state_reset])
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
                 hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state), events]
    if args.step_seconds:
        callbacks.append(tf.keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: time.sleep(args.step_seconds)))

    @hvd.elastic.run  # type: ignore[untyped-decorator]
    def train(state: Any) -> None:
        seed = 1000 * hvd.rank() + int(model.optimizer.iterations.numpy())
        model.fit(batches(images, labels, args.batch_size, seed), steps_per_epoch=args.steps_per_epoch,
                  epochs=args.epochs - state.epoch, callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)

    train(state)
    log.flush()
    if hvd.rank() == 0:
        print(f"done at step {int(model.optimizer.iterations.numpy())} on {hvd.size()} workers "
              f"(pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    main()
