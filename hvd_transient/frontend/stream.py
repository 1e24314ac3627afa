"""The global sample stream in numpy: which samples each rank takes at each step, from any offset (pure).

The stream is an endless run of passes over the data set, each pass a permutation seeded by
``(seed, pass)``, the same on every worker without coordination. A step on ``size`` workers of
``batch_size`` each takes the next ``size * batch_size`` positions, rank ``r`` the ``r``-th block
(:mod:`hvd_transient.core.data_position`), so a job that resumes at a global offset on any number
of workers uses each sample of a pass exactly once.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from hvd_transient.core.data_position import pass_and_index


def pass_order(num_samples: int, pass_number: int, seed: int = 0) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The permutation of pass ``pass_number``."""
    return np.random.default_rng([seed, pass_number]).permutation(num_samples).astype(np.int64)


def rank_batches(num_samples: int, batch_size: int, *, offset: int, rank: int, size: int,
                 seed: int = 0) -> Iterator[np.ndarray[Any, np.dtype[np.int64]]]:
    """This rank's sample indices, one ``batch_size`` vector per step, from stream position ``offset``."""
    if num_samples < 1 or batch_size < 1 or size < 1 or not 0 <= rank < size or offset < 0:
        raise ValueError(f"need num_samples, batch_size >= 1, 0 <= rank < size and offset >= 0; got "
                         f"num_samples={num_samples}, batch_size={batch_size}, rank={rank}, size={size}, "
                         f"offset={offset}")
    orders: dict[int, np.ndarray[Any, np.dtype[np.int64]]] = {}

    def order(k: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        if k not in orders:
            orders.clear()  # this rank's positions only grow: an earlier pass is never read again
            orders[k] = pass_order(num_samples, k, seed)
        return orders[k]

    position = offset
    while True:
        start = position + rank * batch_size
        out = np.empty(batch_size, dtype=np.int64)
        filled = 0
        while filled < batch_size:
            k, i = pass_and_index(start + filled, num_samples)
            take = min(batch_size - filled, num_samples - i)
            out[filled:filled + take] = order(k)[i:i + take]
            filled += take
        yield out
        position += size * batch_size
