"""An input pipeline that resumes at the exact sample, whatever the number of workers.

::

    @hvd.elastic.run
    def train(state):
        model.fit(hvdt.elastic_dataset(state, (images, labels), BATCH), steps_per_epoch=N,
                  epochs=EPOCHS, callbacks=callbacks)

Built inside the elastic ``train`` function, it starts where the whole job
stands (``state.samples``, the global sample offset of
:mod:`hvd_transient.core.data_position`) and gives this rank its block of every
global batch, so after a leave, a join or a cold restart on any number of
workers, each sample of a pass over the data is still used exactly once. The
passes are seeded permutations (the same on every worker, no coordination).
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvd_transient.core.data_position import pass_and_index

#: passes of the stream; large enough to be endless
_PASSES = 2 ** 40

# tf.data traces the functions below with AutoGraph, which would rewrite them (0.4 s of every worker's start);
# they are straight-line tensor code, with nothing for it to convert.
_as_is = tf.autograph.experimental.do_not_convert


def _num_samples(arrays: Any) -> int:
    sizes = {int(len(leaf)) for leaf in tf.nest.flatten(arrays)}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"the arrays must be non-empty and of one length (samples), got lengths {sorted(sizes)}")
    return sizes.pop()


def stream_indices(num_samples: int, batch_size: int, *, offset: int, rank: int, size: int,
                   seed: int = 0) -> tf.data.Dataset:
    """This rank's sample indices, one ``batch_size`` vector per step, from stream position ``offset``."""
    if batch_size < 1 or size < 1 or not 0 <= rank < size or offset < 0:
        raise ValueError(f"need batch_size >= 1, 0 <= rank < size and offset >= 0; got batch_size={batch_size}, "
                         f"rank={rank}, size={size}, offset={offset}")
    first_pass, skip = pass_and_index(offset, num_samples)

    def one_pass(k: tf.Tensor) -> tf.data.Dataset:
        keys = tf.random.stateless_uniform([num_samples], seed=tf.stack([tf.constant(seed, tf.int64), k]))
        order = tf.cast(tf.argsort(keys), tf.int64)
        return tf.data.Dataset.from_tensor_slices(order[tf.where(k == first_pass, skip, 0):])

    lo, hi = rank * batch_size, (rank + 1) * batch_size
    return (tf.data.Dataset.range(first_pass, _PASSES).flat_map(_as_is(one_pass))
            .batch(size * batch_size, drop_remainder=True)
            .map(_as_is(lambda block: block[lo:hi])))


def stream_batches(arrays: Any, batch_size: int, *, offset: int, rank: int, size: int,
                   seed: int = 0) -> tf.data.Dataset:
    """Batches of ``arrays`` (a nest of equally long arrays) at this rank's stream positions."""
    tensors = tf.nest.map_structure(tf.convert_to_tensor, arrays)
    ids = stream_indices(_num_samples(arrays), batch_size, offset=offset, rank=rank, size=size, seed=seed)
    # No autotuning: its model thread can hold up the iterator's destruction for tens of seconds
    # on a busy CPU, and an elastic reset destroys the iterator while a notice window runs.
    options = tf.data.Options()
    options.autotune.enabled = False
    return (ids.map(_as_is(lambda idx: tf.nest.map_structure(lambda t: tf.gather(t, idx), tensors)))
            .prefetch(2).with_options(options))


def elastic_dataset(state: Any, arrays: Any, batch_size: int, *, seed: int = 0) -> tf.data.Dataset:
    """This worker's batches from where the job stands; call it inside the elastic ``train`` function.

    ``state`` is the one :func:`hvd_transient.keras.elastic_state` made: it holds the global
    sample offset, which the :class:`~hvd_transient.keras.TransientCallback` then advances by
    ``hvd.size() * batch_size`` per step and saves in every checkpoint.
    """
    import horovod.tensorflow as hvd

    position = getattr(state, "hvdt_position", None)
    if position is None:
        raise TypeError("elastic_dataset needs the state made by hvd_transient.keras.elastic_state, "
                        f"not {type(state).__name__}")
    rank, size = hvd.rank(), hvd.size()
    position.track(size * batch_size)
    return stream_batches(arrays, batch_size, offset=int(state.samples), rank=rank, size=size, seed=seed)
