"""The training state of a Keras model: its variables, the checkpoint restore, and the elastic state.

:func:`elastic_state` is the ``hvd.elastic.KerasState`` a script makes (re-exported by
:mod:`hvd_transient.keras`); it restores the run's latest committed checkpoint on a cold start
and carries the data position that :func:`hvd_transient.keras.data.elastic_dataset` reads.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Any

import tensorflow as tf

from ckpt_service.stores import open_store
from hvd_transient.core.checksums import state_crc
from hvd_transient.core.control import clear_stop
from hvd_transient.frontend.host_updates import check_host_updates_and_sync
from hvd_transient.frontend.position import DataPosition
from hvd_transient.frontend.restore import latest_checkpoint, restored_counters, restored_summary
from hvd_transient.frontend.saved_values import keep_apart, restore_copies
from hvd_transient.join import standby
from hvd_transient.keras.autograph import skip_horovod_conversion

log = logging.getLogger(__name__)

#: the state's values that a cold start takes from the checkpoint's metadata, where the script keeps them
_COUNTERS = ("epoch", "batch", "samples")


def optimizer_step(optimizer: Any) -> int:
    """The optimizer's step (``iterations``), read by one TensorFlow op.

    The callback reads it after every batch; ``iterations.numpy()`` runs two ops (a read and an
    identity), about four times the cost of this single read on a CPU.
    """
    iterations = optimizer.iterations
    handle = getattr(iterations, "handle", None)
    if handle is None:  # not a resource variable: whatever this one offers
        return int(iterations.numpy())
    return int(tf.raw_ops.ReadVariableOp(resource=handle, dtype=iterations.dtype))


def optimizer_variables(optimizer: Any) -> list[tf.Variable]:
    """The optimizer's variables, whether this Keras version offers them as a method or as a property."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def state_variables(model: tf.keras.Model) -> dict[str, tf.Variable]:
    """Every variable that defines the training state, under stable, unique names.

    Names carry the position because Keras variable names are not unique across
    layers or models; restore checks shapes and dtypes against the live model.
    """
    named = {f"model/{i:04d}/{v.name}": v for i, v in enumerate(model.weights)}
    if model.optimizer is not None:
        named.update({f"optimizer/{i:04d}/{v.name}": v
                      for i, v in enumerate(optimizer_variables(model.optimizer))})
    return named


def learning_rate_of(optimizer: Any) -> float | None:
    """The optimizer's current learning rate if it is held in a variable (one eager read), else None."""
    lr = getattr(optimizer, "learning_rate", None)
    # value() rather than numpy(): numpy() reads through read_value(), one more op on the training thread
    return float(lr.value()) if isinstance(lr, tf.Variable) else None


def build_optimizer_slots(model: tf.keras.Model) -> None:
    """Create slot variables now, identically on every worker (horovod#2652)."""
    if not model.built:
        raise ValueError("build the model before making its elastic state (call it on one batch or "
                         "use model.build(input_shape)); its variables must exist on every worker")
    optimizer = model.optimizer
    if optimizer is None:
        raise ValueError("compile the model (with hvd.DistributedOptimizer) before making its elastic state")
    if hasattr(optimizer, "build"):
        optimizer.build(model.trainable_variables)
    else:  # legacy optimizers create slots on the first apply_gradients
        optimizer._create_all_weights(model.trainable_variables)  # noqa: SLF001


def restore_model(model: tf.keras.Model, store: str) -> dict[str, Any] | None:
    """Load the latest committed checkpoint of ``store`` into ``model``; its metadata, or None.

    A freshly built and compiled model works as it is: its optimizer's slot variables,
    which Keras creates on the first step, are created here first.
    """
    if model.optimizer is not None:
        build_optimizer_slots(model)
    variables = state_variables(model)
    expected = {name: (tuple(v.shape), v.dtype.as_numpy_dtype) for name, v in variables.items()}
    ckpt = latest_checkpoint(store, expected=expected, cold_start=False)
    if ckpt is None:
        return None
    for name, var in variables.items():
        var.assign(ckpt.tensors[name])
    return restored_summary(ckpt)


def elastic_state(model: tf.keras.Model, *, store: str, **state_kwargs: Any) -> Any:
    """``hvd.elastic.KerasState`` that survives the whole cluster being lost, and knows its data position.

    Restores the latest committed checkpoint of this run (cold restart), resharded
    from whatever number of writers produced it. Only rank 0 reads it: Horovod's
    state sync then broadcasts it, and a worker joining a live job never has rank 0.
    The state also carries ``samples``, the global sample offset of :func:`~hvd_transient.keras.data.elastic_dataset`.
    """
    import horovod.tensorflow.keras as hvd

    skip_horovod_conversion(model.optimizer)  # before fit traces its step: a cold start's first step comes sooner
    build_optimizer_slots(model)
    restored = None
    state_kwargs.setdefault("samples", 0)
    if standby.pending():  # a standby learns its rank when it is handed a job
        state = _state_class(hvd.elastic.KerasState)(model, **state_kwargs)
        state.hvdt_restored = None
        standby.after_handoff(partial(_cold_start_on_rank0, state, store))
        return state
    if hvd.rank() == 0:
        restored = _cold_start(model, store, state_kwargs)
    state = _state_class(hvd.elastic.KerasState)(model, **state_kwargs)
    state.hvdt_restored = restored
    return state


def _cold_start(model: tf.keras.Model, store: str, state_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Rank 0's part of making the state: the latest checkpoint, and the counters it was saved at."""
    clear_stop(open_store(store))  # a stop request was for the previous launch
    restored = restore_model(model, store)
    if restored is not None:
        state_kwargs.update(restored_counters(restored, {key: state_kwargs[key] for key in _COUNTERS
                                                         if key in state_kwargs}))
    return restored


def _cold_start_on_rank0(state: Any, store: str) -> None:
    """A standby's deferred :func:`_cold_start`, once handed a job: the state is made, so it is saved again."""
    import horovod.tensorflow.keras as hvd

    if hvd.rank() != 0:  # a joining worker gets the ring's state from rank 0's sync
        return
    counters = dict(state._saved_state)  # noqa: SLF001
    state.hvdt_restored = _cold_start(state.model, store, counters)
    if state.hvdt_restored is not None:
        for key, value in counters.items():
            setattr(state, key, value)
        state.save()


def _state_class(base: type) -> type:
    class TransientKerasState(base):  # type: ignore[misc]
        """Horovod's KerasState whose ``samples`` always matches the model's optimizer step.

        Horovod saves, restores and broadcasts the attributes. The offset is advanced every
        batch and recomputed from the step when saved, and sync sends the live value, so it is
        right after a rollback (restored with the model), a removal (no sync: the live value)
        and a join (rank 0's live value is broadcast).
        """

        _saved_state: dict[str, Any]  # Horovod's: the values it saves, restores and broadcasts

        def __init__(self, model: tf.keras.Model, **kwargs: Any) -> None:
            self.hvdt_position = DataPosition()  # tracked once elastic_dataset says its samples per step
            super().__init__(model, **kwargs)

        def hvdt_advance(self, step: int) -> None:
            """The live offset after ``step`` (the callback's, every batch)."""
            samples = self.hvdt_position.samples_at(step)
            if samples is not None:
                self.samples = samples

        def save(self) -> None:
            if self.hvdt_position.cursor is not None:  # the step is read only where an offset is tracked
                self.hvdt_advance(optimizer_step(self.model.optimizer))
            super().save()
            keep_apart(self)  # a value the script changes in place must not change the rollback point

        def restore(self) -> None:
            super().restore()
            restore_copies(self)

        def check_host_updates(self) -> None:
            # a reset never skips the sync: the driver may add a host in it (frontend/host_updates.py)
            check_host_updates_and_sync(super().check_host_updates)

        def sync(self) -> None:
            # Horovod broadcasts the *saved* attributes but the *live* model; the live values are the ones
            # that match it (the offset, advanced every batch; the script's epoch and batch; all restored with
            # the model on a rollback)
            self._saved_state = {key: getattr(self, key) for key in self._saved_state}
            # Horovod's Keras sync saves the broadcast model too: the synced model and values are the ring's
            # new rollback point together (PyTorch's does not: hvd_transient/torch/state.py saves there)
            super().sync()
            keep_apart(self)

    return TransientKerasState


def weights_crc(model: tf.keras.Model) -> int:
    """Checksum of the state that data parallelism keeps identical on every rank.

    Trainable weights and optimizer slots are; per-rank statistics such as batch-norm
    moving averages are not (each rank updates them from its own batches), so they are
    left out here.
    """
    trainable = {id(v) for v in model.trainable_weights}
    return state_crc({name: v for name, v in state_variables(model).items()
                      if name.startswith("optimizer/") or id(v) in trainable})
