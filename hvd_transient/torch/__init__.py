"""PyTorch integration: preemption safety for a standard Horovod elastic PyTorch script.

The changed lines of a Horovod elastic script::

    import horovod.torch as hvd
    import hvd_transient.torch as hvdt                                          # (1)

    hvd.init()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                         named_parameters=model.named_parameters())
    state = hvdt.elastic_state(model, optimizer, store=STORE)                  # (2) was hvd.elastic.TorchState
    transient = hvdt.Transient(state, store=STORE, base_lr=LR)                 # (3)

    @hvd.elastic.run
    def train(state):
        for x, y in hvdt.elastic_batches(state, (images, labels), BATCH,        # (4) was ElasticSampler
                                         epochs=EPOCHS, steps_per_epoch=N):
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            transient.after_step()                                              # (5)
            if state.step % 10 == 0:
                state.commit()

    train(state)

``elastic_state`` restores the run's latest committed checkpoint on rank 0 on a cold start (Horovod's
sync broadcasts it) and keeps the step and the global sample offset with the model; ``elastic_batches``
resumes at the exact sample on however many workers the ring has; ``Transient`` runs the protocol of
:mod:`hvd_transient.core.transient` (notices, the emergency sharded checkpoint, the master's election,
the leave, periodic saves, LR scaling) through :mod:`hvd_transient.frontend`. A static job
(``horovodrun -np N`` without discovery, or ``mpirun``) uses ``static_state`` instead of (2) and no
``hvd.elastic.run``: on a notice the loop ends after the emergency checkpoint, and the relaunch resumes
from it. Importing it loads neither TensorFlow nor the Keras frontend.
"""
from __future__ import annotations

from hvd_transient.torch.data import elastic_batches
from hvd_transient.torch.hook import Transient
from hvd_transient.torch.state import StaticState, elastic_state, full_crc, replicated_crc, static_state

__all__ = ["StaticState", "Transient", "elastic_batches", "elastic_state", "full_crc", "replicated_crc",
           "static_state"]
