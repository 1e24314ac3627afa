"""The batches of a PyTorch elastic loop, from the exact global sample position, on any number of workers.

::

    @hvd.elastic.run
    def train(state):
        for images, labels in hvdt.elastic_batches(state, (x, y), BATCH, epochs=E, steps_per_epoch=N):
            ...
            optimizer.step()
            transient.after_step()

Made inside the elastic ``train`` function, it starts where the whole job stands (``state.samples``,
:mod:`hvd_transient.core.data_position`) and gives this rank its block of every global batch
(:mod:`hvd_transient.frontend.stream`), so after a leave, a join or a cold restart at another size each
sample of a pass is used exactly once. It replaces ``ElasticSampler`` and the ``DataLoader``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from hvd_transient.frontend.stream import rank_batches


def _fetcher(data: Any) -> tuple[int, Callable[[np.ndarray[Any, Any]], Any]]:
    """(samples, indices -> batch) for a tuple of equally long tensors or arrays, or a map-style dataset."""
    if isinstance(data, (tuple, list)):
        tensors: Sequence[torch.Tensor] = [torch.as_tensor(a) for a in data]
        sizes = {len(t) for t in tensors}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"the tensors must be non-empty and of one length (samples), got {sorted(sizes)}")
        return sizes.pop(), lambda idx: tuple(t[torch.from_numpy(idx)] for t in tensors)
    if len(data) < 1:
        raise ValueError("the data set is empty")
    collate = torch.utils.data.default_collate
    return len(data), lambda idx: collate([data[int(i)] for i in idx])


def elastic_batches(state: Any, data: Any, batch_size: int, *, epochs: int, steps_per_epoch: int,
                    seed: int = 0) -> Iterator[Any]:
    """This worker's batches from where the job stands until ``epochs * steps_per_epoch`` steps are done.

    ``data``: a tuple of equally long tensors or arrays (each batch is the tuple of their rows), or a
    map-style dataset (batches collated by ``default_collate``). ``state`` is the one
    :func:`~hvd_transient.torch.elastic_state` made; with a :class:`~hvd_transient.torch.Transient`, each
    loop body must call its ``after_step()`` once, and the loop ends early, at one step on every rank,
    when a stop is requested; its end takes the final checkpoint.
    """
    import horovod.torch as hvd

    position = getattr(state, "hvdt_position", None)
    if position is None:
        raise TypeError("elastic_batches needs the state made by hvd_transient.torch.elastic_state or "
                        f"static_state, not {type(state).__name__}")
    if epochs < 0 or steps_per_epoch < 1:
        raise ValueError(f"need epochs >= 0 and steps_per_epoch >= 1, got {epochs} and {steps_per_epoch}")
    rank, size = hvd.rank(), hvd.size()
    num_samples, fetch = _fetcher(data)
    position.track(size * batch_size)
    transient = state.hvdt_transient
    if transient is not None:
        transient.begin(steps_per_epoch)
    else:
        position.begin(int(state.step), int(state.samples))
    total = epochs * steps_per_epoch
    indices = rank_batches(num_samples, batch_size, offset=int(state.samples), rank=rank, size=size, seed=seed)
    while int(state.step) < total and not (transient is not None and transient.stopping):
        step = int(state.step)
        yield fetch(next(indices))
        if transient is None:
            state.step = step + 1
            state.samples = position.samples_at(step + 1)
        elif int(state.step) != step + 1:
            raise RuntimeError(f"the loop body must call after_step() once per batch (step {step} -> {state.step})")
    if transient is not None:
        transient.end()
