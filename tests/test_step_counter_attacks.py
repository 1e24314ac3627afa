"""Attacks on the counted step (:mod:`hvd_transient.frontend.step_counter`) with a real Keras ``fit``.

The callback reads the optimizer's step exactly only at the first batch after a reset of its counter
and where ``impl.plain_step(counted)`` is False, and counts one step per batch in between. The rules
attacked here:

1. every step the protocol is handed (saves, rounds, events) is the optimizer's real step;
2. the elastic state's ``samples`` is ``samples0 + (step - step0) x global batch`` wherever Horovod
   saves, restores or broadcasts it, and in every checkpoint's metadata;
3. every rank takes the same steps for plain, whatever it saw before (a joining worker included);
4. (covered by tests/test_plain_step_counts.py) a plain step runs no TensorFlow op.

Each fit runs in this process, Horovod in a world of one. The real step is read in a wrapper around
``impl.after_step`` (an op the callback itself does not run: these tests do not count ops).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from ckpt_service.manager import CheckpointManager

GLOBAL_BATCH = 4  # world of one x per-worker batch


def _data(n: int = 400) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((n, 3)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


class _Twice(tf.keras.Sequential):  # type: ignore[misc]
    """A custom train_step that applies its gradients twice per batch (two optimizer steps)."""

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = self.compiled_loss(y, self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


class _EveryOther(tf.keras.Sequential):  # type: ignore[misc]
    """A custom train_step that applies gradients only at odd batches (no optimizer step at even ones)."""

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compiled_loss(y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        batches = self._hvdt_batches.assign_add(1)

        def apply() -> tf.Tensor:
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return tf.constant(True)
        tf.cond(batches % 2 == 0, apply, lambda: tf.constant(False))
        return {"loss": loss}


def _model(hvd: Any, cls: type = tf.keras.Sequential, *, optimizer: Any = None, steps_per_execution: Any = 1,
           loss: Any = None, float32_head: bool = False) -> tf.keras.Model:
    tf.random.set_seed(3)
    layers = [tf.keras.Input((3,)), tf.keras.layers.Dense(2)]
    if float32_head:
        layers.append(tf.keras.layers.Activation("linear", dtype="float32"))
    model = cls(layers)
    if cls is _EveryOther:
        model._hvdt_batches = tf.Variable(0, dtype=tf.int64, trainable=False)  # noqa: SLF001
    model.compile(optimizer=optimizer or hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss=loss or tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


def _callback(state: Any, store: str, **kwargs: Any) -> Any:
    import hvd_transient.keras as hvdt

    kwargs = {"save_every_steps": 4, "check_every_steps": 3, "save_on_train_end": False, "watcher": "local",
              **kwargs}
    return hvdt.TransientCallback(state, store=store, **kwargs)


def _record(cb: Any) -> list[tuple[int, int, Any, int]]:
    """Wraps ``cb.impl.after_step``: (step handed, the optimizer's real step, samples handed, rounds so far)."""
    seen: list[tuple[int, int, Any, int]] = []
    inner = cb.impl.after_step

    def after_step(step: int, *args: Any, **kwargs: Any) -> Any:
        real = int(cb.model.optimizer.iterations.numpy())
        out = inner(step, *args, **kwargs)
        seen.append((step, real, kwargs.get("samples"), cb.impl.notice_rounds))
        return out
    cb.impl.after_step = after_step
    return seen


def _fit(model: Any, state: Any, callbacks: list[Any], *, steps_per_epoch: int, epochs: int, **kwargs: Any) -> None:
    import hvd_transient.keras as hvdt

    model.fit(hvdt.elastic_dataset(state, _data(), GLOBAL_BATCH), steps_per_epoch=steps_per_epoch, epochs=epochs,
              verbose=0, callbacks=callbacks, **kwargs)


def _mismatches(seen: list[tuple[int, int, Any, int]]) -> list[tuple[int, int]]:
    return [(handed, real) for handed, real, _, _ in seen if handed != real]


def _setup(hvd: Any, tmp_path: Any, cls: type = tf.keras.Sequential, cb_kwargs: dict[str, Any] | None = None,
           **model_kwargs: Any) -> tuple[Any, Any, Any, str]:
    """A model, its elastic state and the callback, after a one-step fit that makes the callback's impl."""
    import hvd_transient.keras as hvdt

    store = str(tmp_path / "store")
    model = _model(hvd, cls, **model_kwargs)
    state = hvdt.elastic_state(model, store=store)
    cb = _callback(state, store, **(cb_kwargs or {}))
    _fit(model, state, [cb], steps_per_epoch=1, epochs=1)
    return model, state, cb, store


def _samples_ok(seen: list[tuple[int, int, Any, int]]) -> list[tuple[int, Any]]:
    """Steps whose samples handed to the protocol are not step x global batch (the run began at 0, 0)."""
    return [(real, samples) for _, real, samples, _ in seen if samples is not None and samples != real * GLOBAL_BATCH]


# --------------------------------------------------------------------------------- attacks the code survives


def test_mixed_precision_skipped_steps_still_count_one_per_batch(hvd, tmp_path):
    """A LossScaleOptimizer skipping steps on inf gradients (forced twice) still increments ``iterations``
    in Keras 2.15: every step handed is exact, the count never differs, samples stay step x batch."""
    boom = tf.Variable(0.0)

    def loss(y, logits):
        base = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        return base * (1.0 + boom * 1e38) * (1.0 + boom * 1e38)  # inf where boom is set

    class Boom(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.n += 1
            boom.assign(1.0 if self.n in (3, 6) else 0.0)

    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(
            hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)))
        model, state, cb, _ = _setup(hvd, tmp_path, optimizer=optimizer, loss=loss, float32_head=True,
                                     cb_kwargs={"check_every_steps": 100, "save_every_steps": 50})
        scale = float(model.optimizer.loss_scale)
        seen = _record(cb)
        _fit(model, state, [Boom(), cb], steps_per_epoch=20, epochs=1)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    assert float(model.optimizer.loss_scale) == scale / 4  # two steps were skipped
    assert [handed for handed, *_ in seen] == list(range(2, 21))
    assert _mismatches(seen) == [] and cb._steps.counts  # noqa: SLF001
    assert _samples_ok(seen) == [] and state.samples == 20 * GLOBAL_BATCH
    cb.close()


@pytest.mark.parametrize("spe", [3, 4])
def test_steps_per_execution_counts_whole_executions(hvd, tmp_path, spe):
    """``steps_per_execution > 1`` (the last execution of each epoch truncated): the batch index Keras passes
    is the execution's last batch, so the count moves by whole executions and stays exact."""
    model, state, cb, _ = _setup(hvd, tmp_path, steps_per_execution=spe)
    seen = _record(cb)
    _fit(model, state, [cb], steps_per_epoch=10, epochs=3)
    assert seen and _mismatches(seen) == [] and cb._steps.counts  # noqa: SLF001
    assert seen[-1][1] == 30 and _samples_ok(seen) == [] and state.samples == 30 * GLOBAL_BATCH
    cb.close()


def test_backward_passes_per_step_still_step_once_per_batch(hvd, tmp_path):
    """Horovod's gradient aggregation (``backward_passes_per_step=2``) increments ``iterations`` at the
    batches it does not apply: one step per batch, counted exactly."""
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), backward_passes_per_step=2)
    model, state, cb, _ = _setup(hvd, tmp_path, optimizer=optimizer)
    seen = _record(cb)
    _fit(model, state, [cb], steps_per_epoch=10, epochs=2)
    assert [handed for handed, *_ in seen] == list(range(2, 21))
    assert _mismatches(seen) == [] and cb._steps.counts  # noqa: SLF001
    cb.close()


def test_validation_resume_mid_epoch_several_fits_and_odd_cadences(hvd, tmp_path):
    """Evaluation between epochs, a fit resumed mid-epoch (ResumeAt), three fits, saves every 7 steps,
    progress every 5, and the adaptive check cadence: every step handed, every event's step, every commit's
    step and metadata match the optimizer; the count never differs."""
    from hvd_transient.telemetry.events import read_events

    model, state, cb, store = _setup(hvd, tmp_path, cb_kwargs={"save_every_steps": 7, "check_every_steps": None})
    cb.impl.config = dataclasses.replace(cb.impl.config, progress_every_steps=5)  # not a callback argument
    seen = _record(cb)
    val = (_data(20)[0], _data(20)[1])
    stop_at = tf.keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: setattr(
        model, "stop_training", int(model.optimizer.iterations.numpy()) == 13))
    _fit(model, state, [cb, stop_at], steps_per_epoch=6, epochs=4, validation_data=val)  # stops mid-epoch 2
    assert int(model.optimizer.iterations.numpy()) == 13
    _fit(model, state, [cb], steps_per_epoch=6, epochs=4, validation_data=val)  # resumes at epoch 2, batch 1
    _fit(model, state, [cb], steps_per_epoch=6, epochs=6, initial_epoch=0, validation_data=val)
    assert int(model.optimizer.iterations.numpy()) == 36
    assert [handed for handed, *_ in seen] == list(range(2, 37))
    assert _mismatches(seen) == [] and _samples_ok(seen) == [] and cb._steps.counts  # noqa: SLF001
    assert state.samples == 36 * GLOBAL_BATCH
    cb.impl.manager.wait()
    cb.impl.events.flush()
    manager = CheckpointManager(store)
    for step in manager.all_steps():
        assert step % 7 == 0
        meta = manager.manifest(step).metadata
        assert meta["step"] == step and meta["samples"] == step * GLOBAL_BATCH
        assert (meta["epoch"], meta["batch"]) == divmod(step, 6)
    stepped = {"progress": 5, "async_save": 7, "commit": 7}
    for event in read_events(manager.store):
        if event["event"] in stepped:
            assert event["step"] % stepped[event["event"]] == 0, event
        if event["event"] == "resume_at":
            assert (event["epoch"], event["batch"]) == divmod(event["step"], 6)
            assert event["samples"] == event["step"] * GLOBAL_BATCH
    manager.close()
    cb.close()


def test_a_reset_inside_a_counted_stretch_restores_and_syncs_the_exact_offset(hvd, tmp_path):
    """Horovod's commits (listed before the callback, so they run before its advance) and a failure in the
    middle of counted steps: every committed offset is step x batch, the restore brings back the committed
    one, the sync broadcasts it, and the next fit resumes at the exact sample."""
    model, state, cb, _ = _setup(hvd, tmp_path, cb_kwargs={"check_every_steps": 100, "save_every_steps": 100})
    saved: list[tuple[int, int]] = []
    save = state.save

    def recording_save() -> None:
        save()
        saved.append((int(model.optimizer.iterations.numpy()), int(state.samples)))
    state.save = recording_save

    class Failure(Exception):
        pass

    def fail_at(batch: int, logs: Any) -> None:
        if int(model.optimizer.iterations.numpy()) == 11:  # a counted step: not the first of the epoch
            raise Failure()
    commit = hvd.elastic.CommitStateCallback(state, batches_per_commit=4)
    with pytest.raises(Failure):
        _fit(model, state, [commit, cb, tf.keras.callbacks.LambdaCallback(on_train_batch_end=fail_at)],
             steps_per_epoch=10, epochs=3)
    assert saved and all(samples == step * GLOBAL_BATCH for step, samples in saved)
    state.restore()  # HorovodInternalError: back to the last commit
    state.on_reset()
    state.sync()
    step = int(model.optimizer.iterations.numpy())
    assert step == saved[-1][0] and state.samples == step * GLOBAL_BATCH
    seen = _record(cb)
    _fit(model, state, [cb], steps_per_epoch=10, epochs=3)
    assert _mismatches(seen) == [] and _samples_ok(seen) == [] and state.samples == 30 * GLOBAL_BATCH
    cb.close()


# ----------------------------------------------------------------------------------------- open violations


def test_a_train_step_that_steps_twice_is_handed_its_real_steps(hvd, tmp_path):
    """Rule 1 (every step the protocol acts on is the optimizer's real step): a ``train_step`` that applies
    its gradients twice per batch. The first exact read after the epoch's start anchors the count; the count
    then lags the optimizer until the count reaches a due step, and the steps in between are taken for plain
    with the wrong numbers, so the save due at real step 8 (``save_every_steps=4``) is never started; the
    exact reads before the counter took its place started it."""
    model, state, cb, _ = _setup(hvd, tmp_path, _Twice, cb_kwargs={"check_every_steps": 100})
    seen = _record(cb)
    _fit(model, state, [cb], steps_per_epoch=10, epochs=1)
    assert 8 in [handed for handed, *_ in seen], "the save due at step 8 was taken for a plain step"
    assert _mismatches(seen) == []
    cb.close()


def test_an_autotuned_steps_per_execution_change_is_handed_the_real_steps(hvd, tmp_path):
    """Rule 1: ``steps_per_execution="auto"``. Keras's tuner thread assigns the model's steps-per-execution
    variable at any moment; one that lands between the data handler's yield (which fixes the batch index
    passed to ``on_train_batch_end``) and the execution makes the execution run more steps than the index
    says. Here a callback makes that assignment at a batch's begin (as the thread may), deterministically:
    the count lags by two from then on and every step until the next exact read is off by two, the save
    due at real step 20 (``save_every_steps=10``) among them."""
    model, state, cb, _ = _setup(hvd, tmp_path, steps_per_execution="auto",
                                 cb_kwargs={"check_every_steps": 100, "save_every_steps": 10})
    model._steps_per_execution.assign(1)  # noqa: SLF001 - where the tuner starts, whatever it chose since

    class Tuner(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.n += 1
            if self.n == 2:
                self.model._steps_per_execution.assign(3)  # noqa: SLF001

    seen = _record(cb)
    _fit(model, state, [Tuner(), cb], steps_per_epoch=30, epochs=1)
    assert _mismatches(seen) == []
    cb.close()


def test_a_fit_ending_in_a_counted_stretch_leaves_the_exact_offset(hvd, tmp_path):
    """Rule 2 (samples = step x global batch wherever Horovod saves, restores or broadcasts it, and in every
    checkpoint): a model that does not step once per batch (``train_step`` stepping twice), and a fit that
    ends before the count reached a due step. Its last ``hvdt_advance`` used the counted step; nothing
    reads the step at the fit's end (``on_train_end`` reads it for the final save, not for the offset), and
    the next fit's ``hvdt_begin`` takes that live offset as its cursor's origin: the next fit's first
    checkpoint (step 8) carries samples 28, not 32. With exact reads at every batch both were exact."""
    model, state, cb, store = _setup(hvd, tmp_path, _Twice,
                                     cb_kwargs={"check_every_steps": 1000, "save_every_steps": 8})
    _fit(model, state, [cb], steps_per_epoch=2, epochs=2)  # resumes at step 2 (epoch 1): 2 batches, 4 and 6
    step = int(model.optimizer.iterations.numpy())
    live = int(state.samples)
    _fit(model, state, [cb], steps_per_epoch=2, epochs=4)
    cb.impl.manager.wait()
    manager = CheckpointManager(store)
    metas = {s: manager.manifest(s).metadata for s in manager.all_steps()}
    manager.close()
    cb.close()
    assert step == 6 and 8 in metas
    assert live == step * GLOBAL_BATCH, f"after the fit at step {step}: samples {live}"
    assert {s: m.get("samples") for s, m in metas.items()} == {s: s * GLOBAL_BATCH for s in metas}


def test_a_joining_worker_takes_the_same_steps_for_plain(hvd, tmp_path):
    """Rule 3 (every rank takes the same steps for plain). On a model that does not step once per batch, a
    long-running worker's counter has seen its count differ and reads every batch; a worker that joins the
    ring later starts a fresh counter, which counts. In the new ring both start at the same step and see the
    same batches, but at the second batch the old worker is handed the real step (a due round, a collective)
    and the new one a counted step it takes for plain: in a real ring the old worker waits in an allreduce
    the new one never enters. Simulated in one process by two callbacks in one fit (each with its own
    protocol): they must be handed the same steps and run the same rounds."""
    store = str(tmp_path / "store")
    model, state, old, _ = _setup(hvd, tmp_path, _Twice, cb_kwargs={"check_every_steps": 4, "save_every_steps": None})
    _fit(model, state, [old], steps_per_epoch=10, epochs=1)
    assert not old._steps.counts  # noqa: SLF001 - this worker saw its count differ
    joined = _callback(None, store + "-joined", check_every_steps=4, save_every_steps=None, resume_position=False)
    seen_old = _record(old)
    _fit(model, state, [joined], steps_per_epoch=1, epochs=1)  # makes the joining worker's impl
    seen_new = _record(joined)
    del seen_old[:]
    _fit(model, state, [old, joined], steps_per_epoch=10, epochs=3)
    old.close()
    joined.close()
    assert [handed for handed, *_ in seen_old] == [handed for handed, *_ in seen_new]
    rounds = [(o[3] - seen_old[0][3], n[3] - seen_new[0][3]) for o, n in zip(seen_old, seen_new)]
    assert all(a == b for a, b in rounds), rounds


def test_a_train_step_that_skips_steps_is_handed_its_real_steps(hvd, tmp_path):
    """Rule 1: gradient accumulation in a custom ``train_step`` (one optimizer step every second batch). The
    count runs ahead of the optimizer, so a due step is read early (never missed), but the plain steps before
    it are handed steps the optimizer has not taken (the run's ``last_step``, what a reset reports as rolled
    back, and ``hvdt_advance``'s offset follow them)."""
    model, state, cb, _ = _setup(hvd, tmp_path, _EveryOther, cb_kwargs={"check_every_steps": 100,
                                                                         "save_every_steps": 10})
    seen = _record(cb)
    _fit(model, state, [cb], steps_per_epoch=10, epochs=1)
    assert _mismatches(seen) == []
    cb.close()


def test_steps_per_execution_still_runs_the_fixed_notice_rounds(hvd, tmp_path):
    """Beyond the counter (exact reads hand the same steps): with ``steps_per_execution`` the protocol only
    sees every k-th step, and ``step % check_every_steps == 0`` may never hold, so a fixed cadence runs no
    notice round for a whole epoch (and ``save_every_steps`` no save at the multiples it steps over)."""
    model, state, cb, _ = _setup(hvd, tmp_path, steps_per_execution=3, cb_kwargs={"save_every_steps": None})
    _fit(model, state, [cb], steps_per_epoch=10, epochs=1)  # to step 10
    seen = _record(cb)
    _fit(model, state, [cb], steps_per_epoch=10, epochs=2)  # 13, 16, 19, 20
    assert _mismatches(seen) == []
    rounds = seen[-2][3] - seen[0][3]  # before the epoch's last, truncated execution (step 20)
    assert rounds >= 2, f"steps {[h for h, *_ in seen]}: {rounds} notice rounds over 9 steps with check_every_steps=3"
    cb.close()
