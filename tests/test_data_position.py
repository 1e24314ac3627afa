"""Exact data position: the pure counters, the real tf.data stream across world-size changes, and
Keras fit resuming at the exact batch (single process, real Horovod of size 1)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import tensorflow as tf

from hvd_transient.core.data_position import SampleCursor, epoch_and_batch, pass_and_index
from hvd_transient.keras.data import stream_batches, stream_indices


def test_counters():
    assert epoch_and_batch(0, 25) == (0, 0)
    assert epoch_and_batch(343, 25) == (13, 18)
    with pytest.raises(ValueError):
        epoch_and_batch(3, 0)
    cursor = SampleCursor(step0=100, samples0=6400, per_step=3 * 32)
    assert cursor.samples_at(100) == 6400 and cursor.samples_at(110) == 6400 + 960
    assert pass_and_index(2500, 1000) == (2, 500)


def _take(num_samples, batch, *, offset, size, steps, seed=7):
    """The ids every rank reads in ``steps`` steps from ``offset`` on ``size`` workers, step by step."""
    per_rank = [list(stream_indices(num_samples, batch, offset=offset, rank=r, size=size, seed=seed)
                     .take(steps).as_numpy_iterator()) for r in range(size)]
    return [np.concatenate([per_rank[r][s] for r in range(size)]) for s in range(steps)]


def test_each_sample_of_a_pass_once_across_world_size_changes():
    """3 workers for 5 steps, a leave (2 workers, 4 steps), a join (4 workers, 3 steps), then a cold
    restart on 1 worker: each run starts at the global offset where the previous stopped."""
    n, batch = 100, 4
    ids, offset = [], 0
    for size, steps in ((3, 5), (2, 4), (4, 3), (1, 30)):
        for step in _take(n, batch, offset=offset, size=size, steps=steps):
            ids.extend(step.tolist())
        offset += size * batch * steps
    assert offset == 60 + 32 + 48 + 120 == 260
    first, second = ids[:n], ids[n:2 * n]
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))  # each pass a permutation
    assert first != second  # a fresh order every pass
    assert max(Counter(ids[:2 * n]).values()) == 2
    # the same positions give the same ids, whoever reads them (no per-worker randomness)
    again = _take(n, batch, offset=60, size=2, steps=4)
    assert np.concatenate(again).tolist() == ids[60:92]


def test_stream_batches_gather_the_arrays_and_reject_bad_input():
    x = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    y = np.arange(10, dtype=np.int64)
    xb, yb = next(iter(stream_batches((x, y), 4, offset=3, rank=1, size=2, seed=1)))
    np.testing.assert_array_equal(xb.numpy(), x[yb.numpy()])
    # positions 3 + 4 (rank 0's block) .. 3 + 8: the last three of pass 0 and the first of pass 1
    stream = next(iter(stream_indices(10, 20, offset=0, rank=0, size=1, seed=1))).numpy()
    np.testing.assert_array_equal(yb.numpy(), stream[7:11])
    with pytest.raises(ValueError, match="one length"):
        stream_batches((x, y[:5]), 2, offset=0, rank=0, size=1)
    with pytest.raises(ValueError, match="rank"):
        stream_indices(10, 2, offset=0, rank=2, size=2)


def _model(hvd):
    tf.random.set_seed(3)
    model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(2, name="out")])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _Batches(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, int]] = []
        self.epoch = -1

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((self.epoch, batch))


def test_fit_resumes_at_the_exact_batch_and_sample(hvd, tmp_path):
    """A fit stopped mid-epoch and started again (as after a reset) runs exactly the missing steps."""
    import hvd_transient.keras as hvdt

    x = np.random.default_rng(0).standard_normal((64, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model = _model(hvd)
    state = hvdt.elastic_state(model, store=str(tmp_path / "store"))
    transient = hvdt.TransientCallback(state, store=str(tmp_path / "store"), save_every_steps=None,
                                       save_on_train_end=True, watcher="local")
    stop_at = tf.keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: setattr(model, "stop_training", model.optimizer.iterations.numpy() == 7))
    model.fit(hvdt.elastic_dataset(state, (x, y), 4), steps_per_epoch=5, epochs=3, verbose=0,
              callbacks=[transient, stop_at])
    assert int(model.optimizer.iterations.numpy()) == 7 and state.samples == 7 * 4
    seen = _Batches()
    model.fit(hvdt.elastic_dataset(state, (x, y), 4), steps_per_epoch=5, epochs=3, verbose=0,
              callbacks=[transient, seen])
    assert seen.seen == [(1, 2), (1, 3), (1, 4), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4)]
    assert int(model.optimizer.iterations.numpy()) == 15 and state.samples == 60
    assert getattr(model, "_training_state", None) is None  # the hook is removed after fit
    meta = hvdt.restore_model(_model(hvd), str(tmp_path / "store"))  # a fresh model restores as it is
    assert (meta["step"], meta["samples"], meta["epoch"], meta["batch"]) == (15, 60, 3, 0)
    transient.impl.close()


class _Reset(Exception):
    """What a Horovod reset does to fit: an exception out of a batch-end callback."""


def test_horovods_own_epoch_pattern_still_ends_at_the_exact_step(hvd, tmp_path):
    """A script that keeps ``epoch=``/``batch=`` state, Horovod's epoch callbacks and
    ``epochs=EPOCHS - state.epoch``: a reset mid-epoch resumes at the batch, counting from state.epoch."""
    import hvd_transient.keras as hvdt

    x = np.zeros((40, 3), np.float32)
    y = np.zeros(40, np.int64)
    model = _model(hvd)
    state = hvdt.elastic_state(model, store=str(tmp_path / "store"), epoch=0, batch=0)
    transient = hvdt.TransientCallback(state, store=str(tmp_path / "store"), save_every_steps=None,
                                       save_on_train_end=False, watcher="local")

    def reset_at(step):
        def check(batch, logs):
            if model.optimizer.iterations.numpy() == step:
                raise _Reset()
        return tf.keras.callbacks.LambdaCallback(on_train_batch_end=check)

    callbacks = [hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                 transient]
    for stop in (7, 12):
        with pytest.raises(_Reset):
            model.fit(hvdt.elastic_dataset(state, (x, y), 4), steps_per_epoch=5, epochs=3 - state.epoch,
                      verbose=0, callbacks=callbacks + [reset_at(stop)])
    assert int(model.optimizer.iterations.numpy()) == 12 and state.epoch == 2
    seen = _Batches()
    model.fit(hvdt.elastic_dataset(state, (x, y), 4), steps_per_epoch=5, epochs=3 - state.epoch, verbose=0,
              callbacks=callbacks + [seen])
    assert seen.seen == [(0, 2), (0, 3), (0, 4)]
    assert int(model.optimizer.iterations.numpy()) == 15 and state.samples == 60
    transient.impl.close()
