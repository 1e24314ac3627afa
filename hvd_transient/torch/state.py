"""The elastic state of a PyTorch training job: Horovod's ``TorchState`` that knows its step, its data
position and its learning-rate scaling, and survives the whole cluster being lost (cold restore).

:func:`elastic_state` replaces ``hvd.elastic.TorchState(model, optimizer, **kwargs)`` in a script.
"""
from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from ckpt_service.manager import CheckpointManager
from hvd_transient.core.checksums import state_crc
from hvd_transient.frontend.host_updates import check_host_updates_and_sync
from hvd_transient.frontend.json_values import decode, encode
from hvd_transient.frontend.position import DataPosition
from hvd_transient.frontend.restore import latest_checkpoint, restored_counters, restored_summary
from hvd_transient.frontend.saved_values import keep_apart, restore_copies
from hvd_transient.torch.tensors import META_KEY, load_state, state_tensors, to_host

log = logging.getLogger(__name__)

#: the counters the state keeps besides the script's own: optimizer steps taken, the global sample
#: offset (:mod:`hvd_transient.core.data_position`), and the ring size the learning rates are scaled for
COUNTERS = {"step": 0, "samples": 0, "lr_size": 1}


def elastic_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None = None, *,
                  store: str, **kwargs: Any) -> Any:
    """``hvd.elastic.TorchState`` that survives the whole cluster being lost, and knows its data position.

    ``kwargs`` are the script's own values (e.g. ``epoch=0``), saved, restored and synced as Horovod
    does. The state adds ``step`` (optimizer steps taken, advanced by
    :meth:`~hvd_transient.torch.Transient.after_step`), ``samples`` (the global sample offset that
    :func:`~hvd_transient.torch.elastic_batches` reads) and ``lr_size``. A ``scheduler`` (a learning-rate
    scheduler) is saved, restored and synced with the optimizer.

    On a cold start rank 0 restores the latest committed checkpoint of ``store`` (resharded from
    whatever number of ranks wrote it), and Horovod's state sync broadcasts it.
    """
    import horovod.torch as hvd

    counters = _with_counters(kwargs)
    restored = None
    if hvd.rank() == 0:  # a worker joining a live job never has rank 0: it gets the ring's state by sync
        ckpt = latest_checkpoint(store)
        if ckpt is not None:
            load_state(model, optimizer, scheduler, ckpt.tensors, ckpt.metadata.get(META_KEY, {}))
            counters = restored_counters(ckpt.metadata, counters)
            restored = restored_summary(ckpt)
    state = _state_class(hvd.elastic.TorchState)(model, optimizer, scheduler, **counters)
    state.hvdt_restored = restored
    return state


class StaticState:
    """The training state of a static job (``horovodrun -np N`` without discovery, or ``mpirun``): what
    :func:`elastic_state`'s state keeps (the model, optimizer, scheduler, ``step``, ``samples``, the script's
    values), without Horovod's elastic machinery. Its ring never changes: on a notice every rank writes its
    share of the emergency checkpoint and the loop ends; relaunching the job resumes from it."""

    hvdt_static = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None,
                 counters: dict[str, Any]) -> None:
        self.model, self.optimizer, self.hvdt_scheduler = model, optimizer, scheduler
        self.hvdt_position = DataPosition()
        self.hvdt_transient: Any = None
        self.hvdt_restored: dict[str, Any] | None = None
        self._saved_state = dict(counters)  # the values' names, where Horovod's states keep them
        for key, value in counters.items():
            setattr(self, key, value)

    def register_reset_callbacks(self, callbacks: list[Any]) -> None:
        """A static ring is never reset."""

    def commit(self) -> None:
        """Nothing to commit in memory: a static job is relaunched from the store, not rolled back."""


def static_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None = None, *,
                 store: str, **kwargs: Any) -> StaticState:
    """The state of a static job (see :class:`StaticState`), restored from the latest committed checkpoint of
    ``store`` if there is one (resharded from whatever number of ranks wrote it), else rank 0's model.

    Rank 0 picks the step and every rank reads it (no object is broadcast, so nothing is pickled). A stop
    request left in the store was for the previous launch: it is cleared, as an elastic job's cold start does.
    """
    import horovod.torch as hvd

    from hvd_transient.torch.collectives import TorchCollectives

    counters = _with_counters(kwargs)
    ckpt = latest_checkpoint(store) if hvd.rank() == 0 else None
    step = TorchCollectives().broadcast_json(ckpt.step if ckpt is not None else None, 0, name="static_restore")
    state = StaticState(model, optimizer, scheduler, counters)
    if step is None:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # every rank starts from rank 0's weights
        return state
    if ckpt is None:
        with CheckpointManager(store, max_to_keep=None) as manager:
            ckpt = manager.restore(step=step)
    load_state(model, optimizer, scheduler, ckpt.tensors, ckpt.metadata.get(META_KEY, {}))
    for key, value in restored_counters(ckpt.metadata, counters).items():
        setattr(state, key, value)
    state.hvdt_restored = restored_summary(ckpt)
    return state


def _with_counters(values: dict[str, Any]) -> dict[str, Any]:
    """The state's counters (:data:`COUNTERS`) with the script's own ``values``, which must not reuse their names."""
    for key in COUNTERS:
        if key in values:
            raise ValueError(f"{key!r} is the state's own counter; name the script's value otherwise")
    return {**COUNTERS, **values}


def replicated_crc(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Checksum of the state that data parallelism keeps identical on every rank.

    Parameters and optimizer state are; buffers such as batch-norm running statistics are not (each
    rank updates them from its own batches), so they are left out.
    """
    params = {"model/" + name for name, _ in model.named_parameters()}
    return state_crc({name: to_host(t) for name, t in state_tensors(model, optimizer).items()
                      if name in params or name.startswith("optimizer/")})


def full_crc(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    return state_crc({name: to_host(t) for name, t in state_tensors(model, optimizer).items()})


def _state_class(base: type) -> type:
    class TransientTorchState(base):  # type: ignore[misc]
        """Horovod's TorchState with the counters of :data:`COUNTERS` and a learning-rate scheduler.

        Horovod saves, restores and broadcasts the counters with the model. It broadcasts the *saved*
        attributes but the *live* model and optimizer: ``sync`` sends the live values, the ones that
        match them (after a removal there was no restore; after a rollback, live and saved agree).
        """

        _saved_state: dict[str, Any]  # Horovod's: the values it saves, restores and broadcasts

        def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None,
                     **kwargs: Any) -> None:
            self.hvdt_position = DataPosition()
            self.hvdt_transient: Any = None  # the Transient hook driving this state, once made
            self.hvdt_scheduler = scheduler
            self._hvdt_saved_scheduler = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
            super().__init__(model, optimizer, **kwargs)

        def save(self) -> None:
            if self.hvdt_scheduler is not None:
                self._hvdt_saved_scheduler = copy.deepcopy(self.hvdt_scheduler.state_dict())
            super().save()
            keep_apart(self)  # a value the script changes in place must not change the rollback point

        def restore(self) -> None:
            if self.hvdt_scheduler is not None:
                self.hvdt_scheduler.load_state_dict(copy.deepcopy(self._hvdt_saved_scheduler))
            super().restore()
            restore_copies(self)

        def check_host_updates(self) -> None:
            # a reset never skips the sync: the driver may add a host in it (frontend/host_updates.py)
            check_host_updates_and_sync(super().check_host_updates)

        def sync(self) -> None:
            # the live values, which belong to the live model that Horovod broadcasts (after a rollback, live
            # and saved agree): the counters and the script's own (Horovod would send those of the last commit)
            self._saved_state = {key: getattr(self, key) for key in self._saved_state}
            super().sync()
            if self.hvdt_scheduler is not None:
                from hvd_transient.torch.collectives import TorchCollectives

                # JSON, not Horovod's pickled broadcast_object; exact (integer keys, tuples, infinities)
                synced = TorchCollectives().broadcast_json(encode(self.hvdt_scheduler.state_dict()), 0,
                                                           name="scheduler")
                self.hvdt_scheduler.load_state_dict(decode(synced))
            # The synced state is the ring's new rollback point, the model with its counters: a reset
            # without a commit (a departure, a join) would otherwise leave the counters synced but the model
            # saved at the last commit, and a rollback before the next commit would pair them.
            self.save()

    return TransientTorchState
