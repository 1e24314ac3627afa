"""AutoGraph calls Horovod's functions as they are once the plugin is in use, and the step trains the same."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tensorflow.python.autograph.core import config  # noqa: E402
from tensorflow.python.autograph.impl import conversion  # noqa: E402
from tensorflow.python.autograph.impl.api import is_autograph_artifact  # noqa: E402

from hvd_transient.keras.autograph import horovod_functions, skip_horovod_conversion  # noqa: E402


@pytest.fixture
def rules(monkeypatch: pytest.MonkeyPatch) -> tuple:
    """TensorFlow's own rules, put back after the test (the plugin's rule is process-wide)."""
    original = tuple(r for r in config.CONVERSION_RULES if not (isinstance(r, config.DoNotConvert)
                                                                and r.matches("horovod")))
    monkeypatch.setattr(config, "CONVERSION_RULES", original)
    return original


def users_function(x):
    return x + 1


def test_horovod_is_left_unconverted_and_nothing_else_changes(rules: tuple, hvd) -> None:
    import horovod.tensorflow as hvd_tf
    from horovod._keras import create_distributed_optimizer

    horovods = (hvd_tf.allreduce, hvd_tf.broadcast, create_distributed_optimizer)
    assert not any(conversion.is_allowlisted(f) for f in horovods)  # TensorFlow's default: converted
    assert skip_horovod_conversion() and skip_horovod_conversion()  # idempotent
    assert all(conversion.is_allowlisted(f) for f in horovods)
    assert config.CONVERSION_RULES[1:] == rules  # one rule added, in front; TensorFlow's kept
    assert conversion.is_allowlisted(tf.nn.relu) and not conversion.is_allowlisted(users_function)


def _trained_weights(hvd, steps: int = 3, *, skip: bool = False) -> list[np.ndarray]:
    tf.keras.utils.set_random_seed(5)
    model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(3)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    (allreduce,) = horovod_functions(model.optimizer)  # the gradient allreduce, a tf.function of its own
    vars(allreduce).pop("autograph_info__", None)  # Horovod caches it per settings: another test may have marked it
    assert not is_autograph_artifact(allreduce)
    if skip:
        assert skip_horovod_conversion(model.optimizer)
        assert is_autograph_artifact(allreduce)  # AutoGraph calls it as it is
    x = np.random.default_rng(0).standard_normal((8 * steps, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


def test_a_step_traced_without_converting_horovod_trains_the_same(rules: tuple, hvd) -> None:
    converted = _trained_weights(hvd)
    unconverted = _trained_weights(hvd, skip=True)
    assert len(converted) == len(unconverted) == 2
    for a, b in zip(converted, unconverted):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(converted[0], _initial_kernel())  # it did train


def _initial_kernel() -> np.ndarray:
    tf.keras.utils.set_random_seed(5)
    return tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(3)]).weights[0].numpy()


def test_only_horovods_own_step_functions_are_marked(hvd) -> None:
    """A user's optimizer, or a tf.function of the user's kept on one, is never touched."""
    plain = tf.keras.optimizers.SGD(0.1)
    assert horovod_functions(plain) == [] and horovod_functions(None) == []
    plain.users_step = tf.function(users_function)
    assert horovod_functions(plain) == []
    skip_horovod_conversion(plain)
    assert not is_autograph_artifact(users_function)
