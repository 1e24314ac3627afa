"""Keras integration: preemption safety for a standard Horovod elastic Keras script.

The changed lines of a Horovod elastic script::

    import horovod.tensorflow.keras as hvd
    import hvd_transient.keras as hvdt                                        # (1)

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=...)
    state = hvdt.elastic_state(model, store=STORE)                           # (2) was hvd.elastic.KerasState
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=50),
                 hvdt.TransientCallback(state, store=STORE, base_lr=LR)]     # (3)

    @hvd.elastic.run
    def train(state):
        model.fit(hvdt.elastic_dataset(state, (x, y), BATCH),                # (4)
                  steps_per_epoch=N, epochs=EPOCHS, callbacks=callbacks)

    train(state)

``elastic_state`` builds the optimizer's slot variables on every worker before
the state is made (joining workers otherwise deadlock in ``state.sync()``), and
on a cold start restores the run's latest committed checkpoint on rank 0, from
where Horovod's own sync broadcasts it. ``TransientCallback`` makes every
``fit`` resume at the exact batch the optimizer step says (no epoch is re-run
after a reset), and ``elastic_dataset`` at the exact sample
(:mod:`hvd_transient.core.data_position`). Without a discovery script (a static
job), pass ``state=None``: a notice then writes the emergency checkpoint and
stops ``fit``; the relaunch resumes through :func:`restore_model`.

The names are re-exported here from :mod:`~hvd_transient.keras.state` (the elastic state, the
model's variables and their restore), :mod:`~hvd_transient.keras.callback` (``TransientCallback``,
with the resume hook of :mod:`~hvd_transient.keras.resume`) and :mod:`~hvd_transient.keras.data`.
"""
from __future__ import annotations

from hvd_transient.keras.callback import TransientCallback
from hvd_transient.keras.data import elastic_dataset
from hvd_transient.keras.state import (
    build_optimizer_slots,
    elastic_state,
    learning_rate_of,
    restore_model,
    state_variables,
    weights_crc,
)

__all__ = ["TransientCallback", "build_optimizer_slots", "elastic_dataset", "elastic_state", "learning_rate_of",
           "restore_model", "state_variables", "weights_crc"]
