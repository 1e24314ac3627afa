"""The Keras callback reads where its epochs end from fit's ``params['steps']``, whatever number type the
script gave ``steps_per_epoch`` (Keras hands it back as is: a numpy integer from
``ds.cardinality().numpy() // hvd.size()``, a float from ``np.ceil``). A real ``fit`` records it."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_transient.keras.callback import whole_steps

tf = pytest.importorskip("tensorflow")


def params_steps_of_a_real_fit(steps_per_epoch: object) -> object:
    seen = {}

    class Record(tf.keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["steps"] = self.params.get("steps")

    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    data = tf.data.Dataset.from_tensor_slices((np.zeros((8, 2), "f4"), np.zeros((8, 1), "f4"))).batch(2).repeat()
    model.fit(data, epochs=1, steps_per_epoch=steps_per_epoch, callbacks=[Record()], verbose=0)
    return seen["steps"]


@pytest.mark.parametrize("steps_per_epoch", [4, np.int64(4), np.int32(4), np.float64(4.0)])
def test_fits_steps_per_epoch_of_any_number_type_is_read(steps_per_epoch: object) -> None:
    assert whole_steps(params_steps_of_a_real_fit(steps_per_epoch)) == 4


@pytest.mark.parametrize("value", [None, 0, -3, 2.5, float("nan"), float("inf"), "4", True])
def test_what_is_no_count_of_steps_says_none(value: object) -> None:
    assert whole_steps(value) is None
