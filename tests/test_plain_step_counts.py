"""What ``TransientCallback`` does at a plain step (no save, no notice round), counted, not timed.

A plain step must cost a few attribute and clock reads: no store call, no collective, no event and
no TensorFlow op (the optimizer's step is counted between the steps at which it is read). The counts
come from a real ``model.fit`` (Horovod in a world of one): TensorFlow's op callbacks see every op
the training thread runs, and counting wrappers stand in front of the collectives, the store and
the event log. Counts do not flake where timings would.

The check cadence is also checked on a fake clock: time spent between steps (an evaluation, an
epoch's end) is not a step, so it must not make the ring run its notice round at every step.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

from hvd_transient.core.interfaces import Clocks

STEPS_PER_EPOCH = 25
CHECK_EVERY = 10


def _model(hvd: Any) -> tf.keras.Model:
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((4 * STEPS_PER_EPOCH, 3)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


class Counts:
    """What the training thread did inside one callback call."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self.collectives: list[str] = []
        self.store_calls: list[str] = []
        self.events: list[str] = []
        self._main = threading.get_ident()

    def on_training_thread(self) -> bool:
        # background threads (the event flusher, the stop poller, a background save) may use the store
        return threading.get_ident() == self._main

    def op(self, op_type: str, inputs: Any, attrs: Any, outputs: Any, op_name: Any = None, graph: Any = None) -> None:
        if graph is None:  # executed, not traced into a graph
            self.ops.append(op_type)


class CountingComm:
    """The collectives in front of the real ones: every call but rank() and size() is a collective."""

    def __init__(self, inner: Any, counts: Callable[[], Counts]) -> None:
        self._inner, self._counts = inner, counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in ("rank", "size") or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._counts().collectives.append(name)
            return attr(*args, **kwargs)
        return call


def _count_store_calls(store: Any, counts: Callable[[], Counts]) -> None:
    """Every public method of this store object (shared by the manager, the event log, the lease and
    the stop poller) counts its calls from the training thread."""
    for name in dir(type(store)):
        attr = getattr(store, name, None)
        if name.startswith("_") or not callable(attr):
            continue

        def call(*args: Any, _name: str = name, _attr: Any = attr, **kwargs: Any) -> Any:
            if counts().on_training_thread():
                counts().store_calls.append(_name)
            return _attr(*args, **kwargs)
        setattr(store, name, call)


def _count_events(events: Any, counts: Callable[[], Counts]) -> None:
    emit = events.emit

    def call(event: Any, *args: Any, **kwargs: Any) -> Any:
        if counts().on_training_thread():  # a background save reports its commit from its own thread
            counts().events.append(type(event).__name__)
        return emit(event, *args, **kwargs)
    events.emit = call


def _counted_fit(hvd: Any, tmp_path: Any, elastic: bool) -> tuple[Any, list[tuple[str, int, Counts]], Any]:
    """A fit with the callback, then a second one with every batch hook of the callback counted."""
    import hvd_transient.keras as hvdt

    model, store = _model(hvd), str(tmp_path / "store")
    state = hvdt.elastic_state(model, store=store) if elastic else None
    cb = hvdt.TransientCallback(state, store=store, save_every_steps=CHECK_EVERY, check_every_steps=CHECK_EVERY,
                                save_on_train_end=False, watcher="local")
    x, y = _data()

    def fit(epochs: int) -> None:
        data = (hvdt.elastic_dataset(state, (x, y), 4) if elastic
                else tf.data.Dataset.from_tensor_slices((x, y)).batch(4))
        model.fit(data, steps_per_epoch=STEPS_PER_EPOCH, epochs=epochs, verbose=0, callbacks=[cb])

    fit(2)  # traces the training function and the snapshot; makes the protocol's objects
    assert cb.impl is not None
    calls: list[tuple[str, int, Counts]] = []
    current = [Counts()]
    cb.impl.comm = CountingComm(cb.impl.comm, lambda: current[0])
    _count_store_calls(cb.impl.manager.store, lambda: current[0])
    _count_events(cb.impl.events, lambda: current[0])

    def counted(hook: str) -> None:
        inner = getattr(cb, hook)

        def call(batch: int, logs: Any = None) -> None:
            current[0] = counts = Counts()
            op_callbacks.add_op_callback(counts.op)
            try:
                inner(batch, logs)
            finally:
                op_callbacks.remove_op_callback(counts.op)
                current[0] = Counts()  # what happens between the hooks is not theirs
            calls.append((hook, cb.impl.run.last_step, counts))
        setattr(cb, hook, call)

    counted("on_train_batch_begin")
    counted("on_train_batch_end")
    rounds_before = cb.impl.notice_rounds
    fit(4 if elastic else 2)  # an elastic job's fit resumes at the optimizer's step: its third epoch
    return cb, calls, rounds_before


@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_a_plain_step_makes_no_store_call_no_collective_and_no_tensorflow_op(hvd, tmp_path, elastic):
    cb, calls, rounds_before = _counted_fit(hvd, tmp_path, elastic)
    ends = [(step, counts) for hook, step, counts in calls if hook == "on_train_batch_end"]
    first = ends[0][0]
    assert [step for step, _ in ends] == list(range(first, first + 2 * STEPS_PER_EPOCH))
    # the rounds and saves come every CHECK_EVERY steps; the first step of a fit reports itself
    plain = [(step, c) for step, c in ends if step % CHECK_EVERY and step != first]
    assert len(plain) >= 2 * STEPS_PER_EPOCH - 2 * STEPS_PER_EPOCH // CHECK_EVERY - 2
    for step, c in plain:
        assert c.ops in ([], ["ReadVariableOp"]), f"step {step}: TensorFlow ops {c.ops}"
        assert c.collectives == [] and c.store_calls == [] and c.events == [], \
            f"step {step}: collectives {c.collectives}, store calls {c.store_calls}, events {c.events}"
    # the step is counted, not read: read only at the first batch of each of the fit's two epochs
    read = [step for step, c in plain if c.ops]
    assert len(read) <= 2, f"the step was read at plain steps {read}"
    assert cb._steps.counts  # noqa: SLF001 - one optimizer step per batch: the count never differed
    for _, step, c in (call for call in calls if call[0] == "on_train_batch_begin"):
        assert (c.ops, c.collectives, c.store_calls, c.events) == ([], [], [], []), f"before step {step + 1}"
    # the counters see what they should: the other steps ran the rounds and saves through them
    rounds = [c for step, c in ends if step % CHECK_EVERY == 0]
    assert rounds and all("allreduce_sum" in c.collectives for c in rounds)
    assert cb.impl.notice_rounds - rounds_before == len(rounds)
    assert Counter(op for c in rounds for op in c.ops)["HorovodAllreduce"] >= len(rounds)
    cb.close()


class FakeTime(tf.keras.callbacks.Callback):  # type: ignore[misc]
    """Listed before TransientCallback: each step takes ``step_s`` and each epoch's end ``gap_s`` on a
    fake monotonic clock (the evaluation or the other callbacks of a real epoch's end)."""

    def __init__(self, step_s: float, gap_s: float) -> None:
        super().__init__()
        self.now, self.step_s, self.gap_s = 1000.0, step_s, gap_s

    def monotonic(self) -> float:
        return self.now

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.now += self.step_s

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.now += self.gap_s


def test_time_between_epochs_does_not_pin_the_notice_rounds_at_every_step(hvd, tmp_path):
    import hvd_transient.keras as hvdt

    model, store = _model(hvd), str(tmp_path / "store")
    cb = hvdt.TransientCallback(None, store=store, save_every_steps=None, save_on_train_end=False,
                                watcher="local")  # the default cadence: a round about once a second
    x, y = _data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    model.fit(data, steps_per_epoch=2, epochs=1, verbose=0, callbacks=[cb])  # makes cb.impl
    clock = FakeTime(step_s=0.05, gap_s=120.0)  # 20 steps a second; two minutes at each epoch's end
    cb.impl.clocks = Clocks(monotonic=clock.monotonic)
    before = cb.impl.notice_rounds
    model.fit(data, steps_per_epoch=STEPS_PER_EPOCH * 4, epochs=3, verbose=0, callbacks=[clock, cb])
    rounds = cb.impl.notice_rounds - before
    # about one round per 20 steps of 0.05 s (and a few at the ring's start, before the rate is known);
    # counted as a step, a gap of 120 s made every later step run one (over 200 here)
    assert rounds <= 30, f"{rounds} notice rounds in {3 * 4 * STEPS_PER_EPOCH} steps"
    cb.close()
